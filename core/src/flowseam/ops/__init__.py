"""Op names, the argument checks every implementation shares, and where each op's contract is.

An op is a named operation with a written contract: a backend registers callables for it
(:func:`flowseam.seam.hookspecs.flowseam_register_kernels`), a loop gets the resolved one from
``platform.kernels.get(op)``, once per run. Each op's contract (formula and source, shapes,
edge cases, what is refused) is the docstring of its numpy float64 oracle, the function of the
same name in :mod:`flowseam.ops.reference`, against which the conformance suite checks every
kernel; ``SEQUENCE_PARALLEL_ATTENTION``, a collective with no oracle, has its contract below.

Every kernel validates its arguments first with the ``check_*`` functions here (a bad argument
raises ``ValueError`` naming it), takes one scalar sigma per call, accepts any float dtype and
computes in float32 or wider (float64 for float64 input); its sample or output comes back in the
first tensor's dtype (statistics such as a log-prob in the compute dtype), on that tensor's
device. :mod:`flowseam.ops.eager` implements every contract in eager torch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..errors import InvalidInputError

#: The Euler step of the flow ODE; contract: :func:`flowseam.ops.reference.flow_match_step`.
FLOW_MATCH_STEP = "flow_match_step"
#: Flow-GRPO's SDE step with its log-prob; contract: :func:`flowseam.ops.reference.flow_sde_step`.
FLOW_SDE_STEP = "flow_sde_step"
#: One UniPC step, its history explicit state; contract: :func:`flowseam.ops.reference.unipc_step`.
UNIPC_STEP = "unipc_step"
#: Scaled dot-product attention; contract: :func:`flowseam.ops.reference.attention`.
ATTENTION = "attention"
#: A chunk's attention over a KV cache; contract: :func:`flowseam.ops.reference.cached_attention`.
CACHED_ATTENTION = "cached_attention"
#: Re-noising to a sigma; contract: :func:`flowseam.ops.reference.flow_renoise`.
FLOW_RENOISE = "flow_renoise"
#: Self-attention over a sequence split across ranks. It is a collective, so it has no numpy
#: oracle; its contract is here (the conformance suite runs it on 2 ranks and compares the
#: joined halves with :func:`flowseam.ops.reference.attention` on the whole sequence):
#:
#: ``attn(q, k, v, *, group, attention, scale=None)``: self-attention over a sequence split
#: across the ranks of the torch.distributed process group ``group`` (``N = group.size()``
#: ranks). Rank ``r`` passes its contiguous shard, rows ``[r * S/N, (r + 1) * S/N)`` of q, k and
#: v, each ``(B, heads, S/N, head_dim)`` (every rank the same shape), and gets back the same
#: rows of the unsplit call, in ``q``'s dtype::
#:
#:     attention(cat_r(q_r), cat_r(k_r), cat_r(v_r), scale=scale)[:, :, r*S/N:(r+1)*S/N]
#:
#: ``attention`` is the platform's resolved ``ATTENTION`` kernel: an implementation that
#: decomposes the call (Ulysses' all-to-all, DeepSpeed-Ulysses, Jacobs et al. 2023: trade the
#: sequence split for a head split, attend, trade back) runs its full-sequence part with it; a
#: fused one (ring attention, Liu et al. 2023) may ignore it. No mask (the split DiTs'
#: self-attention has none). Every rank of ``group`` calls it with the same shapes (a
#: collective). ``heads`` must be a multiple of ``N`` for an all-to-all implementation, which
#: raises ``ValueError`` naming both otherwise; an implementation that runs any number of heads
#: (ring attention) says so with the function attribute ``any_heads = True``, and flowseam then
#: does not refuse such a split before loading. Forward only: a tensor that requires grad is
#: refused (flowseam splits generation and rollouts; a training update runs each sample's full
#: sequence on one rank). Arguments are checked with :func:`check_sequence_parallel_attention`.
SEQUENCE_PARALLEL_ATTENTION = "sequence_parallel_attention"

#: Every op flowseam defines a contract for. Plugins may register only these.
ALL_OPS = (FLOW_MATCH_STEP, FLOW_SDE_STEP, UNIPC_STEP, ATTENTION, CACHED_ATTENTION, FLOW_RENOISE,
           SEQUENCE_PARALLEL_ATTENTION)

#: The solver ops: a loop picks its steps from them once, before the first step, from the
#: model's resolved solver (flowseam.schedulers); stochastic sampling is ``FLOW_MATCH_STEP`` to
#: sigma 0 followed by ``FLOW_RENOISE`` to the next sigma.
SOLVER_OPS = (FLOW_MATCH_STEP, UNIPC_STEP, FLOW_SDE_STEP, FLOW_RENOISE)

#: The highest UniPC order flowseam implements.
UNIPC_MAX_ORDER = 3


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


class UniPCState(NamedTuple):
    """The history a ``UNIPC_STEP`` kernel carries from one step to the next (oldest first).

    :ivar sigmas: the sigmas of the stored model outputs, strictly decreasing (Python floats).
    :ivar outputs: the data predictions ``x - sigma * v`` at those sigmas, the latents' shape, in
        the compute dtype (at most ``order`` of them after a step).
    :ivar last_sample: the (corrected) latents the last predictor started from, x's dtype; None
        before the first step.
    :ivar last_order: the order of the last predictor (the next corrector uses it); 0 at first.
    """

    sigmas: tuple
    outputs: tuple
    last_sample: Any
    last_order: int

    @classmethod
    def empty(cls) -> "UniPCState":
        """The state before the first step."""
        return cls((), (), None, 0)


class UniPCStepOutput(NamedTuple):
    """Result of a ``UNIPC_STEP`` kernel: ``sample`` (x's shape and dtype) and the new state."""

    sample: Any
    state: UniPCState


def unipc_order(index: int, num_steps: int, solver_order: int, lower_order_final: bool) -> int:
    """The UniPC order of step ``index`` (0-based) of ``num_steps``, as diffusers'
    ``UniPCMultistepScheduler.step`` chooses it: ``solver_order``, lowered while the history is
    short (warm-up: at most ``index + 1``) and, with ``lower_order_final``, on the last steps (at
    most ``num_steps - index``)."""
    order = min(solver_order, num_steps - index) if lower_order_final else solver_order
    return min(order, index + 1)


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
        raise InvalidInputError(f"sigma={sigma!r} is outside [0, 1]")
    if not (0.0 <= sigma_next <= 1.0) or math.isnan(sigma_next):
        raise InvalidInputError(f"sigma_next={sigma_next!r} is outside [0, 1]")
    if sigma_next > sigma:
        raise InvalidInputError(
            f"sigma_next={sigma_next!r} > sigma={sigma!r}: flow-matching steps go from noise "
            "(sigma=1) towards data (sigma=0), so sigma_next must be <= sigma")
    if not sde:
        return
    if sigma_next == sigma:
        raise InvalidInputError(
            f"sigma_next == sigma == {sigma!r}: the SDE step needs sigma_next < sigma "
            "(its std is std_dev_t * sqrt(sigma - sigma_next))")
    if not (0.0 <= noise_level < math.inf):
        raise InvalidInputError(
            f"noise_level={noise_level!r} must be finite and >= 0 (it scales the "
            "SDE step's std; 0 makes the step deterministic)")
    if noise_level == 0.0:
        return  # the deterministic step: no std, no sigma_max (see reference.flow_sde_step)
    if sigma == 1.0:
        if sigma_max is None:
            raise InvalidInputError(
                "sigma=1.0 needs sigma_max (the largest sigma < 1 of the schedule, Flow-GRPO's "
                "sigmas[1]): std_dev_t = noise_level*sqrt(sigma/(1 - sigma)) is infinite at 1")
        if not (0.0 < sigma_max < 1.0):
            raise InvalidInputError(f"sigma_max={sigma_max!r} must be in (0, 1)")
    if sde_std_dev_t(sigma, noise_level, sigma_max) * math.sqrt(sigma - sigma_next) < 1e-30:
        raise InvalidInputError(f"sigma={sigma!r}, sigma_next={sigma_next!r}: the SDE step's std "
                                "underflows to 0; its log-density is undefined")


def as_sigma(value: Any, name: str = "sigma") -> float:
    """A sigma given as a Python/numpy number or a 0-dim tensor, as a float.

    :raises ValueError: for strings, booleans or tensors with more than one element.
    """
    if isinstance(value, (str, bytes, bool)):
        raise InvalidInputError(f"{name}={value!r} must be a number in [0, 1]")
    shape = tuple(getattr(value, "shape", ()))
    if shape and math.prod(shape) > 1:
        raise InvalidInputError(
            f"{name} has shape {shape}: flow steps take one scalar {name} for the whole batch "
            "(flowseam's loops step every row on one schedule, and its trainers recompute one "
            "BehaviorRecord at a time); group the rows by sigma and call the step once per group")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidInputError(f"{name}={value!r} must be a number in [0, 1] (a float or a "
                                "one-element tensor)") from None


def check_step_tensors(x: Any, v: Any, noise: Any = None, prev_sample: Any = None) -> None:
    """Validate the tensor arguments of a flow step: v, noise and prev_sample must have x's
    shape, and x needs a batch dimension and no size-0 dimension (an empty sample has no
    log-prob: a mean over 0 elements). Raises ValueError naming the shapes."""
    xs = _shape(x)
    for name, t in (("x", x), ("v", v), ("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and not _is_float(t):
            raise InvalidInputError(
                f"{name} has dtype {t.dtype}; flow steps need floating-point tensors")
    if len(xs) < 1:
        raise InvalidInputError(
            f"x has shape {xs}; a flow step needs at least a batch dimension (B, ...)")
    if 0 in xs:
        raise InvalidInputError(
            f"x has shape {xs}; a flow step needs a non-empty tensor (no size-0 "
            "dimension)")
    for name, t in (("v", v), ("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and _shape(t) != xs:
            raise InvalidInputError(
                f"{name} has shape {_shape(t)} but x has shape {xs}; they must match")


def check_attention(q: Any, k: Any, v: Any) -> None:
    """Validate attention shapes: (B, heads, seq, dim) with matching batch/heads/dims."""
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise InvalidInputError(
            f"attention expects 4-d (B, heads, seq, dim) q/k/v, got {qs}, {ks}, {vs}")
    if ks[:2] != qs[:2] or vs[:2] != qs[:2] or ks[2] != vs[2] or ks[3] != qs[3]:
        raise InvalidInputError(
            f"attention shapes do not match: q={qs}, k={ks}, v={vs}; need q (B,H,Lq,D), "
            "k (B,H,Lk,D), v (B,H,Lk,Dv)")


def check_sequence_parallel_attention(q: Any, k: Any, v: Any, world_size: int,
                                      heads_split: bool = True) -> None:
    """Validate a split self-attention call: q/k/v as for attention with one sequence length
    (self-attention), and, for an implementation that splits the heads, ``heads`` a multiple of
    ``world_size``. Raises ValueError naming the shapes and numbers."""
    check_attention(q, k, v)
    qs, ks = _shape(q), _shape(k)
    if ks[2] != qs[2]:
        raise InvalidInputError(
            f"sequence-parallel attention is self-attention: q has {qs[2]} local rows, k {ks[2]}")
    if heads_split and qs[1] % world_size:
        raise InvalidInputError(
            f"sequence parallelism over {world_size} ranks needs heads divisible by "
            f"{world_size}; the attention has {qs[1]} heads")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if getattr(t, "requires_grad", False):
            raise InvalidInputError(
                f"sequence-parallel attention runs forward only; {name} requires grad (a "
                "training update runs each sample's full sequence on one rank)")


def check_cached_attention(q: Any, k: Any, v: Any, cache_k: Any, cache_v: Any) -> None:
    """Validate cached attention shapes: q/k/v as for attention, the caches (B, heads, Lc, D)
    and (B, heads, Lc, Dv), both given or both None. Raises ValueError naming the shapes."""
    check_attention(q, k, v)
    if (cache_k is None) != (cache_v is None):
        raise InvalidInputError("cache_k and cache_v must be given together (or both None)")
    if cache_k is None:
        return
    ks, vs, cks, cvs = _shape(k), _shape(v), _shape(cache_k), _shape(cache_v)
    if len(cks) != 4 or len(cvs) != 4 or cks[:2] != ks[:2] or cvs[:2] != vs[:2] \
            or cks[3] != ks[3] or cvs[3] != vs[3] or cks[2] != cvs[2]:
        raise InvalidInputError(
            f"cached attention shapes do not match: k={ks}, v={vs}, cache_k={cks}, "
            f"cache_v={cvs}; need cache_k (B,H,Lc,D) and cache_v (B,H,Lc,Dv) like k and v")


def check_renoise(x0: Any, noise: Any, sigma: float) -> None:
    """Validate the re-noising op's arguments. Raises ValueError naming the bad value."""
    for name, t in (("x0", x0), ("noise", noise)):
        if not _is_float(t):
            raise InvalidInputError(
                f"{name} has dtype {t.dtype}; re-noising needs floating-point tensors")
    if _shape(noise) != _shape(x0):
        raise InvalidInputError(f"noise has shape {_shape(noise)} but x0 has shape {_shape(x0)}; "
                                "they must match")
    if 0 in _shape(x0):
        raise InvalidInputError(
            f"x0 has shape {_shape(x0)}; re-noising needs a non-empty tensor (no "
            "size-0 dimension)")
    if not (0.0 <= sigma <= 1.0) or math.isnan(sigma):
        raise InvalidInputError(f"sigma={sigma!r} is outside [0, 1]")


def check_unipc(sigma: float, sigma_next: float, state: "UniPCState", *, order: Any,
                solver_type: str, shape: tuple | None = None) -> None:
    """Validate the arguments of a ``UNIPC_STEP`` call (the domain is in the contract,
    :func:`flowseam.ops.reference.unipc_step`).

    :param shape: x's shape; the state's tensors must have it.
    :raises ValueError: naming the bad value and what is allowed.
    """
    if not isinstance(state, UniPCState):
        raise InvalidInputError(f"state={type(state).__name__} must be a flowseam.ops.UniPCState "
                                "(UniPCState.empty() before the first step)")
    if not (0.0 < sigma < 1.0):
        raise InvalidInputError(
            f"sigma={sigma!r}: UniPC needs 0 < sigma < 1 (its log-SNR "
            "log((1 - sigma) / sigma) is infinite at 0 and 1; diffusers' schedule "
            "starts at 1 - 1e-6)")
    if not (0.0 <= sigma_next <= sigma):
        raise InvalidInputError(f"sigma_next={sigma_next!r} must be in [0, sigma={sigma!r}]")
    if solver_type not in ("bh1", "bh2"):
        raise InvalidInputError(
            f"solver_type={solver_type!r} is not a UniPC B(h) variant; use 'bh1' "
            "or 'bh2'")
    if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= UNIPC_MAX_ORDER:
        raise InvalidInputError(f"order={order!r} must be an integer in 1..{UNIPC_MAX_ORDER}")
    if len(state.sigmas) != len(state.outputs):
        raise InvalidInputError(
            f"state has {len(state.sigmas)} sigmas but {len(state.outputs)} outputs")
    if order > len(state.outputs) + 1:
        raise InvalidInputError(
            f"order={order} needs {order - 1} earlier model outputs; the state has "
            f"{len(state.outputs)} (warm up with lower orders, see unipc_order)")
    if sigma_next == 0.0 and order != 1:
        raise InvalidInputError(
            f"order={order} at sigma_next=0: the log-SNR is infinite there and only "
            "order 1 is defined (diffusers lowers the final order with "
            "lower_order_final=True)")
    history = list(state.sigmas) + [sigma]
    if any(not (a > b) for a, b in zip(history, history[1:])):
        raise InvalidInputError(
            f"state.sigmas={tuple(state.sigmas)} must decrease strictly and stay "
            f"above sigma={sigma!r}")
    if state.last_sample is not None and not 1 <= state.last_order <= len(state.outputs):
        raise InvalidInputError(f"state.last_order={state.last_order!r} must be in "
                                f"1..{len(state.outputs)} (the outputs the corrector uses)")
    if shape is not None:
        tensors = [("state.outputs", t) for t in state.outputs]
        if state.last_sample is not None:
            tensors.append(("state.last_sample", state.last_sample))
        for name, t in tensors:
            if _shape(t) != tuple(shape):
                raise InvalidInputError(
                    f"{name} has shape {_shape(t)} but x has shape {tuple(shape)}")


class UniPCCoefficients(NamedTuple):
    """The scalars of one UniPC update (Python floats): ``out = base * x + m0 * m0_tensor +
    sum_k diffs[k] * (older_k - m0_tensor) + last * (m - m0_tensor)`` (``last`` for the
    corrector only)."""

    base: float
    m0: float
    diffs: tuple
    last: float


def _log_snr(s: float) -> float:
    return math.inf if s == 0.0 else math.log1p(-s) - math.log(s)


def unipc_coefficients(s0: float, t: float, older: tuple, solver_type: str, *,
                       corrector: bool) -> UniPCCoefficients:
    """The scalars of a UniPC predictor (``corrector=False``: from ``s0`` to ``t``) or corrector
    (``corrector=True``: the update that lands on ``t``, recomputed with the model output at
    ``t``), in Python float64, from the formulas of :func:`flowseam.ops.reference.unipc_step`.

    :param older: the sigmas of the earlier model outputs used, most recent first (length
        ``order - 1``).
    A helper for kernels: they apply these scalars to tensors. Arguments are assumed valid
    (:func:`check_unipc`).
    """
    import numpy as np

    p = len(older) + 1
    lam0 = _log_snr(s0)
    h = _log_snr(t) - lam0
    alpha_t = 1.0 - t
    hh = -h
    phi1 = math.expm1(hh)
    b_h = hh if solver_type == "bh1" else math.expm1(hh)
    base, m0 = t / s0, -alpha_t * phi1
    if p == 1:
        rho = [0.5] if corrector else []
        last = -alpha_t * b_h * rho[-1] if corrector else 0.0
        return UniPCCoefficients(base, m0, (), last)
    rks = [(_log_snr(s) - lam0) / h for s in older] + [1.0]
    g, factorial, b = phi1 / hh - 1.0, 1, []
    for i in range(1, p + 1):
        b.append(g * factorial / b_h)
        factorial *= i + 1
        g = g / hh - 1.0 / factorial
    R = np.array([[r ** (i - 1) for r in rks] for i in range(1, p + 1)], dtype=np.float64)
    if corrector:
        rho = list(np.linalg.solve(R, np.array(b)))
    elif p == 2:
        rho = [0.5]
    else:
        rho = list(np.linalg.solve(R[:-1, :-1], np.array(b[:-1])))
    diffs = tuple(float(-alpha_t * b_h * rho[k] / rks[k]) for k in range(p - 1))
    last = float(-alpha_t * b_h * rho[-1]) if corrector else 0.0
    return UniPCCoefficients(base, m0, diffs, last)


def sde_std_dev_t(sigma: float, noise_level: float, sigma_max: float | None) -> float:
    """``noise_level * sqrt(sigma / (1 - s))`` with ``s = sigma_max if sigma == 1 else sigma``
    (Flow-GRPO, SD3 ``sde_step_with_logprob``); 0 when ``noise_level == 0``. Python float
    arithmetic (float64)."""
    if noise_level == 0.0:
        return 0.0
    s = sigma_max if sigma == 1.0 else sigma
    return noise_level * math.sqrt(sigma / (1.0 - s))


__all__ = [
    "ALL_OPS", "ATTENTION", "CACHED_ATTENTION", "FLOW_MATCH_STEP", "FLOW_RENOISE", "FLOW_SDE_STEP",
    "SDEStepOutput", "SEQUENCE_PARALLEL_ATTENTION", "SOLVER_OPS", "UNIPC_MAX_ORDER", "UNIPC_STEP",
    "UniPCCoefficients", "UniPCState", "UniPCStepOutput", "as_sigma", "check_attention",
    "check_cached_attention", "check_renoise", "check_sequence_parallel_attention", "check_sigmas", "check_step_tensors", "check_unipc",
    "sde_std_dev_t", "unipc_coefficients", "unipc_order",
]
