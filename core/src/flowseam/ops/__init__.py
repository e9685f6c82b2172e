"""Op names, their contracts, and the argument checks every implementation shares.

Each op is a string constant; a backend registers callables for it (see
:func:`flowseam.hookspecs.flowseam_register_kernels`), loops get the resolved callable from
``platform.kernels.get(op)``. :mod:`flowseam.ops.reference` holds the numpy float64 oracle each
implementation is checked against.

Contracts
---------
``FLOW_MATCH_STEP``: ``step(x, v, sigma, sigma_next) -> x + (sigma_next - sigma) * v``
    One deterministic Euler step of the flow ODE dx/dσ = v (the serve-time solver; matches
    diffusers ``FlowMatchEulerDiscreteScheduler.step``). ``x``, ``v``: same shape, e.g. latents
    ``(B, C, F, H, W)``; the result has ``x``'s dtype, the arithmetic is float32 or wider.

``FLOW_SDE_STEP``: ``step(x, v, sigma, sigma_next, *, noise=None, prev_sample=None,
noise_level=0.7, sigma_max=None, generator=None) -> SDEStepOutput``
    Flow-GRPO's stochastic step with its Gaussian log-prob (Liu et al. 2025, "Flow-GRPO",
    eq. 9-10; their SD3 ``sde_step_with_logprob``). With ``dt = sigma_next - sigma < 0``::

        s          = sigma_max if sigma == 1 else sigma
        std_dev_t  = noise_level * sqrt(sigma / (1 - s))
        mean       = x * (1 + std_dev_t**2 * dt / (2*sigma))
                     + v * (1 + std_dev_t**2 * (1 - sigma) / (2*sigma)) * dt
        std        = std_dev_t * sqrt(-dt)
        sample     = prev_sample if given else mean + std * noise
        log_prob   = mean over non-batch dims of log N(sample; mean, std**2)   -> (B,)

    ``noise`` is drawn from ``generator`` (standard normal, x's shape) when not given. The
    sample is returned in ``x``'s dtype and the log-prob is computed from that returned sample
    (so recomputing with ``prev_sample=sample`` reproduces it exactly); the sample enters the
    log-density detached, so gradients reach the log-prob only through ``mean`` (as in
    Flow-GRPO). ``mean``, ``std`` and ``log_prob`` are float32 (or wider).

``ATTENTION``: ``attn(q, k, v, attn_mask=None, scale=None)``
    Scaled dot-product attention, layout ``(B, heads, seq, head_dim)``, the semantics of
    ``torch.nn.functional.scaled_dot_product_attention``: a boolean mask marks the keys that may
    be attended (True = keep), a float mask is added to the scores; ``scale`` defaults to
    ``1/sqrt(head_dim)``. The key/value length may differ from the query length.

``CACHED_ATTENTION``: ``attn(q, k, v, cache_k=None, cache_v=None, scale=None)``
    Block-causal attention of one chunk of a causal video loop over a KV cache: the chunk's
    queries ``q (B, heads, Lq, D)`` attend to every cached key ``cache_k (B, heads, Lc, D)``
    (earlier chunks, already windowed by the loop) and to every key of the chunk itself
    ``k (B, heads, Lk, D)``; values likewise (``cache_v (B, heads, Lc, Dv)``,
    ``v (B, heads, Lk, Dv)``)::

        out = softmax(q @ cat(cache_k, k)^T * scale) @ cat(cache_v, v)     -> (B, heads, Lq, Dv)

    ``Lc`` may be 0 (the first chunk), or both caches None. No mask: within a chunk attention is
    bidirectional, and the cache holds only what the chunk may see (the block-causal mask of
    Self-Forcing / CausVid, Huang et al. 2025; Yin et al. 2025). ``scale`` defaults to
    ``1/sqrt(D)``; the result has ``q``'s dtype. A separate op (not ``attention`` with a mask)
    so that a backend can implement it without materialising the concatenation (e.g.
    flash-attn's ``flash_attn_with_kvcache``), and so that a backend without it falls back to
    the next device visibly (``platform.explain()``).

``FLOW_RENOISE``: ``renoise(x0, noise, sigma) -> (1 - sigma) * x0 + sigma * noise``
    Re-noising a predicted clean sample ``x0`` to noise level ``sigma`` with fresh standard
    normal ``noise`` (the flow-matching forward process; diffusers
    ``FlowMatchEulerDiscreteScheduler.scale_noise``, Self-Forcing's ``scheduler.add_noise``).
    The few-step causal loop predicts ``x0`` with ``flow_match_step(x, v, sigma, 0)`` and
    re-noises it to the next sigma of the chunk's schedule. ``x0``, ``noise``: same shape; the
    result has ``x0``'s dtype, the arithmetic is float32 or wider; ``sigma`` in [0, 1].

Bad arguments (shape mismatch, sigma outside [0, 1], sigma_next > sigma, sigma == 1 without
sigma_max for the SDE step) raise ``ValueError`` naming the value.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

FLOW_MATCH_STEP = "flow_match_step"
FLOW_SDE_STEP = "flow_sde_step"
ATTENTION = "attention"
CACHED_ATTENTION = "cached_attention"
FLOW_RENOISE = "flow_renoise"

#: Every op flowseam defines a contract for. Plugins may register only these.
ALL_OPS = (FLOW_MATCH_STEP, FLOW_SDE_STEP, ATTENTION, CACHED_ATTENTION, FLOW_RENOISE)


class SDEStepOutput(NamedTuple):
    """Result of a ``FLOW_SDE_STEP`` kernel.

    :ivar sample: x's shape and dtype: the next latents.
    :ivar log_prob: ``(B,)`` float32 (or wider): mean Gaussian log-density of ``sample``.
    :ivar mean: x's shape, float32 (or wider): the mean of the step's Gaussian.
    :ivar std: scalar (0-dim) float32 (or wider): the step's standard deviation.
    """

    sample: Any
    log_prob: Any
    mean: Any
    std: Any


def _shape(t: Any) -> tuple:
    return tuple(t.shape)


def _is_float(t: Any) -> bool:
    dtype = t.dtype
    if hasattr(dtype, "is_floating_point"):  # torch
        return bool(dtype.is_floating_point)
    return getattr(dtype, "kind", "f") == "f"  # numpy


def check_sigmas(sigma: float, sigma_next: float, *, sde: bool, sigma_max: float | None = None,
                 noise_level: float = 0.7) -> None:
    """Validate the scalar arguments of a flow step. Raises ValueError naming the bad value."""
    if not (0.0 <= sigma <= 1.0) or math.isnan(sigma):
        raise ValueError(f"sigma={sigma!r} is outside [0, 1]")
    if not (0.0 <= sigma_next <= 1.0) or math.isnan(sigma_next):
        raise ValueError(f"sigma_next={sigma_next!r} is outside [0, 1]")
    if sigma_next > sigma:
        raise ValueError(
            f"sigma_next={sigma_next!r} > sigma={sigma!r}: flow-matching steps go from noise "
            "(sigma=1) towards data (sigma=0), so sigma_next must be <= sigma")
    if not sde:
        return
    if sigma_next == sigma:
        raise ValueError(
            f"sigma_next == sigma == {sigma!r}: the SDE step needs sigma_next < sigma "
            "(its std is std_dev_t * sqrt(sigma - sigma_next))")
    if not (0.0 < noise_level < math.inf):
        raise ValueError(f"noise_level={noise_level!r} must be finite and > 0 (it scales the "
                         "SDE step's std; use flow_match_step for a deterministic step)")
    if sigma == 1.0:
        if sigma_max is None:
            raise ValueError(
                "sigma=1.0 needs sigma_max (the largest sigma < 1 of the schedule, Flow-GRPO's "
                "sigmas[1]): std_dev_t = noise_level*sqrt(sigma/(1 - sigma)) is infinite at 1")
        if not (0.0 < sigma_max < 1.0):
            raise ValueError(f"sigma_max={sigma_max!r} must be in (0, 1)")
    if sde_std_dev_t(sigma, noise_level, sigma_max) * math.sqrt(sigma - sigma_next) < 1e-30:
        raise ValueError(f"sigma={sigma!r}, sigma_next={sigma_next!r}: the SDE step's std "
                         "underflows to 0; its log-density is undefined")


def as_sigma(value: Any, name: str = "sigma") -> float:
    """A sigma given as a Python/numpy number or a 0-dim tensor, as a float.

    :raises ValueError: for strings, booleans or tensors with more than one element.
    """
    if isinstance(value, (str, bytes, bool)):
        raise ValueError(f"{name}={value!r} must be a number in [0, 1]")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name}={value!r} must be a number in [0, 1] (a float or a "
                         "one-element tensor)") from None


def check_step_tensors(x: Any, v: Any, noise: Any = None, prev_sample: Any = None) -> None:
    """Validate the tensor arguments of a flow step: v, noise and prev_sample must have x's
    shape, and x needs a batch dimension. Raises ValueError naming the shapes."""
    xs = _shape(x)
    for name, t in (("x", x), ("v", v), ("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and not _is_float(t):
            raise ValueError(f"{name} has dtype {t.dtype}; flow steps need floating-point tensors")
    if len(xs) < 1:
        raise ValueError(f"x has shape {xs}; a flow step needs at least a batch dimension (B, ...)")
    for name, t in (("v", v), ("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and _shape(t) != xs:
            raise ValueError(f"{name} has shape {_shape(t)} but x has shape {xs}; they must match")


def check_attention(q: Any, k: Any, v: Any) -> None:
    """Validate attention shapes: (B, heads, seq, dim) with matching batch/heads/dims."""
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"attention expects 4-d (B, heads, seq, dim) q/k/v, got {qs}, {ks}, {vs}")
    if ks[:2] != qs[:2] or vs[:2] != qs[:2] or ks[2] != vs[2] or ks[3] != qs[3]:
        raise ValueError(
            f"attention shapes do not match: q={qs}, k={ks}, v={vs}; need q (B,H,Lq,D), "
            "k (B,H,Lk,D), v (B,H,Lk,Dv)")


def check_cached_attention(q: Any, k: Any, v: Any, cache_k: Any, cache_v: Any) -> None:
    """Validate cached attention shapes: q/k/v as for attention, the caches (B, heads, Lc, D)
    and (B, heads, Lc, Dv), both given or both None. Raises ValueError naming the shapes."""
    check_attention(q, k, v)
    if (cache_k is None) != (cache_v is None):
        raise ValueError("cache_k and cache_v must be given together (or both None)")
    if cache_k is None:
        return
    ks, vs, cks, cvs = _shape(k), _shape(v), _shape(cache_k), _shape(cache_v)
    if len(cks) != 4 or len(cvs) != 4 or cks[:2] != ks[:2] or cvs[:2] != vs[:2] \
            or cks[3] != ks[3] or cvs[3] != vs[3] or cks[2] != cvs[2]:
        raise ValueError(
            f"cached attention shapes do not match: k={ks}, v={vs}, cache_k={cks}, "
            f"cache_v={cvs}; need cache_k (B,H,Lc,D) and cache_v (B,H,Lc,Dv) like k and v")


def check_renoise(x0: Any, noise: Any, sigma: float) -> None:
    """Validate the re-noising op's arguments. Raises ValueError naming the bad value."""
    for name, t in (("x0", x0), ("noise", noise)):
        if not _is_float(t):
            raise ValueError(f"{name} has dtype {t.dtype}; re-noising needs floating-point tensors")
    if _shape(noise) != _shape(x0):
        raise ValueError(f"noise has shape {_shape(noise)} but x0 has shape {_shape(x0)}; "
                         "they must match")
    if not (0.0 <= sigma <= 1.0) or math.isnan(sigma):
        raise ValueError(f"sigma={sigma!r} is outside [0, 1]")


def sde_std_dev_t(sigma: float, noise_level: float, sigma_max: float | None) -> float:
    """``noise_level * sqrt(sigma / (1 - s))`` with ``s = sigma_max if sigma == 1 else sigma``
    (Flow-GRPO, SD3 ``sde_step_with_logprob``). Python float arithmetic (float64)."""
    s = sigma_max if sigma == 1.0 else sigma
    return noise_level * math.sqrt(sigma / (1.0 - s))


__all__ = [
    "ALL_OPS", "ATTENTION", "CACHED_ATTENTION", "FLOW_MATCH_STEP", "FLOW_RENOISE", "FLOW_SDE_STEP",
    "SDEStepOutput", "as_sigma", "check_attention", "check_cached_attention", "check_renoise",
    "check_sigmas", "check_step_tensors", "sde_std_dev_t",
]
