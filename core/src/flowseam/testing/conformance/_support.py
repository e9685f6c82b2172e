"""What the conformance tests share: their cases, the standard request of each card, tolerances,
and a recorder that captures the calls the serve loop makes into each component."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import pytest
import torch

from flowseam import ops
from flowseam.seam.declarations import Provenance
from flowseam.models import CARDS as MODEL_CARDS
from flowseam.ops.reference import TOLERANCES
from flowseam.request import DiffusionParams, GenerationRequest
from flowseam.testing import tiny

#: The cards the suite runs, one tiny checkpoint each (:data:`flowseam.testing.tiny.CARDS`, which
#: says why ``ltx2-i2v`` is not among them).
CARDS = tiny.CARDS

# -- tolerances --------------------------------------------------------------------------------


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the keys of ``TOLERANCES``)."""
    return str(dtype).removeprefix("torch.")


def tolerance(dtype: Any) -> tuple[float, float]:
    """(rtol, atol) for results in ``dtype`` (:data:`flowseam.ops.reference.TOLERANCES`)."""
    name = dtype_name(dtype)
    if name not in TOLERANCES:
        raise ValueError(f"no conformance tolerance for dtype {name!r}; "
                         f"known: {sorted(TOLERANCES)}")
    return TOLERANCES[name]


def to_f64(value: Any) -> np.ndarray:
    if torch.is_tensor(value):
        return value.detach().to("cpu", torch.float64).numpy()
    return np.asarray(value, dtype=np.float64)


def assert_close(got: Any, want: Any, dtype: Any, what: str) -> None:
    """``got`` equals ``want`` within the tolerance of ``dtype`` (elementwise rtol/atol)."""
    rtol, atol = tolerance(dtype)
    g, w = to_f64(got), to_f64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape}, expected {w.shape}"
    np.testing.assert_allclose(
        g, w, rtol=rtol, atol=atol,
        err_msg=f"{what} (tolerance of {dtype_name(dtype)}: rtol={rtol}, atol={atol})")


#: Whole components and loops in reduced precision against the float32 cpu build: the bound on
#: the relative error ``||got - want|| / ||want||`` (2-norm over the whole tensor). An
#: elementwise bound does not fit here: every layer rounds, the errors compound over the model's
#: depth and the denoising steps, and elements near zero get large relative errors. The bound
#: is about 13 units of roundoff (u = 2^-8 for bfloat16, 2^-11 for float16) — what flowseam's
#: cuda backend holds its bf16 DiT to, with room for the 3 steps of the serve checks. float32
#: and float64 builds are held to :data:`TOLERANCES` elementwise, as kernels are.
MODEL_RELATIVE_TOLERANCES = {"bfloat16": 5e-2, "float16": 1e-2}


def assert_model_close(got: Any, want: Any, dtype: Any, what: str) -> None:
    """A component's or a loop's output computed in ``dtype`` equals the float32 cpu build's:
    elementwise within :data:`TOLERANCES` for float32 and wider, within
    :data:`MODEL_RELATIVE_TOLERANCES` in relative 2-norm for reduced precision."""
    name = dtype_name(dtype)
    if name not in MODEL_RELATIVE_TOLERANCES:
        assert_close(got, want, dtype, what)
        return
    g, w = to_f64(got), to_f64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape}, expected {w.shape}"
    bound = MODEL_RELATIVE_TOLERANCES[name]
    error = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    assert error <= bound, (f"{what}: relative error ||got - want|| / ||want|| = {error:.3g} > "
                            f"{bound} (the tolerance of a {name} model; max abs difference "
                            f"{float(np.abs(g - w).max()):.3g})")


def randn(shape: tuple[int, ...], seed: int, dtype: str, device: str) -> torch.Tensor:
    """Standard normal values drawn in float64, then rounded to ``dtype`` (so the oracle sees
    exactly the kernel's inputs)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(getattr(torch, dtype)).to(device)


# -- kernel cases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCase:
    """One solver step of the kernel checks: sigmas, latent shape and noise level."""

    id: str
    sigma: float
    sigma_next: float
    shape: tuple[int, ...]
    sigma_max: float | None = None
    noise_level: float = 0.7


STEPS = (
    StepCase("first", 1.0, 0.95, (2, 16, 2, 4, 4), sigma_max=0.95),  # sigma == 1: SDE uses sigma_max
    StepCase("middle", 0.6, 0.45, (3, 37)),                          # odd size, rank 2
    StepCase("last", 0.1, 0.0, (1, 16, 64)),                         # packed latents, batch 1, to 0
    StepCase("noise_level_0", 0.6, 0.45, (2, 9), noise_level=0.0),   # the SDE step, deterministic
    StepCase("large", 0.5, 0.3, (2, 16, 5, 12, 20), noise_level=1.0),
)
LARGE = STEPS[-1]


#: The ranks of the ``sequence_parallel_attention`` check (:mod:`._split`).
WORLD = 2


@dataclass(frozen=True)
class SplitCase:
    """One split self-attention: the whole ``(B, heads, S, head_dim)`` of q, k and v (``S`` is
    split in :data:`WORLD` halves) and the softmax scale."""

    id: str
    shape: tuple[int, int, int, int]
    scale: float | None = None

    @property
    def heads_divide(self) -> bool:
        return self.shape[1] % WORLD == 0


SPLIT_CASES = (
    SplitCase("self", (2, 4, 16, 8)),
    SplitCase("batch1_odd_rows", (1, 4, 10, 8)),   # 5 rows per rank
    SplitCase("scale", (1, 4, 8, 8), scale=0.3),
    # heads that 2 does not divide: an all-to-all kernel may refuse (ValueError naming the heads)
    SplitCase("heads3", (2, 3, 12, 8)),
)


@dataclass(frozen=True)
class UniPCCase:
    """One UniPC step of the kernel checks: the sigmas of the earlier model outputs (oldest
    first), the step, its order, solver type and whether the corrector runs."""

    id: str
    history: tuple[float, ...]
    sigma: float
    sigma_next: float
    order: int
    solver_type: str = "bh2"
    corrector: bool = True
    shape: tuple[int, ...] = (2, 16, 2, 4, 4)

    @property
    def last_order(self) -> int:
        """The previous step's order (what its corrector uses): all of the history."""
        return len(self.history)


UNIPC_CASES = (
    UniPCCase("first", (), 0.999999, 0.9, 1),                          # no history, no corrector
    UniPCCase("order2", (0.95, 0.8), 0.6, 0.4, 2, shape=(3, 37)),
    UniPCCase("order3_bh1", (0.95, 0.85, 0.7), 0.55, 0.35, 3, solver_type="bh1"),
    UniPCCase("order3_no_corrector", (0.95, 0.85, 0.7), 0.55, 0.35, 3, corrector=False),
    UniPCCase("last_to_zero", (0.3, 0.2), 0.1, 0.0, 1, shape=(1, 16, 64)),
    UniPCCase("repeated_final_sigma", (0.3,), 0.2, 0.2, 1, solver_type="bh1"),
)

#: id → (x dtype, v dtype). The last is what a bf16 DiT hands the loop: float32 latents and a
#: bf16 velocity.
STEP_DTYPES = {
    "float32": ("float32", "float32"),
    "float64": ("float64", "float64"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float16": ("float16", "float16"),
    "float32-v_bfloat16": ("float32", "bfloat16"),
}


@dataclass(frozen=True)
class AttentionCase:
    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    mask: str | None = None  # "bool" (key padding, keep = True) or "float" (added to the scores)
    scale: float | None = None


ATTENTION_CASES = (
    AttentionCase("self", (2, 2, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)),
    AttentionCase("cross", (1, 3, 10, 16), (1, 3, 7, 16), (1, 3, 7, 12)),
    AttentionCase("bool_mask", (2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8), mask="bool"),
    AttentionCase("float_mask", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8), mask="float"),
    AttentionCase("scale", (2, 1, 5, 4), (2, 1, 5, 4), (2, 1, 5, 4), scale=0.3),
)
ATTENTION_DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class CachedAttentionCase:
    """A chunk's q/k/v and the KV cache it attends to (``cache`` = (Lc, Dv); Lc 0 = empty)."""

    id: str
    q: tuple[int, ...]
    kv: tuple[int, ...]          # (Lk, Dv): the chunk's own keys/values
    cache: tuple[int, int] | None
    scale: float | None = None


CACHED_ATTENTION_CASES = (
    CachedAttentionCase("no_cache", (2, 2, 6, 8), (6, 8), None),
    CachedAttentionCase("empty_cache", (1, 2, 4, 8), (4, 8), (0, 8)),
    CachedAttentionCase("cache", (2, 2, 6, 8), (6, 8), (18, 8)),
    CachedAttentionCase("value_dim", (1, 3, 5, 16), (5, 12), (10, 12), scale=0.2),
)


@dataclass(frozen=True)
class RenoiseCase:
    id: str
    sigma: float
    shape: tuple[int, ...]


RENOISE_CASES = (
    RenoiseCase("sigma1", 1.0, (2, 16, 3, 4, 4)),
    RenoiseCase("middle", 0.8333333, (3, 37)),
    RenoiseCase("sigma0", 0.0, (1, 16, 64)),
    RenoiseCase("large", 0.625, (2, 16, 3, 12, 20)),
)


@dataclass(frozen=True)
class KernelCase:
    """One kernel check: a registration (op, arch), input dtypes and a step or attention case."""

    op: str
    arch: str
    x_dtype: str = "float32"
    v_dtype: str = "float32"
    step: StepCase | None = None
    attention: AttentionCase | None = None
    cached: CachedAttentionCase | None = None
    renoise: RenoiseCase | None = None
    unipc: UniPCCase | None = None
    split: SplitCase | None = None

    @property
    def compute_dtype(self) -> str:
        """The dtype of mean/std/log_prob: float32, or float64 for float64 latents."""
        return "float64" if self.x_dtype == "float64" else "float32"


def _registrations(choice: Any) -> list:
    return sorted(choice.record.kernels, key=lambda k: (k.op, k.arch))


def registration_cases(choice: Any) -> Iterator[tuple[str, KernelCase]]:
    """Every (op, arch) the backend registers."""
    for reg in _registrations(choice):
        yield f"{reg.op}@{reg.arch}", KernelCase(reg.op, reg.arch)


def kernel_cases(choice: Any) -> Iterator[tuple[str, KernelCase]]:
    """Every registration x dtype x step (solver ops) or attention case."""
    for reg in _registrations(choice):
        name = f"{reg.op}@{reg.arch}"
        if reg.op == ops.ATTENTION:
            for dtype in ATTENTION_DTYPES:
                for case in ATTENTION_CASES:
                    yield (f"{name}-{dtype}-{case.id}",
                           KernelCase(reg.op, reg.arch, dtype, dtype, attention=case))
        elif reg.op == ops.CACHED_ATTENTION:
            for dtype in ATTENTION_DTYPES:
                for case in CACHED_ATTENTION_CASES:
                    yield (f"{name}-{dtype}-{case.id}",
                           KernelCase(reg.op, reg.arch, dtype, dtype, cached=case))
        elif reg.op == ops.FLOW_RENOISE:
            for dtype_id, (xd, nd) in STEP_DTYPES.items():
                for case in RENOISE_CASES:
                    yield (f"{name}-{dtype_id}-{case.id}",
                           KernelCase(reg.op, reg.arch, xd, nd, renoise=case))
        elif reg.op in (ops.FLOW_MATCH_STEP, ops.FLOW_SDE_STEP):
            for dtype_id, (xd, vd) in STEP_DTYPES.items():
                for step in STEPS:
                    if step.noise_level == 0.0 and reg.op != ops.FLOW_SDE_STEP:
                        continue  # a noise level means nothing to the other steps
                    yield (f"{name}-{dtype_id}-{step.id}",
                           KernelCase(reg.op, reg.arch, xd, vd, step=step))
        elif reg.op == ops.UNIPC_STEP:
            for dtype_id, (xd, vd) in STEP_DTYPES.items():
                for case in UNIPC_CASES:
                    yield (f"{name}-{dtype_id}-{case.id}",
                           KernelCase(reg.op, reg.arch, xd, vd, unipc=case))
        elif reg.op == ops.SEQUENCE_PARALLEL_ATTENTION:  # on 2 ranks: _split.py
            for dtype in ATTENTION_DTYPES:
                for case in SPLIT_CASES:
                    yield (f"{name}-{dtype}-{case.id}",
                           KernelCase(reg.op, reg.arch, dtype, dtype, split=case))
        else:  # an op added to flowseam.ops without a conformance check: the test says so
            yield name, KernelCase(reg.op, reg.arch)


def sde_cases(choice: Any) -> Iterator[tuple[str, KernelCase]]:
    """Every flow_sde_step registration x dtype, on the large step."""
    for reg in _registrations(choice):
        if reg.op == ops.FLOW_SDE_STEP:
            for dtype_id, (xd, vd) in STEP_DTYPES.items():
                yield (f"{reg.op}@{reg.arch}-{dtype_id}",
                       KernelCase(reg.op, reg.arch, xd, vd, step=LARGE))


def sde_gradient_cases(choice: Any) -> Iterator[tuple[str, KernelCase]]:
    """Every flow_sde_step registration in float32 and float64, on the first and large steps."""
    for reg in _registrations(choice):
        if reg.op == ops.FLOW_SDE_STEP:
            for dtype in ("float32", "float64"):
                for step in (STEPS[0], LARGE):
                    yield (f"{reg.op}@{reg.arch}-{dtype}-{step.id}",
                           KernelCase(reg.op, reg.arch, dtype, dtype, step=step))


def pinned_kernel(platform: Any, case: KernelCase) -> Any:
    """The backend's own implementation of ``case`` (pinned by its implementation id); skips the
    test when its arch rung is not on this host's chain."""
    rec = platform.backend
    chain = platform.arch_chains[rec.device]
    if case.arch not in chain:
        pytest.skip(f"{case.op} is registered at arch {case.arch!r}, which is not on this host's "
                    f"{rec.device} arch chain ({' → '.join(chain)})")
    prov = Provenance(case.op, rec.name, rec.distribution, rec.version, rec.device, case.arch)
    return platform.kernels.pin(prov.impl_id)


# -- cards, requests and components ----------------------------------------------------------

PROMPT = "a red ball rolling on the grass"


def card_cases(choice: Any) -> Iterator[tuple[str, str]]:
    for card in CARDS:
        yield card, card


#: The solvers a checkpoint's scheduler may name, per card: (variant id, overrides of the tiny
#: checkpoint's ``scheduler_config.json``). The tiny checkpoints ship FlowMatchEuler (Wan:
#: shift 3; FLUX: dynamic shifting).
UNIPC_FLOW = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
              "use_flow_sigmas": True, "flow_shift": 3.0, "solver_order": 2}
SOLVER_VARIANTS = {
    "wan2.1-t2v": (("unipc_order2", UNIPC_FLOW), ("unipc_order3_bh1",
                   {**UNIPC_FLOW, "solver_order": 3, "solver_type": "bh1",
                    "final_sigmas_type": "sigma_min"}),
                   ("stochastic", {"stochastic_sampling": True})),
    "wan2.1-i2v": (("unipc_order2", UNIPC_FLOW),),
    "flux.1-t2i": (("static_shift", {"use_dynamic_shifting": False, "shift": 2.0}),
                   ("stochastic", {"stochastic_sampling": True})),
}


def solver_cases(choice: Any) -> Iterator[tuple[str, tuple[str, str, dict]]]:
    """Every (card, solver variant) of :data:`SOLVER_VARIANTS`."""
    for card in CARDS:
        for variant, overrides in SOLVER_VARIANTS.get(card, ()):
            yield f"{card}-{variant}", (card, variant, overrides)


def diffusers_output(checkpoint: Any, card: str, overrides: dict, request: GenerationRequest,
                     pipelines: dict) -> np.ndarray:
    """diffusers' own pipeline on ``checkpoint`` with its scheduler replaced as
    ``Class.from_config(pipe.scheduler.config, **overrides)`` (what
    ``ModelInstance.with_scheduler`` mirrors), for ``request``: frames ``(B, F, H, W, 3)``.

    Stochastic sampling draws its noise from the request's per-sample generators (diffusers'
    ``scheduler.step(..., generator=...)``), as flowseam does."""
    import diffusers

    if card not in pipelines:
        pipelines[card] = diffusers.DiffusionPipeline.from_pretrained(checkpoint)
        pipelines[card].set_progress_bar_config(disable=True)
    pipe = pipelines[card]
    original = pipe.scheduler
    cls = getattr(diffusers, overrides.get("_class_name", type(original).__name__))
    pipe.scheduler = cls.from_config(original.config, **{k: v for k, v in overrides.items()
                                                          if k != "_class_name"})
    p = request.params
    generators = [torch.Generator().manual_seed(s) for s in request.sample_seeds(p)]
    if pipe.scheduler.config.get("stochastic_sampling"):
        pipe.scheduler.step = functools.partial(pipe.scheduler.step, generator=generators)
    args = dict(prompt=request.prompts, num_inference_steps=p.num_steps, height=p.height,
                width=p.width, guidance_scale=p.guidance_scale, generator=generators,
                output_type="np")
    try:
        if card.startswith("flux"):
            return pipe(**args).images[:, None]
        args.update(num_frames=p.num_frames, negative_prompt=p.negative_prompt)
        if request.image is not None:
            args["image"] = request.image
        return pipe(**args).frames
    finally:
        pipe.scheduler = original


def component_cases(choice: Any) -> Iterator[tuple[str, tuple[str, Any]]]:
    """Every component of every card: (card, ComponentEntry). The causal card is left out: its
    components are wan2.1-t2v's classes and kinds, checked there."""
    for card in CARDS:
        if card == "wan2.1-causal-t2v":
            continue
        for entry in MODEL_CARDS[card].components:
            yield f"{card}-{entry.name}", (card, entry)


def built_component_cases(choice: Any) -> Iterator[tuple[str, tuple[str, Any]]]:
    """The components whose kind the backend declares it builds."""
    for case_id, (card, entry) in component_cases(choice):
        if choice.record.builds(entry.kind):
            yield case_id, (card, entry)


@functools.cache
def conditioning_image():
    """A fixed 40x48 RGB image (not the output size, so the I2V resize runs)."""
    from PIL import Image

    pixels = (np.random.RandomState(7).rand(40, 48, 3) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def request_for(card: str, *, sde_rollout: bool = False) -> GenerationRequest:
    """The one request every test of ``card`` uses (same shapes everywhere, so a compiling
    backend compiles each graph once): 3 steps at 32x32, Wan with 5 frames and CFG, seed 3; the
    causal card 13 frames in 2 chunks of 2 latent frames (each chunk the DiT input shape of the
    wan2.1-t2v request, so a compiling backend reuses that graph's code) with CFG and a rolling
    window of 3 frames with 1 sink frame (frame 1 is evicted for the second chunk); LTX-2 in two
    stages (2 base steps at 32x32, upsample, the 3 distilled refine steps at 64x64), 5 frames at
    25 fps, 32 text tokens, without CFG (one DiT batch size: a compiling backend compiles the DiT
    for the two stages' sizes only; CFG's 2B batch is Wan's case)."""
    common = dict(num_steps=3, height=32, width=32, seed=3, sde_rollout=sde_rollout)
    if card == "wan2.1-causal-t2v":
        params = DiffusionParams(num_frames=13, chunk_frames=2, local_attn_size=3, sink_size=1,
                                 guidance_scale=5.0, negative_prompt="blurry, low quality",
                                 **common)
    elif card.startswith("wan"):
        params = DiffusionParams(num_frames=5, guidance_scale=5.0,
                                 negative_prompt="blurry, low quality", **common)
    elif card.startswith("ltx2"):
        params = DiffusionParams(**dict(common, num_steps=2, height=64, width=64), num_frames=5,
                                 frame_rate=25.0, guidance_scale=1.0, audio_guidance_scale=1.0,
                                 stages=2, max_sequence_length=32)
    else:
        params = DiffusionParams(guidance_scale=3.5, **common)
    image = conditioning_image() if card in ("wan2.1-i2v", "ltx2-i2v") else None
    return GenerationRequest(prompt=PROMPT, task=MODEL_CARDS[card].task, params=params, image=image)


# -- recording the calls into components ------------------------------------------------------

def flatten(obj: Any, prefix: str = "out", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a component's output (tuples, ModelOutputs, distributions), named by its
    path (``out.latent_dist.mean``), moved to the CPU."""
    if torch.is_tensor(obj):
        return [(prefix, obj.detach().to("cpu").clone())]
    if depth > 6:
        return []
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif isinstance(obj, (tuple, list)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        items = sorted((k, v) for k, v in vars(obj).items() if not k.startswith("_"))
    else:
        return []
    found = []
    for key, value in items:
        found += flatten(value, f"{prefix}.{key}", depth + 1)
    return found


def _clone(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_clone(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _for_cpu(obj: Any) -> Any:
    """Inputs as the cpu build takes them: on the CPU, floating tensors in float32."""
    if torch.is_tensor(obj):
        obj = obj.detach().to("cpu")
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_for_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _for_cpu(v) for k, v in obj.items()}
    return obj


@dataclass
class Call:
    """One call the loop made into a component: its inputs and the tensors it returned."""

    method: str  # "__call__" (forward), "encode" or "decode"
    args: tuple
    kwargs: dict
    outputs: list[tuple[str, torch.Tensor]]

    def replay(self, component: Any) -> list[tuple[str, torch.Tensor]]:
        """The same call on another build of the component (the cpu one), in float32."""
        fn = component if self.method == "__call__" else getattr(component, self.method)
        with torch.no_grad():
            return flatten(fn(*_for_cpu(self.args), **_for_cpu(self.kwargs)))


class _Recorder:
    """Stands in for a component during one serve run: forwards everything, and records the
    first and the latest call of ``forward``, ``encode`` and ``decode``. A proxy rather than a
    hook, so a compiled module is called exactly as in serving (no recompilation)."""

    _METHODS = ("encode", "decode")

    def __init__(self, target: Any, calls: list[Call]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_calls", calls)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name in self._METHODS and callable(attr):
            return functools.partial(self._record, name, attr)
        return attr

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._record("__call__", self._target, *args, **kwargs)

    def _record(self, method: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = _clone(args), _clone(kwargs)
        try:
            out = fn(*args, **kwargs)
        except RuntimeError as exc:  # name the component and the dtypes, not just torch's words
            raise AssertionError(describe_failed_call(self._target, method, args, kwargs, exc)) \
                from exc
        call = Call(method, *inputs, flatten(out))
        same = [i for i, c in enumerate(self._calls) if c.method == method]
        if len(same) >= 2:
            self._calls[same[-1]] = call  # keep the first and the latest
        else:
            self._calls.append(call)
        return out


def _float_dtypes(obj: Any) -> set[str]:
    if torch.is_tensor(obj):
        return {dtype_name(obj.dtype)} if obj.is_floating_point() else set()
    if isinstance(obj, (tuple, list)):
        return set().union(*(_float_dtypes(v) for v in obj)) if obj else set()
    if isinstance(obj, dict):
        return _float_dtypes(list(obj.values()))
    return set()


def describe_failed_call(component: Any, method: str, args: tuple, kwargs: dict,
                         exc: BaseException) -> str:
    """Why a call the serve loop made into a backend's component failed, in the suite's words:
    the component, its parameters' dtypes, the dtypes it was given, and — for a dtype mismatch —
    what a reduced-precision component must do."""
    from flowseam.seam.components import module_dtype

    have = module_dtype(component) or "no parameters"
    given = ", ".join(sorted(_float_dtypes([args, kwargs]))) or "no floating-point tensors"
    text = (f"{type(component).__name__}.{'forward' if method == '__call__' else method} failed "
            f"in the serve loop: the component's parameters are {have}, its floating-point "
            f"inputs were {given}: {type(exc).__name__}: {exc}")
    words = str(exc).lower()
    if "dtype" in words or "scalar type" in words:
        text += (". A component built in reduced precision must accept the inputs the loop "
                 "and other callers hand it (float32 among them): cast them in a forward "
                 "pre-hook, e.g. flowseam.seam.components.cast_inputs(module) "
                 "(docs/writing-a-backend.md, section 5)")
    return text


@contextlib.contextmanager
def recording(model: Any) -> Iterator[dict[str, list[Call]]]:
    """Record the calls into every ``torch.nn.Module`` component of ``model`` (by name)."""
    original = dict(model.components)
    calls: dict[str, list[Call]] = {}
    for name, component in original.items():
        if isinstance(component, torch.nn.Module):
            calls[name] = []
            model.components[name] = _Recorder(component, calls[name])
    try:
        yield calls
    finally:
        model.components.update(original)


def compare_outputs(got: list, want: list, dtype: Any, what: str) -> None:
    """Two flattened outputs: the same names, and equal tensors within ``dtype``'s tolerance
    (integer tensors exactly)."""
    assert [k for k, _ in got] == [k for k, _ in want], \
        f"{what}: outputs {[k for k, _ in got]}, expected {[k for k, _ in want]}"
    for (key, g), (_, w) in zip(got, want):
        if g.is_floating_point():
            assert_model_close(g, w, dtype, f"{what} {key}")
        else:
            assert torch.equal(g.cpu(), w.cpu()), f"{what} {key}: integer outputs differ"
