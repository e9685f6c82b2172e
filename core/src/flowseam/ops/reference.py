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
    as_sigma,
    check_attention,
    check_cached_attention,
    check_renoise,
    check_sigmas,
    check_step_tensors,
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
