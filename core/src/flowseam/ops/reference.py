"""The numpy float64 oracle for every op in :mod:`flowseam.ops`.

Written directly from the formulas in the op contracts (see :mod:`flowseam.ops`), in float64,
with no torch. Every kernel a backend registers is checked against these functions by the
conformance suite (tolerance by dtype, see :data:`TOLERANCES`).
"""

from __future__ import annotations

import math

import numpy as np

from . import (
    SDEStepOutput,
    UniPCState,
    UniPCStepOutput,
    as_sigma,
    check_attention,
    check_cached_attention,
    check_renoise,
    check_sigmas,
    check_step_tensors,
    check_unipc,
    sde_std_dev_t,
)

#: (rtol, atol) for comparing a kernel's output in a dtype against the float64 oracle (C1).
TOLERANCES = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-5),
    "float16": (1e-2, 1e-2),
    "bfloat16": (2e-2, 2e-2),
}


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def flow_match_step(x, v, sigma: float, sigma_next: float) -> np.ndarray:
    """``x + (sigma_next - sigma) * v`` in float64. Shapes: x, v (B, ...)."""
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    return _f64(x) + (sigma_next - sigma) * _f64(v)


def flow_sde_step(x, v, sigma: float, sigma_next: float, *, noise=None, prev_sample=None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: np.random.Generator | None = None) -> SDEStepOutput:
    """Flow-GRPO's SDE step with log-prob in float64 (formulas in :mod:`flowseam.ops`).

    ``generator`` is a ``numpy.random.Generator`` here (the torch kernels take a
    ``torch.Generator``); pass ``noise`` to compare against a torch kernel.
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    x, v = _f64(x), _f64(v)
    dt = sigma_next - sigma
    if noise_level == 0.0:  # deterministic: the Euler step, no density (see flowseam.ops)
        mean = x + dt * v
        sample = mean if prev_sample is None else _f64(prev_sample)
        return SDEStepOutput(sample=sample, log_prob=np.zeros(x.shape[0]), mean=mean,
                             std=np.float64(0.0))
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    mean = (x * (1.0 + std_dev_t**2 * dt / (2.0 * sigma))
            + v * (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt)
    std = std_dev_t * math.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise = (generator or np.random.default_rng()).standard_normal(x.shape)
        sample = mean + std * _f64(noise)
    else:
        sample = _f64(prev_sample)
    log_density = (-((sample - mean) ** 2) / (2.0 * std**2) - math.log(std)
                   - 0.5 * math.log(2.0 * math.pi))
    log_prob = log_density.reshape(log_density.shape[0], -1).mean(axis=1)
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean, std=np.float64(std))


def _lambda(s: float) -> float:
    """UniPC's log-SNR of flow sigmas: log(alpha) - log(sigma) with alpha = 1 - sigma."""
    return np.inf if s == 0 else float(np.log(1.0 - s) - np.log(s))


def _unipc_solve(s0: float, t: float, older: list[float], solver_type: str,
                 corrector: bool) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(h, hh, rks, rhos) of one UniPC update, written from Zhao et al. 2023, Algorithm 2
    (B(h) variants) in diffusers' data-prediction form."""
    h = _lambda(t) - _lambda(s0)
    hh = -h
    p = len(older) + 1
    rks = np.array([(_lambda(s) - _lambda(s0)) / h for s in older] + [1.0])
    b_h = hh if solver_type == "bh1" else np.expm1(hh)
    # b_i = i! * phi_{i+1}(hh) / B(h), with h*phi_1 = expm1(hh) and the recursion
    # phi_{k+1} = phi_k / hh - 1 / (k+1)! (Zhao et al. 2023, eq. 12)
    phis, g, fact = [], np.expm1(hh) / hh - 1.0, 1.0
    for i in range(1, p + 1):
        phis.append(g * fact / b_h)
        fact *= i + 1
        g = g / hh - 1.0 / fact
    powers = np.vander(rks, p, increasing=True).T  # row i: rks ** i
    if corrector:
        rhos = np.array([0.5]) if p == 1 else np.linalg.solve(powers, np.array(phis))
    else:
        rhos = np.array([0.5]) if p == 2 else (
            np.linalg.solve(powers[:-1, :-1], np.array(phis[:-1])) if p > 2 else np.zeros(0))
    return h, hh, rks, rhos


def unipc_step(x, v, sigma: float, sigma_next: float, state: UniPCState, *, order: int,
               solver_type: str = "bh2", corrector: bool = True) -> UniPCStepOutput:
    """One UniPC step in float64 (formulas and state in :mod:`flowseam.ops`); the state holds
    numpy arrays."""
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_unipc(sigma, sigma_next, state, order=order, solver_type=solver_type, shape=x.shape)
    x, v = _f64(x), _f64(v)
    m = x - sigma * v
    if corrector and state.last_sample is not None:
        p, s0, m0 = state.last_order, state.sigmas[-1], _f64(state.outputs[-1])
        older = [state.sigmas[-1 - k] for k in range(1, p)]
        h, hh, rks, rhos = _unipc_solve(s0, sigma, older, solver_type, corrector=True)
        b_h = hh if solver_type == "bh1" else np.expm1(hh)
        res = sum(rhos[k - 1] * (_f64(state.outputs[-1 - k]) - m0) / rks[k - 1]
                  for k in range(1, p)) + rhos[-1] * (m - m0)
        x = (sigma / s0) * _f64(state.last_sample) - (1 - sigma) * np.expm1(hh) * m0 \
            - (1 - sigma) * b_h * res
    sigmas = list(state.sigmas) + [sigma]
    outputs = [_f64(o) for o in state.outputs] + [m]
    older = [sigmas[-1 - k] for k in range(1, order)]
    if sigma_next == 0.0:  # order 1 (checked): the limit h -> inf of the update is m
        sample = m.copy()
    elif sigma_next == sigma:  # h = 0: the identity
        sample = x.copy()
    else:
        h, hh, rks, rhos = _unipc_solve(sigma, sigma_next, older, solver_type, corrector=False)
        b_h = hh if solver_type == "bh1" else np.expm1(hh)
        res = sum(rhos[k - 1] * (outputs[-1 - k] - m) / rks[k - 1] for k in range(1, order))
        sample = (sigma_next / sigma) * x - (1 - sigma_next) * np.expm1(hh) * m \
            - (1 - sigma_next) * b_h * res
    return UniPCStepOutput(sample, UniPCState(tuple(sigmas[-order:]), tuple(outputs[-order:]),
                                              x, order))


def attention(q, k, v, attn_mask=None, scale: float | None = None) -> np.ndarray:
    """Softmax attention in float64, layout (B, heads, seq, dim): ``softmax(q k^T * scale + mask) v``.

    A boolean mask keeps the True positions (the others get -inf); a float mask is added. A
    query whose keys are all masked out gets zeros (as torch's SDPA does).
    """
    check_attention(q, k, v)
    q, k, v = _f64(q), _f64(k), _f64(v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask.astype(np.float64)
    row_max = scores.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(row_max)  # every key masked out
    weights = np.exp(scores - np.where(dead, 0.0, row_max))
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.where(dead, 0.0, weights / np.where(dead, 1.0, total))
    return weights @ v


def cached_attention(q, k, v, cache_k=None, cache_v=None, scale: float | None = None) -> np.ndarray:
    """Block-causal chunk attention over a KV cache in float64: softmax attention of ``q``
    ``(B, heads, Lq, D)`` over ``cat(cache_k, k)`` / ``cat(cache_v, v)`` along the sequence,
    no mask (contract in :mod:`flowseam.ops`)."""
    check_cached_attention(q, k, v, cache_k, cache_v)
    if cache_k is not None:
        k = np.concatenate([_f64(cache_k), _f64(k)], axis=2)
        v = np.concatenate([_f64(cache_v), _f64(v)], axis=2)
    return attention(q, k, v, scale=scale)


def flow_renoise(x0, noise, sigma: float) -> np.ndarray:
    """``(1 - sigma) * x0 + sigma * noise`` in float64 (the flow-matching forward process)."""
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    return (1.0 - sigma) * _f64(x0) + sigma * _f64(noise)
