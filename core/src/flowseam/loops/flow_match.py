"""The flow-match denoise loop (Wan2.1 T2V/I2V, FLUX.1): serve and rollout are the same loop.

``run`` reads top to bottom like a diffusers pipeline's ``__call__``: check inputs → encode
prompt → prepare latents → prepare sigmas → denoise → decode. The only indirection is the seam:
the solver comes from ``platform.kernels`` (resolved once, before the first step, by
:class:`~flowseam.loops.solvers.SolverSteps` from the checkpoint's scheduler) and the card's
step bodies run the components the platform built (a two-expert Wan2.2 model switches DiT at
its boundary timestep, as diffusers does). With ``ExecutionProfile.ROLLOUT`` the loop also
captures a :class:`BehaviorRecord` per step; with ``sde_rollout=False`` that capture changes
nothing about the result (SERVE and ROLLOUT outputs are bit-identical).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .checks import check_finite, check_velocity, component_faults
from ..request import GenerationRequest
from ..step_constants import reuse_across_steps
from .records import BehaviorRecord, ExecutionProfile, LoopResult, Model, StepCallback
from .solvers import SolverSteps
from .step_cache import StepCache, check_cache


#: The component kinds that turn a request into conditioning (stage 2).
ENCODERS = ("text_encoder", "tokenizer", "image_encoder", "image_processor")


def run(model: Model, request: GenerationRequest,
        profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
        decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """Run the flow-match loop of ``model`` for ``request`` (Wan2.1 T2V/I2V, FLUX.1).

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per step.
    :param progress: show a tqdm progress bar over the denoising steps.
    :param decode: decode the final latents with the VAE (``frames`` is empty otherwise).
    :param step_callback: ``step_callback(i, num_steps, latents)`` after step ``i``
        (:data:`~flowseam.loops.records.StepCallback`); an exception it raises stops the loop.
    :raises ValueError: for invalid requests (raised before any model runs).
    :raises PluginFaultError: when a kernel or component raises or returns something wrong (a
        wrong shape, dtype or device, non-finite values), naming the plugin, the step, the op and
        the kernel's ``impl_id`` (:mod:`flowseam.seam.faults`).
    """
    t_start = time.perf_counter()
    # 1. Check inputs: fill the card's defaults, validate, one generator per sample; switch the
    #    DiT experts to the request's LoRA set (each file read once per model; flowseam.models.adapters).
    params = model.validate(request)  # the card's rules (and, split over ranks, the split's)
    if model.parallel is not None:  # every rank stops at the step any rank's callback raises
        step_callback = model.parallel.agreed(step_callback)
    capture = profile is ExecutionProfile.ROLLOUT
    check_cache(params.cache, capture)
    model.adapters.activate(params.lora)
    seeds = request.sample_seeds(params)
    generators = [torch.Generator().manual_seed(s) for s in seeds]

    # 2. Encode the prompt (cached per text-encoder weights version and prompt). A component
    #    that raises, or returns non-finite embeddings, is named with the plugin that built it.
    with component_faults(model, ENCODERS, "encoding the prompt"):
        cond = model.encode(request, params)
    check_finite(model, ENCODERS, cond.prompt_embeds, "returned non-finite prompt embeddings")
    model.placement.release_encoders()  # offload="text_encoder": freed once the prompts are encoded
    t_encoded = time.perf_counter()

    # 3. Prepare latents, then the sigma schedule (it may depend on the latent size): the
    #    checkpoint's scheduler, with what the request overrides (model.solver,
    #    flowseam.schedulers).
    with component_faults(model, ("vae", "image_encoder"), "preparing the latents"):
        latents = model.prepare_latents(request, params, generators, cond)
    schedule = model.schedule(params, latents)

    # 4. Denoise: the solver op is picked once, before the first step, from the schedule's
    #    solver (an SDE rollout runs Flow-GRPO's first-order steps on the same schedule); each
    #    step's expert is the DiT that owns its timestep (one for Wan2.1 and FLUX.1).
    #    With a cache policy (off by default) a step's velocity may be predicted instead of
    #    computed, per CFG branch (StepCache, flowseam.loops.step_cache).
    solve = SolverSteps(model.platform.kernels, params, generators, sampler=schedule.solver.ops,
                        config=schedule.solver, model=model)
    solve.start(schedule)
    cache = None if params.cache is None else StepCache(params.cache, solve.sigmas)
    records: list[BehaviorRecord] = []
    experts: list[str] = []
    steps = range(len(schedule.timesteps))
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=f"{model.card.name} denoise", unit="step", leave=False)
    with torch.no_grad(), reuse_across_steps():  # text-only values once per run (step_constants)
        for i in steps:
            t = schedule.timesteps[i].expand(latents.shape[0])
            expert = model.experts.at(schedule.timesteps[i])
            with component_faults(model, ("dit",), f"predicting the velocity at step {i}"):
                if cache is None:
                    velocity = model.velocity(latents, t, cond, params, expert=expert)
                else:
                    velocity = cache.velocity(
                        i, expert, model.num_branches(cond),
                        lambda branches: model.branch_velocity(latents, t, cond, params, branches,
                                                               expert=expert),
                        lambda branches: model.guide(branches, params, expert))
            check_velocity(model, i, velocity, latents)
            # every kernel output is checked in the step: the latents' shape, dtype and device,
            # finite (else named: step, op, impl_id; or the DiT's plugin for a non-finite velocity)
            step = solve(i, latents, velocity)
            if capture:
                records.append(BehaviorRecord(i, latents, step.next_latents, t, step.sigma,
                                              step.sigma_next, step.sigma_max, step.log_prob,
                                              step.impl_id, expert=expert,
                                              cache=None if cache is None else str(params.cache),
                                              predicted=cache is not None and cache.predicted[-1]))
            experts.append(expert)
            latents = step.next_latents
            if step_callback is not None:
                step_callback(i, len(schedule.timesteps), latents)
    t_denoised = time.perf_counter()

    # 5. Decode.
    frames = np.zeros((0,), np.float32)
    if decode:
        with component_faults(model, ("vae",), "decoding the latents"):
            frames = model.decode(latents, params)
        check_finite(model, ("vae",), frames, "decoded non-finite frames")
    t_end = time.perf_counter()
    return LoopResult(
        frames=frames, latents=latents, params=params, seeds=seeds, records=records, cond=cond,
        seconds={"encode": t_encoded - t_start, "denoise": t_denoised - t_encoded,
                 "decode": t_end - t_denoised, "total": t_end - t_start},
        kernels=solve.impl_ids, solver=solve.line(schedule.solver.describe()), experts=experts,
        cache=None if cache is None else cache.report())


def record_velocity(model: Model, result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` (default the model's expert that ran the step, ``record.expert``)
    predicts at ``record``'s step of ``result``: what the rollout's kernel was given, recomputed
    (with gradients if enabled). For a two-expert model pass the trainer's copy of that expert."""
    return model.velocity(record.latents, record.timestep, result.cond, result.params, dit=dit,
                          expert=record.expert)
