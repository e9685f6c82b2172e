"""The loops' one stepper (flowseam.loops.solvers.SolverSteps): every loop advances its latents
through it, no other module looks a solver kernel up, and each sampler it runs is checked step by
step against the numpy float64 oracle (flowseam.ops.reference) with noise drawn independently
from generators seeded the same way."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import flowseam
from flowseam import ops
from flowseam.errors import KernelPinError
from flowseam.loops.records import BehaviorRecord, LoopResult
from flowseam.loops.solvers import X0_RENOISE, SolverSteps
from flowseam.ops import reference
from flowseam.request import DiffusionParams

ROOT = Path(flowseam.__file__).parent
SOLVER_OPS = {"FLOW_MATCH_STEP", "FLOW_SDE_STEP", "FLOW_RENOISE", "UNIPC_STEP",
              *(f"'{op}'" for op in ops.ALL_OPS if op not in (ops.ATTENTION, ops.CACHED_ATTENTION))}
SIGMAS = [1.0, 0.75, 0.4, 0.0]


@pytest.fixture(scope="module")
def cpu():
    return flowseam.Platform("cpu")


def _solver_lookups(source: str) -> list[str]:
    """The ``<...>kernels.get(op)`` / ``.pin(...)`` calls of ``source`` whose op is a solver op."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "pin") and node.args
                and ast.unparse(node.func.value).endswith("kernels")):
            arg = ast.unparse(node.args[0])
            if any(arg.endswith(op) for op in SOLVER_OPS) or node.func.attr == "pin":
                found.append(ast.unparse(node))
    return found


def test_only_the_stepper_looks_up_solver_kernels():
    """Outside loops/solvers.py (and the conformance suite, which checks what the loops
    resolved), no module of flowseam calls ``kernels.get`` for a solver op or ``kernels.pin``."""
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "loops/solvers.py" or rel.startswith("testing/"):
            continue
        calls = [c for c in _solver_lookups(path.read_text()) if "explain" not in rel]
        if calls and rel != "seam/platform.py":  # platform.explain() names a conflict's loser by pin
            offenders[rel] = calls
    assert offenders == {}
    # the scan finds such a call when there is one
    assert _solver_lookups("e = model.platform.kernels.get(ops.FLOW_MATCH_STEP)") != []
    assert _solver_lookups("a = platform.kernels.get(ops.ATTENTION)") == []


def _gens(seed: int, batch: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(batch)]


def _inputs(batch: int = 2, shape=(3, 4)):
    g = torch.Generator().manual_seed(7)
    x = torch.randn((batch, *shape), generator=g)
    vs = [torch.randn((batch, *shape), generator=g) for _ in SIGMAS[:-1]]
    return x, vs


def _noise(gens, shape) -> np.ndarray:
    """What the stepper must draw: row b from gens[b] (diffusers' randn_tensor with a list)."""
    return np.concatenate([torch.randn((1, *shape[1:]), generator=g).numpy() for g in gens])


def _run(solve: SolverSteps, x, vs):
    solve.start(SIGMAS)
    steps = []
    for i, v in enumerate(vs):
        steps.append(solve(i, x, v))
        x = steps[-1].next_latents
    return steps


def test_euler_sampler_is_the_ode_step(cpu):
    x, vs = _inputs()
    solve = SolverSteps(cpu.kernels, DiffusionParams(), _gens(0, 2))
    steps = _run(solve, x, vs)
    want = x.double().numpy()
    for i, (step, v) in enumerate(zip(steps, vs)):
        want = reference.flow_match_step(want, v.numpy(), SIGMAS[i], SIGMAS[i + 1])
        np.testing.assert_allclose(step.next_latents.numpy(), want, rtol=1e-5, atol=1e-6)
        assert step.log_prob is None and (step.sigma, step.sigma_next) == (SIGMAS[i], SIGMAS[i + 1])
    assert solve.impl_ids == {ops.FLOW_MATCH_STEP: cpu.kernels.get(ops.FLOW_MATCH_STEP).impl_id}


def test_x0_renoise_sampler_draws_fresh_noise_and_none_at_the_last_step(cpu):
    """Self-Forcing's sampler: x0 = x - sigma v, re-noised to the next sigma with fresh noise;
    the last step (to sigma 0) returns x0 and draws nothing, so the next chunk's noise is the
    generators' next draw."""
    x, vs = _inputs()
    gens, mine = _gens(3, 2), _gens(3, 2)
    steps = _run(SolverSteps(cpu.kernels, DiffusionParams(), gens, sampler=X0_RENOISE), x, vs)
    cur = x.double().numpy()
    for i, (step, v) in enumerate(zip(steps, vs)):
        x0 = cur - SIGMAS[i] * v.double().numpy()  # hand computation
        s = SIGMAS[i + 1]
        cur = x0 if s == 0 else (1 - s) * x0 + s * _noise(mine, x.shape)
        np.testing.assert_allclose(step.next_latents.numpy(), cur, rtol=1e-5, atol=1e-5)
        kernel = ops.FLOW_MATCH_STEP if s == 0 else ops.FLOW_RENOISE
        assert step.impl_id == cpu.kernels.get(kernel).impl_id
    # both generators are where the hand computation's are: 2 draws each, not 3
    assert all(torch.equal(torch.randn(5, generator=a), torch.randn(5, generator=b))
               for a, b in zip(gens, mine))


def test_sde_window_steps_sde_inside_and_the_ode_outside(cpu):
    """Flow-GRPO's window on a stochastic-sampling checkpoint (the flow_match loop): outside
    ``sde_window=(1, 2)`` the steps are the ODE's Euler steps (no noise drawn), step 1 the SDE
    step with the generators' first draw."""
    x, vs = _inputs()
    params = DiffusionParams(sde_rollout=True, sde_window=(1, 2), noise_level=0.7)
    gens, mine = _gens(13, 2), _gens(13, 2)
    solve = SolverSteps(cpu.kernels, params, gens, sampler=X0_RENOISE)
    steps = _run(solve, x, vs)
    assert [s.log_prob is not None for s in steps] == [False, True, False]
    after0 = reference.flow_match_step(x.numpy(), vs[0].numpy(), SIGMAS[0], SIGMAS[1])
    np.testing.assert_allclose(steps[0].next_latents.numpy(), after0, rtol=1e-5, atol=1e-6)
    want = reference.flow_sde_step(steps[0].next_latents.numpy(), vs[1].numpy(), SIGMAS[1],
                                   SIGMAS[2], noise=_noise(mine, x.shape), noise_level=0.7,
                                   sigma_max=SIGMAS[1])
    np.testing.assert_allclose(steps[1].next_latents.numpy(), want.sample, rtol=1e-5, atol=1e-5)
    after2 = reference.flow_match_step(steps[1].next_latents.numpy(), vs[2].numpy(), SIGMAS[2],
                                       SIGMAS[3])
    np.testing.assert_allclose(steps[2].next_latents.numpy(), after2, rtol=1e-5, atol=1e-6)
    assert set(solve.impl_ids) == {ops.FLOW_SDE_STEP, ops.FLOW_MATCH_STEP}


def test_sde_window_with_the_sampler_outside(cpu):
    """``outside_window="sampler"`` (the causal loop): step 1 is Flow-GRPO's SDE step (the
    oracle's mean and log-prob with the same noise), steps 0 and 2 Self-Forcing's x0 + re-noise."""
    x, vs = _inputs()
    params = DiffusionParams(sde_rollout=True, sde_window=(1, 2), noise_level=0.7)
    gens, mine = _gens(11, 2), _gens(11, 2)
    solve = SolverSteps(cpu.kernels, params, gens, sampler=X0_RENOISE, outside_window="sampler")
    steps = _run(solve, x, vs)
    assert [s.log_prob is not None for s in steps] == [False, True, False]
    x0 = x.double().numpy() - SIGMAS[0] * vs[0].double().numpy()
    after0 = (1 - SIGMAS[1]) * x0 + SIGMAS[1] * _noise(mine, x.shape)
    np.testing.assert_allclose(steps[0].next_latents.numpy(), after0, rtol=1e-5, atol=1e-5)
    want = reference.flow_sde_step(steps[0].next_latents.numpy(), vs[1].numpy(), SIGMAS[1],
                                   SIGMAS[2], noise=_noise(mine, x.shape), noise_level=0.7,
                                   sigma_max=SIGMAS[1])
    np.testing.assert_allclose(steps[1].next_latents.numpy(), want.sample, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps[1].log_prob.numpy(), want.log_prob, rtol=1e-4)
    assert set(solve.impl_ids) == {ops.FLOW_SDE_STEP, ops.FLOW_MATCH_STEP, ops.FLOW_RENOISE}


def test_recompute_pins_the_rollout_kernel_and_gives_ratio_one(cpu):
    x, vs = _inputs()
    params = DiffusionParams(sde_rollout=True)
    solve = SolverSteps(cpu.kernels, params, _gens(5, 2))
    solve.start(SIGMAS)
    records, cur = [], x
    for i, v in enumerate(vs):
        step = solve(i, cur, v)
        records.append(BehaviorRecord(i, cur, step.next_latents, torch.zeros(2), step.sigma,
                                      step.sigma_next, step.sigma_max, step.log_prob, step.impl_id))
        cur = step.next_latents
    result = LoopResult(frames=np.zeros((0,)), latents=cur, params=params, seeds=[5, 6],
                        records=records)
    again = SolverSteps.recompute(cpu.kernels, result)
    for rec, v in zip(records, vs):
        ratio = torch.exp(again.log_prob(rec, v).log_prob.double() - rec.log_prob.double())
        assert float((ratio - 1).abs().max()) <= 1e-6
    records[0].impl_id = "cuda:flow_sde_step:cuda:sm90:flowseam-cuda==0.1.0"
    with pytest.raises(KernelPinError):
        SolverSteps.recompute(cpu.kernels, result)
    ode = LoopResult(frames=np.zeros((0,)), latents=cur, params=DiffusionParams(), seeds=[0],
                     records=[BehaviorRecord(0, x, x, torch.zeros(2), 1.0, 0.5, None, None, "x")])
    with pytest.raises(ValueError, match="needs SDE rollouts"):
        SolverSteps.recompute(cpu.kernels, ode)


def test_bad_sampler_refused(cpu):
    with pytest.raises(ValueError, match="sampler 'flow_renoise'"):
        SolverSteps(cpu.kernels, DiffusionParams(), _gens(0, 1), sampler=(ops.FLOW_RENOISE,))
    with pytest.raises(ValueError, match="needs the checkpoint's solver config"):
        SolverSteps(cpu.kernels, DiffusionParams(), _gens(0, 1), sampler=(ops.UNIPC_STEP,))
    with pytest.raises(ValueError, match="outside_window='sde'"):
        SolverSteps(cpu.kernels, DiffusionParams(), _gens(0, 1), outside_window="sde")
