"""The eager-torch implementation of every op contract, on whatever device the tensors are on.

Backends register these functions as their kernels (the cpu backend for every op; the cuda
backend for its ``generic`` rung, below the cupy kernels), so the one implementation is written
once. Each follows the contract in :mod:`flowseam.ops` and is checked against the numpy float64
oracle (:mod:`flowseam.ops.reference`) at C1: float32 inputs match within rtol = atol = 1e-5.
Dtype rules (every backend's): the arithmetic is float32, float64 for float64 ``x``; the Euler
step and the SDE sample come back in ``x``'s dtype, ``mean``, ``std`` and ``log_prob`` in the
compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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

HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 or wider: float64 stays float64, everything else computes in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def flow_match_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """``x + (sigma_next - sigma) * v``; x, v: (B, ...) any float dtype; returns x's dtype.

    Matches diffusers ``FlowMatchEulerDiscreteScheduler.step`` (which upcasts to float32).
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    dt = sigma_next - sigma
    if x.dtype == torch.float32 and v.dtype == torch.float32:
        return torch.add(x, v, alpha=dt)
    ct = compute_dtype(x)
    return torch.add(x.to(ct), v.to(ct), alpha=dt).to(x.dtype)


def flow_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, *,
                  noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: torch.Generator | None = None) -> SDEStepOutput:
    """Flow-GRPO's SDE step with log-prob (formulas and shapes in :mod:`flowseam.ops`)."""
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    ct = compute_dtype(x)
    dt = sigma_next - sigma
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    x_c, v_c = x.to(ct), v.to(ct)
    mean = (x_c * (1.0 + std_dev_t**2 * dt / (2.0 * sigma))
            + v_c * ((1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt))
    std = std_dev_t * math.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=ct, device=x.device)
        sample = (mean + std * noise.to(ct)).to(x.dtype)
    else:
        sample = prev_sample.to(x.dtype)
    diff = sample.detach().to(ct) - mean
    log_density = diff.square() * (-0.5 / std**2) - (math.log(std) + HALF_LOG_2PI)
    log_prob = log_density.reshape(x.shape[0], -1).mean(dim=1)
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean,
                         std=torch.tensor(std, dtype=ct, device=x.device))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on (B, heads, seq, dim) tensors."""
    check_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Chunk attention over a KV cache: SDPA of q ``(B, heads, Lq, D)`` over ``cat(cache_k, k)``
    and ``cat(cache_v, v)`` (contract in :mod:`flowseam.ops`)."""
    check_cached_attention(q, k, v, cache_k, cache_v)
    if cache_k is not None and cache_k.shape[2]:
        k, v = torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def flow_renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise``; x0, noise: (B, ...) any float dtype; returns x0's
    dtype, computed in float32 (float64 for float64 x0)."""
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    ct = compute_dtype(x0)
    return torch.add(x0.to(ct) * (1.0 - sigma), noise.to(ct), alpha=sigma).to(x0.dtype)
