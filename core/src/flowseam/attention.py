"""Route every attention call of a diffusers transformer through the platform's ``attention`` op.

diffusers' own attention processors (``WanAttnProcessor``, ``FluxAttnProcessor``,
``LTX2AudioVideoAttnProcessor``, ...) end, with the ``native`` backend, in one
``torch.nn.functional.scaled_dot_product_attention`` call on ``(B, heads, seq, dim)`` tensors:
exactly the layout of flowseam's ``attention`` contract. :func:`route_attention` installs,
through diffusers' public ``set_attention_backend`` / ``set_attn_processor`` API, a small
processor that runs the stock processor unchanged inside a ``torch.overrides.TorchFunctionMode``
which sends that one SDPA call to the kernel resolved when the model is loaded (never per step).
No diffusers code is copied and nothing is monkeypatched; undo restores the stock processors.
Under ``torch.compile`` the routed processor runs eagerly between the compiled graphs (why:
:func:`_routed_class`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _SDPARoute(TorchFunctionMode):
    """Sends ``scaled_dot_product_attention`` to ``attn``; every other torch call passes through."""

    def __init__(self, attn: Callable) -> None:
        super().__init__()
        self.attn = attn
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        a = dict(zip(_SDPA_ARGS, args), **kwargs)
        if a.get("dropout_p", 0.0) or a.get("is_causal", False) or a.get("enable_gqa", False):
            raise NotImplementedError(
                "the attention op has no dropout, causal or GQA mode; got "
                f"dropout_p={a.get('dropout_p')}, is_causal={a.get('is_causal')}, "
                f"enable_gqa={a.get('enable_gqa')}")
        self.calls += 1
        return self.attn(a["query"], a["key"], a["value"], attn_mask=a.get("attn_mask"),
                         scale=a.get("scale"))


class RoutedAttnProcessor:
    """Runs a model's own attention processor; only its SDPA call goes to ``attn``.

    Every argument is passed to the inner processor as the attention module gave it (Wan's and
    Flux's processors take ``rotary_emb``, LTX-2's ``query_rotary_emb``/``key_rotary_emb`` and,
    for STG blocks, ``perturbation_mask``). Build it with :func:`routed_processor`, whose class
    has the inner processor's ``__call__`` signature: diffusers' attention modules read that
    signature to decide which keyword arguments to pass (LTX2Attention drops the others).

    :raises RuntimeError: if the inner processor did not call SDPA (a non-native backend would
        silently bypass the seam).
    """

    def __init__(self, inner: Any, attn: Callable) -> None:
        self.inner = inner
        self._mode = _SDPARoute(attn)

    @property
    def calls(self) -> int:
        """How many SDPA calls this processor has sent to ``attn`` so far (public: a backend or
        a test checks with it that a compiled model's attention still goes through the seam)."""
        return self._mode.calls

    def __call__(self, attn_module, *args, **kwargs):
        before = self._mode.calls
        with self._mode:
            out = self.inner(attn_module, *args, **kwargs)
        if self._mode.calls == before:
            raise RuntimeError(f"{type(self.inner).__name__} did not call scaled_dot_product_attention;"
                               " its attention was not routed through the platform")
        return out


def compiling() -> bool:
    """Whether torch.compile is in use in this process (``torch._dynamo`` imported: a compiling
    backend such as accel, or the user's ``torch.compile``). A routed processor is kept out of
    tracing only then: importing dynamo costs seconds a process that never compiles need not
    pay."""
    return "torch._dynamo" in sys.modules


@functools.cache
def _routed_class(inner_cls: type, untraced: bool) -> type:
    """A :class:`RoutedAttnProcessor` subclass whose ``__call__`` signature is ``inner_cls``'s;
    with ``untraced``, excluded from torch.compile's tracing (``torch.compiler.disable``).

    Under ``torch.compile`` (the accel backend compiles the DiT's repeated transformer blocks)
    each attention layer's processor (its projections, RoPE and the routed SDPA call) then runs
    eagerly between the compiled graphs of its block, exactly as in an eager model, and the
    per-call check that the stock processor really called SDPA runs there too. Tracing the mode
    instead broke every block into many small graphs (dynamo cannot trace
    ``Tensor.unflatten``'s ``super()`` call under a ``TorchFunctionMode``), and dynamo compiles
    the mode's ``__torch_function__`` as a frame of its own, where the call counter would be
    traced away or guarded on. A compile-friendly route into the graphs needs a public diffusers
    hook for custom attention backends, which diffusers 0.42 does not have (its backend registry
    is private).
    """
    def __call__(self, *args, **kwargs):
        return RoutedAttnProcessor.__call__(self, *args, **kwargs)

    __call__.__signature__ = inspect.signature(inner_cls.__call__)
    if untraced:
        __call__ = torch.compiler.disable(__call__)
    return type(f"Routed{inner_cls.__name__}", (RoutedAttnProcessor,), {"__call__": __call__})


def routed_processor(inner: Any, attn: Callable) -> RoutedAttnProcessor:
    """``inner`` (a diffusers attention processor) with its SDPA call sent to ``attn``.

    The processor is kept out of torch.compile's tracing when torch.compile is in use in this
    process (``torch._dynamo`` imported: a compiling backend such as accel, or the user's
    ``torch.compile``), and plain otherwise: importing dynamo costs seconds a process that never
    compiles need not pay. A model compiled after it was routed without it still runs right
    (dynamo then traces the processor, with graph breaks)."""
    return _routed_class(type(inner), compiling())(inner, attn)


def route_attention(model: Any, attn: Callable,
                    choose: Callable[[str], Callable] | None = None) -> Callable[[], None]:
    """Send every attention call of diffusers ``model`` (a ``ModelMixin`` with attention
    processors: WanTransformer3DModel, FluxTransformer2DModel, LTX2VideoTransformer3DModel, ...)
    to ``attn(q, k, v, attn_mask=None, scale=None)`` with q/k/v ``(B, heads, seq, head_dim)``.
    A model already routed is re-routed (its stock processors are kept, not wrapped twice).

    :param choose: processor name (``blocks.0.attn1.processor``) → the callable for that layer,
        instead of ``attn`` for every layer (sequence parallelism routes self- and
        cross-attention differently).
    :returns: a callable that restores the model's original processors.
    """
    original = dict(model.attn_processors)
    stock = {name: p.inner if isinstance(p, RoutedAttnProcessor) else p
             for name, p in original.items()}
    model.set_attention_backend("native")
    model.set_attn_processor({name: routed_processor(p, attn if choose is None else choose(name))
                              for name, p in stock.items()})
    return lambda: model.set_attn_processor(original)

