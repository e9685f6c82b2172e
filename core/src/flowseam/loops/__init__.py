"""Denoising loops: one module per loop family, each reading top to bottom like a diffusers
pipeline's ``__call__``. Serve and rollout are the same loop (``ExecutionProfile``).

:func:`run_loop` runs the loop the model's card names (``card.loops[0]``); each loop module has
``run(model, request, profile, progress, decode, step_callback) -> LoopResult`` and calls
``step_callback(index, num_steps, latents)`` (:data:`StepCallback`) after every denoising step:
progress reporting and cancellation hang on it. The loops stand below the models: a model's
``generate`` calls :func:`run_loop`, and a loop drives the model's step bodies (``encode``,
``velocity``, ``decode``, ...) without importing the models. Loop modules share the modules
below them (:mod:`.records`, :mod:`.solvers`, :mod:`.checks`, :mod:`.step_cache`) and never
import each other or training.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..errors import InvalidInputError
from ..request import GenerationRequest
from . import causal, flow_match, ltx2
from .causal import Chunk
from .records import BehaviorRecord, ExecutionProfile, LoopResult, Model, StepCallback


#: loop name (as cards list them in ``ModelCard.loops``) → its ``run`` function
LOOPS: dict[str, Callable[..., LoopResult]] = {"flow_match": flow_match.run,
                                               "wan_causal": causal.run, "ltx2": ltx2.run}
#: loops that stream their output chunk by chunk → their ``stream`` generator
STREAMS: dict[str, Callable[..., Iterator[Chunk]]] = {"wan_causal": causal.stream}
#: loop name → its ``record_velocity(model, result, record, dit)`` (the pinned recompute's
#: velocity: each loop knows what its DiT saw at a step)
RECOMPUTE: dict[str, Callable[..., torch.Tensor]] = {"flow_match": flow_match.record_velocity,
                                                     "wan_causal": causal.record_velocity,
                                                     "ltx2": ltx2.record_velocity}


def check_no_module_cache(model: Model) -> None:
    """Refuse a DiT on which diffusers' cache hooks are enabled (``enable_cache`` with
    ``FirstBlockCacheConfig``, ``MagCacheConfig``, ``TaylorSeerCacheConfig``, ...).

    Decision: flowseam's loops do not run those hooks. They would skip blocks inside the DiT,
    where the loop cannot see it: a rollout's log-probs would then not be the model's, and
    the hooks need a ``cache_context`` per guidance branch while flowseam batches both branches
    into one DiT call. Adaptive step caching is the loop's own policy
    (:mod:`flowseam.loops.step_cache`: ``DiffusionParams(cache="reuse:0.05")``, ``--cache``), which
    covers the same family (First-Block Cache, MagCache, TeaCache, TaylorSeer's forecast).

    :raises ValueError: naming the DiT and the way out, before any model runs.
    """
    for name, dit in model.experts.items():
        if getattr(dit, "is_cache_enabled", False):
            raise InvalidInputError(
                f"{model.card.name}'s DiT {name!r} has diffusers' cache hooks enabled "
                "(enable_cache); flowseam's loops do not run them: call "
                f"model.components[{name!r}].disable_cache() and use flowseam's step cache "
                "instead (DiffusionParams(cache='reuse:0.05'), flowseam "
                "generate --cache reuse:0.05; the flow-match loop)")


def run_loop(model: Model, request: GenerationRequest,
             profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
             decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """Run the card's loop for ``request`` (see the loop module for the stages).

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step.
    :param progress: show a tqdm progress bar over the denoising steps.
    :param decode: decode the final latents with the VAE (``frames`` is empty otherwise).
    :param step_callback: called as ``step_callback(index, num_steps, latents)`` after every
        denoising step (:data:`StepCallback`); an exception it raises stops the loop there and
        propagates.
    :raises ValueError: for invalid requests (raised before any model runs), a card whose
        loop flowseam does not have, or a DiT with diffusers' cache hooks enabled
        (:func:`check_no_module_cache`).
    """
    check_no_module_cache(model)
    name = model.card.loops[0]
    try:
        loop = LOOPS[name]
    except KeyError:
        raise InvalidInputError(f"card {model.card.name} runs loop {name!r}; flowseam has "
                                f"{sorted(LOOPS)}") from None
    extra = {} if step_callback is None else {"step_callback": step_callback}
    return loop(model, request, profile=profile, progress=progress, decode=decode, **extra)


def stream_loop(model: Model, request: GenerationRequest,
                profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
                decode: bool = True, step_callback: StepCallback | None = None) -> Iterator[Chunk]:
    """Run the card's loop chunk by chunk, yielding each :class:`Chunk` as it is ready.

    :raises ValueError: if the card's loop does not stream (only ``wan_causal`` does), for
        an invalid request (before any model runs), or a DiT with diffusers' cache hooks
        enabled (:func:`check_no_module_cache`).
    """
    check_no_module_cache(model)
    name = model.card.loops[0]
    if name not in STREAMS:
        raise InvalidInputError(
            f"card {model.card.name} runs loop {name!r}, which does not stream; "
            f"streaming loops: {sorted(STREAMS)} (a causal checkpoint)")
    return STREAMS[name](model, request, profile=profile, progress=progress, decode=decode,
                         step_callback=step_callback)


def record_velocity(model: Model, result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` (default the model's DiT) predicts at ``record``'s step of the rollout
    ``result``, computed the way ``result.loop`` computed it (the causal loop rebuilds the KV
    cache of the earlier chunks). With the rollout's weights it is the rollout's velocity, so the
    pinned kernel reproduces the recorded log-prob (C2)."""
    return RECOMPUTE[result.loop](model, result, record, dit=dit)


def rollout_loop(model: Model, request: GenerationRequest,
                 profile: ExecutionProfile = ExecutionProfile.ROLLOUT, decode: bool = True) -> LoopResult:
    """A rollout: the serve loop (:func:`run_loop`) with capture — one :class:`BehaviorRecord` per
    step. With ``request.params.sde_rollout`` the steps are Flow-GRPO's SDE steps with log-probs;
    without it the result is bit-identical to serving the same request."""
    return run_loop(model, request, profile=profile, decode=decode)


__all__ = ["BehaviorRecord", "Chunk", "ExecutionProfile", "LOOPS", "LoopResult", "RECOMPUTE",
           "STREAMS", "StepCallback", "check_no_module_cache", "record_velocity", "rollout_loop",
           "run_loop", "stream_loop"]
