"""cupy fused kernels for the solver ops, on torch tensors shared zero-copy through DLPack.

Registered at arch ``sm80`` (they convert bf16 with the ``cvt.rn.bf16.f32`` instruction that
Ampere introduced), so every GPU of capability 8.0 or newer resolves to them through its arch
chain. cupy is imported on first use, never at import time. Inputs and outputs are torch
tensors (outputs allocated by torch's caching allocator) that cupy views without a copy
(:func:`_view`), and every launch runs on torch's *current* stream (:func:`_on_torch_stream`),
so the kernels are ordered with the surrounding torch work without any synchronization.
``flow_match_step`` is one elementwise pass; ``flow_sde_step`` one pass plus a deterministic
per-sample reduction, so that the recomputed log-prob equals the rollout's bit for bit (C2;
:func:`flow_sde_step` says how). Both run inside ``torch.autograd.Function`` s whose backward
is the analytic gradient, written with torch ops: the Euler step and the SDE step's ``mean``
are linear in x and v, and the sample enters the log-density detached, as in Flow-GRPO.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import numpy as np
import torch
from flowseam.ops import SDEStepOutput, as_sigma, check_sigmas, check_step_tensors, sde_std_dev_t
from flowseam.ops.eager import deterministic_sde_step

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_BLOCK = 256            # threads per block (the reduction tree assumes a power of two)
_ITEMS = 4              # elements per thread per sample the SDE grid aims for
_MAX_CHUNKS = 8192      # blocks per sample, at most (grid x)


@functools.cache
def _cupy():
    return importlib.import_module("cupy")


# -- CUDA source -------------------------------------------------------------------------------
# Storage types and conversions per torch dtype: (C storage type, load -> compute, store <- compute)
# 16-bit floats travel as unsigned short bits; compute is float (CT), or double for float64 x.
_STORAGE = {
    torch.float32: ("float", "((CT)({}))", "((float)({}))"),
    torch.float64: ("double", "((CT)({}))", "((double)({}))"),
    torch.bfloat16: ("unsigned short", "((CT)bf16_to_f32({}))", "f32_to_bf16((float)({}))"),
    torch.float16: ("unsigned short", "((CT)f16_to_f32({}))", "f32_to_f16((float)({}))"),
}

_PRELUDE = r"""
__device__ __forceinline__ float bf16_to_f32(unsigned short u) {
    return __uint_as_float(((unsigned int)u) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {   /* round to nearest even, sm80+ */
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
__device__ __forceinline__ float f16_to_f32(unsigned short u) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u)); return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
"""

_FLOW_MATCH_STEP = r"""
extern "C" __global__ void flow_match_step(const X_T* __restrict__ x, const V_T* __restrict__ v,
                                           X_T* __restrict__ out, const long long n, const CT dt) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = STORE_X(FMA(dt, LOAD_V(v[i]), LOAD_X(x[i])));
    }
}
"""

# grid (chunks, B), block BLOCK: block (c, b) handles elements c*BLOCK + t, stepping by
# chunks*BLOCK, of sample b, and writes the sum of their log-densities to partial[b, c].
_FLOW_SDE_STEP = r"""
extern "C" __global__ void flow_sde_step(
        const X_T* __restrict__ x, const V_T* __restrict__ v, const N_T* __restrict__ noise_or_prev,
        X_T* __restrict__ sample, CT* __restrict__ mean, CT* __restrict__ partial,
        const long long n, const CT a, const CT b, const CT std, const CT neg_half_inv_var,
        const CT log_norm, const int has_prev) {
    __shared__ CT acc[BLOCK];
    const long long base = (long long)blockIdx.y * n;
    const long long stride = (long long)gridDim.x * BLOCK;
    CT sum = 0;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += stride) {
        const long long j = base + i;
        const CT m = FMA(LOAD_X(x[j]), a, MUL(LOAD_V(v[j]), b));
        CT s;
        if (has_prev) {
            s = LOAD_N(noise_or_prev[j]);
        } else {
            const X_T stored = STORE_X(FMA(std, LOAD_N(noise_or_prev[j]), m));
            sample[j] = stored;
            s = LOAD_X(stored);                       /* the log-density sees the stored sample */
        }
        mean[j] = m;
        const CT d = s - m;
        sum += FMA(MUL(d, d), neg_half_inv_var, -log_norm);
    }
    acc[threadIdx.x] = sum;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {         /* fixed tree: deterministic */
        if (threadIdx.x < k) acc[threadIdx.x] += acc[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.y * gridDim.x + blockIdx.x] = acc[0];
}
"""


def kernel_source(body: str, x: torch.dtype, v: torch.dtype, n: torch.dtype | None = None) -> str:
    """The CUDA C++ source of ``body`` specialized for storage dtypes x, v, n (noise or
    prev_sample). Compute type CT is double for float64 x, else float. Pure string work
    (testable without a GPU).

    :raises TypeError: for a dtype the kernels do not handle (not a float type).
    """
    for name, dtype in (("x", x), ("v", v), ("noise/prev_sample", n)):
        if dtype is not None and dtype not in _STORAGE:
            raise TypeError(f"the cupy kernels take float32/float64/bfloat16/float16 tensors; "
                            f"{name} is {dtype}")
    double = x == torch.float64
    lines = [f"#define BLOCK {_BLOCK}", f"#define CT {'double' if double else 'float'}",
             "#define FMA(a, b, c) " + ("__fma_rn((a), (b), (c))" if double else "__fmaf_rn((a), (b), (c))"),
             "#define MUL(a, b) " + ("__dmul_rn((a), (b))" if double else "__fmul_rn((a), (b))")]
    for tag, dtype in (("X", x), ("V", v), ("N", n if n is not None else x)):
        ctype, load, store = _STORAGE[dtype]
        lines += [f"#define {tag}_T {ctype}", f"#define LOAD_{tag}(u) {load.format('(u)')}",
                  f"#define STORE_{tag}(f) {store.format('(f)')}"]
    return "\n".join(lines) + "\n" + _PRELUDE + body


@functools.cache
def _kernel(name: str, x: torch.dtype, v: torch.dtype, n: torch.dtype | None):
    """The compiled ``cupy.RawKernel`` (NVRTC on first launch, then cupy's on-disk cache)."""
    body = {"flow_match_step": _FLOW_MATCH_STEP, "flow_sde_step": _FLOW_SDE_STEP}[name]
    return _cupy().RawKernel(kernel_source(body, x, v, n), name)


# -- torch <-> cupy ----------------------------------------------------------------------------

def _view(t: torch.Tensor):
    """A zero-copy cupy view of contiguous ``t`` (``cupy.from_dlpack``); 16-bit floats as their
    int16 bits, since cupy has no bfloat16 dtype (the kernels convert them). Detached: DLPack
    refuses tensors that require grad (the autograd Functions below handle gradients)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return _cupy().from_dlpack(t)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """Make torch's current stream on ``device`` cupy's current stream (wrapped in a
    ``cupy.cuda.ExternalStream``)."""
    cp = _cupy()
    with cp.cuda.Device(device.index):
        with cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
            yield


def _check_cuda(**tensors: torch.Tensor | None) -> torch.device:
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"the cuda backend's kernels take CUDA tensors; {name} is on {t.device}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}; move them to one GPU")
        device = device or t.device
    return device


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scalar(value: float, ct: torch.dtype):
    return np.float64(value) if ct == torch.float64 else np.float32(value)


# -- flow_match_step ---------------------------------------------------------------------------

def flow_match_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """``x + (sigma_next - sigma) * v`` in one pass (float32 arithmetic, float64 for float64 x):
    one fused multiply-add per element, stored in ``x``'s dtype; reads x and v once, writes the
    output once.

    :param x: latents ``(B, ...)`` on a GPU, float32/float64/bfloat16/float16; ``v`` the same
        shape, any of those dtypes.
    :returns: a new tensor of ``x``'s shape and dtype.
    :raises ValueError: shape mismatch, sigmas outside the contract, or non-CUDA tensors.
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    _check_cuda(x=x, v=v)
    return _EulerStep.apply(x.contiguous(), v.contiguous(), sigma_next - sigma)


def _euler_launch(x: torch.Tensor, v: torch.Tensor, dt: float) -> torch.Tensor:
    """One launch of the Euler kernel on contiguous CUDA tensors."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    if n == 0:
        return out
    kernel = _kernel("flow_match_step", x.dtype, v.dtype, None)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(-(-n // _BLOCK), sms * 32)
    with _on_torch_stream(x.device):
        kernel((grid,), (_BLOCK,), (_view(x), _view(v), _view(out), np.int64(n),
                                    _scalar(dt, _compute_dtype(x))))
    return out


class _EulerStep(torch.autograd.Function):
    """The Euler kernel with its backward: d out / d x = 1, d out / d v = dt."""

    @staticmethod
    def forward(ctx, x, v, dt):
        ctx.dt, ctx.input_dtypes = dt, (x.dtype, v.dtype)
        return _euler_launch(x, v, dt)

    @staticmethod
    def backward(ctx, grad_out):
        x_dtype, v_dtype = ctx.input_dtypes
        ct = torch.float64 if x_dtype == torch.float64 else torch.float32
        return (grad_out.to(x_dtype) if ctx.needs_input_grad[0] else None,
                (grad_out.to(ct) * ctx.dt).to(v_dtype) if ctx.needs_input_grad[1] else None, None)


# -- flow_sde_step -----------------------------------------------------------------------------

def _sde_launch(x: torch.Tensor, v: torch.Tensor, noise_or_prev: torch.Tensor, has_prev: bool,
                coef: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of the SDE kernel on contiguous (B, ...) tensors.

    :returns: ``(sample, mean, log_prob)``; sample is ``noise_or_prev`` itself when ``has_prev``.
    """
    ct = _compute_dtype(x)
    batch = x.shape[0]
    n = x.numel() // batch if batch else 0
    mean = torch.empty(x.shape, dtype=ct, device=x.device)
    sample = noise_or_prev if has_prev else torch.empty_like(x)
    if n == 0:
        return sample, mean, torch.zeros(batch, dtype=ct, device=x.device)
    chunks = max(1, min(-(-n // (_BLOCK * _ITEMS)), _MAX_CHUNKS))
    partial = torch.empty((batch, chunks), dtype=ct, device=x.device)
    kernel = _kernel("flow_sde_step", x.dtype, v.dtype, noise_or_prev.dtype)
    with _on_torch_stream(x.device):
        kernel((chunks, batch), (_BLOCK,),
               (_view(x), _view(v), _view(noise_or_prev), _view(sample), _view(mean), _view(partial),
                np.int64(n), *(_scalar(c, ct) for c in coef), np.int32(1 if has_prev else 0)))
    log_prob = (partial.sum(dim=1, dtype=torch.float64) / n).to(ct)
    return sample, mean, log_prob


class _SDEStep(torch.autograd.Function):
    """The SDE kernel with its analytic backward: gradients reach ``mean`` and ``log_prob``
    through x and v only (the sample is not differentiable)."""

    @staticmethod
    def forward(ctx, x, v, noise_or_prev, has_prev, coef):
        sample, mean, log_prob = _sde_launch(x.detach(), v.detach(), noise_or_prev.detach(),
                                             has_prev, coef)
        ctx.mark_non_differentiable(sample)
        ctx.save_for_backward(sample, mean)
        ctx.coef = coef
        ctx.input_dtypes = (x.dtype, v.dtype)
        return sample, mean, log_prob

    @staticmethod
    def backward(ctx, _grad_sample, grad_mean, grad_log_prob):
        sample, mean = ctx.saved_tensors
        a, b, std = ctx.coef[:3]
        n = mean[0].numel()
        # d log_prob_b / d mean_bi = (sample_bi - mean_bi) / (N std^2)
        diff = sample.to(mean.dtype) - mean
        shape = (-1,) + (1,) * (mean.dim() - 1)
        g = grad_mean + grad_log_prob.reshape(shape) * diff * (1.0 / (n * std * std))
        x_dtype, v_dtype = ctx.input_dtypes
        return ((g * a).to(x_dtype) if ctx.needs_input_grad[0] else None,
                (g * b).to(v_dtype) if ctx.needs_input_grad[1] else None, None, None, None)


def flow_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, *,
                  noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: torch.Generator | None = None) -> SDEStepOutput:
    """Flow-GRPO's SDE step with log-prob in one fused pass (formulas in :mod:`flowseam.ops`).

    One kernel reads x, v and noise (or ``prev_sample``) once and writes ``sample`` (x's dtype)
    and ``mean`` (float32), and each thread block reduces the log-densities of its slice of one
    sample to a partial sum; a second, tiny step adds each sample's partials in float64 and
    divides by the element count. The log-density is computed from the *stored* sample (rounded
    to x's dtype and read back), so the recompute with ``prev_sample`` runs the same code on the
    same bits. The reduction is deterministic (a fixed tree inside each block, a fixed grid for
    a given shape, no atomics), and ``mean`` uses explicit ``__fmaf_rn`` / ``__fmul_rn``, so the
    compiler cannot contract the two paths differently: the recomputed log-prob equals the
    rollout's bit for bit (C2).

    :param x: latents ``(B, ...)`` on a GPU; ``v``, ``noise``, ``prev_sample`` the same shape.
    :param noise: drawn with ``torch.randn(generator=...)`` (float32, x's device) when neither it
        nor ``prev_sample`` is given: the same draw as the torch fallback.
    :returns: :class:`flowseam.ops.SDEStepOutput` ``(sample, log_prob (B,), mean, std)``.
    :raises ValueError: as every backend (flowseam.ops), or for non-CUDA tensors.
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    _check_cuda(x=x, v=v, noise=noise, prev_sample=prev_sample)
    if noise_level == 0.0:  # deterministic: the Euler mean, log-prob 0 (flowseam.ops contract)
        return deterministic_sde_step(x, v, sigma, sigma_next, prev_sample)
    ct = _compute_dtype(x)
    dt = sigma_next - sigma
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    std = std_dev_t * math.sqrt(-dt)
    coef = (1.0 + std_dev_t**2 * dt / (2.0 * sigma),                    # a: mean = a x + b v
            (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt,  # b
            std,
            -0.5 / std**2,                                              # log N = d^2 (-1/2std^2)
            math.log(std) + _HALF_LOG_2PI)                              #         - log_norm
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=ct, device=x.device)
        source, has_prev = noise, False
    else:
        source, has_prev = prev_sample, True
    sample, mean, log_prob = _SDEStep.apply(x.contiguous(), v.contiguous(), source.contiguous(),
                                            has_prev, coef)
    if has_prev:
        sample = prev_sample  # returned as given, like every backend
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean,
                         std=torch.tensor(std, dtype=ct, device=x.device))
