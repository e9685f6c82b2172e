"""The cpu backend's kernels against the numpy float64 oracle (C1: float32 within 1e-5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flowseam
from flowseam import ops
from flowseam.ops import reference

RTOL, ATOL = reference.TOLERANCES["float32"]


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def test_flow_match_step_matches_oracle_and_formula(cpu):
    step = cpu.kernels.get(ops.FLOW_MATCH_STEP)
    x, v = _rand(2, 4, 3, 8, 8, seed=1), _rand(2, 4, 3, 8, 8, seed=2)
    out = step(x, v, 0.75, 0.5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    np.testing.assert_allclose(out.numpy(), reference.flow_match_step(x.numpy(), v.numpy(), 0.75, 0.5),
                               rtol=RTOL, atol=ATOL)
    # hand computation of one element: x + (0.5 - 0.75) * v
    assert math.isclose(float(out[0, 0, 0, 0, 0]), float(x[0, 0, 0, 0, 0]) - 0.25 * float(v[0, 0, 0, 0, 0]),
                        rel_tol=1e-6, abs_tol=1e-6)


def test_flow_match_step_bf16_keeps_dtype_and_computes_in_float32(cpu):
    step = cpu.kernels.get(ops.FLOW_MATCH_STEP)
    x, v = _rand(2, 16, seed=3, dtype=torch.bfloat16), _rand(2, 16, seed=4, dtype=torch.bfloat16)
    out = step(x, v, 1.0, 0.9)
    assert out.dtype == torch.bfloat16
    expect = reference.flow_match_step(x.float().numpy(), v.float().numpy(), 1.0, 0.9)
    rtol, atol = reference.TOLERANCES["bfloat16"]
    np.testing.assert_allclose(out.float().numpy(), expect, rtol=rtol, atol=atol)


@pytest.mark.parametrize("sigma,sigma_next,sigma_max", [
    (1.0, 0.9, 0.9),     # first step: sigma == 1 uses sigma_max
    (0.6, 0.45, None),   # a middle step
    (0.1, 0.0, None),    # the last step, to sigma_next = 0
])
def test_flow_sde_step_matches_oracle(cpu, sigma, sigma_next, sigma_max):
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v, noise = _rand(3, 4, 2, 6, 6, seed=5), _rand(3, 4, 2, 6, 6, seed=6), _rand(3, 4, 2, 6, 6, seed=7)
    out = step(x, v, sigma, sigma_next, noise=noise, noise_level=0.7, sigma_max=sigma_max)
    ref = reference.flow_sde_step(x.numpy(), v.numpy(), sigma, sigma_next, noise=noise.numpy(),
                                  noise_level=0.7, sigma_max=sigma_max)
    assert out.sample.dtype == torch.float32 and out.log_prob.shape == (3,)
    for got, want in ((out.sample, ref.sample), (out.mean, ref.mean), (out.log_prob, ref.log_prob),
                      (out.std, ref.std)):
        np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL)


def test_flow_sde_step_hand_computed_std_and_logprob(cpu):
    """One element by hand from Flow-GRPO's formulas: sigma=0.5, sigma_next=0.25, noise_level=0.5."""
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x = torch.tensor([[2.0]])
    v = torch.tensor([[-1.0]])
    noise = torch.tensor([[0.5]])
    out = step(x, v, 0.5, 0.25, noise=noise, noise_level=0.5)
    std_dev_t = 0.5 * math.sqrt(0.5 / 0.5)          # 0.5
    dt = -0.25
    mean = 2.0 * (1 + 0.25 * dt / 1.0) + (-1.0) * (1 + 0.25 * 0.5 / 1.0) * dt
    std = std_dev_t * math.sqrt(0.25)               # 0.25
    sample = mean + std * 0.5
    logp = -0.5 * 0.5**2 - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert math.isclose(float(out.std), std, rel_tol=1e-6)
    assert math.isclose(float(out.mean), mean, rel_tol=1e-6)
    assert math.isclose(float(out.sample), sample, rel_tol=1e-6)
    assert math.isclose(float(out.log_prob), logp, rel_tol=1e-6)


def test_flow_sde_step_recompute_reproduces_logprob_exactly(cpu):
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 3, 8, 8, seed=8), _rand(2, 3, 8, 8, seed=9)
    first = step(x, v, 0.8, 0.6, generator=torch.Generator().manual_seed(3))
    again = step(x, v, 0.8, 0.6, prev_sample=first.sample)
    assert torch.equal(first.log_prob, again.log_prob)
    # the generator path is deterministic and draws standard normal noise of x's shape
    other = step(x, v, 0.8, 0.6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first.sample, other.sample)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(first.sample.numpy(), (first.mean + first.std * noise).numpy(), rtol=0, atol=0)


def test_flow_sde_step_bf16_recompute_is_exact_and_logprob_float32(cpu):
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 64, seed=10, dtype=torch.bfloat16), _rand(2, 64, seed=11, dtype=torch.bfloat16)
    out = step(x, v, 0.5, 0.4, generator=torch.Generator().manual_seed(0))
    assert out.sample.dtype == torch.bfloat16 and out.log_prob.dtype == torch.float32
    again = step(x, v, 0.5, 0.4, prev_sample=out.sample)
    assert torch.equal(out.log_prob, again.log_prob)
    ref = reference.flow_sde_step(x.float().numpy(), v.float().numpy(), 0.5, 0.4,
                                  prev_sample=out.sample.float().numpy())
    np.testing.assert_allclose(out.log_prob.numpy(), ref.log_prob, rtol=1e-5, atol=1e-5)


def test_flow_sde_step_gradient_flows_through_mean_only(cpu):
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x = _rand(2, 5, seed=12)
    v = _rand(2, 5, seed=13).requires_grad_(True)
    sample = _rand(2, 5, seed=14).requires_grad_(True)
    out = step(x, v, 0.7, 0.5, prev_sample=sample)
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    assert sample.grad is None


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_attention_matches_oracle(cpu, mask):
    attn = cpu.kernels.get(ops.ATTENTION)
    q, k, v = _rand(2, 3, 5, 8, seed=15), _rand(2, 3, 7, 8, seed=16), _rand(2, 3, 7, 4, seed=17)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
        m[..., 0] = True  # every query keeps at least one key
    elif mask == "float":
        m = _rand(2, 1, 5, 7, seed=18)
    out = attn(q, k, v, attn_mask=m, scale=0.3)
    ref = reference.attention(q.numpy(), k.numpy(), v.numpy(),
                              attn_mask=None if m is None else m.numpy(), scale=0.3)
    np.testing.assert_allclose(out.numpy(), ref, rtol=RTOL, atol=ATOL)


def test_oracle_attention_hand_computed():
    q = np.array([[[[1.0, 0.0]]]])
    k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = np.array([[[[1.0], [3.0]]]])
    w0 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1.0)
    assert math.isclose(float(reference.attention(q, k, v)[0, 0, 0, 0]), w0 * 1 + (1 - w0) * 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sigma=1.2, sigma_next=0.5), "sigma=1.2"),
    (dict(sigma=0.5, sigma_next=-0.1), "sigma_next=-0.1"),
    (dict(sigma=0.4, sigma_next=0.5), "sigma_next=0.5 > sigma=0.4"),
])
def test_bad_sigmas_raise_naming_the_value(cpu, kwargs, match):
    x = torch.zeros(1, 4)
    for op in (ops.FLOW_MATCH_STEP, ops.FLOW_SDE_STEP):
        with pytest.raises(ValueError, match=match):
            cpu.kernels.get(op)(x, x, kwargs["sigma"], kwargs["sigma_next"])
        with pytest.raises(ValueError, match=match):
            getattr(reference, op)(x.numpy(), x.numpy(), kwargs["sigma"], kwargs["sigma_next"])


def test_sde_step_at_sigma_one_needs_sigma_max(cpu):
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="sigma=1.0 needs sigma_max"):
        cpu.kernels.get(ops.FLOW_SDE_STEP)(x, x, 1.0, 0.9)
    with pytest.raises(ValueError, match="sigma_max=1.0"):
        cpu.kernels.get(ops.FLOW_SDE_STEP)(x, x, 1.0, 0.9, sigma_max=1.0)


def test_shape_mismatch_raises_naming_shapes(cpu):
    with pytest.raises(ValueError, match=r"v has shape \(1, 3\) but x has shape \(1, 4\)"):
        cpu.kernels.get(ops.FLOW_MATCH_STEP)(torch.zeros(1, 4), torch.zeros(1, 3), 0.5, 0.4)
    with pytest.raises(ValueError, match="noise has shape"):
        cpu.kernels.get(ops.FLOW_SDE_STEP)(torch.zeros(1, 4), torch.zeros(1, 4), 0.5, 0.4,
                                           noise=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="attention expects 4-d"):
        cpu.kernels.get(ops.ATTENTION)(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))


@pytest.mark.parametrize("bad,match", [
    (dict(noise_level=-0.1), "noise_level=-0.1"),
    (dict(noise_level=float("inf")), "noise_level=inf"),
])
def test_sde_step_rejects_degenerate_noise_level(cpu, bad, match):
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match=match):
        cpu.kernels.get(ops.FLOW_SDE_STEP)(x, x, 0.5, 0.4, **bad)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.1, 0.0)])
def test_sde_step_at_noise_level_zero_is_the_euler_step_with_log_prob_zero(cpu, sigma, sigma_next):
    """Flow-GRPO evaluates with noise_level=0: the sample is the mean, which is then the Euler
    step (std_dev_t = 0 in eq. 9); no sigma_max is needed at sigma 1, the generator is not
    drawn from, and the log-prob is defined as 0 (the contract:
    flowseam.ops.reference.flow_sde_step)."""
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 4, 3, 3, seed=30), _rand(2, 4, 3, 3, seed=31)
    generator = torch.Generator().manual_seed(7)
    out = step(x, v, sigma, sigma_next, noise_level=0.0, generator=generator)
    euler = x + (sigma_next - sigma) * v  # hand formula
    torch.testing.assert_close(out.sample, euler, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-6)
    assert float(out.std) == 0.0 and torch.equal(out.log_prob, torch.zeros(2))
    assert torch.equal(torch.randn(3, generator=generator),
                       torch.randn(3, generator=torch.Generator().manual_seed(7)))
    again = step(x, v, sigma, sigma_next, noise_level=0.0, prev_sample=out.sample + 1)
    assert torch.equal(again.sample, out.sample + 1) and torch.equal(again.log_prob, torch.zeros(2))
    ref = reference.flow_sde_step(x.numpy(), v.numpy(), sigma, sigma_next, noise_level=0.0)
    np.testing.assert_allclose(out.sample.numpy(), ref.sample, rtol=RTOL, atol=ATOL)
    assert not ref.log_prob.any()


@pytest.mark.parametrize("op", [ops.FLOW_MATCH_STEP, ops.FLOW_SDE_STEP])
def test_per_sample_sigma_is_refused_with_the_reason(cpu, op):
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"sigma has shape \(2,\).*one scalar sigma.*group the rows"):
        cpu.kernels.get(op)(x, x, torch.tensor([0.5, 0.6]), 0.4)
    out = cpu.kernels.get(ops.FLOW_MATCH_STEP)(x, x, torch.tensor([0.5]), 0.4)  # one element: ok
    assert out.shape == x.shape


def test_non_float_tensors_and_non_numeric_sigmas_are_rejected(cpu):
    step = cpu.kernels.get(ops.FLOW_MATCH_STEP)
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        step(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4), 0.5, 0.4)
    with pytest.raises(ValueError, match="sigma='0.5'"):
        step(torch.zeros(1, 4), torch.zeros(1, 4), "0.5", 0.4)
    out = step(torch.ones(1, 4), torch.ones(1, 4), torch.tensor(0.5), np.float32(0.25))
    torch.testing.assert_close(out, torch.full((1, 4), 0.75))


def test_sde_step_on_1d_latents_and_prev_sample_dtype(cpu):
    step = cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v, noise = _rand(3, seed=20), _rand(3, seed=21), _rand(3, seed=22)
    out = step(x, v, 0.5, 0.3, noise=noise)
    ref = reference.flow_sde_step(x.numpy(), v.numpy(), 0.5, 0.3, noise=noise.numpy())
    np.testing.assert_allclose(out.log_prob.numpy(), ref.log_prob, rtol=RTOL, atol=ATOL)
    again = step(x, v, 0.5, 0.3, prev_sample=out.sample.double())
    assert again.sample.dtype == torch.float32


def test_attention_fully_masked_row_is_zero_like_torch(cpu):
    q, k, v = _rand(1, 1, 2, 4, seed=23), _rand(1, 1, 3, 4, seed=24), _rand(1, 1, 3, 4, seed=25)
    mask = torch.tensor([[[[True, False, True], [False, False, False]]]])
    out = cpu.kernels.get(ops.ATTENTION)(q, k, v, attn_mask=mask)
    ref = reference.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=mask.numpy())
    np.testing.assert_allclose(out.numpy(), ref, rtol=RTOL, atol=ATOL)
    assert not ref[0, 0, 1].any()


# -- the multistep and stochastic solvers against diffusers' schedulers (an independent source) ---

def _fake_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A smooth, non-linear stand-in for a DiT (the solvers only see its outputs)."""
    target = _rand(2, 4, 3, 3, seed=40)
    w = _rand(4, 4, seed=41) * 0.3
    return (x - target) + 0.2 * torch.tanh(torch.einsum("ij,bj...->bi...", w, x)) * sigma


@pytest.mark.parametrize("order,solver_type,final,disable", [
    (1, "bh2", "zero", []), (2, "bh2", "zero", []), (3, "bh2", "zero", []),
    (2, "bh1", "sigma_min", []), (3, "bh1", "sigma_min", [0]), (3, "bh2", "zero", [1, 2]),
])
def test_unipc_step_runs_diffusers_unipc_schedule(cpu, order, solver_type, final, disable):
    """A whole UniPC run (flow sigmas, flow prediction) stepped by the cpu kernel and by the numpy
    oracle, driven by ops.unipc_order and the corrector rule, equals diffusers'
    UniPCMultistepScheduler.step run on the same velocities (float32 within 1e-5), and its order
    sequence is diffusers' own; orders differ from each other (the input matters)."""
    import diffusers

    sched = diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        solver_order=order, solver_type=solver_type, final_sigmas_type=final,
        disable_corrector=disable)
    n = 6
    sched.set_timesteps(n)
    sigmas = sched.sigmas.tolist()
    x0 = _rand(2, 4, 3, 3, seed=42)
    theirs, their_orders = x0.clone(), []
    for i, t in enumerate(sched.timesteps):
        theirs = sched.step(_fake_velocity(theirs, sigmas[i]), t, theirs).prev_sample
        their_orders.append(sched.this_order)
    step = cpu.kernels.get(ops.UNIPC_STEP)
    ours, state = x0.clone(), ops.UniPCState.empty()
    oracle, ref_state = x0.double().numpy(), ops.UniPCState.empty()
    orders = [ops.unipc_order(i, n, order, True) for i in range(n)]
    for i in range(n):
        kw = dict(order=orders[i], solver_type=solver_type,
                  corrector=i > 0 and (i - 1) not in disable)
        ours, state = step(ours, _fake_velocity(ours, sigmas[i]), sigmas[i], sigmas[i + 1],
                           state, **kw)
        v = _fake_velocity(torch.from_numpy(oracle).float(), sigmas[i]).double().numpy()
        oracle, ref_state = reference.unipc_step(oracle, v, sigmas[i], sigmas[i + 1], ref_state, **kw)
    assert orders == their_orders
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(oracle, theirs.double().numpy(), rtol=RTOL, atol=ATOL)
    if order > 1:  # the history matters: a first-order run ends elsewhere
        first, st = x0.clone(), ops.UniPCState.empty()
        for i in range(n):
            first, st = step(first, _fake_velocity(first, sigmas[i]), sigmas[i], sigmas[i + 1], st,
                             order=1, solver_type=solver_type, corrector=False)
        assert (first - ours).abs().max() > 1e-3


def test_unipc_bh1_to_sigma_zero_is_the_data_prediction(cpu):
    """diffusers 0.42 returns NaN for bh1 at a final sigma of 0 (it multiplies B(h) = -inf by a
    zero residual); the op takes the limit: the sample is x - sigma * v (hand formula)."""
    step = cpu.kernels.get(ops.UNIPC_STEP)
    x, v = _rand(2, 4, 3, 3, seed=43), _rand(2, 4, 3, 3, seed=44)
    hist = ops.UniPCState((0.3,), (_rand(2, 4, 3, 3, seed=45),), _rand(2, 4, 3, 3, seed=46), 1)
    for solver_type in ("bh1", "bh2"):
        out = step(x, v, 0.1, 0.0, hist, order=1, solver_type=solver_type, corrector=False)
        torch.testing.assert_close(out.sample, x - 0.1 * v, rtol=0, atol=1e-6)


def test_stochastic_sampling_is_euler_to_zero_then_renoise_as_diffusers(cpu):
    """diffusers' FlowMatchEulerDiscreteScheduler(stochastic_sampling=True).step with a list of
    per-sample generators equals flow_match_step to sigma 0 then flow_renoise to sigma_next (how
    the loop runs it), with the noise drawn the same way (flowseam.noise)."""
    import diffusers

    from flowseam.noise import noise_like

    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    sched.set_timesteps(4)
    x, v = _rand(2, 4, 3, 3, seed=47), _rand(2, 4, 3, 3, seed=48)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    theirs = sched.step(v, sched.timesteps[1], x, generator=gens).prev_sample
    sigma, sigma_next = sched.sigmas[1].item(), sched.sigmas[2].item()
    noise = noise_like(x, [torch.Generator().manual_seed(s) for s in (1, 2)])
    x0 = cpu.kernels.get(ops.FLOW_MATCH_STEP)(x, v, sigma, 0.0)
    ours = cpu.kernels.get(ops.FLOW_RENOISE)(x0, noise, sigma_next)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=RTOL, atol=ATOL)
    euler = cpu.kernels.get(ops.FLOW_MATCH_STEP)(x, v, sigma, sigma_next)
    assert (ours - euler).abs().max() > 1e-2  # the re-noising is not the ODE step
