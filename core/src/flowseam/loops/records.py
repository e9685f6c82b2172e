"""What every loop returns and what a rollout captures: the records shared by all loop modules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..request import DiffusionParams


#: the model a loop drives: a :class:`flowseam.models.ModelInstance` whose card names the loop.
#: The loops stand below the models and never import them; each loop module says which of the
#: model's step bodies it calls.
Model = Any

#: ``step_callback(index, num_steps, latents)``: what a loop calls after each denoising step
#: (like diffusers' ``callback_on_step_end``). ``index`` is the 0-based step just finished,
#: ``num_steps`` the loop's step count, ``latents`` ``(B, ...)`` the latents that step produced
#: (read them, never modify them in place). It runs on the loop's thread, between steps; an
#: exception it raises stops the loop at that step boundary and propagates to the caller
#: (that is how ``flowseam serve`` cancels a job). Its return value is ignored.
StepCallback = Callable[[int, int, torch.Tensor], None]


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
    :ivar index: the step index (over the whole rollout; the causal loop counts on across chunks).
    :ivar chunk: the chunk the step belongs to (causal loop; None elsewhere). ``latents`` and
        ``next_latents`` are then that chunk's latents ``(B, C, n, h, w)``.
    :ivar start_frame: the chunk's first latent frame (causal loop).
    :ivar cache: the step-cache policy the rollout ran with (``"extrapolate:0.1"``), or None.
    :ivar predicted: whether the step's velocity (any CFG branch of it) was predicted by the
        cache rather than computed by the DiT.
    :ivar expert: the component name of the DiT expert that gave the velocity (``"transformer"``;
        ``"transformer_2"`` for the low-noise steps of a two-expert Wan2.2 model). Recompute
        with ``model.velocity(..., expert=record.expert, dit=<your copy of that expert>)``.
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
    chunk: int | None = None
    start_frame: int = 0
    expert: str = "transformer"
    cache: str | None = None
    predicted: bool = False


@dataclass
class LoopResult:
    """The output of one loop run.

    :ivar frames: ``(B, F, H, W, 3)`` float32 in [0, 1] (F = 1 for images).
    :ivar latents: ``(B, ...)`` the final latents, before decoding.
    :ivar params: the parameters after defaults were filled in.
    :ivar seeds: one seed per sample.
    :ivar records: the BehaviorRecords (ROLLOUT only).
    :ivar cond: the conditioning used (text embeddings etc.), for recomputing velocities.
    :ivar seconds: wall time per stage (``encode``, ``denoise``, ``decode``, ``total``).
    :ivar kernels: op → impl_id of every solver kernel the run used (the serving sampler's ops;
        ``flow_sde_step`` for an SDE rollout, with the Euler step ``flow_match_step`` outside an
        ``sde_window``, Self-Forcing's x0 + re-noise ops in the causal loop;
        ``flow_renoise`` for LTX-2's stage 2), in the order first used; each BehaviorRecord names
        the kernel of its own step.
    :ivar loop: the loop that ran (``"flow_match"``, ``"wan_causal"``, ...).
    :ivar chunks: how many chunks the video was generated in (1 outside the causal loop).
    :ivar kv_cache_peak_bytes: the most bytes the causal loop's KV cache held (all layers).
    :ivar solver: one line: the solver op and kernel that ran, the scheduler class whose sigma
        schedule it stepped, and each setting with its source (checkpoint / request / card
        default / diffusers default).
    :ivar experts: the DiT expert (component name) that ran each step.
    :ivar audio: ``(B, channels, samples)`` float32 waveform in [-1, 1] for cards that make sound
        (LTX-2), else None.
    :ivar sample_rate: the waveform's samples per second (Hz), else None.
    :ivar cache: with a step-cache policy: ``{"policy", "steps_computed", "steps_skipped",
        "branches_computed", "branches_skipped"}`` (:mod:`flowseam.loops.step_cache`); None
        without one.
    """

    frames: np.ndarray
    latents: torch.Tensor
    params: DiffusionParams
    seeds: list[int]
    records: list[BehaviorRecord] = field(default_factory=list)
    cond: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)
    loop: str = "flow_match"
    chunks: int = 1
    kv_cache_peak_bytes: int = 0
    solver: str = ""
    experts: list[str] = field(default_factory=list)
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    cache: dict[str, Any] | None = None
