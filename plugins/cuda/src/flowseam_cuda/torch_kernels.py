"""torch implementations of the ops for CUDA tensors: the ``generic`` rung, and the attention op.

The ``generic`` kernels are plain torch (eager) on whatever device the tensors are on, with the
dtype rules of every flowseam backend (float32 arithmetic, float64 for float64 inputs; results in
``x``'s dtype; see :mod:`flowseam.ops`). They run on any GPU torch supports and are what a
platform resolves to below ``sm80`` (where the cupy kernels are registered); they are also the
"torch eager" side of ``plugins/cuda/bench_kernels.py``.

Attention (registered at ``sm80``; ``generic`` is plain SDPA): flash-attn's
``flash_attn_func`` when the package imports and the call fits it (fp16/bf16, no mask, equal
q/v head dims <= 256), else ``torch.nn.functional.scaled_dot_product_attention`` restricted, in
this priority order, to the FlashAttention-2, cuDNN, memory-efficient and (last resort) math
backends. torch's default ranking of cuDNN has changed between releases; pinning the order
keeps the choice stable, and ranks cuDNN (fast on Hopper, takes masks) above the memory-efficient
kernel (the one fused kernel that also takes float32).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F
from flowseam.ops import (
    SDEStepOutput,
    check_attention,
    check_sigmas,
    check_step_tensors,
    sde_std_dev_t,
)

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def flow_match_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """``x + (sigma_next - sigma) * v`` in float32 (float64 for float64 x); returns x's dtype."""
    sigma, sigma_next = float(sigma), float(sigma_next)
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    ct = _compute_dtype(x)
    return torch.add(x.to(ct), v.to(ct), alpha=sigma_next - sigma).to(x.dtype)


def flow_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, *,
                  noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: torch.Generator | None = None) -> SDEStepOutput:
    """Flow-GRPO's SDE step with log-prob, torch eager (formulas and shapes in flowseam.ops)."""
    sigma, sigma_next = float(sigma), float(sigma_next)
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    ct = _compute_dtype(x)
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
        sample = prev_sample
    diff = sample.detach().to(ct) - mean
    log_density = diff.square() * (-0.5 / std**2) - (math.log(std) + _HALF_LOG_2PI)
    log_prob = log_density.flatten(1).mean(dim=1)
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean,
                         std=torch.tensor(std, dtype=ct, device=x.device))


# -- attention ---------------------------------------------------------------------------------

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """SDPA on ``(B, heads, seq, dim)`` with torch's own backend choice (the generic rung)."""
    check_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


@functools.cache
def _flash_attn_func():
    """flash-attn's ``flash_attn_func`` if the package is installed and imports, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return importlib.import_module("flash_attn").flash_attn_func
    except Exception:  # an ABI-mismatched build: SDPA still works
        return None


@functools.cache
def _sdpa_priority():
    """A context manager factory selecting the fused SDPA backends in priority order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:  # torch >= 2.6
        return functools.partial(sdpa_kernel, order, set_priority=True)
    return functools.partial(sdpa_kernel, order)


def _fits_flash_attn(q: torch.Tensor, v: torch.Tensor, attn_mask) -> bool:
    return (attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256 and q.is_cuda)


def attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The ``attention`` contract through flash-attn or the fused SDPA backends (module
    docstring). Layout ``(B, heads, seq, dim)`` in and out."""
    check_attention(q, k, v)
    flash = _flash_attn_func()
    if flash is not None and _fits_flash_attn(q, v, attn_mask):
        # flash-attn takes (B, seq, heads, dim); the transposes are views (last dim contiguous)
        out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        return out.transpose(1, 2)
    with _sdpa_priority()():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
