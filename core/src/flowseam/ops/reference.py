"""The numpy float64 oracle of every op in :mod:`flowseam.ops`, and each op's written contract.

Each function's docstring is the contract of the op of the same name (signature, formula and its
source, shapes, dtypes, edge cases, what is refused): a backend writes its kernel from it. The
code is those formulas in float64, with no torch, and the conformance suite checks every kernel a
backend registers against it (tolerance by dtype, see :data:`TOLERANCES`).
``sequence_parallel_attention``, a collective, has no oracle; its contract is on
:data:`flowseam.ops.SEQUENCE_PARALLEL_ATTENTION`.
"""

from __future__ import annotations

import math

import numpy as np

from . import (
    SDEStepOutput,
    UniPCState,
    UniPCStepOutput,
    as_sigma,
    check_attention,
    check_cached_attention,
    check_renoise,
    check_sigmas,
    check_step_tensors,
    check_unipc,
    sde_std_dev_t,
)

#: (rtol, atol) for comparing a kernel's output in a dtype against the float64 oracle (C1).
TOLERANCES = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-5),
    "float16": (1e-2, 1e-2),
    "bfloat16": (2e-2, 2e-2),
}


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def flow_match_step(x, v, sigma: float, sigma_next: float) -> np.ndarray:
    """``flow_match_step(x, v, sigma, sigma_next) -> x + (sigma_next - sigma) * v``.

    One deterministic Euler step of the flow ODE dx/dσ = v (the serve-time solver; matches
    diffusers ``FlowMatchEulerDiscreteScheduler.step``). ``x``, ``v``: same shape ``(B, ...)``,
    e.g. latents ``(B, C, F, H, W)``; the result has ``x``'s dtype, the arithmetic is float32 or
    wider (here: float64).

    :raises ValueError: naming the value: a shape mismatch, a non-float or empty tensor, a sigma
        outside [0, 1], ``sigma_next > sigma``, a per-sample sigma tensor (one scalar sigma per
        call).
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_sigmas(sigma, sigma_next, sde=False)
    return _f64(x) + (sigma_next - sigma) * _f64(v)


def flow_sde_step(x, v, sigma: float, sigma_next: float, *, noise=None, prev_sample=None,
                  noise_level: float = 0.7, sigma_max: float | None = None,
                  generator: np.random.Generator | None = None) -> SDEStepOutput:
    """``flow_sde_step(x, v, sigma, sigma_next, *, noise=None, prev_sample=None,
    noise_level=0.7, sigma_max=None, generator=None) -> SDEStepOutput``.

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

    Here ``generator`` is a ``numpy.random.Generator`` (the torch kernels take a
    ``torch.Generator``); pass ``noise`` to compare against a torch kernel.

    :raises ValueError: naming the value: a shape mismatch, a non-float or empty tensor, a sigma
        outside [0, 1], ``sigma_next >= sigma`` (the SDE step needs ``sigma_next < sigma``),
        ``sigma == 1`` without ``sigma_max`` in (0, 1), a negative or infinite ``noise_level``,
        a std that underflows to 0, a per-sample sigma tensor.
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v, noise, prev_sample)
    check_sigmas(sigma, sigma_next, sde=True, sigma_max=sigma_max, noise_level=noise_level)
    x, v = _f64(x), _f64(v)
    dt = sigma_next - sigma
    if noise_level == 0.0:  # deterministic: the Euler step, no density (see the docstring)
        mean = x + dt * v
        sample = mean if prev_sample is None else _f64(prev_sample)
        return SDEStepOutput(sample=sample, log_prob=np.zeros(x.shape[0]), mean=mean,
                             std=np.float64(0.0))
    std_dev_t = sde_std_dev_t(sigma, noise_level, sigma_max)
    mean = (x * (1.0 + std_dev_t**2 * dt / (2.0 * sigma))
            + v * (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt)
    std = std_dev_t * math.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise = (generator or np.random.default_rng()).standard_normal(x.shape)
        sample = mean + std * _f64(noise)
    else:
        sample = _f64(prev_sample)
    log_density = (-((sample - mean) ** 2) / (2.0 * std**2) - math.log(std)
                   - 0.5 * math.log(2.0 * math.pi))
    log_prob = log_density.reshape(log_density.shape[0], -1).mean(axis=1)
    return SDEStepOutput(sample=sample, log_prob=log_prob, mean=mean, std=np.float64(std))


def _lambda(s: float) -> float:
    """UniPC's log-SNR of flow sigmas: log(alpha) - log(sigma) with alpha = 1 - sigma."""
    return np.inf if s == 0 else float(np.log(1.0 - s) - np.log(s))


def _unipc_solve(s0: float, t: float, older: list[float], solver_type: str,
                 corrector: bool) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(h, hh, rks, rhos) of one UniPC update, written from Zhao et al. 2023, Algorithm 2
    (B(h) variants) in diffusers' data-prediction form."""
    h = _lambda(t) - _lambda(s0)
    hh = -h
    p = len(older) + 1
    rks = np.array([(_lambda(s) - _lambda(s0)) / h for s in older] + [1.0])
    b_h = hh if solver_type == "bh1" else np.expm1(hh)
    # b_i = i! * phi_{i+1}(hh) / B(h), with h*phi_1 = expm1(hh) and the recursion
    # phi_{k+1} = phi_k / hh - 1 / (k+1)! (Zhao et al. 2023, eq. 12)
    phis, g, fact = [], np.expm1(hh) / hh - 1.0, 1.0
    for i in range(1, p + 1):
        phis.append(g * fact / b_h)
        fact *= i + 1
        g = g / hh - 1.0 / fact
    powers = np.vander(rks, p, increasing=True).T  # row i: rks ** i
    if corrector:
        rhos = np.array([0.5]) if p == 1 else np.linalg.solve(powers, np.array(phis))
    else:
        rhos = np.array([0.5]) if p == 2 else (
            np.linalg.solve(powers[:-1, :-1], np.array(phis[:-1])) if p > 2 else np.zeros(0))
    return h, hh, rks, rhos


def unipc_step(x, v, sigma: float, sigma_next: float, state: UniPCState, *, order: int,
               solver_type: str = "bh2", corrector: bool = True) -> UniPCStepOutput:
    """``unipc_step(x, v, sigma, sigma_next, state, *, order, solver_type="bh2",
    corrector=True) -> UniPCStepOutput(sample, state)``.

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

    The state carries the solver's history explicitly (:class:`~flowseam.ops.UniPCState`): the
    sigmas and data predictions of the last ``order`` steps (this one included), the corrected
    ``x`` the predictor started from (``last_sample``, x's dtype) and ``order``
    (``last_order``); the initial state is :meth:`~flowseam.ops.UniPCState.empty`. Outputs are
    stored in the compute dtype. How a loop drives the op (diffusers' rules): the order of step
    i of N is :func:`~flowseam.ops.unipc_order`, the corrector runs from the second step on,
    except after the step indices listed in ``disable_corrector``; the DiT is evaluated on the
    predicted (uncorrected) sample, which the next step corrects.

    Domain: ``0 < sigma < 1`` (``lam`` is -inf at sigma 1; diffusers' schedule starts at
    ``1 - 1e-6``), ``0 <= sigma_next <= sigma``, the history's sigmas strictly decreasing and
    above sigma, ``1 <= order <= len(state.outputs) + 1`` and ``order <= 3`` (flowseam's
    implementation; Wan ships 2, diffusers recommends 2 for guided and 3 for unconditional
    sampling). At ``sigma_next == 0`` the log-SNR is infinite and only ``order == 1`` is
    defined: the sample is then ``m`` exactly, for either solver type. (diffusers 0.42 returns
    NaN for ``bh1`` there, multiplying B(h) = -inf by a zero residual, and inf for orders >= 2
    with ``lower_order_final=False``.) At ``sigma_next == sigma`` (a schedule with
    ``final_sigmas_type="sigma_min"`` repeats its last sigma) ``h = 0`` and the predictor is the
    identity: the sample is the corrected ``x``. The step is not required to be differentiable
    (RL rollouts use ``flow_sde_step``). Here the state holds numpy arrays.

    :raises ValueError: for arguments outside the domain, a ``solver_type`` other than bh1/bh2,
        a state whose tensors do not have x's shape, naming the value
        (:func:`~flowseam.ops.check_unipc`).
    """
    sigma, sigma_next = as_sigma(sigma), as_sigma(sigma_next, "sigma_next")
    check_step_tensors(x, v)
    check_unipc(sigma, sigma_next, state, order=order, solver_type=solver_type, shape=x.shape)
    x, v = _f64(x), _f64(v)
    m = x - sigma * v
    if corrector and state.last_sample is not None:
        p, s0, m0 = state.last_order, state.sigmas[-1], _f64(state.outputs[-1])
        older = [state.sigmas[-1 - k] for k in range(1, p)]
        h, hh, rks, rhos = _unipc_solve(s0, sigma, older, solver_type, corrector=True)
        b_h = hh if solver_type == "bh1" else np.expm1(hh)
        res = sum(rhos[k - 1] * (_f64(state.outputs[-1 - k]) - m0) / rks[k - 1]
                  for k in range(1, p)) + rhos[-1] * (m - m0)
        x = (sigma / s0) * _f64(state.last_sample) - (1 - sigma) * np.expm1(hh) * m0 \
            - (1 - sigma) * b_h * res
    sigmas = list(state.sigmas) + [sigma]
    outputs = [_f64(o) for o in state.outputs] + [m]
    older = [sigmas[-1 - k] for k in range(1, order)]
    if sigma_next == 0.0:  # order 1 (checked): the limit h -> inf of the update is m
        sample = m.copy()
    elif sigma_next == sigma:  # h = 0: the identity
        sample = x.copy()
    else:
        h, hh, rks, rhos = _unipc_solve(sigma, sigma_next, older, solver_type, corrector=False)
        b_h = hh if solver_type == "bh1" else np.expm1(hh)
        res = sum(rhos[k - 1] * (outputs[-1 - k] - m) / rks[k - 1] for k in range(1, order))
        sample = (sigma_next / sigma) * x - (1 - sigma_next) * np.expm1(hh) * m \
            - (1 - sigma_next) * b_h * res
    return UniPCStepOutput(sample, UniPCState(tuple(sigmas[-order:]), tuple(outputs[-order:]),
                                              x, order))


def attention(q, k, v, attn_mask=None, scale: float | None = None) -> np.ndarray:
    """``attention(q, k, v, attn_mask=None, scale=None)``: ``softmax(q k^T * scale + mask) v``.

    Scaled dot-product attention, layout ``(B, heads, seq, head_dim)``, the semantics of
    ``torch.nn.functional.scaled_dot_product_attention``: a boolean mask marks the keys that may
    be attended (True = keep; the others get -inf), a float mask is added to the scores;
    ``scale`` defaults to ``1/sqrt(head_dim)``. The key/value length may differ from the query
    length (``q (B, H, Lq, D)``, ``k (B, H, Lk, D)``, ``v (B, H, Lk, Dv)``). A query whose keys
    are all masked out gets zeros (as torch's SDPA does).

    :raises ValueError: q, k, v not 4-d or of mismatched shapes, naming them.
    """
    check_attention(q, k, v)
    q, k, v = _f64(q), _f64(k), _f64(v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask.astype(np.float64)
    row_max = scores.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(row_max)  # every key masked out
    weights = np.exp(scores - np.where(dead, 0.0, row_max))
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.where(dead, 0.0, weights / np.where(dead, 1.0, total))
    return weights @ v


def cached_attention(q, k, v, cache_k=None, cache_v=None, scale: float | None = None) -> np.ndarray:
    """``cached_attention(q, k, v, cache_k=None, cache_v=None, scale=None)``.

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

    :raises ValueError: shapes that do not match, or only one of the caches given, naming them.
    """
    check_cached_attention(q, k, v, cache_k, cache_v)
    if cache_k is not None:
        k = np.concatenate([_f64(cache_k), _f64(k)], axis=2)
        v = np.concatenate([_f64(cache_v), _f64(v)], axis=2)
    return attention(q, k, v, scale=scale)


def flow_renoise(x0, noise, sigma: float) -> np.ndarray:
    """``flow_renoise(x0, noise, sigma) -> (1 - sigma) * x0 + sigma * noise``.

    Re-noising a predicted clean sample ``x0`` to noise level ``sigma`` with fresh standard
    normal ``noise`` (the flow-matching forward process; diffusers
    ``FlowMatchEulerDiscreteScheduler.scale_noise``, Self-Forcing's ``scheduler.add_noise``).
    The few-step causal loop predicts ``x0`` with ``flow_match_step(x, v, sigma, 0)`` and
    re-noises it to the next sigma of the chunk's schedule; FlowMatchEuler's
    ``stochastic_sampling`` is the same pair of steps (diffusers'
    ``x0 = x - sigma * v; (1 - sigma_next) * x0 + sigma_next * noise``). ``x0``, ``noise``: same
    shape; the result has ``x0``'s dtype, the arithmetic is float32 or wider (here: float64).

    :raises ValueError: naming the value: a shape mismatch, a non-float or empty tensor,
        ``sigma`` outside [0, 1], a per-sample sigma tensor.
    """
    sigma = as_sigma(sigma)
    check_renoise(x0, noise, sigma)
    return (1.0 - sigma) * _f64(x0) + sigma * _f64(noise)
