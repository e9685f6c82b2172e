"""The LTX-2 loop: video *and* audio, in one or two stages (base → latent upsample → refine).

``run`` reads top to bottom like diffusers' two-stage recipe (``LTX2Pipeline`` with
``output_type="latent"``, ``LTX2LatentUpsamplePipeline``, then ``LTX2Pipeline`` again with the
refine sigmas); ``stages=1`` stops after stage 1 and decodes at the requested size. The key
decision: the state the solver moves is one float32 tensor per sample holding the packed video
and audio latents (the card's layout, :mod:`flowseam.models.ltx2`). Video and audio share every
sigma, so each step of either stage is **one** call of the loops' one stepper
(:class:`~flowseam.loops.solvers.SolverSteps`), stage 2's re-noising is its ``flow_renoise``
kernel, and a rollout's BehaviorRecord covers both modalities. Every step's output is checked
as in the other loops (:mod:`flowseam.loops.checks`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .. import ops
from .checks import check_finite, check_velocity, component_faults
from ..request import DiffusionParams, GenerationRequest
from ..step_constants import reuse_across_steps
from .records import BehaviorRecord, ExecutionProfile, LoopResult, Model, StepCallback
from .solvers import SolverSteps


#: The component kinds that turn a request into conditioning (stage 2 of ``run``).
ENCODERS = ("text_encoder", "tokenizer", "text_connectors")


def run(model: Model, request: GenerationRequest,
        profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
        decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """Run the LTX-2 loop of ``model`` (an ``ltx2-t2v`` / ``ltx2-i2v`` instance) for ``request``.

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step of both stages, each
        with its kernel's ``impl_id``; the steps are numbered across the stages (stage 2
        continues after stage 1's last index), which is also how ``sde_window`` counts them.
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
        the kernel's ``impl_id`` (:mod:`flowseam.seam.faults`).
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
    model.placement.release_encoders()  # offload="text_encoder": freed once the prompts are encoded
    t_encoded = time.perf_counter()

    # 3. Stage 1: video and audio noise at the base resolution, then the stage's sigmas.
    with component_faults(model, ("vae",), "preparing the latents"):
        latents = model.prepare_latents(request, params, generators, cond)
    sigmas, timesteps = model.schedule(params, latents, cond)

    # 4. Denoise stage 1: the solver is the loops' stepper, its kernels whatever the platform
    #    resolved for this run (both stages).
    total = len(timesteps) + (len(params.refine_sigmas) if params.stages == 2 else 0)
    solve = SolverSteps(model.platform.kernels, params, generators, renoise=params.stages == 2,
                        model=model)
    stage = _Stage(model, solve, cond, params, profile is ExecutionProfile.ROLLOUT, total,
                   _progress(progress, model, total), step_callback)
    latents = stage.denoise(latents, sigmas, timesteps, first=0)
    t_stage1 = t_upsampled = time.perf_counter()

    if params.stages == 2:
        # 5. Upsample the video latents x2 (the latent upsampler); the audio latents carry over.
        with component_faults(model, ("latent_upsampler",), "upsampling the latents"):
            latents = model.upsample(latents, cond, params)
        t_upsampled = time.perf_counter()

        # 6. Stage 2: re-noise to the first refine sigma (the stepper's flow_renoise; the card
        #    draws the noise in its layout), then the refine steps.
        sigmas2, timesteps2 = model.refine_schedule(params, latents, cond)
        latents = model.renoise(latents, params.refine_sigmas[0], generators, cond, solve.renoise)
        latents = stage.denoise(latents, sigmas2, timesteps2, first=len(timesteps))
    stage.close()
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
        frames=frames, latents=latents, params=params, seeds=seeds, records=stage.records,
        cond=cond, kernels=solve.impl_ids, loop="ltx2", audio=audio, sample_rate=rate,
        solver=_describe(solve, model.solver_line(), params),
        seconds={"encode": t_encoded - t_start, "stage1": t_stage1 - t_encoded,
                 "upsample": t_upsampled - t_stage1, "stage2": t_denoised - t_upsampled,
                 "denoise": t_denoised - t_encoded, "decode": t_end - t_denoised,
                 "total": t_end - t_start})


def _describe(solve: SolverSteps, solver_line: str, params: DiffusionParams) -> str:
    """One line: the op and kernel that stepped on the checkpoint's schedule (``solver_line``,
    the model's), and stage 2's re-noising and refine sigmas."""
    line = solve.line(solver_line, "stage-1")
    if params.stages == 2:
        line += (f"; stage 2: {ops.FLOW_RENOISE} [{solve.kernels[ops.FLOW_RENOISE].impl_id}] to "
                 f"sigma {params.refine_sigmas[0]}, then sigmas {list(params.refine_sigmas)} "
                 "(no dynamic or terminal shift)")
    return line


class _Stage:
    """What runs around the stepper at every step of either stage: the DiT's velocity, the
    BehaviorRecords (with ``capture``), the progress bar and the step callback."""

    def __init__(self, model: Model, solve: SolverSteps, cond: Any,
                 params: DiffusionParams, capture: bool, total: int, bar: Any,
                 step_callback: StepCallback | None) -> None:
        self.model, self.solve, self.cond, self.params = model, solve, cond, params
        self.capture, self.total, self.bar, self.step_callback = capture, total, bar, step_callback
        self.records: list[BehaviorRecord] = []

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def denoise(self, latents: torch.Tensor, sigmas: list[float], timesteps: torch.Tensor,
                first: int) -> torch.Tensor:
        """One stage: ``len(timesteps)`` steps from ``sigmas[0]`` to ``sigmas[-1]``; step ``i`` of
        the stage is step ``first + i`` of the run (records, ``sde_window``, the callback)."""
        model, solve = self.model, self.solve
        solve.start(sigmas, first=first)
        # what the DiT computes from the text alone runs at the stage's first step only
        with torch.no_grad(), reuse_across_steps():
            for index in range(first, first + len(timesteps)):
                t = timesteps[index - first].expand(latents.shape[0])
                with component_faults(model, ("dit",), f"predicting the velocity at step {index}"):
                    velocity = model.velocity(latents, t, self.cond, self.params)
                check_velocity(model, index, velocity, latents)
                step = solve(index, latents, velocity)
                if self.capture:
                    self.records.append(BehaviorRecord(
                        index, latents, step.next_latents, t, step.sigma, step.sigma_next,
                        step.sigma_max, step.log_prob, step.impl_id))
                latents = step.next_latents
                if self.bar is not None:
                    self.bar.update(1)
                if self.step_callback is not None:
                    self.step_callback(index, self.total, latents)
        return latents


def record_velocity(model: Model, result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` (default the model's) predicts at ``record``'s step of ``result``
    (either stage: the card finds the stage from the state's size in ``result.cond``), guided as
    the rollout guided it; recomputed with gradients if enabled."""
    return model.velocity(record.latents, record.timestep, result.cond, result.params, dit=dit)


def _progress(progress: bool, model: Model, total: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{model.card.name} denoise", unit="step", leave=False)
