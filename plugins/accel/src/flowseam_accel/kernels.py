"""accel's solver kernels: the op contracts of :mod:`flowseam.ops`, fused by inductor.

Each public function validates its arguments exactly like every other backend
(:func:`flowseam.ops.check_step_tensors`, :func:`flowseam.ops.check_sigmas`), computes the
scalar coefficients of the step in Python float64, and hands the tensor arithmetic to a small
compiled function that inductor fuses into one loop over the latents.

The Euler step on the CPU is the exception: it is cpu's eager kernel
(:func:`flowseam.ops.eager.flow_match_step`), nothing compiled. ``x + dt * v`` in float32 is one
ATen call, ``torch.add(x, v, alpha=dt)``, which already makes a single vectorized pass over x and
v; a fused kernel cannot do less work, and calling a package costs more. Measured with
``bench/accel_kernels.py`` (2026-12-02 03:16 UTC, one torch thread, load 2.8), float32 per call,
the Euler package alone (without accel's checks and autograd wrapper) against cpu's eager call:
53.6 vs 13.6 µs at the bench's latents (2, 16, 5, 8, 8) and 2.61 vs 2.49 ms at a Wan 480p latent
(1, 16, 21, 60, 104); through accel's whole former path (checks, autograd wrapper, package),
215 vs 27 µs and 3.24 vs 2.55 ms (03:11 UTC, load 2.6). So the package saved nothing at any
size. It was also a quarter of accel's cold start: 12.5 of the 53.2 CPU s of the cold first
generation of ``bench/backends.py`` (03:12 UTC, load 2.9), 10.5 of them compiling the package's
C++ wrapper, a fixed cost of every AOTInductor package however small its kernel. On the CPU
accel's Euler step is therefore cpu's, bit for bit, in every dtype. The other kernels do save
time and stay compiled: at the Wan 480p latent ``flow_renoise`` 3.38 vs 5.73 ms and
``flow_sde_step`` 13.0 vs 34.7 ms (the same run of ``bench/accel_kernels.py``).

Two ways to run the compiled functions (:func:`flowseam_accel.compiled.compile_function`)
    **On the CPU in float32** (accel's DiTs are float32, so every rollout and update of a loop on
    accel, and the causal loop's re-noising): an AOTInductor package per function (``torch.export`` with the
    flattened size ``N``, and the batch ``B`` of the log-prob, dynamic from 1 up, no upper bound),
    compiled once into accel's package store (:mod:`flowseam_accel.store`, next to the DiT
    blocks' packages) and loaded by every later process in milliseconds, without dynamo: a
    warm-cache start traces nothing. **Elsewhere** (another device, float64, a size of 0,
    ``FLOWSEAM_ACCEL_AOT=0``, or a package whose export failed): ``torch.compile``. float64 has no
    package because each costs 10-15 s of C++ compiling per cache and only tests and oracles step
    float64 latents. Either way the seconds are booked by :mod:`flowseam_accel.compiled` (a
    package built or loaded counts as a compile).

Four choices keep the compiled code from being rebuilt during a denoising run, or ever more than
a few times:

* **Scalars travel as tensors.** ``dt``, the SDE coefficients and ``std`` are packed into a
  small tensor in the compute dtype, so a new sigma is new *data*, not a new graph (a Python
  float argument would be specialized into the graph and recompile at every step).
* **Latents travel flattened and detached.** ``(B, C, F, H, W)`` becomes ``(B*C*F*H*W,)`` (or
  ``(B, C*F*H*W)`` where the log-prob needs the batch), so one graph serves every latent rank;
  and ``detach()`` turns the flattened view into a plain tensor, because dynamo guards on the
  *base* of a view input (feeding a step's output back in would otherwise recompile). Gradients
  are not lost: both ops run inside ``torch.autograd.Function`` s with analytic backwards.
* **Graphs see only the compute dtype** (float32, or float64 for float64 latents). Storage
  dtypes are converted outside, in eager torch: a no-op for float32, the dtype accel's own
  components produce, and one extra pass for bf16/fp16 latents or velocities. Without this every
  (x, v, noise) dtype combination is its own graph, and dynamo's recompile limit (8 per
  function) is reached quickly.
* **Shapes are dynamic** (``dynamic=True``; the packages' sizes from 1 up): one graph per compute
  dtype serves every batch size and resolution (``torch.compile`` specializes sizes 0 and 1, and
  inductor's reduction codegen may add a size-range guard, so its log-prob graph can recompile
  once for a very different resolution; a package serves any size from 1 up).

Dtype rules (shared with the cpu backend): the arithmetic is float32 (float64 when ``x`` is
float64); the Euler step and the SDE sample come back in ``x``'s dtype; ``mean``, ``std`` and
``log_prob`` in the compute dtype.

C2 by construction (``flow_sde_step``). The log-prob of a rollout must be reproduced bit for bit
when it is recomputed from ``prev_sample``. Rather than hoping that two differently fused graphs
round identically, both paths compute ``mean`` and ``log_prob`` with the *same* compiled
function from the *returned* sample (the same package or graph: which one runs depends only on
the arguments' device, dtypes and sizes and on the package store, never on the grad mode): the
rollout first draws the sample (one fused pass over x, v and noise), then runs that function on
(x, v, sample) exactly as the recompute does. The
price is one extra read of x and v per rollout step. That function runs inside a
``torch.autograd.Function`` with the analytic backward (``mean`` is linear in x and v), so a
recompute that records gradients still runs the same inference graph; gradients reach the
log-prob only through ``mean``, never through the sample (Flow-GRPO).
"""

from __future__ import annotations

import math

import torch
from flowseam.ops import SDEStepOutput, as_sigma, check_renoise, check_sigmas, check_step_tensors, sde_std_dev_t
from flowseam.ops.eager import HALF_LOG_2PI as _HALF_LOG_2PI
from flowseam.ops.eager import compute_dtype as _compute_dtype
from flowseam.ops.eager import deterministic_sde_step
from flowseam.ops.eager import flow_match_step as eager_flow_match_step

from .compiled import compile_function


# No fullgraph=True: these functions have no graph breaks (the tests count their graphs), and
# should dynamo ever refuse one, running it eagerly beats failing a denoising run.
_OPTIONS = {"dynamic": True}

# Indices into the SDE coefficient tensor (compute dtype):
#   mean = x * A + v * B;  sample = mean + STD * noise;
#   log N(s; mean, STD^2) = (s - mean)^2 * NEG_HALF_INV_VAR - LOG_NORM
_A, _B, _STD, _NEG_HALF_INV_VAR, _LOG_NORM = range(5)


def _flat(t: torch.Tensor, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
    """``t`` as ``(-1,)`` (or ``(rows, -1)``) in ``dtype``, detached: a plain tensor, not a
    view (see the module docstring). Free for a contiguous tensor already in ``dtype``."""
    flat = t.reshape(-1) if rows is None else t.reshape(rows, -1)
    return flat.detach().to(dtype)


# -- the compiled arithmetic -------------------------------------------------------------------
# Plain torch functions of compute-dtype tensors; compile_function() compiles each on first use
# and books its compile time apart from its run time (see flowseam_accel.compiled).

def _euler(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """x, v: (N,); dt: 0-dim -> (N,)."""
    return x + dt * v


def _sde_sample(x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
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
    """Gradients of (mean, log_prob) with respect to x and v; all (B, N) but grad_log_prob (B,).

    d log_prob_b / d mean_bi = (sample_bi - mean_bi) / (N std^2) = -2 NEG_HALF_INV_VAR diff / N;
    d mean / d x = A, d mean / d v = B.
    """
    diff = sample - mean
    scale = -2.0 * coef[_NEG_HALF_INV_VAR] / mean.shape[1]
    g = grad_mean + grad_log_prob[:, None] * (diff * scale)
    return g * coef[_A], g * coef[_B]


def _renoise(x0: torch.Tensor, noise: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """x0, noise: (N,); coef: (1 - sigma, sigma) -> (N,)."""
    return x0 * coef[0] + noise * coef[1]


# Packages (flowseam_accel.compiled.AOTFunction) for the CPU calls: one per function, the
# flattened sizes dynamic (the coefficient tensors keep theirs). float32 only: each package costs
# 10-15 s of C++ compiling once per cache, and float64 latents are what tests and oracles use,
# never accel's float32 DiTs; float64 calls keep the torch.compile path.
_N, _BN = ("N",), ("B", "N")
_AOT_DTYPES = (torch.float32,)


def _kernel(fn, name: str, *dims: tuple):
    return compile_function(fn, name, aot=dims, aot_dtypes=_AOT_DTYPES, **_OPTIONS)


# The Euler step's CPU calls never get here (cpu's eager kernel, see the module docstring), so
# it has no package: other devices only.
_EULER = compile_function(_euler, "flow_match_step", **_OPTIONS)
_RENOISE = _kernel(_renoise, "flow_renoise", _N, _N, (None,))
_SDE_SAMPLE = _kernel(_sde_sample, "flow_sde_step.sample", _N, _N, _N, (None,))
_SDE_MEAN_LOG_PROB = _kernel(_sde_mean_log_prob, "flow_sde_step.log_prob", _BN, _BN, _BN, (None,))
_SDE_BACKWARD = _kernel(_sde_backward, "flow_sde_step.backward", _BN, ("B",), _BN, _BN, (None,))


class _EulerStep(torch.autograd.Function):
    """``_euler`` with its backward (d out / d x = 1, d out / d v = dt), so the step stays
    differentiable although the compiled graph only ever sees detached tensors."""

    @staticmethod
    def forward(ctx, x, v, dt):
        ctx.save_for_backward(dt)
        ctx.input_dtypes = (x.dtype, v.dtype)
        out = _EULER(_flat(x, dt.dtype), _flat(v, dt.dtype), dt)
        return out.to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        (dt,) = ctx.saved_tensors
        x_dtype, v_dtype = ctx.input_dtypes
        return (grad_out.to(x_dtype) if ctx.needs_input_grad[0] else None,
                (grad_out.to(dt.dtype) * dt).to(v_dtype) if ctx.needs_input_grad[1] else None, None)


class _Renoise(torch.autograd.Function):
    """``_renoise`` with its backward (d out / d x0 = 1 - sigma, d out / d noise = sigma)."""

    @staticmethod
    def forward(ctx, x0, noise, coef):
        ctx.save_for_backward(coef)
        ctx.input_dtypes = (x0.dtype, noise.dtype)
        out = _RENOISE(_flat(x0, coef.dtype), _flat(noise, coef.dtype), coef)
        return out.to(x0.dtype).reshape(x0.shape)

    @staticmethod
    def backward(ctx, grad_out):
        (coef,) = ctx.saved_tensors
        x0_dtype, noise_dtype = ctx.input_dtypes
        g = grad_out.to(coef.dtype)
        return ((g * coef[0]).to(x0_dtype) if ctx.needs_input_grad[0] else None,
                (g * coef[1]).to(noise_dtype) if ctx.needs_input_grad[1] else None, None)


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

def flow_match_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """``x + (sigma_next - sigma) * v`` (diffusers ``FlowMatchEulerDiscreteScheduler.step``).

    :param x: latents ``(B, ...)``, any float dtype; ``v``: velocity of the same shape.
    :returns: ``x``'s shape and dtype; the arithmetic is float32 (float64 for float64 ``x``).
    :raises ValueError: on a shape mismatch or sigmas outside the contract (see flowseam.ops).

    On the CPU this is cpu's eager kernel (:func:`flowseam.ops.eager.flow_match_step`, one ATen
    pass for float32), measured faster than a compiled one (module docstring); elsewhere the
    compiled ``_euler``.
    """
    if x.device.type == "cpu":
        return eager_flow_match_step(x, v, sigma, sigma_next)
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    dt = torch.tensor(sigma_next - sigma, dtype=_compute_dtype(x), device=x.device)
    return _EulerStep.apply(x, v, dt)


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
    :returns: :class:`flowseam.ops.SDEStepOutput` ``(sample, log_prob (B,), mean, std)``.
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    if noise_level == 0.0:  # deterministic: the Euler mean, log-prob 0 (flowseam.ops contract)
        return deterministic_sde_step(x, v, sigma, sigma_next, prev_sample)
    ct = _compute_dtype(x)
    dt = sigma_next - sigma
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    std = std_dev_t * math.sqrt(-dt)
    coef = torch.tensor(
        [1.0 + std_dev_t**2 * dt / (2.0 * sigma),                      # A
         (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt,    # B
         std,                                                          # STD
         -0.5 / std**2,                                                # NEG_HALF_INV_VAR
         math.log(std) + _HALF_LOG_2PI],                               # LOG_NORM
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
    chunk to the next sigma (contract in :mod:`flowseam.ops`), one fused compiled pass.

    :param x0: ``(B, ...)`` any float dtype; ``noise``: the same shape.
    :returns: ``x0``'s shape and dtype; the arithmetic is float32 (float64 for float64 ``x0``).
    :raises ValueError: on a shape mismatch or sigma outside [0, 1].
    """
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    coef = torch.tensor([1.0 - sigma, sigma], dtype=_compute_dtype(x0), device=x0.device)
    return _Renoise.apply(x0, noise, coef)
