"""Every kernel the backend registers, against the numpy float64 oracle and the op contracts
(:mod:`flowseam.ops`): values, dtypes, shapes, bad arguments, C2 and the log-prob gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowseam import ops
from flowseam.ops import reference
from flowseam.testing.conformance._support import (
    KernelCase,
    assert_close,
    kernel_cases,
    pinned_kernel,
    randn,
    registration_cases,
    sde_cases,
    sde_gradient_cases,
    to_f64,
)
from flowseam.testing.conformance._split import (
    BAD_ARGUMENTS,
    WORLD,
    case_key,
    full_inputs,
    split_results,
)

#: C2: the PPO ratio exp(recomputed - rollout log-prob) must be 1 within this.
RATIO_TOL = 1e-6


def _step_inputs(case: KernelCase, device: str):
    s = case.step
    x = randn(s.shape, 1, case.x_dtype, device)
    v = randn(s.shape, 2, case.v_dtype, device)
    noise = randn(s.shape, 3, case.compute_dtype, device)
    return x, v, noise


def _check_flow_match_step(kernel, case: KernelCase, device: str) -> None:
    s = case.step
    x, v, _ = _step_inputs(case, device)
    out = kernel(x, v, s.sigma, s.sigma_next)
    assert torch.is_tensor(out), f"flow_match_step returned {type(out).__name__}, not a tensor"
    assert out.shape == x.shape and out.dtype == x.dtype, \
        f"flow_match_step returned {out.dtype}{tuple(out.shape)}; the contract is x's " \
        f"{x.dtype}{tuple(x.shape)}"
    assert out.device == x.device, \
        f"flow_match_step returned a tensor on {out.device}, x is on {x.device}"
    want = reference.flow_match_step(to_f64(x), to_f64(v), s.sigma, s.sigma_next)
    assert_close(out, want, x.dtype, "flow_match_step")


def _check_flow_sde_step(kernel, case: KernelCase, device: str) -> None:
    s = case.step
    x, v, noise = _step_inputs(case, device)
    out = kernel(x, v, s.sigma, s.sigma_next, noise=noise, noise_level=s.noise_level,
                 sigma_max=s.sigma_max)
    for name in ("sample", "log_prob", "mean", "std"):
        assert hasattr(out, name), f"flow_sde_step's result has no {name!r} (see SDEStepOutput)"
    batch = x.shape[0]
    assert out.sample.shape == x.shape and out.sample.dtype == x.dtype, \
        f"sample is {out.sample.dtype}{tuple(out.sample.shape)}; the contract is x's " \
        f"{x.dtype}{tuple(x.shape)}"
    assert tuple(out.log_prob.shape) == (batch,), \
        f"log_prob has shape {tuple(out.log_prob.shape)}, expected ({batch},)"
    for name in ("log_prob", "mean", "std"):
        got = getattr(out, name).dtype
        wide_enough = got == torch.float64 or (got == torch.float32
                                               and case.compute_dtype == "float32")
        assert wide_enough, f"{name} is {got}; the contract is float32 or wider " \
                            f"({case.compute_dtype} for {x.dtype} latents)"
    want = reference.flow_sde_step(to_f64(x), to_f64(v), s.sigma, s.sigma_next, noise=to_f64(noise),
                                   noise_level=s.noise_level, sigma_max=s.sigma_max)
    assert_close(out.sample, want.sample, x.dtype, "sample")
    assert_close(out.mean, want.mean, case.compute_dtype, "mean")
    assert_close(out.std, want.std, case.compute_dtype, "std")
    # The log-prob is that of the *returned* sample (rounded to x's dtype), per the contract.
    of_sample = reference.flow_sde_step(to_f64(x), to_f64(v), s.sigma, s.sigma_next,
                                        prev_sample=to_f64(out.sample), noise_level=s.noise_level,
                                        sigma_max=s.sigma_max)
    assert_close(out.log_prob, of_sample.log_prob, case.compute_dtype, "log_prob")


def _unipc_inputs(case: KernelCase, device: str):
    """x, v and a state whose history has random data predictions (compute dtype) and a
    random last sample (x's dtype), as the numpy oracle's and the kernel's state."""
    u = case.unipc
    x = randn(u.shape, 1, case.x_dtype, device)
    v = randn(u.shape, 2, case.v_dtype, device)
    outputs = tuple(randn(u.shape, 10 + k, case.compute_dtype, device)
                    for k in range(len(u.history)))
    last = randn(u.shape, 9, case.x_dtype, device) if u.history else None
    state = ops.UniPCState(u.history, outputs, last, u.last_order)
    ref_state = ops.UniPCState(u.history, tuple(to_f64(o) for o in outputs),
                               None if last is None else to_f64(last), u.last_order)
    return x, v, state, ref_state


def _check_unipc_step(kernel, case: KernelCase, device: str) -> None:
    u = case.unipc
    x, v, state, ref_state = _unipc_inputs(case, device)
    kw = dict(order=u.order, solver_type=u.solver_type, corrector=u.corrector)
    out = kernel(x, v, u.sigma, u.sigma_next, state, **kw)
    for name in ("sample", "state"):
        assert hasattr(out, name), f"unipc_step's result has no {name!r} (see UniPCStepOutput)"
    assert out.sample.shape == x.shape and out.sample.dtype == x.dtype, \
        f"sample is {out.sample.dtype}{tuple(out.sample.shape)}; the contract is x's " \
        f"{x.dtype}{tuple(x.shape)}"
    want = reference.unipc_step(to_f64(x), to_f64(v), u.sigma, u.sigma_next, ref_state, **kw)
    assert_close(out.sample, want.sample, x.dtype, "unipc_step sample")
    got, ref = out.state, want.state
    assert tuple(got.sigmas) == tuple(ref.sigmas) and got.last_order == ref.last_order, \
        f"state sigmas/order {tuple(got.sigmas)}/{got.last_order}, expected " \
        f"{tuple(ref.sigmas)}/{ref.last_order}"
    assert len(got.outputs) == len(ref.outputs), \
        f"the state keeps {len(got.outputs)} outputs, expected {len(ref.outputs)} (the order)"
    for k, (g, w) in enumerate(zip(got.outputs, ref.outputs)):
        assert_close(g, w, case.compute_dtype, f"state.outputs[{k}]")
    assert_close(got.last_sample, ref.last_sample, x.dtype, "state.last_sample (corrected x)")


def _attention_inputs(case: KernelCase, device: str):
    a = case.attention
    dtype = case.x_dtype
    q, k, v = (randn(shape, seed, dtype, device) for shape, seed in ((a.q, 4), (a.k, 5), (a.v, 6)))
    mask = None
    if a.mask == "bool":  # key padding: sample b keeps its first Lk - b - 1 keys (never all masked)
        keep = torch.ones(a.q[0], 1, 1, a.k[2], dtype=torch.bool)
        for b in range(a.q[0]):
            keep[b, ..., a.k[2] - b - 1:] = False
        mask = keep.to(device)
    elif a.mask == "float":
        mask = randn((a.q[0], a.q[1], a.q[2], a.k[2]), 7, dtype, device)
    return q, k, v, mask


def _check_attention(kernel, case: KernelCase, device: str) -> None:
    q, k, v, mask = _attention_inputs(case, device)
    out = kernel(q, k, v, attn_mask=mask, scale=case.attention.scale)
    want_shape = (*q.shape[:3], v.shape[-1])
    assert tuple(out.shape) == want_shape and out.dtype == q.dtype, \
        f"attention returned {out.dtype}{tuple(out.shape)}, expected {q.dtype}{want_shape}"
    np_mask = mask
    if mask is not None:
        np_mask = mask.cpu().numpy() if mask.dtype == torch.bool else to_f64(mask)
    want = reference.attention(to_f64(q), to_f64(k), to_f64(v), attn_mask=np_mask,
                               scale=case.attention.scale)
    assert_close(out, want, q.dtype, "attention")


def _check_cached_attention(kernel, case: KernelCase, device: str) -> None:
    c, dtype = case.cached, case.x_dtype
    B, H, Lq, D = c.q
    Lk, Dv = c.kv
    q = randn(c.q, 4, dtype, device)
    k, v = randn((B, H, Lk, D), 5, dtype, device), randn((B, H, Lk, Dv), 6, dtype, device)
    cache_k = cache_v = None
    if c.cache is not None:
        cache_k = randn((B, H, c.cache[0], D), 7, dtype, device)
        cache_v = randn((B, H, c.cache[0], c.cache[1]), 8, dtype, device)
    out = kernel(q, k, v, cache_k, cache_v, scale=c.scale)
    want_shape = (B, H, Lq, Dv)
    assert tuple(out.shape) == want_shape and out.dtype == q.dtype, \
        f"cached_attention returned {out.dtype}{tuple(out.shape)}, expected {q.dtype}{want_shape}"
    want = reference.cached_attention(
        to_f64(q), to_f64(k), to_f64(v), None if cache_k is None else to_f64(cache_k),
        None if cache_v is None else to_f64(cache_v), scale=c.scale)
    assert_close(out, want, q.dtype, "cached_attention")
    if cache_k is not None and c.cache[0]:  # the cache must matter: attend without it differs
        alone = reference.cached_attention(to_f64(q), to_f64(k), to_f64(v), scale=c.scale)
        assert np.abs(alone - want).max() > 1e-3, "the test's cache does not change the output"


def _check_flow_renoise(kernel, case: KernelCase, device: str) -> None:
    r = case.renoise
    x0 = randn(r.shape, 1, case.x_dtype, device)
    noise = randn(r.shape, 3, case.v_dtype, device)
    out = kernel(x0, noise, r.sigma)
    assert torch.is_tensor(out) and out.shape == x0.shape and out.dtype == x0.dtype, \
        f"flow_renoise returned {getattr(out, 'dtype', type(out))}{tuple(getattr(out, 'shape', ()))};" \
        f" the contract is x0's {x0.dtype}{tuple(x0.shape)}"
    assert out.device == x0.device, f"flow_renoise returned a tensor on {out.device}"
    want = reference.flow_renoise(to_f64(x0), to_f64(noise), r.sigma)
    assert_close(out, want, x0.dtype, "flow_renoise")


def _check_sequence_parallel_attention(platform, kernel, case: KernelCase, device: str) -> None:
    """The op on 2 gloo ranks (:mod:`flowseam.testing.conformance._split`), each passing its half
    of the rows: the joined result equals the oracle's unsplit attention. A kernel may refuse
    heads that the ranks do not divide (an all-to-all one), with ValueError naming the heads."""
    c = case.split
    got = split_results(platform, kernel.impl_id, device)["cases"][case_key(case.x_dtype, c)]
    heads = c.shape[1]
    if "error" in got:
        kind, message, is_value_error = got["error"]
        refusal = (not c.heads_divide and is_value_error and got["all_ranks"]
                   and "head" in message.lower() and str(heads) in message)
        assert refusal, (f"sequence_parallel_attention on {WORLD} ranks raised {kind}"
                         f"{'' if got['all_ranks'] else ' (on some ranks only)'}: {message}"
                         + ("" if c.heads_divide else f" (a refusal of {heads} heads must be a "
                            f"ValueError naming them)"))
        return
    q, k, v = full_inputs(c, case.x_dtype, "cpu")
    out = got["out"]
    want_shape = tuple(q.shape)
    assert tuple(out.shape) == want_shape and out.dtype == q.dtype, \
        f"sequence_parallel_attention's halves joined are {out.dtype}{tuple(out.shape)}, " \
        f"expected {q.dtype}{want_shape}"
    want = reference.attention(to_f64(q), to_f64(k), to_f64(v), scale=c.scale)
    assert_close(out, want, q.dtype, f"sequence_parallel_attention on {WORLD} ranks, joined")


_CHECKS = {
    ops.FLOW_MATCH_STEP: _check_flow_match_step,
    ops.FLOW_SDE_STEP: _check_flow_sde_step,
    ops.UNIPC_STEP: _check_unipc_step,
    ops.ATTENTION: _check_attention,
    ops.CACHED_ATTENTION: _check_cached_attention,
    ops.FLOW_RENOISE: _check_flow_renoise,
}


@pytest.mark.flowseam_cases(cases=kernel_cases, empty="it registers no kernel")
def test_kernel_matches_oracle(flowseam_platform, flowseam_case, expectations):
    """C1 against the numpy float64 oracle, tolerance of the output dtype."""
    kernel = pinned_kernel(flowseam_platform, flowseam_case)
    if flowseam_case.op == ops.SEQUENCE_PARALLEL_ATTENTION:  # a collective: on 2 ranks
        _check_sequence_parallel_attention(flowseam_platform, kernel, flowseam_case,
                                           expectations.torch_device)
        return
    check = _CHECKS.get(flowseam_case.op)
    assert check is not None, f"the conformance suite has no check for op {flowseam_case.op!r} yet"
    check(kernel, flowseam_case, expectations.torch_device)


@pytest.mark.flowseam_cases(cases=registration_cases, empty="it registers no kernel")
def test_kernel_rejects_bad_arguments(flowseam_platform, flowseam_case, expectations):
    """The contract's bad arguments raise ValueError (shape mismatch, an empty tensor, sigmas out
    of order or out of [0, 1], a per-sample ``(B,)`` sigma, sigma == 1 without sigma_max and
    sigma_next == sigma for the SDE step; for UniPC also sigma == 1, an order its history cannot
    support, order > 1 at sigma_next == 0, and a state that is not a UniPCState)."""
    kernel = pinned_kernel(flowseam_platform, flowseam_case)
    device = expectations.torch_device
    if flowseam_case.op == ops.SEQUENCE_PARALLEL_ATTENTION:  # called on 2 ranks, every one refuses
        bad = split_results(flowseam_platform, kernel.impl_id, device)["bad"]
        for name, what in BAD_ARGUMENTS.items():
            for rank, error in enumerate(bad[name]):
                assert error is not None, \
                    f"sequence_parallel_attention accepted bad arguments on rank {rank} ({what})"
                assert error[2], f"sequence_parallel_attention raised {error[0]}, not " \
                                 f"ValueError, on rank {rank} for {what}: {error[1]}"
                if name == "requires_grad":
                    assert "grad" in error[1], f"the refusal does not say why: {error[1]}"
        return
    if flowseam_case.op == ops.ATTENTION:
        q = randn((2, 4, 8), 1, "float32", device)
        with pytest.raises(ValueError):
            kernel(q, q, q)
        return
    if flowseam_case.op == ops.CACHED_ATTENTION:
        q = randn((1, 2, 4, 8), 1, "float32", device)
        bad = [((q, q, q, randn((1, 2, 3, 6), 2, "float32", device),
                 randn((1, 2, 3, 8), 3, "float32", device)), "cache head dim differs from k's"),
               ((q, q, q, q, None), "cache_k without cache_v"),
               ((randn((2, 4, 8), 1, "float32", device),) * 3 + (None, None), "3-d q/k/v")]
        for args, what in bad:
            with pytest.raises(ValueError):
                kernel(*args)
                pytest.fail(f"cached_attention accepted bad arguments ({what})")
        return
    if flowseam_case.op == ops.FLOW_RENOISE:
        x0 = randn((2, 8), 1, "float32", device)
        for args, what in (((x0, randn((2, 9), 2, "float32", device), 0.5), "noise shape"),
                           ((x0, x0, 1.5), "sigma > 1"), ((x0, x0, -0.1), "sigma < 0"),
                           ((x0[:, :0], x0[:, :0], 0.5), "an empty x0")):
            with pytest.raises(ValueError):
                kernel(*args)
                pytest.fail(f"flow_renoise accepted bad arguments ({what})")
        return
    x, v = randn((2, 8), 1, "float32", device), randn((2, 8), 2, "float32", device)
    per_sample = torch.tensor([0.5, 0.6], device=device)
    bad = [((x, randn((2, 9), 3, "float32", device), 0.5, 0.4), "v's shape differs from x's"),
           ((x, v, 1.5, 0.4), "sigma > 1"),
           ((x, v, 0.4, 0.5), "sigma_next > sigma"),
           ((x, v, per_sample, 0.4), "a (B,) sigma"),
           ((x[:0], v[:0], 0.5, 0.4), "an empty batch"), ((x[:, :0], v[:, :0], 0.5, 0.4), "size-0 latents")]
    if flowseam_case.op == ops.FLOW_SDE_STEP:
        bad += [((x, v, 1.0, 0.9), "sigma == 1 without sigma_max"),
                ((x, v, 0.5, 0.5), "sigma_next == sigma")]
    kw: dict = {}
    if flowseam_case.op == ops.UNIPC_STEP:
        empty, kw = ops.UniPCState.empty(), {"order": 1}
        history = ops.UniPCState((0.8,), (randn((2, 8), 4, "float32", device),), x, 1)
        bad = [(args + (empty,), what) for args, what in bad]
        bad += [((x, v, 1.0, 0.9, empty), "sigma == 1 (infinite log-SNR)"),
                ((x, v, 0.5, 0.4, None), "no UniPCState")]
        for args, order, what in (((x, v, 0.5, 0.4, empty), 2, "order 2 without history"),
                                  ((x, v, 0.5, 0.0, history), 2, "order 2 to sigma 0"),
                                  ((x, v, 0.9, 0.4, history), 1, "history below sigma")):
            with pytest.raises(ValueError):
                kernel(*args, order=order)
                pytest.fail(f"unipc_step accepted bad arguments ({what})")
    for args, what in bad:
        with pytest.raises(ValueError):
            kernel(*args, **kw)
            pytest.fail(f"{flowseam_case.op} accepted bad arguments ({what})")


@pytest.mark.flowseam_cases(cases=sde_cases, empty="it registers no flow_sde_step kernel")
def test_sde_recompute_reproduces_log_prob(flowseam_platform, flowseam_case, expectations):
    """C2 at the kernel level: a rollout step drawn from a seeded generator, recomputed with
    ``prev_sample=``, gives the same log-prob (PPO ratio 1 within 1e-6); the same seed gives the
    same sample; the drawn noise is standard normal."""
    kernel = pinned_kernel(flowseam_platform, flowseam_case)
    s = flowseam_case.step
    device = expectations.torch_device
    x, v, _ = _step_inputs(flowseam_case, device)
    kw = dict(noise_level=s.noise_level, sigma_max=s.sigma_max)

    def rollout():
        generator = torch.Generator(device).manual_seed(11)
        return kernel(x, v, s.sigma, s.sigma_next, generator=generator, **kw)

    first, again = rollout(), rollout()
    assert torch.equal(first.sample, again.sample), \
        "the same seeded generator drew different samples"
    recomputed = kernel(x, v, s.sigma, s.sigma_next, prev_sample=first.sample, **kw)
    assert torch.equal(recomputed.sample, first.sample), \
        "prev_sample was not returned as the sample"
    ratio = torch.exp(recomputed.log_prob.double() - first.log_prob.double())
    worst = float((ratio - 1).abs().max())
    assert worst <= RATIO_TOL, \
        f"recomputed log-prob differs: max |ratio - 1| = {worst:.3g} > {RATIO_TOL}"
    z = ((first.sample.double() - first.mean.double()) / float(first.std)).flatten()
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05, \
        f"noise drawn from the generator is not standard normal: mean {float(z.mean()):.3f}, " \
        f"std {float(z.std()):.3f}"


@pytest.mark.flowseam_cases(cases=sde_gradient_cases, empty="it registers no flow_sde_step kernel")
def test_sde_log_prob_gradient(flowseam_platform, flowseam_case, expectations):
    """The log-prob's gradient reaches x and v through the mean only (the sample enters
    detached): d log_prob_b / d mean = (sample - mean) / (N std^2), d mean / dx = A,
    d mean / dv = B (Flow-GRPO's SDE step; coefficients in :mod:`flowseam.ops`)."""
    kernel = pinned_kernel(flowseam_platform, flowseam_case)
    s = flowseam_case.step
    device = expectations.torch_device
    x, v, noise = _step_inputs(flowseam_case, device)
    kw = dict(noise_level=s.noise_level, sigma_max=s.sigma_max)
    sample = kernel(x, v, s.sigma, s.sigma_next, noise=noise, **kw).sample.detach()
    x, v, sample = x.requires_grad_(), v.requires_grad_(), sample.requires_grad_()
    out = kernel(x, v, s.sigma, s.sigma_next, prev_sample=sample, **kw)
    out.log_prob.sum().backward()
    assert sample.grad is None or not sample.grad.any(), \
        "the log-prob was differentiated through the sample"
    ref = reference.flow_sde_step(to_f64(x), to_f64(v), s.sigma, s.sigma_next,
                                  prev_sample=to_f64(sample), **kw)
    dt = s.sigma_next - s.sigma
    std_dev_t = ops.sde_std_dev_t(s.sigma, s.noise_level, s.sigma_max)
    coef_x = 1.0 + std_dev_t**2 * dt / (2.0 * s.sigma)
    coef_v = (1.0 + std_dev_t**2 * (1.0 - s.sigma) / (2.0 * s.sigma)) * dt
    n = math.prod(x.shape[1:])
    d_mean = (to_f64(sample) - ref.mean) / (n * float(ref.std) ** 2)
    for name, got, coef in (("x", x.grad, coef_x), ("v", v.grad, coef_v)):
        assert got is not None, f"no gradient reached {name}"
        want = d_mean * coef
        rtol, _ = reference.TOLERANCES[flowseam_case.x_dtype]
        np.testing.assert_allclose(to_f64(got), want, rtol=rtol, atol=rtol * np.abs(want).max(),
                                   err_msg=f"d log_prob / d {name}")
