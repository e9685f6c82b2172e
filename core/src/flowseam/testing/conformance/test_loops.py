"""The loops end to end on tiny checkpoints of every card: serve parity with cpu (C1), the
solvers a checkpoint's scheduler may name against diffusers' own pipelines, and the log-prob of a
real SDE rollout recomputed with the pinned kernel (C2). For LTX-2 that is the two-stage loop
(base, latent upsample, re-noise, refine), frames and waveform."""

from __future__ import annotations

import pytest
import torch

import flowseam
from flowseam import ops
from flowseam.loops.solvers import SolverSteps
from flowseam.testing.conformance._support import (
    assert_model_close,
    card_cases,
    diffusers_output,
    request_for,
    solver_cases,
)

#: C2: the PPO ratio exp(recomputed - rollout log-prob) must be 1 within this.
RATIO_TOL = 1e-6


@pytest.mark.flowseam_cases(cases=card_cases)
def test_serve_parity_with_cpu(flowseam_platform, flowseam_case, conformance_runs):
    """C1: the card's standard request (same checkpoint, seed and parameters) gives the same final
    latents and frames on the backend as on cpu, within the tolerance of the DiT's dtype (its
    lowest precision; a reduced-precision model's is a relative 2-norm bound,
    :data:`~flowseam.testing.conformance._support.MODEL_RELATIVE_TOLERANCES`)."""
    card = flowseam_case
    ours, ref = conformance_runs.backend(flowseam_platform, card), conformance_runs.reference(card)
    resolved = {op: flowseam_platform.kernels.get(op).impl_id for op in ours.result.kernels}
    assert ops.FLOW_MATCH_STEP in resolved and ours.result.kernels == resolved, \
        f"the serve loop used {ours.result.kernels}, not the platform's {resolved}"
    dtype = ours.model.component_dtype(ours.model.DIT)  # a mixed-precision DiT: its lowest
    assert_model_close(ours.result.latents, ref.result.latents, dtype, f"{card} final latents vs cpu")
    assert_model_close(ours.result.frames, ref.result.frames, dtype, f"{card} decoded frames vs cpu")
    if ref.result.audio is not None:  # LTX-2: the waveform too, at the same rate
        assert ours.result.sample_rate == ref.result.sample_rate
        assert_model_close(ours.result.audio, ref.result.audio, dtype, f"{card} waveform vs cpu")


@pytest.mark.flowseam_cases(cases=card_cases)
def test_rollout_log_prob_recomputes(flowseam_platform, flowseam_case, conformance_runs):
    """C2 through a real rollout: ``run_loop(..., profile=ROLLOUT)`` with ``sde_rollout=True``
    records every step (every (chunk, step) of the causal loop); recomputing the velocity with
    ``flowseam.record_velocity`` (the loop's own recompute: the causal loop rebuilds the KV
    cache of the earlier chunks) and the log-prob with the stepper the RL methods use,
    ``SolverSteps.recompute`` (the kernel pinned by ``platform.kernels.pin(record.impl_id)``;
    ``prev_sample=record.next_latents``) gives the rollout's log-prob: PPO ratio 1 within
    1e-6 on every step, sigma == 1 and the last step to 0 included."""
    card = flowseam_case
    platform = flowseam_platform
    model = conformance_runs.backend(platform, card).model
    request = request_for(card, sde_rollout=True)
    result = flowseam.run_loop(model, request, profile=flowseam.ExecutionProfile.ROLLOUT,
                               decode=False)
    sde = platform.kernels.get(ops.FLOW_SDE_STEP)
    records = result.records
    # the RL update's recompute: the loops' stepper with the rollout's kernel pinned
    recompute = SolverSteps.recompute(platform.kernels, result)
    steps = result.params.num_steps * result.chunks
    if result.params.stages == 2:  # LTX-2: stage 2's refine steps are recorded too
        steps += len(result.params.refine_sigmas)
    assert len(records) == steps, \
        f"{len(records)} records for {steps} steps ({result.chunks} chunk(s), stages " \
        f"{result.params.stages or 1})"
    assert records[0].sigma == 1.0 and records[-1].sigma_next == 0.0
    if result.chunks > 1:
        assert [r.chunk for r in records] == [c for c in range(result.chunks)
                                              for _ in range(result.params.num_steps)]
    for rec in records:
        assert rec.impl_id == sde.impl_id, \
            f"step {rec.index} ran {rec.impl_id}, not the platform's {sde.impl_id}"
        assert rec.log_prob is not None and tuple(rec.log_prob.shape) == (rec.latents.shape[0],)
        with torch.no_grad():
            v = flowseam.record_velocity(model, result, rec)
            out = recompute.log_prob(rec, v)
        ratio = torch.exp(out.log_prob.double().cpu() - rec.log_prob.double().cpu())
        worst = float((ratio - 1).abs().max())
        assert worst <= RATIO_TOL, \
            f"{card} step {rec.index} (sigma {rec.sigma:.4f} → {rec.sigma_next:.4f}): " \
            f"recomputed log-prob {out.log_prob.tolist()} vs rollout {rec.log_prob.tolist()}, " \
            f"max |ratio - 1| = {worst:.3g} > {RATIO_TOL}"


@pytest.mark.flowseam_cases(cases=solver_cases)
def test_checkpoint_solver_matches_diffusers(flowseam_platform, flowseam_case, conformance_runs,
                                             tiny_checkpoints, diffusers_pipelines):
    """The solver a checkpoint's scheduler names (UniPC in Wan2.1-Diffusers' configuration and
    at order 3 with bh1, FlowMatchEuler's stochastic sampling, a static shift on FLUX) runs
    through the platform's kernel for its op and gives diffusers' own pipeline output on the same
    checkpoint, seed and request, within the tolerance of the DiT's dtype (its compute dtype; C1
    against the peer).
    Ops the backend leaves out run as the cpu fallback, and the result says which kernel ran."""
    card, variant, overrides = flowseam_case
    model = conformance_runs.backend(flowseam_platform, card).model.with_scheduler(overrides)
    request = request_for(card)
    result = flowseam.run_loop(model, request)
    resolved = {op: flowseam_platform.kernels.get(op).impl_id for op in model.solver.ops}
    assert result.kernels == resolved, f"the loop ran {result.kernels}, not the platform's {resolved}"
    assert result.solver.startswith(f"solver {model.solver.op} ") and "(override)" in result.solver
    want = diffusers_output(tiny_checkpoints[card], card, overrides, request, diffusers_pipelines)
    dtype = model.component_dtype(model.DIT)
    assert_model_close(result.frames, want, dtype, f"{card} {variant}: frames vs diffusers")
