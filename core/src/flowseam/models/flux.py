"""FLUX.1 text-to-image (diffusers ``FluxPipeline`` layout: CLIP + T5 text encoders).

Step bodies follow diffusers 0.42's FluxPipeline: pooled CLIP embedding plus T5 states (pads not
masked), latents drawn in the T5 dtype as ``(B, 16, 2*(H//16), 2*(W//16))`` and packed into 2x2
patch tokens ``(B, seq, 64)``, the schedule from the checkpoint's scheduler with custom sigmas
``linspace(1, 1/N, N)`` and the flow shift ``mu`` from the token count (``calculate_shift``, used
when the scheduler has dynamic shifting), the distilled guidance embedded when the transformer
has ``guidance_embeds``, timestep passed as ``t / 1000`` in the latent dtype, decode
``x / scaling_factor + shift_factor``.
"""

from __future__ import annotations

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
    check_multiple,
    check_no_causal,
)
from ..schedulers import EULER, UNIPC, SolverConfig
from .card import ComponentEntry, ModelCard
from .instance import Conditioning, ModelInstance, draw_noise, frames_to_pixels, postprocess
from .split import SplitSupport


def flux_tokens(params: DiffusionParams,
                configs: Mapping[str, Mapping[str, Any]]) -> tuple[int, int]:
    """``(H/16) * (W/16)`` image tokens (the VAE's ``2 ** (len(block_out_channels) - 1)`` times
    the 2x2 packing) and ``max_sequence_length`` text tokens, which join the self-attention."""
    f = 2 ** (len(configs["vae"]["block_out_channels"]) - 1) * 2
    return (params.height // f) * (params.width // f), params.max_sequence_length


#: sequence parallelism (diffusers' ``FluxTransformer2DModel._cp_plan``): the image and the text
#: tokens are split with their position ids at the DiT's input, so the rotary embedding is
#: computed for each rank's own (global) positions; every attention is joint self-attention over
#: both; the output projection (image tokens) is gathered. No CFG branches to split.
FLUX_SPLIT = SplitSupport(
    sequence=SequenceSplit(
        inputs={"": {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}},
        gather={"proj_out": 1}),
    no_cfg_reason="FLUX.1 is guidance-distilled: guidance_scale is embedded in one pass",
    tokens=flux_tokens)


class FluxT2I(ModelInstance):
    """FLUX.1 text-to-image. Packed latents ``(B, (H/16)*(W/16), 64)``."""

    SHARED_CONDITION_KEYS = ("text_ids", "img_ids")  # position ids, the same for every row
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.components["vae"].config.block_out_channels) - 1)

    # -- 1. check -------------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        params = request.params.with_defaults(self.defaults)
        check_common(params, request)
        check_no_causal(params, self.card.name)
        self.experts.check(params)
        multiple = self.vae_scale_factor * 2
        for name in ("height", "width"):
            check_multiple(name, getattr(params, name), multiple,
                           f"VAE factor {self.vae_scale_factor} x 2x2 latent packing")
        if params.num_frames not in (None, 1):
            raise InvalidInputError(
                f"num_frames={params.num_frames!r}: {self.card.name} makes images; "
                "leave it unset or 1")
        if params.negative_prompt is not None:
            raise InvalidInputError(
                "negative_prompt is not supported by flux.1-t2i: FLUX.1-dev is guidance-"
                "distilled (guidance_scale is embedded, there is no unconditional pass)")
        if params.max_sequence_length > 512:
            raise InvalidInputError(
                f"max_sequence_length={params.max_sequence_length} must be <= 512")
        if request.image is not None:
            raise InvalidInputError(f"{self.card.name} is text-to-image and takes no image")
        return params.replace(num_frames=1)

    # -- 2. encode ------------------------------------------------------------------------------
    def _encode_one(self, prompt: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        clip_tok, clip = self.components["tokenizer"], self.components["text_encoder"]
        t5_tok, t5 = self.components["tokenizer_2"], self.components["text_encoder_2"]
        ids = clip_tok([prompt], padding="max_length", max_length=clip_tok.model_max_length,
                       truncation=True, return_tensors="pt").input_ids
        ids2 = t5_tok([prompt], padding="max_length", max_length=max_len, truncation=True,
                      return_tensors="pt").input_ids
        with torch.no_grad():
            pooled = clip(ids.to(self.component_device("text_encoder")),
                          output_hidden_states=False).pooler_output
            embeds = t5(ids2.to(self.component_device("text_encoder_2")), output_hidden_states=False)[0]
        return embeds, pooled

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        version = (self.versions.get("text_encoder", 0), self.versions.get("text_encoder_2", 0))
        max_len = params.max_sequence_length
        rows = [self.cached_text(("flux", version, p, max_len), lambda p=p: self._encode_one(p, max_len))
                for p in request.prompts]
        device = self.component_device(self.DIT)
        embeds = torch.cat([r[0] for r in rows]).to(device)
        pooled = torch.cat([r[1] for r in rows]).to(device, self.component_dtype(self.DIT))
        text_ids = torch.zeros(embeds.shape[1], 3, dtype=embeds.dtype, device=device)
        return Conditioning(prompt_embeds=embeds, extra={"pooled": pooled, "text_ids": text_ids})

    # -- 3. latents and sigmas -----------------------------------------------------------------
    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        B = len(generators)
        C = self.dit.config.in_channels // 4
        h = 2 * (params.height // (self.vae_scale_factor * 2))
        w = 2 * (params.width // (self.vae_scale_factor * 2))
        latents = self.pack(draw_noise((B, C, h, w), generators, dtype=cond.prompt_embeds.dtype))
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        device = self.component_device(self.DIT)
        cond.extra["img_ids"] = ids.reshape(-1, 3).to(device, latents.dtype)
        return latents.to(device)

    def timestep_args(self, params: DiffusionParams, latents: torch.Tensor,
                      solver: SolverConfig) -> dict[str, Any]:
        """As FluxPipeline calls ``set_timesteps``: custom ``sigmas = linspace(1, 1/N, N)``
        (none when the scheduler makes its own flow sigmas, i.e. UniPC) and the dynamic-shifting
        ``mu = calculate_shift(seq_len)`` from the scheduler's ``base_image_seq_len``,
        ``max_image_seq_len``, ``base_shift``, ``max_shift`` (used only when the scheduler has
        ``use_dynamic_shifting``)."""
        n = params.num_steps
        c = solver.config
        base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
        base_shift, max_shift = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
        m = (max_shift - base_shift) / (max_len - base_len)
        mu = latents.shape[1] * m + (base_shift - m * base_len)
        sigmas = None if solver.flow_sigmas else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": mu}

    # -- 4. velocity ----------------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 params: DiffusionParams, dit: torch.nn.Module | None = None,
                 expert: str | None = None) -> torch.Tensor:
        """Velocity ``(B, seq, 64)``; guidance is embedded (no second pass)."""
        _, dit = self.experts.pick(timestep, expert, dit)
        guidance = None
        if self.dit.config.guidance_embeds:
            guidance = torch.full([latents.shape[0]], params.guidance_scale, dtype=torch.float32,
                                  device=latents.device)
        return dit(hidden_states=latents, timestep=timestep.to(latents.dtype) / 1000,
                        guidance=guidance, pooled_projections=cond.extra["pooled"],
                        encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.extra["text_ids"],
                        img_ids=cond.extra["img_ids"], return_dict=False)[0]

    # -- 5. decode ------------------------------------------------------------------------------
    def unpack(self, latents: torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        """Packed ``(B, seq, 4C)`` → ``(B, C, h, w)`` latents (diffusers' ``_unpack_latents``)."""
        B, _, D = latents.shape
        C = D // 4
        h = 2 * (params.height // (self.vae_scale_factor * 2))
        w = 2 * (params.width // (self.vae_scale_factor * 2))
        return latents.view(B, h // 2, w // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, h, w)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, h, w)`` → ``(B, (h/2)*(w/2), 4C)`` 2x2 patch tokens (diffusers' ``_pack_latents``)."""
        B, C, h, w = x.shape
        x = x.view(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (h // 2) * (w // 2), C * 4)

    def encode_latents(self, frames, params: DiffusionParams) -> torch.Tensor:
        """Images ``(B, 1, H, W, 3)`` in [0, 1] → packed ``(x - shift) * scaling`` VAE means."""
        vae = self.components["vae"]
        pixels = frames_to_pixels(frames)[:, :, 0]
        with torch.no_grad():
            latent = vae.encode(pixels.to(self.component_device("vae"), self.component_dtype("vae"))
                                ).latent_dist.mode()
        latent = (latent - vae.config.shift_factor) * vae.config.scaling_factor
        return self.pack(latent.float()).to(self.component_device(self.DIT))

    def decode(self, latents: torch.Tensor, params: DiffusionParams) -> np.ndarray:
        """Packed latents → images ``(B, 1, H, W, 3)`` float32 in [0, 1]."""
        vae = self.components["vae"]
        x = self.unpack(latents, params) / vae.config.scaling_factor + vae.config.shift_factor
        with torch.no_grad():
            image = vae.decode(x.to(self.component_device("vae")), return_dict=False)[0]
        return postprocess(image)


FLUX_T2I = ModelCard(
    name="flux.1-t2i", pipeline_class="FluxPipeline", tasks=(TaskType.T2I,),
    components=(
        ComponentEntry("tokenizer", "tokenizer"),
        ComponentEntry("text_encoder", "text_encoder"),
        ComponentEntry("tokenizer_2", "tokenizer"),
        ComponentEntry("text_encoder_2", "text_encoder"),
        ComponentEntry("vae", "vae"),
        ComponentEntry("transformer", "dit"),
    ),
    defaults=dict(num_steps=28, guidance_scale=3.5, height=1024, width=1024, num_frames=1,
                  max_sequence_length=512),
    default_scheduler=EULER,
    #: FLUX.1-dev's scheduler, where the checkpoint's scheduler_config.json says nothing
    scheduler_defaults={EULER: {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                                "max_shift": 1.15, "base_image_seq_len": 256,
                                "max_image_seq_len": 4096},
                        UNIPC: {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}},
    passes_mu=True,
    rules=("height and width divisible by 16 (VAE factor 8 x 2x2 packing)",
           "num_steps >= 1; guidance_scale >= 0 (embedded guidance, FLUX.1-dev)",
           "no negative prompt, no image", "max_sequence_length <= 512"),
    instance=FluxT2I, split=FLUX_SPLIT)
