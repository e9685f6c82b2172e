"""The LTX-2 loop: video *and* audio, in one or two stages (base → latent upsample → refine).

``run`` reads top to bottom like diffusers' two-stage recipe (``LTX2Pipeline`` with
``output_type="latent"``, ``LTX2LatentUpsamplePipeline``, then ``LTX2Pipeline`` again with the
refine sigmas): check inputs → encode the prompt → stage 1 (noise, sigmas, denoise with CFG at the
base resolution) → upsample the video latents x2 → re-noise to the first refine sigma → stage 2
(a few refine steps, the audio latents carried from stage 1) → decode the frames and the waveform.
``stages=1`` stops after stage 1 and decodes at the requested size.

The state the solver moves is one float32 tensor per sample holding the packed video and audio
latents (the card's layout; see :mod:`flowseam.models.ltx2`): video and audio share every sigma,
so each step of either stage is **one** call of the kernel ``platform.kernels`` resolved for this
run (before the first step), and a rollout's BehaviorRecord covers both modalities; stage 2's
re-noising is one call of the platform's ``flow_renoise`` kernel. With
``ExecutionProfile.ROLLOUT`` every step of both stages is captured with its kernel's
``impl_id``; the steps are numbered across the stages (stage 2 continues after stage 1's last
index), which is also how ``sde_window`` counts them.

Every step's output is checked as in the other loops (:mod:`flowseam.faults`): the DiT's velocity
(a tensor of the state's shape, on its device), each kernel's output (the state's shape, dtype
and device, finite; an SDE step's finite ``(B,)`` log-prob) and the re-noised stage-2 state; a
failing component (encoders, DiT, upsampler, VAEs, vocoder) is named with the plugin that built
it, a failing kernel with its step, op and ``impl_id``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import ops
from ..faults import check_finite, check_step, check_velocity, component_faults
from ..noise import noise_like
from ..request import DiffusionParams, GenerationRequest
from ..step_constants import reuse_across_steps
from .records import BehaviorRecord, ExecutionProfile, LoopResult, StepCallback

if TYPE_CHECKING:  # pragma: no cover
    from ..models.base import ModelInstance

#: The component kinds that turn a request into conditioning (stage 2 of ``run``).
ENCODERS = ("text_encoder", "tokenizer", "text_connectors")


def run(model: "ModelInstance", request: GenerationRequest,
        profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
        decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """Run the LTX-2 loop of ``model`` (an ``ltx2-t2v`` / ``ltx2-i2v`` instance) for ``request``.

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step of both stages.
    :param progress: show a tqdm progress bar over the denoising steps of both stages.
    :param decode: decode the frames and the waveform (``frames`` is empty and ``audio`` None
        otherwise).
    :param step_callback: ``step_callback(i, num_steps, latents)`` after step ``i`` of the run
        (both stages counted together: ``num_steps`` = base steps + refine steps; ``latents`` the
        joint state); an exception it raises stops the loop there.
    :returns: a :class:`LoopResult` with ``frames (B, F, H, W, 3)``, ``audio (B, channels,
        samples)`` and ``sample_rate``; ``seconds`` has ``encode``, ``stage1``, ``upsample``,
        ``stage2``, ``decode`` and ``total``.
    :raises ValueError: for invalid requests (raised before any model runs): the card's rules, a
        two-stage request on a checkpoint without the latent upsampler.
    :raises PluginFaultError: when a kernel or component raises or returns something wrong (a
        wrong shape, dtype or device, non-finite values), naming the plugin, the step, the op and
        the kernel's ``impl_id`` (:mod:`flowseam.faults`).
    """
    t_start = time.perf_counter()
    # 1. Check inputs before any model runs (frames 8k+1, sizes ÷ 32 or 64, the upsampler for
    #    two stages); every sample draws its noise from its own generator, in both stages.
    params = model.check(request)
    seeds = request.sample_seeds(params)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    # 2. Encode the prompt: Gemma hidden states → text connectors → video and audio embeddings.
    with component_faults(model, ENCODERS, "encoding the prompt"):
        cond = model.encode(request, params)
    t_encoded = time.perf_counter()

    # 3. Stage 1: video and audio noise at the base resolution, then the stage's sigmas.
    with component_faults(model, ("vae",), "preparing the latents"):
        latents = model.prepare_latents(request, params, generators, cond)
    sigmas, timesteps = model.schedule(params, latents, cond)

    # 4. Denoise stage 1: the solver is whatever the platform resolved for this op (both stages).
    total = len(timesteps) + (len(params.refine_sigmas) if params.stages == 2 else 0)
    solver = _Solver(model.platform, params, profile is ExecutionProfile.ROLLOUT, total,
                     _progress(progress, model, total), step_callback)
    latents = solver.denoise(model, latents, sigmas, timesteps, cond, params, generators, first=0)
    t_stage1 = t_upsampled = time.perf_counter()

    if params.stages == 2:
        # 5. Upsample the video latents x2 (the latent upsampler); the audio latents carry over.
        with component_faults(model, ("latent_upsampler",), "upsampling the latents"):
            latents = model.upsample(latents, cond, params)
        t_upsampled = time.perf_counter()

        # 6. Stage 2: re-noise to the first refine sigma (the platform's flow_renoise kernel),
        #    then the refine steps.
        sigmas2, timesteps2 = model.refine_schedule(params, latents, cond)
        upsampled = latents
        latents = model.renoise(latents, params.refine_sigmas[0], generators, cond, solver.renoise)
        check_step(model, "renoise", solver.renoise, upsampled, None, latents, 0.0,
                   params.refine_sigmas[0])
        latents = solver.denoise(model, latents, sigmas2, timesteps2, cond, params, generators,
                                 first=len(timesteps))
    solver.close()
    t_denoised = time.perf_counter()

    # 7. Decode: the frames (video VAE) and the waveform (audio VAE → vocoder).
    frames, audio, rate = np.zeros((0,), np.float32), None, None
    if decode:
        with component_faults(model, ("vae",), "decoding the frames"):
            frames = model.decode(latents, params, cond)
        check_finite(model, ("vae",), frames, "decoded non-finite frames")
        with component_faults(model, ("audio_vae", "vocoder"), "decoding the audio"):
            audio, rate = model.decode_audio(latents, params, cond)
        if audio is not None:
            check_finite(model, ("audio_vae", "vocoder"), audio, "decoded a non-finite waveform")
    t_end = time.perf_counter()
    return LoopResult(
        frames=frames, latents=latents, params=params, seeds=seeds, records=solver.records,
        cond=cond, kernels=solver.used, loop="ltx2", audio=audio, sample_rate=rate,
        solver=solver.describe(model.solver_line(), params),
        seconds={"encode": t_encoded - t_start, "stage1": t_stage1 - t_encoded,
                 "upsample": t_upsampled - t_stage1, "stage2": t_denoised - t_upsampled,
                 "denoise": t_denoised - t_encoded, "decode": t_end - t_denoised,
                 "total": t_end - t_start})


class _Solver:
    """The kernels of one run, resolved once from ``platform.kernels`` (the ODE step, Flow-GRPO's
    SDE step for an ``sde_rollout``, and ``flow_renoise``), the BehaviorRecords they produced (with
    ``capture``), and what runs after every step (the progress bar, the step callback)."""

    def __init__(self, platform: Any, params: DiffusionParams, capture: bool, total: int,
                 bar: Any, step_callback: StepCallback | None) -> None:
        self.op = ops.FLOW_SDE_STEP if params.sde_rollout else ops.FLOW_MATCH_STEP
        self.step = platform.kernels.get(self.op)
        # outside an sde_window the step is the ODE one
        self.ode = platform.kernels.get(ops.FLOW_MATCH_STEP) if params.sde_rollout else self.step
        self.renoise = platform.kernels.get(ops.FLOW_RENOISE)  # stage 2's re-noising
        #: op → impl_id of every kernel the run used
        self.used = {self.op: self.step.impl_id}
        if params.sde_rollout and params.sde_window is not None:
            self.used[ops.FLOW_MATCH_STEP] = self.ode.impl_id
        if params.stages == 2:
            self.used[ops.FLOW_RENOISE] = self.renoise.impl_id
        self.window = range(*params.sde_window) if params.sde_window is not None else None
        self.capture, self.total, self.bar, self.step_callback = capture, total, bar, step_callback
        self.records: list[BehaviorRecord] = []

    def describe(self, solver_line: str, params: DiffusionParams) -> str:
        """One line: the ops and kernels that ran, on the checkpoint's schedule (``solver_line``,
        the model's), and stage 2's re-noising and refine sigmas."""
        how = "ODE" if not params.sde_rollout else "Flow-GRPO SDE rollout" + (
            f", SDE steps {self.window.start}-{self.window.stop - 1}" if self.window else "")
        settings = solver_line.split(": ", 1)[-1]
        line = f"solver {self.op} [{self.step.impl_id}] ({how}) on the stage-1 schedule: {settings}"
        if params.stages == 2:
            line += (f"; stage 2: {ops.FLOW_RENOISE} [{self.renoise.impl_id}] to sigma "
                     f"{params.refine_sigmas[0]}, then sigmas {list(params.refine_sigmas)} "
                     "(no dynamic or terminal shift)")
        return line

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def denoise(self, model: "ModelInstance", latents: torch.Tensor, sigmas: list[float],
                timesteps: torch.Tensor, cond: Any, params: DiffusionParams,
                generators: list[torch.Generator], first: int) -> torch.Tensor:
        """One stage: ``len(timesteps)`` steps from ``sigmas[0]`` to ``sigmas[-1]``; step ``i`` of
        the stage is step ``first + i`` of the run (records, ``sde_window``, the callback)."""
        sigma_max = sigmas[1] if len(sigmas) > 2 else None
        # what the DiT computes from the text alone runs at the stage's first step only
        with torch.no_grad(), reuse_across_steps():
            for i in range(len(timesteps)):
                index, sigma, sigma_next = first + i, sigmas[i], sigmas[i + 1]
                t = timesteps[i].expand(latents.shape[0])
                with component_faults(model, ("dit",), f"predicting the velocity at step {index}"):
                    velocity = model.velocity(latents, t, cond, params)
                check_velocity(model, index, velocity, latents)
                sde = params.sde_rollout and (self.window is None or index in self.window)
                if sde:
                    used = self.step
                    out = used(latents, velocity, sigma, sigma_next,
                               noise=noise_like(latents, generators),
                               noise_level=params.noise_level, sigma_max=sigma_max)
                    next_latents, log_prob = getattr(out, "sample", out), getattr(out, "log_prob", None)
                else:
                    used = self.ode
                    next_latents, log_prob = used(latents, velocity, sigma, sigma_next), None
                # the state's shape, dtype and device, finite (else named: step, op, impl_id)
                check_step(model, index, used, latents, velocity, next_latents, sigma, sigma_next,
                           log_prob, sde=sde)
                if self.capture:
                    self.records.append(BehaviorRecord(index, latents, next_latents, t, sigma,
                                                       sigma_next, sigma_max, log_prob, used.impl_id))
                latents = next_latents
                if self.bar is not None:
                    self.bar.update(1)
                if self.step_callback is not None:
                    self.step_callback(index, self.total, latents)
        return latents


def record_velocity(model: "ModelInstance", result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` (default the model's) predicts at ``record``'s step of ``result``
    (either stage: the card finds the stage from the state's size in ``result.cond``), guided as
    the rollout guided it; recomputed with gradients if enabled."""
    return model.velocity(record.latents, record.timestep, result.cond, result.params, dit=dit)


def _progress(progress: bool, model: "ModelInstance", total: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{model.card.name} denoise", unit="step", leave=False)
