"""Ahead-of-time compiled transformer blocks: one AOTInductor package per block class and input
pattern, cached on disk, so a later process loads machine code instead of tracing with dynamo.

Why
    ``torch.compile`` caches inductor's generated code on disk, but every new process still
    traces the block with dynamo (fake tensors, symbolic shapes, guards) before it can look the
    code up: about 8 CPU s per block class on a small CPU, the bulk of a warm-cache start. An
    AOTInductor package (``torch.export`` + ``torch._inductor.aoti_compile_and_package``; torch's
    documentation "AOTInductor") is a shared library with a C++ wrapper: loading it takes
    milliseconds, and calling it checks no guards and runs no Python between its kernels.

What is compiled
    The block's whole computation (modulation, norms, residuals, feed-forward, and its attention
    modules' projections, q/k norms and RoPE) with **the parameters as inputs**
    (``torch.func.functional_call``), so one package serves every block of the class, a weight
    sync that copies new values in needs no new package (an adapter adds peft modules: those
    calls take the ``torch.compile`` path, see below), and nothing of a checkpoint is written to
    disk. Three things stay out of the graph, each a call of a custom op back into Python with
    the block's index as an argument:

    - the **attention kernel**: a routed processor's SDPA call
      (:func:`flowseam.attention.routed_processor`) becomes ``flowseam_accel::attention``, which
      calls the platform's ``attention`` kernel the processor was routed to and counts the call
      as the eager route does (the kernel stays the dispatch path, ``DESIGN.md``);
    - the submodules whose output :mod:`flowseam.step_constants` reuses across the steps of a
      loop (Wan's ``attn2.to_k``, ``to_v``, ``norm_k``: the text keys and values), through
      ``flowseam_accel::block_module``, so the package reuses them as the eager model does
      instead of recomputing them at every step (their outputs are copied for the package, and
      a copy passed back to the next such module is swapped for its original, so that module's
      reuse still matches by identity);
    - an attention module whose processor is not routed: the whole module, through
      ``flowseam_accel::block_module`` (its processor then calls SDPA itself, as it would in
      the eager model).

    Until 2026-12-02 every attention module was called back whole (projections, RoPE and the
    routed kernel in eager Python): on ``bench/backends.py`` (80 tokens, 4 blocks) those
    callbacks were most of a block's time and accel was no faster than cpu (accel/cpu
    0.98-1.28); tracing them leaves the kernel and the reused text K/V outside (accel/cpu in the
    README's benchmark table).

    Sizes are dynamic (``torch.export.Dim.AUTO``): the export says which input sizes became
    symbols and their ranges (torch specializes sizes 0 and 1, so a batch of one, i.e. CFG off,
    gets a package of its own); a call runs a package only if every input size is the value or in
    the range the package was exported with (checked on every call, a few integer comparisons),
    else a new one is exported. A package's key is a hash of what the generated code depends on:
    torch, diffusers and this package's versions, the CPU capability, the block's module classes
    and parameter shapes/dtypes, the attention modules' and processors' classes, which
    submodules are called back, and the call's structure (which arguments are tensors, their
    dtypes and ranks, the other arguments' values).

When the ``torch.compile`` path runs instead (decided per call)
    gradients enabled (a trainer's recompute: AOTInductor packages are inference-only); a device
    other than the CPU; a block that is not plain torch/diffusers modules outside its attention
    (peft's LoRA layers multiply by Python floats that the package would freeze — adapters stay on
    ``torch.compile``, whose guards see them); hooks on the block or a replaced ``forward`` (diffusers'
    cache hooks); a stateful attention processor (the causal KV cache); an argument that is
    neither a tensor nor a plain constant; a called-back module that returns anything but
    tensors; an attention call with a mask; or an export that fails (said once with the reason when
    flowseam's notices are on). ``FLOWSEAM_ACCEL_AOT=0`` turns the packages off (read when accel
    builds a DiT; :func:`enabled`).

Where
    In accel's package store (:mod:`flowseam_accel.store`):
    ``<inductor cache dir>/flowseam_accel_aot/<key>-<n>.pt2`` with ``<key>-<n>.json`` (its size
    pattern, output structure and sha256), each written to a temporary file and renamed, so a
    killed or failed compile leaves no half package. A structure whose export or compile failed
    for a reason of the program is recorded as ``<key>.failed`` (its reason), so later processes
    go straight to ``torch.compile`` (a killed compiler, lack of memory or a timeout is not
    recorded: store's Failures). Delete a file, or the directory, to compile again.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
import operator
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from flowseam.attention import RoutedAttnProcessor, stock_processor
from flowseam.step_constants import paused, reuses_outputs
from torch.utils import _pytree as pytree

from . import store
from .store import AOT_ENV, enabled  # noqa: F401 - accel's switch, read when a DiT is built

_LOCK = threading.RLock()
# a block's index (its tensor argument to the ops) -> block; an entry leaves with its block, so
# models built and dropped (a trainer's copies, a server's swaps) do not pile up; indexes are
# never reused (a package call in flight keeps its block, and with it its entry, alive)
_BLOCKS: dict[int, weakref.ref] = {}
_INDEXES = itertools.count()
_EXPORTING = threading.local()      # during an export: attention modules, their outputs' rules
_SIMPLE = (int, float, bool, str, type(None))


class Packages:
    """The packages the blocks of one class (in one model) have loaded: per call structure a
    list of packages (or :data:`flowseam_accel.store.FAILED`), and the paths already loaded."""

    def __init__(self) -> None:
        self.by_call: dict[tuple, list] = {}
        self.paths: set[Path] = set()


@functools.lru_cache(maxsize=256)
def _parse_call(call: str) -> tuple[str, pytree.TreeSpec]:
    name, spec = call.split("|", 1)
    return name, pytree.treespec_loads(spec)


def _attention_call(module: Callable[[str], torch.nn.Module], call: str, tensors: list) -> Any:
    name, spec = _parse_call(call)
    args, kwargs = pytree.tree_unflatten(list(tensors), spec)
    return module(name)(*args, **kwargs)


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"an attention module returned {spec}, not only tensors")
    return leaves


def _own(outputs: list[torch.Tensor], inputs: list, copy: bool = False) -> list[torch.Tensor]:
    """Outputs as the custom op must return them: contiguous (the compiled code reads them with
    the strides the fake implementation gave, which are contiguous), no input returned, and
    with ``copy`` none returned as it is."""
    return [t.clone(memory_format=torch.contiguous_format)
            if copy or any(t is x for x in inputs) else t.contiguous() for t in outputs]


# The two operators the packages call back through. Defined with torch.library.Library, not
# torch.library.custom_op: a custom_op's Python autograd and dispatch wrappers cost about
# 0.1 ms a call, as much as a small block's compiled code; these have no autograd (packages
# run without gradients) and the dispatcher calls the Python kernel directly.
_LIBRARY = torch.library.Library("flowseam_accel", "FRAGMENT")  # noqa: TOR901 - kept
_LIBRARY.define("block_module(Tensor index, str call, Tensor?[] tensors) -> Tensor[]")
_LIBRARY.define("attention(Tensor index, str name, Tensor query, Tensor key, Tensor value, "
                "float? scale) -> Tensor")


@torch.library.impl(_LIBRARY, "block_module", "CompositeExplicitAutograd")
def _block_module(index: torch.Tensor, call: str,
                  tensors: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """Run submodule ``call`` (``"<name>|<argument structure>"``) of block ``index`` eagerly on
    ``tensors`` (its tensor arguments, flattened); its tensor outputs, flattened, contiguous and
    owned by the caller (a module that reuses its output across steps returns the tensor it
    keeps: the compiled code may write into its outputs' buffers, so those are copies)."""
    block = _registered_block(index)
    # a copy this op returned earlier, passed back unchanged (its last use has not come yet, so
    # the compiled code cannot have written into it): the module gets the original, so that a
    # reusing module (attn2.norm_k after attn2.to_k) matches its input by identity, not by bits
    tensors = [_originals(t) for t in tensors]
    originals = _flat_outputs(_attention_call(block.get_submodule, call, tensors))
    outputs = _own(originals, tensors, copy=True)
    copies = _COPIES.__dict__.setdefault("by_id", {})
    if len(copies) > 256:   # copies live for one block call; ids are checked by weakref
        copies.clear()
    for copy_, original in zip(outputs, originals):
        copies[id(copy_)] = (weakref.ref(copy_), original)
    return outputs


def _registered_block(index: torch.Tensor) -> torch.nn.Module:
    """The block registered under ``index`` (:data:`_BLOCKS`).

    :raises RuntimeError: when that block no longer exists.
    """
    ref = _BLOCKS.get(int(index))
    block = ref() if ref is not None else None
    if block is None:
        raise RuntimeError(f"accel: block {int(index)} of an AOT-compiled DiT no longer exists")
    return block


_COPIES = threading.local()   # per thread: id(copy block_module returned) -> (weakref, original)


def _originals(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    entry = getattr(_COPIES, "by_id", {}).get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else t


@torch.library.impl(_LIBRARY, "attention", "CompositeExplicitAutograd")
def _attention(index: torch.Tensor, name: str, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """The platform's attention kernel, as attention module ``name`` of block ``index`` routes
    it (:func:`flowseam.attention.routed_processor`): ``(B, heads, S_q, D)`` query,
    ``(B, heads, S_kv, D)`` key/value, float, on the CPU -> ``(B, heads, S_q, D_v)``, contiguous.
    The call is counted by the processor's route as an eager call is."""
    block = _registered_block(index)
    route = block.get_submodule(name).processor._mode
    route.calls += 1
    return route.attn(query, key, value, attn_mask=None, scale=scale).contiguous()


@torch.library.register_fake("flowseam_accel::attention", lib=_LIBRARY)
def _(index, name, query, key, value, scale):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


block_module = torch.ops.flowseam_accel.block_module.default
attention = torch.ops.flowseam_accel.attention.default


@torch.library.register_fake("flowseam_accel::block_module", lib=_LIBRARY)
def _(index, call, tensors):
    # Only while a block is exported and compiled. The export runs each attention module on
    # fake tensors and notes how its output sizes follow from its input sizes; inductor's later
    # propagations (several per compile, a second each through the routed processor) reuse it.
    rule = _EXPORTING.rules.get(call)
    if not _EXPORTING.tracing and rule:
        return [tensors[k].new_empty([tensors[i].shape[j] if i >= 0 else j for i, j in dims],
                                     dtype=dtype) for k, dtype, dims in rule]
    out = _attention_call(_EXPORTING.modules.__getitem__, call, tensors)
    outputs = _own(_flat_outputs(out), tensors)
    _EXPORTING.out_specs[call] = pytree.tree_flatten(out)[1]
    derived = _size_rule(outputs, tensors)
    if rule is None or rule == derived:
        _EXPORTING.rules[call] = derived
    else:
        _EXPORTING.rules[call] = False   # two call sites disagree: always run the module
    return outputs


def _size_rule(outputs: list[torch.Tensor], inputs: list) -> list | bool:
    """Per output ``(input to allocate like, dtype, [(input, dim) or (-1, size)])``, or
    ``False`` when an output size is not an input's size or a constant."""
    sizes = {}
    for i, x in enumerate(inputs):
        for j, size in enumerate(x.shape if isinstance(x, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                sizes.setdefault(str(size.node.expr), (i, j))
    like = next((i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)), None)
    rule = []
    for out in outputs:
        dims = []
        for size in out.shape:
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                dims.append((-1, int(size)))
            elif str(size.node.expr) in sizes:
                dims.append(sizes[str(size.node.expr)])
            else:
                return False
        if like is None or out.device != inputs[like].device:
            return False
        rule.append((like, out.dtype, dims))
    return rule


class _CallbackShim(torch.nn.Module):
    """Stands in for a submodule that runs eagerly while its block is exported: the graph gets
    one ``block_module`` call with the module's tensor arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.index: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not all(x is None or isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"submodule {self.name!r} got a non-tensor argument")
        call = f"{self.name}|{pytree.treespec_dumps(spec)}"
        outs = block_module(self.index, call, leaves)
        return pytree.tree_unflatten(outs, _EXPORTING.out_specs[call])


def _attention_names(block: torch.nn.Module) -> list[str]:
    names: list[str] = []
    for name, module in block.named_modules():
        if name and hasattr(module, "processor") and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def _settings(module: torch.nn.Module) -> tuple:
    """The module's plain attributes (``eps``, ``approximate``, ``normalized_shape``,
    ``training``, ...): the export freezes them into the package, so they are part of its key."""
    return tuple((k, v) for k, v in module.__dict__.items()
                 if not k.startswith("_") and (isinstance(v, _SIMPLE) or (
                     isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v))))


class _Snapshot:
    """What a block's plan (:meth:`AOTBlock._weights`) depends on: for each of its modules the
    dicts of children, parameters, buffers and forward (pre-)hooks and the instance ``__dict__``
    (plain attributes such as ``eps``, an instance ``forward``, an attention ``processor``),
    with the keys and values they held, compared by identity (immutable values that are the
    same object are equal; a changed value is a new object). The comparison runs in C
    (``itertools.chain``, ``map(operator.is_, ...)``): a few microseconds for a block of ~30
    modules, where building and comparing per-module tuples cost 0.4 ms, about a tenth of the
    block's compiled code."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.dicts = [d for m in modules for d in (m._modules, m._parameters, m._buffers,
                                                    m._forward_hooks, m._forward_pre_hooks,
                                                    m.__dict__)]
        self.keys, self.values = self._contents()

    def _contents(self) -> tuple[list, list]:
        return (list(itertools.chain.from_iterable(self.dicts)),
                list(itertools.chain.from_iterable(map(dict.values, self.dicts))))

    def holds(self) -> bool:
        """Whether every watched dict still holds the same keys and the same objects."""
        keys, values = self._contents()
        return (len(values) == len(self.values) and all(map(operator.is_, values, self.values))
                and all(map(operator.is_, keys, self.keys)))


def _plain(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__.split(".")[0] in ("torch", "diffusers") and "forward" not in module.__dict__
            and not module._forward_hooks and not module._forward_pre_hooks)


class AOTBlock:
    """The no-grad forward of one repeated block through a cached AOTInductor package; see the
    module docstring. ``__call__`` returns :data:`NotImplemented` when the call is not one it
    runs (the caller then uses the ``torch.compile`` path)."""

    def __init__(self, block: torch.nn.Module, name: str, packages: Packages) -> None:
        index = next(_INDEXES)   # atomic under the GIL
        # the callback takes no lock: it runs wherever the block is collected
        self._block = weakref.ref(block, lambda _: _BLOCKS.pop(index, None))
        _BLOCKS[index] = self._block
        self.index = torch.tensor(index)
        self.name = name
        self._attention = _attention_names(block)
        # shared by the blocks of one class in one model: fast table and loaded packages
        self._packages = packages
        self._cpu = next(iter(block.parameters()), torch.empty(0)).device.type == "cpu"
        self._said: set[str] = set()
        self._snapshot: _Snapshot | None = None
        self._cached: dict[str, torch.Tensor] | None = None
        self._settings: tuple = ()
        self._inline: tuple[str, ...] = ()      # attention modules traced into the package
        self._callbacks: tuple[str, ...] = ()   # submodules the package calls back eagerly

    def _weights(self, block: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The parameters and buffers the package takes (the block's, less those of the
        submodules it calls back), or ``None`` when the call must take the ``torch.compile``
        path: an attention processor that is not one of diffusers' own (stateful), or a module
        the package would trace that is not plain torch/diffusers (see the module docstring).

        Also decides what the package calls back eagerly (:attr:`_callbacks`): the submodules
        whose output :mod:`flowseam.step_constants` reuses across steps (the cross-attention's
        text keys and values: a compiled copy would recompute them at every step) and the
        attention modules whose processor is not routed through the platform (the package
        then calls the whole module, whose SDPA call is the processor's own). Routed attention
        modules are traced into the package (:attr:`_inline`), their SDPA call as
        :func:`attention`.

        Walking the modules costs more than a small block's compiled code, so the result is
        kept with a snapshot of what it depends on (each module's children, parameters,
        buffers, hooks, plain attributes and instance ``forward``, and the processors),
        compared on every call: a LoRA injection, a replaced parameter, a changed ``eps``, a new
        hook or processor is seen at once."""
        if self._snapshot is not None and self._snapshot.holds():
            return self._cached
        processors = [block.get_submodule(n).processor for n in self._attention]
        weights: dict[str, torch.Tensor] | None = {}
        if not all(stock_processor(p) for p in processors):
            weights = None
        # routed through the platform: the export turns their SDPA call into attention()
        inline = tuple(n for n, p in zip(self._attention, processors)
                       if isinstance(p, RoutedAttnProcessor))
        callbacks = [n for n in self._attention if n not in inline]
        modules = [block.get_submodule(n) for n in self._attention]  # their processors
        for mname, module in block.named_modules():
            if any(mname.startswith(n + ".") for n in callbacks):
                continue
            modules.append(module)
            if mname in callbacks:
                continue
            if mname and reuses_outputs(module):
                callbacks.append(mname)
            elif not _plain(module):
                weights = None
            elif weights is not None:
                prefix = f"{mname}." if mname else ""
                weights.update((prefix + n, v) for n, v in module.named_parameters(recurse=False))
                weights.update((prefix + n, v) for n, v in module.named_buffers(recurse=False))
        self._snapshot = _Snapshot(modules)
        self._cached = weights
        self._settings = tuple(_settings(m) for m in modules)
        self._inline, self._callbacks = inline, tuple(callbacks)
        return weights

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self._block()
        if (block is None or torch.is_grad_enabled() or not self._cpu
                or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks):
            return NotImplemented
        weights = self._weights(block)
        if weights is None:
            return NotImplemented
        leaves, spec = pytree.tree_flatten((args, kwargs))
        # contiguous, as exported: the generated code computes strides from the sizes
        tensors = [x.contiguous() for x in leaves if isinstance(x, torch.Tensor)]
        if len(tensors) + sum(isinstance(x, _SIMPLE) for x in leaves) != len(leaves):
            return NotImplemented
        shapes = tuple(tuple(t.shape) for t in tensors)
        fast = (str(spec), tuple(x if not isinstance(x, torch.Tensor) else (x.dtype, x.device.type)
                                 for x in leaves),
                tuple((n, w.dtype, w.shape, w.device.type) for n, w in weights.items()),
                self._settings, self._inline, self._callbacks)
        package = self._find(fast, shapes)
        if package is None:
            package = self._build(block, weights, args, kwargs, leaves, fast, shapes)
        if package is store.FAILED:
            return NotImplemented
        return package(list(weights.values()) + [self.index] + tensors)

    def _find(self, fast: tuple, shapes: tuple) -> store.Package | object | None:
        """The loaded package for this call (:func:`flowseam_accel.store.loaded`)."""
        return store.loaded(self._packages.by_call.get(fast, ()), shapes)

    def _key(self, block: torch.nn.Module, weights: dict, leaves: list, spec_str: str) -> str:
        import diffusers

        from . import __version__

        described = {
            "torch": torch.__version__, "diffusers": diffusers.__version__, "accel": __version__,
            "python": sys.version_info[:2], "cpu": torch.backends.cpu.get_cpu_capability(),
            "block": f"{type(block).__module__}.{type(block).__qualname__}",
            "modules": [f"{n}:{type(m).__module__}.{type(m).__qualname__}:{_settings(m)!r}"
                        for n, m in block.named_modules()],
            "processors": {n: type(block.get_submodule(n).processor).__qualname__ for n in self._attention},
            "inline": self._inline, "callbacks": self._callbacks,
            "weights": [(n, tuple(w.shape), str(w.dtype)) for n, w in weights.items()],
            "call": spec_str,
            "leaves": [(str(x.dtype), x.dim()) if isinstance(x, torch.Tensor) else repr(x) for x in leaves],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]

    def _build(self, block, weights, args, kwargs, leaves, fast, shapes) -> store.Package | object:
        """Load the package for this call from the store, or export and compile it;
        :data:`store.FAILED <flowseam_accel.store.FAILED>` (and the ``torch.compile`` path from
        then on for this call structure) if that fails (:func:`flowseam_accel.store.obtain`).
        Called with :data:`_LOCK` held (see :func:`dispatcher`)."""
        return store.obtain(
            self._key(block, weights, leaves, fast[0]), shapes, self._packages.paths,
            self._packages.by_call.setdefault(fast, []),
            lambda path: _export_and_compile(block, weights, self.index, self._inline,
                                             self._callbacks, args, kwargs, path),
            lambda message: self._say(f"accel: {self.name}: {message}"))

    def _say(self, message: str) -> None:
        from flowseam.console import notices_enabled

        if message not in self._said and notices_enabled():
            self._said.add(message)
            print(message, file=sys.stderr)


def _export_and_compile(block, weights, index, inline, callbacks, args, kwargs,
                        path: Path) -> dict:
    """Export ``block``'s call (parameters and ``index`` as inputs; the attention modules
    ``inline`` traced, their routed SDPA call as an :func:`attention` call; the submodules
    ``callbacks`` as ``block_module`` calls), compile it into the package ``path`` and write its
    size pattern, output structure and sha256 next to it (``.json``) through
    :func:`flowseam_accel.store.write` (a failed compile leaves nothing behind).

    :returns: ``{"pattern": [...], "out": <output treespec>, "sha256": str}`` (see
        :class:`flowseam_accel.store.Package`).
    """
    from torch.export import Dim

    shims = {name: _CallbackShim(name) for name in callbacks}

    # traced: a copy of the block's module tree (same tensors, its own dicts) whose called-back
    # modules are the shims, so the block itself never changes (other threads may run it)
    traced = _structural_copy(block, shims)
    traced_index: list[torch.Tensor] = []

    def routed_to_op(name: str) -> Callable:
        def attn(query, key, value, attn_mask=None, scale=None):
            if attn_mask is not None:
                raise NotImplementedError(f"attention module {name!r} passes an attention mask")
            return attention(traced_index[0], name, query, key, value, scale)
        return attn

    class _Call(torch.nn.Module):
        def forward(self, weights, index, args, kwargs):
            for shim in shims.values():
                shim.index = index
            traced_index[:] = [index]
            return torch.func.functional_call(traced, weights, args, kwargs)

    def dims(x):
        return {i: Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None

    args, kwargs = pytree.tree_map(
        lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    dynamic = ({n: None for n in weights}, None, pytree.tree_map(dims, args),
               pytree.tree_map(dims, kwargs))
    saved = {name: block.get_submodule(name) for name in callbacks}
    _EXPORTING.modules, _EXPORTING.out_specs, _EXPORTING.rules = saved, {}, {}
    # the export runs each called-back attention module once on fake tensors: its routed SDPA
    # call is not a call of the platform's kernel (the count is restored), nor a step's text
    # K/V (paused); the traced ones send it to the op instead of the kernel while tracing
    routes = {name: m.processor._mode for name, m in block.named_modules()
              if hasattr(getattr(m, "processor", None), "_mode")}
    kernels = {name: route.attn for name, route in routes.items()}
    calls = {name: route.calls for name, route in routes.items()}
    try:
        with torch.no_grad(), store.quiet(), paused():
            for name in inline:
                routes[name].attn = routed_to_op(name)
            _EXPORTING.tracing = True
            try:
                program = torch.export.export(_Call(), (weights, index, args, kwargs),
                                              dynamic_shapes=dynamic, strict=False)
            finally:
                _EXPORTING.tracing = False
                for name, route in routes.items():
                    route.attn = kernels[name]
            # inductor propagates fake tensors through the graph again: the fake
            # block_module still needs the called-back modules
            return store.write(program, path, skip=len(weights) + 1)
    finally:
        _EXPORTING.modules = None
        for name, route in routes.items():
            route.calls = calls[name]


def _structural_copy(module: torch.nn.Module, replace: dict[str, torch.nn.Module],
                     prefix: str = "") -> torch.nn.Module:
    """``module`` and its submodules as new objects with their own parameter, buffer and
    submodule dicts (the same tensors, no data copied) and no compiled call; the submodules
    named in ``replace`` (qualified names) replaced."""
    clone = copy.copy(module)   # nn.Module.__getstate__ leaves _compiled_call_impl out
    clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
    clone._modules = {
        name: replace.get(prefix + name) or (
            None if child is None else _structural_copy(child, replace, f"{prefix}{name}."))
        for name, child in module._modules.items()}
    return clone


def dispatcher(block: torch.nn.Module, name: str, packages: Packages,
               compiled_call: Callable) -> Callable:
    """A block's call: its AOTInductor package when :class:`AOTBlock` runs the call, else
    ``compiled_call`` (the ``torch.compile``'d ``_call_impl``).

    Calls of accel's compiled blocks run one at a time in a process (:data:`_LOCK`): an export
    swaps the block's attention modules and parameters while it traces (another thread would
    run the shims), and a package's runner is not reentrant (a second thread waiting for it
    inside the C++ call, holding the GIL, deadlocked the first one's attention callback).
    Waiting on this lock releases the GIL; on a CPU the intra-op threads keep the cores busy
    anyway."""
    aot = AOTBlock(block, name, packages)

    def call(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            out = aot(*args, **kwargs)
            return compiled_call(*args, **kwargs) if out is NotImplemented else out

    call.aot = aot
    return call
