"""The eager-torch implementation of every op contract, on whatever device the tensors are on.

Backends register these functions as their kernels (the cpu backend for every op; the cuda
backend for its ``generic`` rung, below the cupy kernels), so the one implementation is written
once. Each function follows the contract of its op, the docstring of the numpy float64 oracle of
the same name in :mod:`flowseam.ops.reference`, and the dtype rules of :mod:`flowseam.ops`
(arithmetic in :func:`compute_dtype`); each is checked against that oracle at C1
(:data:`flowseam.ops.reference.TOLERANCES`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import (
    SDEStepOutput,
    UniPCState,
    UniPCStepOutput,
    as_sigma,
    check_attention,
    check_cached_attention,
    check_renoise,
    check_sequence_parallel_attention,
    check_sigmas,
    check_step_tensors,
    check_unipc,
    sde_std_dev_t,
    unipc_coefficients,
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
    """Flow-GRPO's SDE step with log-prob (formulas and shapes:
    :func:`flowseam.ops.reference.flow_sde_step`)."""
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    if noise_level == 0.0:
        return deterministic_sde_step(x, v, sigma, sigma_next, prev_sample)
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


def deterministic_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float,
                           prev_sample: torch.Tensor | None = None) -> SDEStepOutput:
    """``flow_sde_step`` at ``noise_level == 0`` (contract:
    :func:`flowseam.ops.reference.flow_sde_step`): ``mean`` is the Euler step in the compute
    dtype, ``sample`` that mean in x's dtype (or ``prev_sample`` as given), ``std`` 0 and
    ``log_prob`` 0 per sample. Arguments are assumed checked; every backend may call this for
    its ``noise_level == 0`` case."""
    ct = compute_dtype(x)
    mean = torch.add(x.to(ct), v.to(ct), alpha=sigma_next - sigma)
    sample = mean.detach().to(x.dtype) if prev_sample is None else prev_sample.to(x.dtype)
    zeros = torch.zeros(x.shape[0], dtype=ct, device=x.device)
    return SDEStepOutput(sample=sample, log_prob=zeros, mean=mean,
                         std=torch.tensor(0.0, dtype=ct, device=x.device))


def _unipc_update(coef, base: torch.Tensor, m0: torch.Tensor, older: list[torch.Tensor],
                  m: torch.Tensor | None) -> torch.Tensor:
    out = base * coef.base + m0 * coef.m0
    for scale, o in zip(coef.diffs, older):
        out = out + (o - m0) * scale
    if m is not None:
        out = out + (m - m0) * coef.last
    return out


def unipc_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float,
               state: UniPCState, *, order: int, solver_type: str = "bh2",
               corrector: bool = True) -> UniPCStepOutput:
    """One UniPC step (flow-matching data prediction, B(h) variants; formulas, state and domain
    in :func:`flowseam.ops.reference.unipc_step`). x, v: (B, ...) any float dtype; the sample
    comes back in x's dtype, the stored data predictions in the compute dtype. Matches diffusers'
    ``UniPCMultistepScheduler.step`` with ``use_flow_sigmas=True``."""
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_unipc(sigma, sigma_next, state, order=order, solver_type=solver_type, shape=x.shape)
    ct = compute_dtype(x)
    m = x.to(ct) - sigma * v.to(ct)
    sample = x
    if corrector and state.last_sample is not None:
        p = state.last_order
        older = [state.outputs[-1 - k] for k in range(1, p)]
        coef = unipc_coefficients(state.sigmas[-1], sigma,
                                  tuple(state.sigmas[-1 - k] for k in range(1, p)), solver_type,
                                  corrector=True)
        sample = _unipc_update(coef, state.last_sample.to(ct), state.outputs[-1], older,
                               m).to(x.dtype)
    sigmas, outputs = tuple(state.sigmas) + (sigma,), tuple(state.outputs) + (m,)
    if sigma_next == sigma:  # h = 0: the predictor is the identity
        out = sample.clone()
    else:
        older = [outputs[-1 - k] for k in range(1, order)]
        coef = unipc_coefficients(sigma, sigma_next,
                                  tuple(sigmas[-1 - k] for k in range(1, order)), solver_type,
                                  corrector=False)
        out = _unipc_update(coef, sample.to(ct), m, older, None).to(x.dtype)
    return UniPCStepOutput(out, UniPCState(sigmas[-order:], outputs[-order:], sample, order))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on (B, heads, seq, dim) tensors."""
    check_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Chunk attention over a KV cache: SDPA of q ``(B, heads, Lq, D)`` over ``cat(cache_k, k)``
    and ``cat(cache_v, v)`` (contract: :func:`flowseam.ops.reference.cached_attention`)."""
    check_cached_attention(q, k, v, cache_k, cache_v)
    if cache_k is not None and cache_k.shape[2]:
        k, v = torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                      attention, scale: float | None = None) -> torch.Tensor:
    """Sequence-parallel self-attention by all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023,
    arXiv:2309.14509): q/k/v ``(B, H, S/N, D)``, this rank's rows of the sequence, are traded
    for ``(B, H/N, S, D)``, this rank's ``H/N`` heads over the whole sequence (one
    ``all_to_all_single`` each), ``attention`` runs on those, and one more all-to-all trades the
    result back to ``(B, H, S/N, D)`` (contract: :data:`flowseam.ops.SEQUENCE_PARALLEL_ATTENTION`).
    Bytes moved per rank and call: ``4 * (N-1)/N * B*H*(S/N)*D * itemsize`` sent (and as many
    received).

    :raises ValueError: heads not a multiple of N, q/k/v of different lengths, or grad.
    """
    import torch.distributed as dist

    n = dist.get_world_size(group)
    check_sequence_parallel_attention(q, k, v, n)
    if n == 1:
        return attention(q, k, v, scale=scale)
    heads = [_rows_to_heads(t, n, group) for t in (q, k, v)]
    out = attention(*heads, scale=scale)
    del heads  # q, k, v over the whole sequence: freed before the trade back
    B, h, S, Dv = out.shape
    send = out.reshape(B, h, n, S // n, Dv).permute(2, 0, 1, 3, 4).contiguous()
    del out
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's heads of my rows
    del send
    return recv.transpose(0, 1).reshape(B, n * h, S // n, Dv)


def _rows_to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """``(B, H, s, D)`` rows of rank r → ``(B, H/n, n*s, D)``: head chunk j goes to rank j, and
    rank j's rows arrive in rank order (the global sequence order)."""
    import torch.distributed as dist

    B, H, s, D = x.shape
    send = x.reshape(B, n, H // n, s, D).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's rows of my heads
    del send  # the buffers a call holds at once: the peak memory of a split attention
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * s, D)


def flow_renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise``; x0, noise: (B, ...) any float dtype; returns x0's
    dtype, computed in float32 (float64 for float64 x0)."""
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    ct = compute_dtype(x0)
    return torch.add(x0.to(ct) * (1.0 - sigma), noise.to(ct), alpha=sigma).to(x0.dtype)
