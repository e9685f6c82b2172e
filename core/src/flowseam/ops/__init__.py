"""Op names, their contracts, and the argument checks every implementation shares.

Each op is a string constant; a backend registers callables for it (see
:func:`flowseam.seam.hookspecs.flowseam_register_kernels`), loops get the resolved callable from
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

    Edge cases (as Flow-GRPO has them). ``noise_level == 0`` is accepted: Flow-GRPO evaluates
    with it, and the step is then deterministic: ``std_dev_t = std = 0``, ``mean`` is the Euler
    step ``x + dt * v``, ``sample = mean`` (rounded to x's dtype; ``noise`` and ``generator``
    are not used; ``prev_sample``, if given, is returned as given), ``sigma_max`` is not needed,
    and ``log_prob`` is **0** for every sample: a point mass has no density, and 0 is the log of
    the probability (1) that the deterministic step produces its own output. Flow-GRPO's own
    formula gives NaN there. A PPO ratio built on it is exactly 1, so flowseam's trainers refuse
    ``noise_level=0`` for training. A **per-sample** sigma (a ``(B,)`` tensor, as in Flow-GRPO's
    training batches whose timesteps are shuffled per sample) is refused with ``ValueError``:
    flowseam's loops step every row of a batch on one schedule, and its trainers recompute each
    BehaviorRecord (one sigma for the whole batch), so one scalar sigma per call keeps every
    backend's kernel a single fused pass; group rows by sigma to recompute such a batch.

``UNIPC_STEP``: ``step(x, v, sigma, sigma_next, state, *, order, solver_type="bh2",
corrector=True) -> UniPCStepOutput(sample, state)``
    One step of UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for
    Fast Sampling of Diffusion Models", the B(h) variants) in the flow-matching, data-prediction
    form of diffusers' ``UniPCMultistepScheduler`` (``use_flow_sigmas=True``,
    ``prediction_type="flow_prediction"``, ``predict_x0=True``; what the Wan2.1-Diffusers
    checkpoints ship). With ``alpha(s) = 1 - s`` and the log-SNR
    ``lam(s) = log(alpha(s)) - log(s)`` (``lam(0) = +inf``)::

        m    = x - sigma * v                       # the model output as a data prediction

    **Corrector** (UniC), when ``corrector`` and ``state.last_sample`` is not None: with
    ``s0 = state.sigmas[-1]``, ``m0 = state.outputs[-1]``, ``p = state.last_order``,
    ``x_prev = state.last_sample``::

        h     = lam(sigma) - lam(s0);   hh = -h;   phi1 = expm1(hh)
        B     = hh (bh1) or expm1(hh) (bh2)
        r_k   = (lam(state.sigmas[-1-k]) - lam(s0)) / h,   D_k = (state.outputs[-1-k] - m0) / r_k,
                for k = 1 .. p-1;  r_p = 1
        R     = [[r_j ** (i-1)]]  (p x p, i = 1..p rows, j = 1..p columns)
        b_i   = g_i * i! / B with g_1 = phi1/hh - 1,  g_{i+1} = g_i/hh - 1/(i+1)!
        rho   = [0.5] if p == 1 else solve(R, b)
        x     = (sigma/s0) * x_prev - alpha(sigma) * phi1 * m0
                - alpha(sigma) * B * (sum_k rho_k D_k + rho_p * (m - m0))

    **Predictor** (UniP) of order ``q = order`` from ``x`` (corrected) at ``s0 = sigma`` to
    ``t = sigma_next``, over the history ``state.outputs + (m,)``: ``h = lam(t) - lam(sigma)``,
    ``r_k``, ``D_k`` (k = 1 .. q-1), ``hh``, ``phi1``, ``B``, ``R``, ``b`` as above with ``m0 = m``;
    ``rho = [0.5]`` for q == 2, else ``solve(R[:-1, :-1], b[:-1])``::

        sample = (t/sigma) * x - alpha(t) * phi1 * m - alpha(t) * B * sum_k rho_k D_k

    The state carries the solver's history explicitly (:class:`UniPCState`): the sigmas and data
    predictions of the last ``order`` steps (this one included), the corrected ``x`` the
    predictor started from (``last_sample``, x's dtype) and ``order`` (``last_order``); the
    initial state is :meth:`UniPCState.empty`. Outputs are stored in the compute dtype. How a
    loop drives the op (diffusers' rules): the order of step i of N is
    :func:`unipc_order`, the corrector runs from the second step on, except after the step
    indices listed in ``disable_corrector``; the DiT is evaluated on the predicted (uncorrected)
    sample, which the next step corrects.

    Domain: ``0 < sigma < 1`` (``lam`` is -inf at sigma 1; diffusers' schedule starts at
    ``1 - 1e-6``), ``0 <= sigma_next <= sigma``, the history's sigmas strictly decreasing and
    above sigma, ``1 <= order <= len(state.outputs) + 1`` and ``order <= 3`` (flowseam's
    implementation; Wan ships 2, diffusers recommends 2 for guided and 3 for unconditional
    sampling). At ``sigma_next == 0`` the log-SNR is infinite and only ``order == 1`` is
    defined: the sample is then ``m`` exactly, for either solver type. (diffusers 0.42 returns
    NaN for ``bh1`` there, multiplying B(h) = -inf by a zero residual, and inf for orders >= 2
    with ``lower_order_final=False``.) At ``sigma_next == sigma`` (a schedule with
    ``final_sigmas_type="sigma_min"`` repeats its last sigma) ``h = 0`` and the predictor is the
    identity: the sample is the corrected ``x``. Bad arguments raise ``ValueError``. The step is not
    required to be differentiable (RL rollouts use ``FLOW_SDE_STEP``).

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

``SEQUENCE_PARALLEL_ATTENTION``: ``attn(q, k, v, *, group, attention, scale=None)``
    Self-attention over a sequence split across the ranks of the torch.distributed process group
    ``group`` (``N = group.size()`` ranks): rank ``r`` passes its contiguous shard, rows
    ``[r * S/N, (r + 1) * S/N)`` of q, k and v, each ``(B, heads, S/N, head_dim)`` (every rank
    the same shape), and gets back the same rows of the unsplit call::

        attention(cat_r(q_r), cat_r(k_r), cat_r(v_r), scale=scale)[:, :, r*S/N:(r+1)*S/N]

    in ``q``'s dtype. ``attention`` is the platform's resolved ``ATTENTION`` kernel: an
    implementation that decomposes the call (Ulysses' all-to-all, DeepSpeed-Ulysses, Jacobs et
    al. 2023: trade the sequence split for a head split, attend, trade back) runs its
    full-sequence part with it; a fused one (ring attention, Liu et al. 2023) may ignore it. No
    mask (the split DiTs' self-attention has none). Every rank of ``group`` calls it with the same
    shapes (a collective). ``heads`` must be a multiple of ``N`` for an all-to-all
    implementation, which raises ``ValueError`` naming both otherwise; an implementation that
    runs any number of heads (ring attention) says so with the function attribute
    ``any_heads = True``, and flowseam then does not refuse such a split before loading. Forward only: a tensor
    that requires grad is refused (flowseam splits generation and rollouts; a training update
    runs each sample's full sequence on one rank).

``FLOW_RENOISE``: ``renoise(x0, noise, sigma) -> (1 - sigma) * x0 + sigma * noise``
    Re-noising a predicted clean sample ``x0`` to noise level ``sigma`` with fresh standard
    normal ``noise`` (the flow-matching forward process; diffusers
    ``FlowMatchEulerDiscreteScheduler.scale_noise``, Self-Forcing's ``scheduler.add_noise``).
    The few-step causal loop predicts ``x0`` with ``flow_match_step(x, v, sigma, 0)`` and
    re-noises it to the next sigma of the chunk's schedule; FlowMatchEuler's
    ``stochastic_sampling`` is the same pair of steps (diffusers'
    ``x0 = x - sigma * v; (1 - sigma_next) * x0 + sigma_next * noise``). ``x0``, ``noise``: same shape; the
    result has ``x0``'s dtype, the arithmetic is float32 or wider; ``sigma`` in [0, 1].

Bad arguments (shape mismatch, sigma outside [0, 1], sigma_next > sigma, sigma == 1 without
sigma_max for the SDE step, a per-sample sigma tensor) raise ``ValueError`` naming the value.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..errors import InvalidInputError

FLOW_MATCH_STEP = "flow_match_step"
FLOW_SDE_STEP = "flow_sde_step"
UNIPC_STEP = "unipc_step"
ATTENTION = "attention"
CACHED_ATTENTION = "cached_attention"
FLOW_RENOISE = "flow_renoise"
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
        return  # the deterministic step: no std, no sigma_max needed (see FLOW_SDE_STEP)
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
    """Validate the arguments of a ``UNIPC_STEP`` call (domain in :mod:`flowseam.ops`).

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
    ``t``), in Python float64, from the formulas in :mod:`flowseam.ops`.

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
