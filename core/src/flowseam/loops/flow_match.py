"""The flow-match denoise loop (Wan2.1 T2V/I2V, FLUX.1): serve and rollout are the same loop.

``run`` reads top to bottom like a diffusers pipeline's ``__call__``: check inputs → encode
prompt → prepare latents → prepare sigmas → denoise → decode. The only indirection is the seam:
the solver comes from ``platform.kernels`` (resolved once, before the first step) and the card's
step bodies run the components the platform built. With ``ExecutionProfile.ROLLOUT`` the loop also
captures a :class:`BehaviorRecord` per step; with ``sde_rollout=False`` that capture changes
nothing about the result (SERVE and ROLLOUT outputs are bit-identical).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import ops
from ..noise import noise_like
from ..request import GenerationRequest
from .records import BehaviorRecord, ExecutionProfile, LoopResult, StepCallback

if TYPE_CHECKING:  # pragma: no cover
    from ..models.base import ModelInstance


def run(model: "ModelInstance", request: GenerationRequest,
        profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
        decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """Run the flow-match loop of ``model`` for ``request`` (Wan2.1 T2V/I2V, FLUX.1).

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step.
    :param progress: show a tqdm progress bar over the denoising steps.
    :param decode: decode the final latents with the VAE (``frames`` is empty otherwise).
    :param step_callback: ``step_callback(i, num_steps, latents)`` after step ``i``
        (:data:`~flowseam.loops.records.StepCallback`); an exception it raises stops the loop.
    :raises ValueError: for invalid requests (raised before any model runs).
    """
    t_start = time.perf_counter()
    # 1. Check inputs: fill the card's defaults, validate, one generator per sample.
    params = model.check(request)
    seeds = request.sample_seeds(params)
    generators = [torch.Generator().manual_seed(s) for s in seeds]

    # 2. Encode the prompt (cached per text-encoder weights version and prompt).
    cond = model.encode(request, params)
    t_encoded = time.perf_counter()

    # 3. Prepare latents, then the sigma schedule (it may depend on the latent size).
    latents = model.prepare_latents(request, params, generators, cond)
    sigmas, timesteps = model.schedule(params, latents)

    # 4. Denoise: the solver is whatever the platform resolved for this op.
    op = ops.FLOW_SDE_STEP if params.sde_rollout else ops.FLOW_MATCH_STEP
    step = model.platform.kernels.get(op)
    # outside an sde_window the step is the ODE one
    ode_step = model.platform.kernels.get(ops.FLOW_MATCH_STEP) if params.sde_rollout else step
    window = range(*params.sde_window) if params.sde_window is not None else None
    capture = profile is ExecutionProfile.ROLLOUT
    sigma_max = sigmas[1] if len(sigmas) > 2 else None
    records: list[BehaviorRecord] = []
    steps = range(len(timesteps))
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=f"{model.card.name} denoise", unit="step", leave=False)
    with torch.no_grad():
        for i in steps:
            sigma, sigma_next = sigmas[i], sigmas[i + 1]
            t = timesteps[i].expand(latents.shape[0])
            velocity = model.velocity(latents, t, cond, params)
            if params.sde_rollout and (window is None or i in window):
                used = step
                noise = noise_like(latents, generators)
                out = step(latents, velocity, sigma, sigma_next, noise=noise,
                           noise_level=params.noise_level, sigma_max=sigma_max)
                next_latents, log_prob = out.sample, out.log_prob
            else:
                used = ode_step
                next_latents, log_prob = used(latents, velocity, sigma, sigma_next), None
            if capture:
                records.append(BehaviorRecord(i, latents, next_latents, t, sigma, sigma_next,
                                              sigma_max, log_prob, used.impl_id))
            latents = next_latents
            if step_callback is not None:
                step_callback(i, len(timesteps), latents)
    t_denoised = time.perf_counter()

    # 5. Decode.
    frames = model.decode(latents, params) if decode else np.zeros((0,), np.float32)
    t_end = time.perf_counter()
    return LoopResult(
        frames=frames, latents=latents, params=params, seeds=seeds, records=records, cond=cond,
        seconds={"encode": t_encoded - t_start, "denoise": t_denoised - t_encoded,
                 "decode": t_end - t_denoised, "total": t_end - t_start},
        kernels={op: step.impl_id})


def record_velocity(model: "ModelInstance", result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` (default the model's) predicts at ``record``'s step of ``result``:
    what the rollout's kernel was given, recomputed (with gradients if enabled)."""
    return model.velocity(record.latents, record.timestep, result.cond, result.params, dit=dit)
