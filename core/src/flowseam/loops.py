"""The flow-match denoise loop, shared by every card. Serve and rollout are the same loop.

``run_loop`` reads top to bottom like a diffusers pipeline's ``__call__``: check inputs → encode
prompt → prepare latents → prepare sigmas → denoise → decode. The only indirection is the seam:
the solver comes from ``platform.kernels`` (resolved once, before the first step) and the card's
step bodies run the components the platform built. With ``ExecutionProfile.ROLLOUT`` the loop also
captures a :class:`BehaviorRecord` per step; with ``sde_rollout=False`` that capture changes
nothing about the result (SERVE and ROLLOUT outputs are bit-identical).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import ops
from .request import DiffusionParams, GenerationRequest

if TYPE_CHECKING:  # pragma: no cover
    from .models.base import Conditioning, ModelInstance


class ExecutionProfile(str, enum.Enum):
    """SERVE: generate. ROLLOUT: generate and capture a BehaviorRecord per step."""

    SERVE = "serve"
    ROLLOUT = "rollout"


@dataclass
class BehaviorRecord:
    """What a rollout captures for one denoising step.

    :ivar latents: ``(B, ...)`` the latents the step started from (the DiT's input state).
    :ivar next_latents: ``(B, ...)`` the latents it produced.
    :ivar timestep: ``(B,)`` float32, what the DiT was given (card-specific scaling of sigma).
    :ivar sigma, sigma_next: the step's noise levels (floats in [0, 1]).
    :ivar sigma_max: the SDE step's sigma at sigma == 1 (Flow-GRPO's ``sigmas[1]``).
    :ivar log_prob: ``(B,)`` float32 log-prob of ``next_latents`` (SDE steps only, else None).
    :ivar impl_id: the kernel that produced the step (pin it to recompute the log-prob).
    :ivar index: the step index.
    """

    index: int
    latents: torch.Tensor
    next_latents: torch.Tensor
    timestep: torch.Tensor
    sigma: float
    sigma_next: float
    sigma_max: float | None
    log_prob: torch.Tensor | None
    impl_id: str


@dataclass
class LoopResult:
    """The output of one loop run.

    :ivar frames: ``(B, F, H, W, 3)`` float32 in [0, 1] (F = 1 for images).
    :ivar latents: ``(B, ...)`` the final latents, before decoding.
    :ivar params: the parameters after defaults were filled in.
    :ivar records: the BehaviorRecords (ROLLOUT only).
    :ivar cond: the conditioning used (text embeddings etc.), for recomputing velocities.
    :ivar seconds: wall time per stage (``encode``, ``denoise``, ``decode``, ``total``).
    :ivar kernels: op → impl_id of the step kernel the loop used (outside an ``sde_window`` the
        steps are ``flow_match_step``; each BehaviorRecord names its own kernel).
    """

    frames: np.ndarray
    latents: torch.Tensor
    params: DiffusionParams
    seeds: list[int]
    records: list[BehaviorRecord] = field(default_factory=list)
    cond: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)


def run_loop(model: "ModelInstance", request: GenerationRequest,
             profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
             decode: bool = True) -> LoopResult:
    """Run the flow-match loop of ``model`` for ``request``.

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step.
    :param progress: show a tqdm progress bar over the denoising steps.
    :param decode: decode the final latents with the VAE (``frames`` is empty otherwise).
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
                noise = _sde_noise(latents, generators)
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
    t_denoised = time.perf_counter()

    # 5. Decode.
    frames = model.decode(latents, params) if decode else np.zeros((0,), np.float32)
    t_end = time.perf_counter()
    return LoopResult(
        frames=frames, latents=latents, params=params, seeds=seeds, records=records, cond=cond,
        seconds={"encode": t_encoded - t_start, "denoise": t_denoised - t_encoded,
                 "decode": t_end - t_denoised, "total": t_end - t_start},
        kernels={op: step.impl_id})


def rollout_loop(model: "ModelInstance", request: GenerationRequest,
                 profile: ExecutionProfile = ExecutionProfile.ROLLOUT, decode: bool = True) -> LoopResult:
    """A rollout: the serve loop (:func:`run_loop`) with capture — one :class:`BehaviorRecord` per
    step. With ``request.params.sde_rollout`` the steps are Flow-GRPO's SDE steps with log-probs;
    without it the result is bit-identical to serving the same request."""
    return run_loop(model, request, profile=profile, decode=decode)


def _sde_noise(latents: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Per-sample SDE noise: row b from generators[b], so every group member has its own."""
    from .models.base import draw_noise

    return draw_noise(tuple(latents.shape), generators, torch.float32).to(latents.device)
