"""Wan2.1 and Wan2.2 text-to-video and image-to-video (diffusers ``WanPipeline`` /
``WanImageToVideoPipeline`` layouts).

Step bodies follow diffusers 0.42's pipelines so that, on the same weights, seed and parameters,
flowseam's output equals diffusers' (tested): T5 embeddings zeroed past each prompt's length and
padded to ``max_sequence_length``; CFG ``uncond + g * (cond - uncond)`` when
``guidance_scale > 1``, run as one 2B batch rather than two forwards (equal to float rounding);
the DiT's timestep is the scheduler's (``sigma * 1000`` for FlowMatchEuler, UniPC's integer
timesteps); latents ``x * std + mean`` before the VAE. Wan2.2 A14B (``transformer_2`` and
``boundary_ratio`` in ``model_index.json``) has two DiT experts, each built through
``platform.build_component("dit", ...)``, that split the steps by timestep
(:mod:`flowseam.models.experts`); Wan2.2 TI2V-5B (``expand_timesteps=True``, per-token
timesteps) is refused by name.
"""

from __future__ import annotations

import html
import re
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import InvalidInputError
from ..parallel import SequenceSplit
from ..request import (
    DiffusionParams,
    GenerationRequest,
    TaskType,
    check_common,
    check_frames,
    check_multiple,
    check_no_causal,
)
from ..schedulers import EULER, UNIPC
from .card import ComponentEntry, ModelCard
from .instance import Conditioning, ModelInstance, draw_noise, frames_to_pixels, postprocess
from .split import SplitSupport


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning: ftfy's fix_text, double HTML unescape, collapsed whitespace."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def wan_tokens(params: DiffusionParams,
               configs: Mapping[str, Mapping[str, Any]]) -> tuple[int, None]:
    """``F' * (H' / p_h) * (W' / p_w)`` latent patches (``F' = (frames - 1) / 4 + 1``, ``H' =
    height / 8``: the VAE's ``scale_factor_temporal`` and ``_spatial``; ``p``: the transformer's
    ``patch_size``); the text is cross-attended, so no text tokens join the self-attention."""
    p_t, p_h, p_w = configs["transformer"]["patch_size"]
    temporal, spatial = (int(configs["vae"][f"scale_factor_{k}"]) for k in ("temporal", "spatial"))
    frames = (params.num_frames - 1) // temporal + 1
    h, w = params.height // spatial, params.width // spatial
    return (frames // p_t) * (h // p_h) * (w // p_w), None


#: sequence and CFG parallelism (diffusers' ``WanTransformer3DModel._cp_plan``): the rotary
#: embedding (computed for the whole video) and the first block's tokens are split, the output
#: projection gathered; ``attn2`` attends from the local tokens to the whole text
WAN_SPLIT = SplitSupport(
    sequence=SequenceSplit(inputs={"blocks.0": {"hidden_states": 1}},
                           outputs={"rope": {0: 1, 1: 1}}, gather={"proj_out": 1},
                           cross_attention=("attn2",)),
    cfg_branches=True, tokens=wan_tokens)


class WanT2V(ModelInstance):
    """Wan2.1 text-to-video. Latents ``(B, 16, (F - 1) // 4 + 1, H / 8, W / 8)`` float32."""

    #: the text (and I2V image) embedders and each block's cross-attention keys and values
    #: depend on the conditioning alone: computed at the first step of a loop run, reused after
    STEP_CONSTANTS = ("condition_embedder.text_embedder", "condition_embedder.image_embedder",
                      "attn2.to_k", "attn2.to_v", "attn2.norm_k", "attn2.add_k_proj",
                      "attn2.add_v_proj", "attn2.norm_added_k")

    # -- 1. check -------------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        params = request.params.with_defaults(self.defaults)
        check_common(params, request)
        self.check_loop_params(params)
        self.experts.check(params)
        check_frames(params.num_frames, self.vae_temporal_factor, "Wan's VAE")
        multiple = self.vae_spatial_factor * self.dit.config.patch_size[1]
        for name in ("height", "width"):
            check_multiple(name, getattr(params, name), multiple,
                           f"VAE factor {self.vae_spatial_factor} x patch {self.dit.config.patch_size[1]}")
        self.check_image(request)
        return params

    def check_loop_params(self, params: DiffusionParams) -> None:
        check_no_causal(params, self.card.name)

    @property
    def vae_temporal_factor(self) -> int:
        return int(self.components["vae"].config.scale_factor_temporal)

    @property
    def vae_spatial_factor(self) -> int:
        return int(self.components["vae"].config.scale_factor_spatial)

    # -- 2. encode ------------------------------------------------------------------------------
    def encode_text(self, prompts: list[str], max_len: int) -> torch.Tensor:
        """T5 embeddings ``(B, max_len, D)`` in the DiT's dtype, zero past each prompt's length.
        The states of each prompt's own tokens are cached per (text encoder weights version,
        prompt, max_len): a cached prompt takes its tokens' rows, not ``max_len`` rows (for
        umT5-XXL in float32 a 20-token prompt is 0.3 MiB, 512 rows 8 MiB)."""
        version = self.versions.get("text_encoder", 0)
        rows = [self.cached_text(("wan", version, p, max_len), lambda p=p: self._encode_one(p, max_len))
                for p in prompts]
        out = torch.zeros(len(prompts), max_len, rows[0][0].shape[-1],
                          device=self.component_device(self.DIT), dtype=self.component_dtype(self.DIT))
        for i, (states, keep) in enumerate(rows):
            out[i, keep.to(out.device)] = states[0].to(device=out.device, dtype=out.dtype)
        return out

    def _encode_one(self, prompt: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The T5 states of the prompt's tokens ``(1, L, D)`` and where they go among ``max_len``
        positions (a bool ``(max_len,)``: the tokenizer's attention mask); every other position
        is zero (diffusers' ``_get_t5_prompt_embeds``). Only the prompt's own tokens run through
        the encoder: with the attention mask a token never attends to padding, and the
        padding's states are zeroed, so encoding the padding (up to 512 positions for a few
        words) changes nothing but the cost."""
        tokenizer, encoder = self.components["tokenizer"], self.components["text_encoder"]
        tok = tokenizer([clean_prompt(prompt)], padding="max_length", max_length=max_len,
                        truncation=True, add_special_tokens=True, return_attention_mask=True,
                        return_tensors="pt")
        keep = tok.attention_mask[0].bool()  # the prompt's tokens (the tokenizer pads after them)
        device = self.component_device("text_encoder")
        with torch.no_grad():
            hidden = encoder(tok.input_ids[:, keep].to(device),
                             tok.attention_mask[:, keep].to(device)).last_hidden_state
        return hidden, keep

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        prompts = request.prompts
        embeds = self.encode_text(prompts, params.max_sequence_length)
        negative = None
        if params.guidance_scale > 1.0:
            negative = self.encode_text([params.negative_prompt or ""] * len(prompts),
                                        params.max_sequence_length)
        return Conditioning(prompt_embeds=embeds, negative_embeds=negative)

    # -- 3. latents and sigmas -----------------------------------------------------------------
    def latent_channels(self) -> int:
        return int(self.dit.config.in_channels)

    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        shape = (len(generators), self.latent_channels(),
                 (params.num_frames - 1) // self.vae_temporal_factor + 1,
                 params.height // self.vae_spatial_factor, params.width // self.vae_spatial_factor)
        return draw_noise(shape, generators).to(self.component_device(self.DIT))

    # -- 4. velocity ----------------------------------------------------------------------------
    def dit_inputs(self, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, dict]:
        return latents.to(self.component_dtype(self.DIT)), {}

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 params: DiffusionParams, dit: torch.nn.Module | None = None,
                 expert: str | None = None) -> torch.Tensor:
        """CFG-guided velocity ``(B, 16, F', H', W')`` in the DiT's dtype, from ``expert``
        (default: the one that owns ``timestep``) or ``dit`` (a trainer's copy of it).

        With CFG the conditional and unconditional passes run as one batch of 2B (diffusers runs
        two forwards; the results agree to float rounding), then
        ``v = v_uncond + g * (v_cond - v_uncond)`` with the expert's guidance scale ``g``
        (``guidance_scale``, or ``guidance_scale_2`` for Wan2.2's low-noise expert).
        """
        expert, dit = self.experts.pick(timestep, expert, dit)
        branches = list(range(self.num_branches(cond)))
        return self.guide(self.branch_velocity(latents, timestep, cond, params, branches, dit=dit,
                                               expert=expert), params, expert)

    def num_branches(self, cond: Conditioning) -> int:
        """2 with CFG (unconditional, conditional), else 1."""
        return 1 if cond.negative_embeds is None else 2

    def branch_velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                        params: DiffusionParams, branches: list[int],
                        dit: torch.nn.Module | None = None,
                        expert: str | None = None) -> list[torch.Tensor]:
        """The unguided velocities of ``branches`` (0: unconditional, 1: conditional; only 0
        without CFG), each ``(B, 16, F', H', W')``, from one DiT call on a batch of
        ``len(branches) * B``."""
        expert, dit = self.experts.pick(timestep, expert, dit)
        if len(branches) == 2 and self.parallel is not None and self.parallel.runs_cfg_branches(dit):
            # CFG parallelism: this rank's group runs one branch; the two are exchanged
            mine = branches[self.parallel.cfg_branch()]
            return self.parallel.gather_branches(self.branch_velocity(
                latents, timestep, cond, params, [mine], dit=dit, expert=expert)[0])
        x, extra = self.dit_inputs(latents, cond)
        if cond.negative_embeds is None:
            return [dit(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.prompt_embeds,
                        return_dict=False, **extra)[0]]
        text = (cond.negative_embeds, cond.prompt_embeds)
        n = len(branches)
        key = tuple(branches)
        batched_text = cond.batched_text.get(key)
        if batched_text is None or torch.is_grad_enabled():  # grad: a trainer's recompute
            batched_text = torch.cat([text[b] for b in branches])
            if not torch.is_grad_enabled():  # once per condition: the same tensor every step
                cond.batched_text[key] = batched_text  # (flowseam.step_constants)
        out = dit(hidden_states=torch.cat([x] * n), timestep=torch.cat([timestep] * n),
                  encoder_hidden_states=batched_text,
                  return_dict=False, **{k: torch.cat([v] * n) for k, v in extra.items()})[0]
        return list(out.chunk(n))

    def guide(self, branches: list[torch.Tensor], params: DiffusionParams, expert: str) -> torch.Tensor:
        """CFG: ``v_uncond + g * (v_cond - v_uncond)`` with ``expert``'s guidance scale."""
        if len(branches) == 1:
            return branches[0]
        v_uncond, v_cond = branches
        return v_uncond + self.experts.guidance(expert, params) * (v_cond - v_uncond)

    # -- 5. decode ------------------------------------------------------------------------------
    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.components["vae"].config
        z = config.z_dim
        mean = torch.tensor(config.latents_mean).view(1, z, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, z, 1, 1, 1)
        return mean, inv_std

    def decode(self, latents: torch.Tensor, params: DiffusionParams) -> np.ndarray:
        """Latents → frames ``(B, F, H, W, 3)`` float32 in [0, 1]."""
        vae = self.components["vae"]
        device, dtype = self.component_device("vae"), self.component_dtype("vae")
        mean, inv_std = (t.to(device, dtype) for t in self.latent_stats())
        with torch.no_grad():
            video = vae.decode(latents.to(device, dtype) / inv_std + mean, return_dict=False)[0]
        return postprocess(video)


    def encode_latents(self, frames, params: DiffusionParams) -> torch.Tensor:
        """Frames ``(B, F, H, W, 3)`` in [0, 1] → normalised VAE means ``(B, 16, F', H/8, W/8)``."""
        vae = self.components["vae"]
        device, dtype = self.component_device("vae"), self.component_dtype("vae")
        mean, inv_std = (t.to(device, dtype) for t in self.latent_stats())
        with torch.no_grad():
            latent = vae.encode(frames_to_pixels(frames).to(device, dtype)).latent_dist.mode()
        return ((latent - mean) * inv_std).to(self.component_device(self.DIT), torch.float32)


class WanI2V(WanT2V):
    """Wan2.1 image-to-video: the image is VAE-encoded into the first latent frame's condition
    (mask + latents concatenated to the noise channels) and, through the CLIP image encoder, into
    extra cross-attention tokens (diffusers' WanImageToVideoPipeline).

    A request of B prompts takes one image for all of them (as diffusers repeats it) or a list
    of B images, one per prompt: sample ``k`` starts from ``image[k]``, and equals the request
    of prompt ``k`` and image ``k`` alone with seed ``seeds[k]`` to float rounding (diffusers'
    pipeline has no per-sample images; tested against it image by image). An RL group's
    rollouts (one first frame per member) run as one batch this way."""

    IMAGE_PER_SAMPLE = True

    def latent_channels(self) -> int:
        return int(self.components["vae"].config.z_dim)

    def check(self, request: GenerationRequest) -> DiffusionParams:
        params = super().check(request)
        split = [n for n, m in self.experts.items() if m.config.added_kv_proj_dim is not None]
        if split and params.max_sequence_length != 512:
            raise InvalidInputError(
                f"max_sequence_length={params.max_sequence_length} must be 512 for this "
                f"checkpoint: its {' and '.join(split)} has image cross-attention projections "
                "(added_kv_proj_dim), and diffusers' WanAttnProcessor splits image from text "
                "tokens at 512")
        return params

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        """Text conditioning, plus ``extra["image"]`` (one PIL image, or one per prompt) and,
        for Wan2.1 I2V, ``extra["image_embeds"] (B, 257, D)``: the CLIP vision encoder's
        penultimate hidden states (diffusers' ``encode_image``), each image encoded once."""
        cond = super().encode(request, params)
        per_sample = isinstance(request.image, list)
        images = [load_image(im) for im in request.image] if per_sample else [load_image(request.image)]
        cond.extra["image"] = images if per_sample else images[0]
        if self.dit.config.image_dim is not None:  # Wan2.1 I2V (image_encoder checked at load)
            processor, encoder = self.components["image_processor"], self.components["image_encoder"]
            pixels = processor(images=images, return_tensors="pt")
            device = self.component_device("image_encoder")
            with torch.no_grad():
                states = encoder(**{k: v.to(device) for k, v in pixels.items()},
                                 output_hidden_states=True).hidden_states[-2]
            if not per_sample:
                states = states.repeat(len(request.prompts), 1, 1)
            cond.extra["image_embeds"] = states.to(self.component_device(self.DIT),
                                                   self.component_dtype(self.DIT))
        return cond

    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        latents = super().prepare_latents(request, params, generators, cond)  # noise drawn first
        cond.extra["condition"] = self._image_condition(cond.extra["image"], params, latents)
        return latents

    def _image_condition(self, image, params: DiffusionParams, latents: torch.Tensor) -> torch.Tensor:
        """``cat([mask (B, 4, F', h, w), normalised VAE mean of [image, zeros...]], dim=1)``;
        ``image`` is one PIL image (repeated over the batch) or a list of B, encoded as one batch."""
        from PIL import Image

        vae = self.components["vae"]
        device, dtype = self.component_device("vae"), self.component_dtype("vae")
        H, W, F = params.height, params.width, params.num_frames
        images = image if isinstance(image, list) else [image]
        resized = [im.resize((W, H), resample=Image.LANCZOS) for im in images]  # diffusers' video_processor
        pixels = torch.from_numpy(np.stack([np.asarray(im) for im in resized]).astype(np.float32)
                                  / 255.0).permute(0, 3, 1, 2)
        pixels = pixels * 2.0 - 1.0
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(len(images), 3, F - 1, H, W)], dim=2)
        with torch.no_grad():
            latent = vae.encode(video.to(device, dtype)).latent_dist.mode()
        mean, inv_std = (t.to(device, dtype) for t in self.latent_stats())
        latent = ((latent - mean) * inv_std).to(torch.float32)
        B = latents.shape[0]
        mask = torch.zeros(B, self.vae_temporal_factor, *latents.shape[2:])
        mask[:, :, 0] = 1.0
        if len(images) == 1:
            latent = latent.repeat(B, 1, 1, 1, 1)
        return torch.cat([mask, latent.cpu()], dim=1).to(latents.device)

    def dit_inputs(self, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, dict]:
        x = torch.cat([latents, cond.extra["condition"]], dim=1).to(self.component_dtype(self.DIT))
        extra = {}
        if "image_embeds" in cond.extra:
            extra["encoder_hidden_states_image"] = cond.extra["image_embeds"]
        return x, extra


def load_image(image: Any):
    """A PIL RGB image from a PIL image, a path, or an ``(H, W, 3)`` float array in [0, 1]
    (:func:`flowseam.media.read_image`: every mode converted correctly, bad files refused).

    :raises ValueError: naming what was given and what is wrong with it.
    """
    from ..media import read_image

    return read_image(image)


_WAN_COMMON = (
    ComponentEntry("tokenizer", "tokenizer"),
    ComponentEntry("text_encoder", "text_encoder"),
    ComponentEntry("vae", "vae"),
    ComponentEntry("transformer", "dit"),
)
_WAN_RULES = (
    "num_frames = 4k+1 (the VAE compresses time by 4)",
    "height and width divisible by 16 (VAE factor 8 x patch 2)",
    "num_steps >= 1; guidance_scale >= 0 (CFG with the negative prompt when > 1)",
)
_I2V_RULES = ("an image is required; it is resized to (height, width) with Lanczos, ignoring its "
              "aspect ratio (as diffusers does)",
              "max_sequence_length = 512 when the transformer has image cross-attention "
              "projections (added_kv_proj_dim: Wan2.1 I2V)")
_WAN22_RULES = ("guidance_scale for the high-noise expert (transformer), guidance_scale_2 "
                "(default: guidance_scale) for the low-noise one (transformer_2)",)
#: diffusers' WanPipeline / WanImageToVideoPipeline call defaults
_WAN_DEFAULTS = dict(num_steps=50, guidance_scale=5.0, height=480, width=832, num_frames=81,
                     max_sequence_length=512)
#: where the checkpoint's scheduler_config.json says nothing: the Wan2.1-Diffusers scheduler
#: (UniPC, flow sigmas, flow_shift 3.0 for 480p), or shift 3.0 for a FlowMatchEuler config
_WAN_SCHEDULER = dict(
    default_scheduler=UNIPC,
    scheduler_defaults={EULER: {"shift": 3.0},
                        UNIPC: {"flow_shift": 3.0, "use_flow_sigmas": True,
                                "prediction_type": "flow_prediction"}},
    passes_mu=False)
_I2V_COMPONENTS = (ComponentEntry("image_processor", "image_processor", required=False),
                   ComponentEntry("image_encoder", "image_encoder", required=False))
_EXPERT_2 = (ComponentEntry("transformer_2", "dit"),)
_TWO_EXPERTS = dict(experts=("transformer", "transformer_2"),
                    pipeline_options=("boundary_ratio", "expand_timesteps"))

WAN_T2V = ModelCard(
    name="wan2.1-t2v", pipeline_class="WanPipeline", tasks=(TaskType.T2V,),
    components=_WAN_COMMON, defaults=_WAN_DEFAULTS, rules=_WAN_RULES, instance=WanT2V,
    pipeline_options=("boundary_ratio", "expand_timesteps"), split=WAN_SPLIT, **_WAN_SCHEDULER)

WAN_I2V = ModelCard(
    name="wan2.1-i2v", pipeline_class="WanImageToVideoPipeline", tasks=(TaskType.I2V,),
    components=_WAN_COMMON + _I2V_COMPONENTS, defaults=_WAN_DEFAULTS,
    rules=_WAN_RULES + _I2V_RULES, instance=WanI2V,
    pipeline_options=("boundary_ratio", "expand_timesteps"), split=WAN_SPLIT, **_WAN_SCHEDULER)

WAN22_T2V = ModelCard(
    name="wan2.2-t2v", pipeline_class="WanPipeline", tasks=(TaskType.T2V,),
    components=_WAN_COMMON + _EXPERT_2, defaults=_WAN_DEFAULTS,
    rules=_WAN_RULES + _WAN22_RULES, instance=WanT2V, split=WAN_SPLIT, **_TWO_EXPERTS,
    **_WAN_SCHEDULER)

WAN22_I2V = ModelCard(
    name="wan2.2-i2v", pipeline_class="WanImageToVideoPipeline", tasks=(TaskType.I2V,),
    components=_WAN_COMMON + _EXPERT_2 + _I2V_COMPONENTS, defaults=_WAN_DEFAULTS,
    rules=_WAN_RULES + _I2V_RULES + _WAN22_RULES, instance=WanI2V, split=WAN_SPLIT,
    **_TWO_EXPERTS, **_WAN_SCHEDULER)
