"""accel's solver kernels: the op contracts of :mod:`flowseam.ops`, fused by ``torch.compile``.

Each public function validates its arguments like every other backend
(:func:`flowseam.ops.check_step_tensors`, :func:`flowseam.ops.check_sigmas`), computes the step's
scalar coefficients in Python float64, and hands the tensor arithmetic to a small function
compiled with ``torch.compile`` (:func:`flowseam_accel.compiled.compile_function`), which
inductor fuses into one loop over the latents (C++/OpenMP on the CPU, triton on CUDA). The Euler
step and the re-noise are the same ``a x + b y`` graph with different coefficients. Key
decision: nothing in a denoising run recompiles. The coefficients travel as a small tensor (a new
sigma is new data, not a new graph), the latents flattened and detached (:func:`_flat`) through
``torch.autograd.Function`` s with analytic backwards, the graphs see only the compute dtype
(bf16/fp16 latents share the float32 graph), and shapes are dynamic. :func:`flow_sde_step` says
how its log-prob is C2 by construction; :func:`ring_attention`, accel's
``sequence_parallel_attention``, runs eagerly (its work is matmuls between the messages).
"""

from __future__ import annotations

import math

import torch
from flowseam.ops import (SDEStepOutput, as_sigma, check_renoise, check_sequence_parallel_attention,
                          check_sigmas, check_step_tensors, sde_std_dev_t)
from flowseam.ops.eager import HALF_LOG_2PI, compute_dtype, deterministic_sde_step

from .compiled import compile_function

# No fullgraph=True: should dynamo ever refuse one, running it eagerly beats failing a run.
_OPTIONS = {"dynamic": True}

# Indices into the SDE coefficient tensor (compute dtype):
#   mean = x * A + v * B;  sample = mean + STD * noise;
#   log N(s; mean, STD^2) = (s - mean)^2 * NEG_HALF_INV_VAR - LOG_NORM
_A, _B, _STD, _NEG_HALF_INV_VAR, _LOG_NORM = range(5)


def _flat(t: torch.Tensor, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
    """``t`` as ``(-1,)`` (or ``(rows, -1)``, where the log-prob needs the batch) in ``dtype``,
    detached: one graph for every rank, and a plain tensor rather than a view (dynamo guards on
    a view's base). The autograd Functions around the compiled code keep the gradients."""
    flat = t.reshape(-1) if rows is None else t.reshape(rows, -1)
    return flat.detach().to(dtype)


# -- the compiled arithmetic: plain torch functions of compute-dtype tensors ---------------------

def _combine(x: torch.Tensor, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """x, y: (N,); coef (a, b) -> a x + b y: Euler (1, dt), re-noise (1 - sigma, sigma)."""
    return x * coef[0] + y * coef[1]


def _sde_sample(x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor,
                coef: torch.Tensor) -> torch.Tensor:
    """x, v, noise: (N,) -> sample (N,), before rounding to x's dtype."""
    return x * coef[_A] + v * coef[_B] + coef[_STD] * noise


def _sde_mean_log_prob(x: torch.Tensor, v: torch.Tensor, sample: torch.Tensor,
                       coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, v, sample: (B, N) -> mean (B, N) and log_prob (B,)."""
    mean = x * coef[_A] + v * coef[_B]
    diff = sample - mean
    return mean, (diff.square() * coef[_NEG_HALF_INV_VAR] - coef[_LOG_NORM]).mean(dim=1)


def _sde_backward(grad_mean: torch.Tensor, grad_log_prob: torch.Tensor, sample: torch.Tensor,
                  mean: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of (mean, log_prob) with respect to x and v; all (B, N) but grad_log_prob (B,):
    d log_prob_b / d mean_bi = (sample_bi - mean_bi) / (N std^2) = -2 NEG_HALF_INV_VAR diff / N;
    d mean / d x = A, d mean / d v = B.
    """
    diff = sample - mean
    scale = -2.0 * coef[_NEG_HALF_INV_VAR] / mean.shape[1]
    g = grad_mean + grad_log_prob[:, None] * (diff * scale)
    return g * coef[_A], g * coef[_B]


_COMBINE = compile_function(_combine, "flow_match_step+flow_renoise", **_OPTIONS)
_SDE_SAMPLE = compile_function(_sde_sample, "flow_sde_step.sample", **_OPTIONS)
_SDE_MEAN_LOG_PROB = compile_function(_sde_mean_log_prob, "flow_sde_step.log_prob", **_OPTIONS)
_SDE_BACKWARD = compile_function(_sde_backward, "flow_sde_step.backward", **_OPTIONS)


class _Combine(torch.autograd.Function):
    """``_combine`` with its backward (d out / d x = a, d out / d y = b), so the step stays
    differentiable although the compiled graph only ever sees detached tensors."""

    @staticmethod
    def forward(ctx, x, y, coef):
        ctx.save_for_backward(coef)
        ctx.input_dtypes = (x.dtype, y.dtype)
        out = _COMBINE(_flat(x, coef.dtype), _flat(y, coef.dtype), coef)
        return out.to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        (coef,) = ctx.saved_tensors
        g = grad_out.to(coef.dtype)
        return tuple((g * coef[i]).to(dtype) if ctx.needs_input_grad[i] else None
                     for i, dtype in enumerate(ctx.input_dtypes)) + (None,)


class _MeanLogProb(torch.autograd.Function):
    """``_sde_mean_log_prob`` with its analytic backward: the forward always runs the one
    inference graph, whether or not the caller records gradients (C2 by construction)."""

    @staticmethod
    def forward(ctx, x, v, sample, coef):
        rows, ct = x.shape[0], coef.dtype
        sample = _flat(sample, ct, rows)
        mean, log_prob = _SDE_MEAN_LOG_PROB(_flat(x, ct, rows), _flat(v, ct, rows), sample, coef)
        ctx.save_for_backward(sample, mean, coef)
        ctx.inputs = (x.shape, x.dtype, v.dtype)
        return mean.reshape(x.shape), log_prob

    @staticmethod
    def backward(ctx, grad_mean, grad_log_prob):
        sample, mean, coef = ctx.saved_tensors
        shape, x_dtype, v_dtype = ctx.inputs
        grad_x, grad_v = _SDE_BACKWARD(_flat(grad_mean, coef.dtype, len(mean)),
                                       grad_log_prob.detach(), sample, mean, coef)
        return (grad_x.reshape(shape).to(x_dtype) if ctx.needs_input_grad[0] else None,
                grad_v.reshape(shape).to(v_dtype) if ctx.needs_input_grad[1] else None, None, None)


# -- the op implementations (registered by flowseam_accel.plugin) -------------------------------

def flow_match_step(x: torch.Tensor, v: torch.Tensor, sigma: float,
                    sigma_next: float) -> torch.Tensor:
    """``x + (sigma_next - sigma) * v`` (diffusers ``FlowMatchEulerDiscreteScheduler.step``).

    :param x: latents ``(B, ...)``, any float dtype; ``v``: velocity of the same shape.
    :returns: ``x``'s shape and dtype; the arithmetic is float32 (float64 for float64 ``x``).
    :raises ValueError: on a shape mismatch or sigmas outside the contract (see flowseam.ops).
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    coef = torch.tensor([1.0, sigma_next - sigma], dtype=compute_dtype(x), device=x.device)
    return _Combine.apply(x, v, coef)


def flow_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, *,
                  noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: torch.Generator | None = None) -> SDEStepOutput:
    """Flow-GRPO's SDE step with its Gaussian log-prob (Liu et al. 2025, eq. 9-10); formulas,
    shapes and errors in :mod:`flowseam.ops`.

    :param x: latents ``(B, ...)``; ``v``, ``noise``, ``prev_sample``: the same shape.
    :param noise: standard normal noise; drawn from ``generator`` (compute dtype, x's device,
        the same draw as the cpu backend) when neither it nor ``prev_sample`` is given.
    :param prev_sample: the sample of an earlier rollout: returned as is, and its log-prob
        recomputed bit for bit (the same compiled graph as the rollout).
    :returns: :class:`flowseam.ops.SDEStepOutput` ``(sample, log_prob (B,), mean, std)``:
        ``sample`` in ``x``'s dtype; ``mean``, ``std`` and ``log_prob`` in the compute dtype
        (float32, float64 for float64 ``x``), the dtype rules of the cpu backend.

    C2 by construction: the rollout draws the sample (one fused pass over x, v and noise), then
    computes ``mean`` and ``log_prob`` from the *returned* sample with the same compiled
    function a recompute from ``prev_sample`` runs, so the two agree bit for bit (at the price
    of one more read of x and v per rollout step). That function runs inside a
    ``torch.autograd.Function`` with the analytic backward, so a recompute that records
    gradients runs the same inference graph; gradients reach the log-prob through ``mean`` only
    (Flow-GRPO).
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    if noise_level == 0.0:  # deterministic: the Euler mean, log-prob 0 (flowseam.ops contract)
        return deterministic_sde_step(x, v, sigma, sigma_next, prev_sample)
    ct = compute_dtype(x)
    dt = sigma_next - sigma
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    std = std_dev_t * math.sqrt(-dt)
    coef = torch.tensor(
        [1.0 + std_dev_t**2 * dt / (2.0 * sigma),                      # A
         (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt,    # B
         std,                                                          # STD
         -0.5 / std**2,                                                # NEG_HALF_INV_VAR
         math.log(std) + HALF_LOG_2PI],                               # LOG_NORM
        dtype=ct, device=x.device)

    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=ct, device=x.device)
        # the sample is not differentiated (it enters the log-density detached)
        sample = _SDE_SAMPLE(_flat(x, ct), _flat(v, ct), _flat(noise, ct), coef)
        sample = sample.to(x.dtype).reshape(x.shape)
    else:
        sample = prev_sample
    mean, log_prob = _MeanLogProb.apply(x, v, sample, coef)
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean,
                         std=torch.tensor(std, dtype=ct, device=x.device))


def flow_renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise``: the causal loop's re-noising of a predicted clean
    chunk to the next sigma (contract: :func:`flowseam.ops.reference.flow_renoise`), one fused
    compiled pass.

    :param x0: ``(B, ...)`` any float dtype; ``noise``: the same shape.
    :returns: ``x0``'s shape and dtype; the arithmetic is float32 (float64 for float64 ``x0``).
    :raises ValueError: on a shape mismatch or sigma outside [0, 1].
    """
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    coef = torch.tensor([1.0 - sigma, sigma], dtype=compute_dtype(x0), device=x0.device)
    return _Combine.apply(x0, noise, coef)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                   attention=None, scale: float | None = None) -> torch.Tensor:
    """Sequence-parallel self-attention by ring attention (Liu, Zaharia and Abbeel 2023, "Ring
    Attention with Blockwise Transformers for Near-Infinite Context", arXiv:2310.01889): the
    ``sequence_parallel_attention`` contract of :mod:`flowseam.ops`, without its all-to-all.

    Rank ``r`` of the ``N`` ranks of ``group`` keeps its rows ``q_r`` and attends to one block of
    keys and values at a time: at step ``t`` (``0 <= t < N``) it holds ``(k_j, v_j)`` of rank
    ``j = (r - t) mod N`` and, while it computes, sends that block to rank ``r + 1`` and receives
    the next from rank ``r - 1`` (``torch.distributed.batch_isend_irecv``; the k/v blocks travel
    around the ring, the queries and the running result never move). Blockwise online softmax
    with log-sum-exp merging (Milakov and Gimelshein 2018; the blockwise form of Rabe and
    Staats 2021 and FlashAttention), in the compute dtype::

        S_j   = scale * q_r k_j^T                       (B, H, S/N, S/N)
        lse_j = log sum_cols exp(S_j)                   (B, H, S/N, 1)
        o_j   = exp(S_j - lse_j) v_j                    (the block's softmax attention)
        lse   = logaddexp(lse, lse_j)
        o     = exp(lse_old - lse) o + exp(lse_j - lse) o_j

    After ``N`` blocks ``o = softmax(scale * q_r K^T) V`` over the whole sequence: the rows of the
    unsplit call, exactly up to rounding. Memory per rank is one ``(S/N) x (S/N)`` score block,
    never ``S/N x S``; each rank sends ``(N-1) * B*H*(S/N)*(D+Dv) * itemsize`` bytes per call
    (Ulysses: ``4 (N-1)/N`` of one q/k/v/output block), in ``N-1`` messages to one neighbour.
    Nothing is asked of the heads: any number of heads splits over any ``N``.

    :param q: this rank's rows ``(B, H, S/N, D)``; ``k``: the same shape; ``v``:
        ``(B, H, S/N, Dv)``; any float dtype, every rank the same shapes (a collective).
    :param group: the torch.distributed process group of the ``N`` ranks sharing the sequence.
    :param attention: the platform's ``attention`` kernel; not used (the blocks are computed
        here, with their log-sum-exp, which the ``attention`` op does not return).
    :param scale: the softmax scale, default ``1 / sqrt(D)``.
    :returns: ``(B, H, S/N, Dv)`` in ``q``'s dtype; the arithmetic is float32 (float64 for
        float64 ``q``).
    :raises ValueError: (``InvalidInputError``) for q/k/v that are not 4-d with matching batch,
        heads and head dims, k with other rows than q, or a tensor that requires grad (forward
        only, as the contract says).
    """
    import torch.distributed as dist

    n = dist.get_world_size(group)
    check_sequence_parallel_attention(q, k, v, n, heads_split=False)
    ct = compute_dtype(q)
    d = q.shape[-1]
    qs = q.to(ct) * (1.0 / math.sqrt(d) if scale is None else float(scale))
    kv = torch.cat([k, v.to(k.dtype)], dim=-1).contiguous()  # one message per step
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    me = ranks.index(dist.get_rank())
    after, before = ranks[(me + 1) % n], ranks[(me - 1) % n]
    # gloo moves CPU tensors only: a CUDA tensor on a gloo group travels through host memory
    staged = kv.device.type != "cpu" and _backend_for(group, kv.device) == "gloo"
    out = lse = None
    for step in range(n):
        pending = None
        if step < n - 1:
            send = kv.cpu() if staged else kv
            recv = torch.empty_like(send)
            pending = (recv, dist.batch_isend_irecv([
                dist.P2POp(dist.isend, send, after, group),
                dist.P2POp(dist.irecv, recv, before, group)]))
        kb, vb = kv[..., :d].to(ct), kv[..., d:].to(ct)
        scores = qs @ kb.transpose(-1, -2)
        block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        block_out = torch.exp(scores - block_lse) @ vb
        if out is None:
            out, lse = block_out, block_lse
        else:
            merged = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
            lse = merged
        if pending is not None:
            recv, works = pending
            for work in works:
                work.wait()
            kv = recv.to(kv.device) if staged else recv
    return out.to(q.dtype)


def _backend_for(group, device: torch.device) -> str:
    """The torch.distributed backend that moves ``device`` tensors on ``group`` ("gloo",
    "nccl", ...)."""
    import torch.distributed as dist

    name = str(dist.get_backend(group))
    if ":" not in name:  # one backend for every device
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    return by_device.get(device.type, name)


#: the op contract's word for a kernel that runs any number of heads over the ranks (flowseam
#: then does not refuse a split whose heads ``sp`` does not divide)
ring_attention.any_heads = True
