"""torch implementations of the ops for CUDA tensors: the ``generic`` rung, and the attention op.

The ``generic`` kernels are core's eager-torch implementation (:mod:`flowseam.ops.eager`, the
cpu backend's too), with the dtype rules of every flowseam backend: what a platform resolves to
on any GPU below ``sm80`` (where the cupy kernels are registered), and the "torch eager" side of
``plugins/cuda/bench_kernels.py``. Attention (registered at ``sm80``; ``generic`` is plain
SDPA) runs flash-attn when it fits the call, else SDPA restricted to its fused backends in a
pinned priority order (:func:`attention_fast` says which and why).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch
import torch.nn.functional as F
from flowseam.ops import check_attention
from flowseam.ops.eager import (  # the generic rung
    attention,
    cached_attention,
    flow_match_step,
    flow_renoise,
    flow_sde_step,
    ulysses_attention,
    unipc_step,
)

__all__ = ["attention", "attention_fast", "cached_attention", "flow_match_step", "flow_renoise",
           "flow_sde_step", "ulysses_attention", "unipc_step"]


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
    """The ``attention`` contract through flash-attn or the fused SDPA backends. Layout
    ``(B, heads, seq, dim)`` in and out.

    flash-attn's ``flash_attn_func`` when the package imports and the call fits it (fp16/bf16,
    no mask, equal q/v head dims <= 256), else ``torch.nn.functional.scaled_dot_product_attention``
    restricted, in this priority order, to the FlashAttention-2, cuDNN, memory-efficient and
    (last resort) math backends. torch's default ranking of cuDNN has changed between releases;
    pinning the order keeps the choice stable, and ranks cuDNN (fast on Hopper, takes masks)
    above the memory-efficient kernel (the one fused kernel that also takes float32)."""
    check_attention(q, k, v)
    flash = _flash_attn_func()
    if flash is not None and _fits_flash_attn(q, v, attn_mask):
        # flash-attn takes (B, seq, heads, dim); the transposes are views (last dim contiguous)
        out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        return out.transpose(1, 2)
    with _sdpa_priority()():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
