"""LTX-2 (Lightricks): text/image-to-video *with sound*, in one or two stages (diffusers
``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` layouts, plus the ``latent_upsampler/`` folder of
``LTX2LatentUpsamplerModel`` that LTX-2's converter writes next to them).

One DiT denoises video and audio latents together, conditioned on a Gemma 3 text encoder through
the text connectors; the loop (:mod:`flowseam.loops.ltx2`) runs stage 1 with CFG, upsamples the
video latents x2, re-noises them and refines (diffusers' two-stage recipe). Key decision: video
and audio share every sigma, so the loop's state is one float32 tensor ``(B, Nv + Na)``, the
packed video and audio latents flattened and joined (:meth:`LTX2T2V.split` /
:meth:`LTX2T2V.join`): one solver step moves both and one log-prob covers both.
:class:`StageLayout` says how a state of each stage's size unpacks and is guided. Step bodies
follow diffusers 0.42.1, so that the output equals its pipelines' on the same weights, seed and
sigmas (each method says how); docs/ltx2.md has the user's view and how the parity is tested.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import FlowseamError, InvalidInputError
from ..noise import draw_noise
from ..request import (
    DiffusionParams,
    GenerationRequest,
    TaskType,
    check_common,
    check_frames,
    check_multiple,
)
from ..schedulers import EULER, SolverConfig
from .card import ComponentEntry, ModelCard
from .instance import Conditioning, ModelInstance, postprocess

#: Lightricks' distilled stage-2 sigmas (diffusers ``STAGE_2_DISTILLED_SIGMA_VALUES``).
REFINE_SIGMAS = (0.909375, 0.725, 0.421875)

#: diffusers' hard-coded size rule for LTX-2 (``check_inputs``: height and width ÷ 32).
SIZE_MULTIPLE = 32


@dataclass
class StageLayout:
    """How a state of one stage unpacks, and how it is guided; kept in
    ``cond.extra["layouts"]``, keyed by the state's width (:meth:`LTX2T2V.layout`).

    :ivar stage: 1 (base resolution) or 2 (refine).
    :ivar video: latent video shape ``(C, F, H, W)`` (unpacked); ``audio``: ``(C, L, M)``.
    :ivar guidance: ``(video, audio)`` CFG scales of the stage.
    :ivar sigmas: timestep value → sigma (the x0 conversion needs the scheduler's sigma exactly).
    :ivar mask: image-to-video only: ``(B, tokens)`` float32, 1 on the tokens of the clean first
        latent frame.
    :ivar inputs: the DiT inputs every step of the stage shares (``LTX2T2V._stage_inputs``).
    """

    stage: int
    video: tuple[int, int, int, int]
    audio: tuple[int, int, int]
    guidance: tuple[float, float]
    sigmas: dict[float, float]
    mask: torch.Tensor | None = None
    inputs: dict = dataclasses.field(default_factory=dict)

    @property
    def video_numel(self) -> int:
        return math.prod(self.video)

    @property
    def numel(self) -> int:
        return self.video_numel + math.prod(self.audio)


class LTX2T2V(ModelInstance):
    """LTX-2 text-to-video with audio. See the module docstring for the state layout; each step
    body says which part of diffusers' ``LTX2Pipeline`` it follows."""

    #: what LTX-2.0's DiT computes from the text alone (the caption projections, the text
    #: cross-attention's keys and values, for video and audio) and from the stage's RoPE
    #: coordinates alone (the cos/sin of ``rope``, ``audio_rope``, ``cross_attn_rope``,
    #: ``cross_attn_audio_rope``; the coordinates are built once per stage, ``_stage_inputs``):
    #: reused across the steps of a stage (:mod:`flowseam.step_constants`); LTX-2.3's
    #: timestep-modulated prompt makes different inputs at each step, which then simply run again
    STEP_CONSTANTS = ("caption_projection", "attn2.to_k", "attn2.to_v", "attn2.norm_k", "rope")

    # -- shapes -----------------------------------------------------------------------------------
    @property
    def vae_spatial(self) -> int:
        return int(self.components["vae"].spatial_compression_ratio)

    @property
    def vae_temporal(self) -> int:
        return int(self.components["vae"].temporal_compression_ratio)

    @property
    def patch(self) -> tuple[int, int]:
        """(temporal, spatial) patch size of the DiT."""
        return int(self.dit.config.patch_size_t), int(self.dit.config.patch_size)

    @property
    def upscale(self) -> int:
        """The latent upsampler's spatial factor (2 for LTX-2's)."""
        config = self.components["latent_upsampler"].config
        scale = config.rational_spatial_scale if config.use_rational_resampler else 2.0
        return int(scale)

    def stage_size(self, params: DiffusionParams, stage: int) -> tuple[int, int]:
        """Pixel ``(height, width)`` of ``stage``: the output size for stage 2 or a one-stage
        run, the output size divided by the upsampler's factor for stage 1 of two."""
        if params.stages == 2 and stage == 1:
            return params.height // self.upscale, params.width // self.upscale
        return params.height, params.width

    def audio_frames(self, params: DiffusionParams) -> int:
        """Latent audio frames for ``num_frames`` at ``frame_rate`` (diffusers' formula):
        ``round(num_frames / frame_rate * sample_rate / mel_hop_length / t)``, ``t`` the audio
        VAE's temporal compression."""
        config = self.components["audio_vae"].config
        per_second = config.sample_rate / config.mel_hop_length / float(
            self.components["audio_vae"].temporal_compression_ratio)
        return round(params.num_frames / params.frame_rate * per_second)

    # -- 1. check -----------------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        params = request.params.with_defaults(self.defaults)  # flowseam.json, then the card
        check_common(params, request)
        check_frames(params.num_frames, self.vae_temporal, "LTX-2's video VAE")
        if params.lora or params.cache is not None:
            given = "lora" if params.lora else f"cache={params.cache}"
            raise InvalidInputError(
                f"{given}: {self.card.name} runs the ltx2 loop, which does not apply "
                "LoRA sets or step caching yet (Wan and FLUX.1 cards do)")
        if params.flow_shift is not None:
            raise InvalidInputError(
                f"flow_shift={params.flow_shift!r} is not taken by {self.card.name}: "
                "its sigmas are shifted by the scheduler config's dynamic shift (mu from "
                "the video token count); leave flow_shift unset")
        if self.solver.config.get("shift_terminal") and params.num_steps < 2:
            raise InvalidInputError(
                f"num_steps={params.num_steps} must be >= 2 with this checkpoint's scheduler: its "
                f"shift_terminal={self.solver.config['shift_terminal']} stretches the schedule "
                "so that its last sigma lands there, which one step cannot do (diffusers gives NaN)")
        if params.stages not in (1, 2):
            raise InvalidInputError(
                f"stages={params.stages!r} must be 1 (base resolution only) or 2 "
                "(base, latent upsample x2, refine)")
        if params.stages == 2 and "latent_upsampler" not in self.components:
            raise InvalidInputError(
                f"stages=2 needs the latent upsampler, and {self.path} has no latent_upsampler/ "
                "folder (LTX2LatentUpsamplerModel, as LTX-2's converter writes it); add it, or "
                "generate in one stage (stages=1, --stages 1)")
        multiple = math.lcm(SIZE_MULTIPLE, self.vae_spatial * self.patch[1])
        why = f"LTX-2 sizes are multiples of {multiple}"
        if params.stages == 2:
            multiple *= self.upscale
            why += f", and stage 1 runs at 1/{self.upscale} of the output size"
        for name in ("height", "width"):
            check_multiple(name, getattr(params, name), multiple, why)
        if not isinstance(params.frame_rate, (int, float)) or not params.frame_rate > 0:
            raise InvalidInputError(
                f"frame_rate={params.frame_rate!r} must be a number of frames per "
                "second > 0")
        for name in ("audio_guidance_scale", "refine_guidance_scale"):
            if getattr(params, name) < 0:
                raise InvalidInputError(f"{name}={getattr(params, name)!r} must be >= 0")
        sigmas = params.refine_sigmas
        if (not sigmas or any(not 0.0 < s <= 1.0 for s in sigmas)
                or any(b >= a for a, b in zip(sigmas, sigmas[1:]))):
            raise InvalidInputError(
                f"refine_sigmas={sigmas!r} must be a non-empty, strictly decreasing "
                f"list in (0, 1], e.g. {list(REFINE_SIGMAS)} (the distilled ones)")
        if not isinstance(params.max_sequence_length, int) or params.max_sequence_length < 1:
            raise InvalidInputError(
                f"max_sequence_length={params.max_sequence_length!r} must be an "
                "integer >= 1")
        self.check_image(request)
        return params

    # -- 2. encode ------------------------------------------------------------------------------
    def _encode_one(self, prompt: str, max_len: int) -> tuple[torch.Tensor, ...]:
        """(video embeds (1, L, Dv), audio embeds (1, L, Da), mask (1, L)) for one prompt, as
        diffusers encodes it: ``prompt.strip()``, the Gemma tokenizer with left padding to
        ``max_len``, every hidden state stacked and flattened to ``(1, L, D * (layers + 1))``,
        then the connectors with the tokenizer's padding side."""
        tokenizer, encoder = self.components["tokenizer"], self.components["text_encoder"]
        tokenizer.padding_side = "left"  # Gemma; diffusers sets it on every call too
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tok = tokenizer([prompt.strip()], padding="max_length", max_length=max_len,
                        truncation=True, add_special_tokens=True, return_tensors="pt")
        device = self.component_device("text_encoder")
        with torch.no_grad():
            hidden = encoder(input_ids=tok.input_ids.to(device),
                             attention_mask=tok.attention_mask.to(device),
                             output_hidden_states=True).hidden_states
            embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.component_dtype("text_encoder"))
            connectors = self.components["connectors"]
            cdev = self.component_device("connectors")
            video, audio, mask = connectors(embeds.to(cdev, self.component_dtype("connectors")),
                                            tok.attention_mask.to(cdev),
                                            padding_side=tokenizer.padding_side)
        return video, audio, mask

    def encode_prompts(self, prompts: list[str], max_len: int) -> tuple[torch.Tensor, ...]:
        """Connector outputs for ``prompts``, cached per (text encoder and connectors weights
        version, prompt, max_len): video ``(B, L, Dv)`` and audio ``(B, L, Da)`` embeddings in the
        DiT's dtype, and the binary mask ``(B, L)``."""
        version = (self.versions.get("text_encoder", 0), self.versions.get("connectors", 0))
        rows = [self.cached_text(("ltx2", version, p, max_len),
                                 lambda p=p: self._encode_one(p, max_len)) for p in prompts]
        device, dtype = self.component_device(self.DIT), self.component_dtype(self.DIT)
        return (torch.cat([r[0] for r in rows]).to(device, dtype),
                torch.cat([r[1] for r in rows]).to(device, dtype),
                torch.cat([r[2] for r in rows]).to(device))

    def guidance(self, params: DiffusionParams, stage: int) -> tuple[float, float]:
        """``(video, audio)`` CFG scales of ``stage`` (stage 2 uses ``refine_guidance_scale``)."""
        if stage == 2:
            return params.refine_guidance_scale, params.refine_guidance_scale
        return params.guidance_scale, params.audio_guidance_scale

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        """The prompts' embeddings and, when a stage runs CFG (its video or audio guidance
        > 1), the negative prompt's (``""`` by default)."""
        prompts = request.prompts
        video, audio, mask = self.encode_prompts(prompts, params.max_sequence_length)
        cond = Conditioning(prompt_embeds=video, extra={"audio_embeds": audio, "mask": mask,
                                                        "layouts": {}})
        stages = range(1, params.stages + 1)
        if any(max(self.guidance(params, s)) > 1.0 for s in stages):
            negative = [params.negative_prompt or ""] * len(prompts)
            nv, na, nm = self.encode_prompts(negative, params.max_sequence_length)
            cond.negative_embeds = nv
            cond.extra.update(negative_audio_embeds=na, negative_mask=nm)
        return cond

    # -- 3. latents, sigmas, upsampling ----------------------------------------------------------
    def pack_video(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, F, H, W)`` → ``(B, F/pt * H/p * W/p, C*pt*p*p)`` tokens (diffusers' order)."""
        pt, p = self.patch
        B, C, F, H, W = x.shape
        x = x.reshape(B, C, F // pt, pt, H // p, p, W // p, p)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def unpack_video(self, tokens: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """The inverse of :meth:`pack_video` for a latent ``shape = (C, F, H, W)``."""
        pt, p = self.patch
        C, F, H, W = shape
        x = tokens.reshape(tokens.shape[0], F // pt, H // p, W // p, C, pt, p, p)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(tokens.shape[0], C, F, H, W)

    @staticmethod
    def pack_audio(x: torch.Tensor) -> torch.Tensor:
        """``(B, C, L, M)`` → ``(B, L, C*M)``."""
        return x.transpose(1, 2).flatten(2, 3)

    @staticmethod
    def unpack_audio(tokens: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """``(B, L, C*M)`` → ``(B, C, L, M)`` for ``shape = (C, L, M)``."""
        return tokens.unflatten(2, (shape[0], shape[2])).transpose(1, 2)

    def split(self, state: torch.Tensor, layout: StageLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """A joint state ``(B, Nv + Na)`` → packed video ``(B, S, D)`` and audio ``(B, L, C*M)``."""
        C, F, H, W = layout.video
        pt, p = self.patch
        video = state[:, :layout.video_numel].reshape(state.shape[0], (F // pt) * (H // p) * (W // p), -1)
        audio = state[:, layout.video_numel:].reshape(state.shape[0], layout.audio[1], -1)
        return video, audio

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Packed video and audio → the joint state ``(B, Nv + Na)`` float32."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1).float()

    def layout(self, state: torch.Tensor, cond: Conditioning) -> StageLayout:
        """The :class:`StageLayout` of a state (found by its width).

        :raises ValueError: for a state of a size no stage of this request has.
        """
        if cond is None or "layouts" not in cond.extra:
            raise InvalidInputError(
                "an LTX-2 state unpacks only with its request's conditioning (the "
                "cond of the LoopResult that produced it)")
        try:
            return cond.extra["layouts"][state.shape[1]]
        except KeyError:
            raise InvalidInputError(
                f"no stage of this request has a state of width {state.shape[1]}; "
                f"known: {sorted(cond.extra['layouts'])}") from None

    def _register(self, cond: Conditioning, params: DiffusionParams, stage: int, video: tuple,
                  audio: tuple, mask: torch.Tensor | None = None) -> StageLayout:
        layout = StageLayout(stage, tuple(video), tuple(audio), self.guidance(params, stage), {}, mask)
        cond.extra["layouts"][layout.numel] = layout
        return layout

    def _noise(self, generators: list[torch.Generator], video_shape: tuple, audio_shape: tuple,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample noise: video ``(B, *video_shape)`` then audio ``(B, *audio_shape)``; each
        sample's generator draws its video noise before its audio noise (as diffusers does)."""
        B = len(generators)
        return draw_noise((B, *video_shape), generators), draw_noise((B, *audio_shape), generators)

    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        """Stage-1 noise, packed and joined: ``(B, Nv + Na)`` float32 on the DiT's device. Each
        sample's generator draws video ``(C, F', H', W')`` (``F' = (F - 1) / t + 1``, ``t`` the
        VAE's temporal compression), then audio ``(C_a, L, M')`` (:meth:`audio_frames`)."""
        height, width = self.stage_size(params, 1)
        video = (int(self.dit.config.in_channels) // (self.patch[0] * self.patch[1] ** 2),
                 (params.num_frames - 1) // self.vae_temporal + 1,
                 height // self.vae_spatial, width // self.vae_spatial)
        audio_vae = self.components["audio_vae"]
        audio = (int(audio_vae.config.latent_channels), self.audio_frames(params),
                 int(audio_vae.config.mel_bins) // int(audio_vae.mel_compression_ratio))
        noise_v, noise_a = self._noise(generators, video, audio)
        self._register(cond, params, 1, video, audio, self.first_frame_mask(cond, len(generators), video))
        v = self.condition_video(request, params, cond, noise_v)
        return self.join(self.pack_video(v), self.pack_audio(noise_a)).to(self.component_device(self.DIT))

    def condition_video(self, request: GenerationRequest, params: DiffusionParams,
                        cond: Conditioning, noise: torch.Tensor) -> torch.Tensor:
        """The stage-1 video latents ``(B, C, F, H, W)``: pure noise for text-to-video."""
        return noise

    def first_frame_mask(self, cond: Conditioning, batch: int, video: tuple) -> torch.Tensor | None:
        """Image-to-video's clean-first-frame token mask; None for text-to-video."""
        return None

    def _record_sigmas(self, state: torch.Tensor, cond: Conditioning,
                       schedule: tuple[list[float], torch.Tensor]) -> tuple[list[float], torch.Tensor]:
        sigmas, timesteps = schedule
        self.layout(state, cond).sigmas.update(
            {float(t): s for t, s in zip(timesteps.tolist(), sigmas)})
        return sigmas, timesteps

    def schedule(self, params: DiffusionParams, latents: torch.Tensor,
                 cond: Conditioning | None = None) -> tuple[list[float], torch.Tensor]:
        """Stage 1: ``linspace(1, 1/N, N)`` through the checkpoint's resolved scheduler
        (``self.solver``, :mod:`flowseam.schedulers`), with the dynamic shift ``mu`` from the
        video token count (diffusers' ``calculate_shift`` with the config's base/max seq len and
        shifts: 1024/4096 and 0.95/2.05 unless the config says otherwise) and the config's
        terminal shift. Returns the N + 1 sigmas (ending in 0) and the N timesteps ``sigma * 1000``
        (float32)."""
        layout = self.layout(latents, cond)
        c = self.solver.config
        tokens = self.split(latents[:1], layout)[0].shape[1]
        m = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
        mu = tokens * m + (c["base_shift"] - m * c["base_image_seq_len"])
        n = params.num_steps
        return self._record_sigmas(latents, cond, self.solver.timesteps(
            n, sigmas=np.linspace(1.0, 1 / n, n), mu=mu, device=latents.device))

    def refine_schedule(self, params: DiffusionParams, latents: torch.Tensor,
                        cond: Conditioning) -> tuple[list[float], torch.Tensor]:
        """Stage 2: ``refine_sigmas`` through the checkpoint's scheduler without dynamic or
        terminal shift (as diffusers' two-stage recipe sets it; with LTX-2's ``shift=1`` they
        stay as they are), then 0."""
        solver = dataclasses.replace(self.solver, config=dict(
            self.solver.config, use_dynamic_shifting=False, shift_terminal=None))
        return self._record_sigmas(latents, cond, solver.timesteps(
            len(params.refine_sigmas), sigmas=list(params.refine_sigmas), device=latents.device))

    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        vae = self.components["vae"]
        return (vae.latents_mean.view(1, -1, 1, 1, 1), vae.latents_std.view(1, -1, 1, 1, 1),
                float(vae.config.scaling_factor))

    def denormalize_video(self, x: torch.Tensor) -> torch.Tensor:
        """``x * std / scaling + mean`` (diffusers' ``_denormalize_latents``)."""
        mean, std, scaling = self._latent_stats()
        return x * std.to(x.device, x.dtype) / scaling + mean.to(x.device, x.dtype)

    def normalize_video(self, x: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """``(x - mean) * scaling / std`` (diffusers' ``_normalize_latents``)."""
        mean, std, config_scaling = self._latent_stats()
        scaling = config_scaling if scaling is None else scaling
        return (x - mean.to(x.device, x.dtype)) * scaling / std.to(x.device, x.dtype)

    def upsample(self, latents: torch.Tensor, cond: Conditioning, params: DiffusionParams) -> torch.Tensor:
        """Stage-1 result → the clean stage-2 state: the video latents denormalised, upsampled
        (``LTX2LatentUpsamplerModel``, x2 spatially) and normalised again; the audio latents as
        they are. Registers stage 2's layout."""
        layout = self.layout(latents, cond)
        video, audio = self.split(latents, layout)
        x = self.denormalize_video(self.unpack_video(video, layout.video))
        upsampler = self.components["latent_upsampler"]
        with torch.no_grad():
            up = upsampler(x.to(self.component_device("latent_upsampler"),
                                self.component_dtype("latent_upsampler"))).float()
        up = self.normalize_video(up.to(latents.device))
        self._register(cond, params, 2, tuple(up.shape[1:]), layout.audio,
                       self.first_frame_mask(cond, latents.shape[0], tuple(up.shape[1:])))
        return self.join(self.pack_video(up), audio)

    def renoise(self, latents: torch.Tensor, sigma: float, generators: list[torch.Generator],
                cond: Conditioning, renoise: Any) -> torch.Tensor:
        """``(1 - sigma) * x + sigma * noise`` on the stage-2 state with the platform's
        ``flow_renoise`` kernel ``renoise`` (diffusers' ``_create_noised_state``); the noise is
        drawn per sample in the packed video shape, then the packed audio shape."""
        layout = self.layout(latents, cond)
        video, audio = self.split(latents, layout)
        noise_v, noise_a = self._noise(generators, video.shape[1:], audio.shape[1:])
        return renoise(latents, self.join(noise_v, noise_a).to(latents.device), sigma)

    # -- 4. velocity ----------------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 params: DiffusionParams, dit: torch.nn.Module | None = None) -> torch.Tensor:
        """The guided velocity of the joint state ``(B, Nv + Na)`` at ``timestep`` ``(B,)``
        (``sigma * 1000``), float32, the state's shape.

        With CFG (the stage's video or audio scale > 1) the unconditional and conditional passes
        run as one batch of 2B; guidance is applied in x0 space, separately for the video
        (``guidance_scale``) and the audio (``audio_guidance_scale``): :func:`_guided`. The DiT
        runs with ``use_cross_timestep=True``, the pipeline's default.
        Image-to-video tokens of the clean first frame get velocity 0 (the step leaves them).
        """
        dit = self.dit if dit is None else dit
        layout = self.layout(latents, cond)
        g_video, g_audio = layout.guidance
        cfg = g_video > 1.0 or g_audio > 1.0
        video, audio = self.split(latents, layout)
        dtype, device = self.component_dtype(self.DIT), latents.device
        _, F, H, W = layout.video
        fps = float(params.frame_rate)
        n = 2 if cfg else 1
        embeds, audio_embeds, mask, video_coords, audio_coords = self._stage_inputs(
            dit, layout, cond, latents.shape[0] * n, cfg, fps, device)
        video_t = timestep if layout.mask is None else timestep[:, None] * (1 - layout.mask)
        rep = lambda t: t.repeat((n,) + (1,) * (t.ndim - 1)) if n > 1 else t  # noqa: E731
        v_video, v_audio = dit(
            hidden_states=rep(video).to(dtype), audio_hidden_states=rep(audio).to(dtype),
            encoder_hidden_states=embeds, audio_encoder_hidden_states=audio_embeds,
            timestep=rep(video_t), audio_timestep=None if layout.mask is None else rep(timestep),
            sigma=rep(timestep), encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=F, height=H, width=W, fps=fps,
            audio_num_frames=layout.audio[1], video_coords=video_coords,
            audio_coords=audio_coords, isolate_modalities=False,
            spatio_temporal_guidance_blocks=None, perturbation_mask=None,
            use_cross_timestep=True, return_dict=False)
        sigma = self._sigma(layout, timestep)
        v_video = _guided(video, v_video.float(), sigma, g_video, cfg)
        v_audio = _guided(audio, v_audio.float(), sigma, g_audio, cfg)
        if layout.mask is not None:  # the clean first frame is not stepped
            v_video = v_video * (1 - layout.mask[..., None])
        return self.join(v_video, v_audio)

    @staticmethod
    def _stage_inputs(dit: torch.nn.Module, layout: StageLayout, cond: Conditioning, batch: int,
                      cfg: bool, fps: float, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The DiT inputs that stay the same at every step of a stage, built at its first step
        (as diffusers builds them before its denoising loop) and kept in ``layout.inputs``: the
        text embeddings and mask (``[negative, prompt]`` with CFG; no mask when every position
        is valid: :func:`_attended_text`), the video and audio RoPE coordinates for
        ``batch`` rows (the CFG batch)."""
        key = (batch, cfg, device)
        if key not in layout.inputs:
            embeds, audio_embeds, mask = (cond.prompt_embeds, cond.extra["audio_embeds"],
                                          cond.extra["mask"])
            if cfg:
                embeds = torch.cat([cond.negative_embeds, embeds])
                audio_embeds = torch.cat([cond.extra["negative_audio_embeds"], audio_embeds])
                mask = torch.cat([cond.extra["negative_mask"], mask])
            embeds, audio_embeds, mask = _attended_text(embeds, audio_embeds, mask)
            _, F, H, W = layout.video
            layout.inputs[key] = (
                embeds, audio_embeds, mask,
                dit.rope.prepare_video_coords(batch, F, H, W, device, fps=fps),
                dit.audio_rope.prepare_audio_coords(batch, layout.audio[1], device))
        return layout.inputs[key]

    @staticmethod
    def _sigma(layout: StageLayout, timestep: torch.Tensor) -> torch.Tensor:
        """The scheduler's sigma for ``timestep`` (one value for the batch), float32 0-dim."""
        t = float(timestep.flatten()[0])
        sigma = layout.sigmas.get(t, t / 1000.0)
        return torch.tensor(sigma, dtype=torch.float32, device=timestep.device)

    # -- 5. decode ------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, params: DiffusionParams,
               cond: Conditioning | None = None) -> np.ndarray:
        """The final state → frames ``(B, F, H, W, 3)`` float32 in [0, 1]: the video latents
        denormalised (``x * std / scaling + mean``), then the VAE (``temb = 0`` for a
        timestep-conditioned VAE, diffusers' default ``decode_timestep``)."""
        layout = self.layout(latents, cond)
        vae = self.components["vae"]
        device, dtype = self.component_device("vae"), self.component_dtype("vae")
        video = self.denormalize_video(self.unpack_video(self.split(latents, layout)[0], layout.video))
        temb = None
        if vae.config.timestep_conditioning:  # diffusers' default decode_timestep = 0
            temb = torch.zeros(latents.shape[0], device=device, dtype=dtype)
        with torch.no_grad():
            frames = vae.decode(video.to(device, dtype), temb, return_dict=False)[0]
        return postprocess(frames)

    def decode_audio(self, latents: torch.Tensor, params: DiffusionParams,
                     cond: Conditioning) -> tuple[np.ndarray, int]:
        """The final state → ``(waveform (B, channels, samples) float32, sample rate in Hz)``:
        the audio latents denormalised (``x * std + mean``), the audio VAE's mel spectrogram, the
        vocoder; the rate is the vocoder's ``output_sampling_rate``."""
        layout = self.layout(latents, cond)
        audio_vae, vocoder = self.components["audio_vae"], self.components["vocoder"]
        device, dtype = self.component_device("audio_vae"), self.component_dtype("audio_vae")
        audio = self.split(latents, layout)[1].to(device, dtype)
        audio = audio * audio_vae.latents_std.to(device, dtype) + audio_vae.latents_mean.to(device, dtype)
        with torch.no_grad():
            mel = audio_vae.decode(self.unpack_audio(audio, layout.audio), return_dict=False)[0]
            wave = vocoder(mel.to(self.component_device("vocoder"), self.component_dtype("vocoder")))
        return wave.float().cpu().numpy(), int(vocoder.config.output_sampling_rate)


    def encode_latents(self, frames, params: DiffusionParams) -> torch.Tensor:
        """Not available: the ``finetune`` method's flow-matching loss would need the sound of
        every training clip as well (LTX-2 denoises video and audio latents together).

        :raises FlowseamError: always, saying so.
        """
        raise FlowseamError(f"{self.card.name} cannot be fine-tuned on frames alone: its DiT "
                            "denoises video and audio latents together (train it with flowgrpo)")


def _attended_text(embeds: torch.Tensor, audio_embeds: torch.Tensor, mask: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The text inputs of the DiT's cross-attention: the video ``(B, L, Dv)`` and audio
    ``(B, L, Da)`` embeddings as they are, and the binary mask ``(B, L)``, or None when every
    position is valid.

    The DiT turns the mask into the additive bias ``(1 - mask) * -10000`` on the text keys,
    which is ``-0.0`` at a valid position: adding it leaves every attention score's bits as
    they are, so no mask gives the same output, and SDPA skips reading and adding a
    ``(B, heads, 1, L)`` bias in every text cross-attention of every block and step. diffusers
    0.42.1's ``LTX2TextConnectors`` always return an all-ones mask (with learnable registers the
    padding is replaced; without them its binarisation ``video_attn_mask < 1e-6`` also marks
    the padding valid), so the DiT attends to every text position either way.
    """
    return embeds, audio_embeds, None if bool(mask.bool().all()) else mask


def _guided(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, scale: float, cfg: bool) -> torch.Tensor:
    """diffusers' LTX-2 guidance of one modality in x0 space (``v`` is ``(2B, ...)`` [uncond,
    cond] with CFG): ``x0 = x - v * sigma``, ``x0_g = x0_c + (scale - 1) * (x0_c - x0_u)``,
    returned as a velocity ``(x - x0_g) / sigma``."""
    if cfg:
        v_uncond, v_cond = v.chunk(2)
        x0 = x - v_cond * sigma
        x0 = x0 + (scale - 1) * (x0 - (x - v_uncond * sigma))
    else:
        x0 = x - v * sigma
    return (x - x0) / sigma


class LTX2I2V(LTX2T2V):
    """LTX-2 image-to-video with audio: the image becomes the clean first latent frame."""

    def read_index(self, index: dict[str, Any], source: str = "model_index.json") -> None:
        # the image conditioning's CRF follows the text encoder's generation (diffusers'
        # resolve_default_image_crf): read at load, as offload may free the text encoder later
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        super().read_index(index, source)
        self.image_crf = resolve_default_image_crf(self.components["text_encoder"])

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        from .wan import load_image

        cond = super().encode(request, params)
        cond.extra["image"] = load_image(request.image)
        return cond

    def first_frame_mask(self, cond: Conditioning, batch: int, video: tuple) -> torch.Tensor:
        """``(B, tokens)``, 1 on the first latent frame's tokens: they get timestep 0 and
        velocity 0, and are never re-noised, so the image's frame stays clean."""
        _, F, H, W = video
        mask = torch.zeros(batch, 1, F, H, W)
        mask[:, :, 0] = 1.0
        return self.pack_video(mask).squeeze(-1).to(self.component_device(self.DIT))

    def condition_video(self, request: GenerationRequest, params: DiffusionParams,
                        cond: Conditioning, noise: torch.Tensor) -> torch.Tensor:
        """``image_latents * mask + noise * (1 - mask)``: the re-compressed, resized image's
        normalised VAE mode in the first latent frame (repeated over frames, masked). The image
        is H.264 re-compressed at the model's default CRF (33 for Gemma 3 text encoders;
        diffusers' ``apply_image_conditioning_crf``, through PyAV) and resized to the stage-1
        size (bilinear, diffusers' ``VideoProcessor``)."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        height, width = self.stage_size(params, 1)
        image = cond.extra["image"]
        crf = getattr(self, "image_crf", None) or resolve_default_image_crf(
            self.components["text_encoder"])
        if crf:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        processor = VideoProcessor(vae_scale_factor=self.vae_spatial, resample="bilinear")
        pixels = processor.preprocess(image, height=height, width=width)
        vae = self.components["vae"]
        with torch.no_grad():
            latent = vae.encode(pixels.to(self.component_device("vae"), self.component_dtype("vae"))
                                .unsqueeze(2)).latent_dist.mode()
        # diffusers normalises the image latent with scaling 1 (its I2V ``prepare_latents`` does
        # not pass the VAE's scaling_factor); LTX-2's VAE has scaling_factor 1.0 anyway
        latent = self.normalize_video(latent.float().cpu(), scaling=1.0)
        latent = latent.repeat(1, 1, noise.shape[2], 1, 1)
        mask = torch.zeros(noise.shape[0], 1, *noise.shape[2:])
        mask[:, :, 0] = 1.0
        return latent * mask + noise * (1 - mask)

    def renoise(self, latents: torch.Tensor, sigma: float, generators: list[torch.Generator],
                cond: Conditioning, renoise: Any) -> torch.Tensor:
        """As text-to-video, but the video noise is drawn in the unpacked video shape (as
        diffusers' I2V does), and the clean first frame stays clean: its tokens keep their values
        (diffusers scales its noise by ``sigma * (1 - mask)``: 0 there)."""
        layout = self.layout(latents, cond)
        video, audio = self.split(latents, layout)
        noise_v, noise_a = self._noise(generators, layout.video, audio.shape[1:])
        noised = renoise(latents, self.join(self.pack_video(noise_v), noise_a).to(latents.device),
                         sigma)
        keep = torch.zeros_like(latents, dtype=torch.bool)
        keep[:, :layout.video_numel] = (layout.mask[..., None] > 0).expand_as(video).reshape(
            latents.shape[0], -1)
        return torch.where(keep, latents, noised)


_LTX2_COMPONENTS = (
    ComponentEntry("tokenizer", "tokenizer"),
    ComponentEntry("text_encoder", "text_encoder"),
    ComponentEntry("connectors", "text_connectors"),
    ComponentEntry("transformer", "dit"),
    ComponentEntry("vae", "vae"),
    ComponentEntry("audio_vae", "audio_vae"),
    ComponentEntry("vocoder", "vocoder"),
    ComponentEntry("latent_upsampler", "latent_upsampler", required=False,
                   cls="diffusers.pipelines.ltx2.LTX2LatentUpsamplerModel",
                   purpose="two-stage generation (stages=2)"),
)
_LTX2_RULES = (
    "num_frames = 8k+1 (the video VAE compresses time by 8; by its temporal factor in general)",
    "height and width divisible by 32; by 64 for two stages (stage 1 runs at half the size)",
    "stages = 1 or 2; two stages need the latent_upsampler/ folder",
    "refine_sigmas strictly decreasing in (0, 1]; guidance scales >= 0 (CFG when > 1)",
    "frame_rate > 0: RoPE positions and the audio length follow it",
)
_LTX2_DEFAULTS = dict(num_steps=30, guidance_scale=3.0, audio_guidance_scale=7.0, height=1024,
                      width=1536, num_frames=121, frame_rate=24.0, max_sequence_length=1024,
                      stages=2, refine_sigmas=REFINE_SIGMAS, refine_guidance_scale=1.0)

@dataclass(frozen=True)
class LTX2Card(ModelCard):
    """An LTX-2 card: its scheduler is read as every card's (:mod:`flowseam.schedulers`;
    ``LTX2Pipeline`` passes a resolution-dependent ``mu``), and the ``ltx2`` loop steps it with
    ``flow_match_step`` (Flow-GRPO's ``flow_sde_step`` for a rollout).

    Decision: diffusers' LTX-2 pipelines would also step another scheduler class, but Lightricks
    ships only FlowMatchEuler (deterministic) for LTX-2 and the two-stage recipe re-noises with
    its sigmas; flowseam's ``ltx2`` loop implements exactly that, and refuses UniPC and
    ``stochastic_sampling`` by name rather than run them differently from diffusers.
    """

    def resolve_solver(self, scheduler_config: Any, **kwargs: Any) -> SolverConfig:
        """:raises FlowseamError: for a scheduler the ``ltx2`` loop does not step (above)."""
        solver = super().resolve_solver(scheduler_config, **kwargs)
        if solver.scheduler_class != EULER or solver.config.get("stochastic_sampling"):
            raise FlowseamError(
                f"{solver.file}: {self.name} runs {EULER} without stochastic_sampling (the "
                f"scheduler LTX-2 ships); this config asks for {solver.op} "
                f"({solver.scheduler_class}), which flowseam's ltx2 loop does not implement")
        return solver


LTX2_T2V = LTX2Card(
    name="ltx2-t2v", pipeline_class="LTX2Pipeline", tasks=(TaskType.T2V,),
    components=_LTX2_COMPONENTS, defaults=_LTX2_DEFAULTS, rules=_LTX2_RULES, instance=LTX2T2V,
    loops=("ltx2",), audio=True, passes_mu=True)

LTX2_I2V = LTX2Card(
    name="ltx2-i2v", pipeline_class="LTX2ImageToVideoPipeline", tasks=(TaskType.I2V,),
    components=_LTX2_COMPONENTS, defaults=_LTX2_DEFAULTS,
    rules=_LTX2_RULES + ("an image is required: H.264 re-compressed at the model's CRF, resized "
                         "(bilinear) to the stage-1 size; it becomes the clean first latent frame",),
    instance=LTX2I2V, loops=("ltx2",), audio=True, passes_mu=True)
