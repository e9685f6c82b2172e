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
    The block's own computation (modulation, norms, residuals, feed-forward) with **the
    parameters as inputs** (``torch.func.functional_call``), so one package serves every block of
    the class, a weight sync that copies new values in needs no new package (an adapter adds
    peft modules: those calls take the ``torch.compile`` path, see below), and nothing of a checkpoint is written to disk. Each **attention module** of the
    block (every submodule with an attention ``processor``) stays out of the graph: the package
    calls back into Python through the custom op ``flowseam_accel::block_attention`` (the
    block's index and the module's name are its arguments), which runs that module eagerly, with
    its projections, RoPE, the platform's attention kernel (:mod:`flowseam.attention`) and the
    cross-attention key/value reuse of :mod:`flowseam.step_constants` — exactly what the
    regional ``torch.compile`` path (:mod:`flowseam_accel.components`) runs there.

    Sizes are dynamic (``torch.export.Dim.AUTO``): the export says which input sizes became
    symbols and their ranges (torch specializes sizes 0 and 1, so a batch of one, i.e. CFG off,
    gets a package of its own); a call runs a package only if every input size is the value or in
    the range the package was exported with (checked on every call, a few integer comparisons),
    else a new one is exported. A package's key is a hash of what the generated code depends on:
    torch, diffusers and this package's versions, the CPU capability, the block's module classes
    and parameter shapes/dtypes, the attention modules' and processors' classes, and the call's
    structure (which arguments are tensors, their dtypes and ranks, the other arguments' values).

When the ``torch.compile`` path runs instead (decided per call)
    gradients enabled (a trainer's recompute: AOTInductor packages are inference-only); a device
    other than the CPU; a block that is not plain torch/diffusers modules outside its attention
    (peft's LoRA layers multiply by Python floats that the package would freeze — adapters stay on
    ``torch.compile``, whose guards see them); hooks on the block or a replaced ``forward`` (diffusers'
    cache hooks); an argument that is neither a tensor nor a plain constant; an attention module
    that returns anything but tensors; or an export that fails (said once with the reason when
    flowseam's notices are on). ``FLOWSEAM_ACCEL_AOT=0`` turns the packages off (read when accel
    builds a DiT; :func:`enabled`).

Where
    In accel's package store (:mod:`flowseam_accel.store`):
    ``<inductor cache dir>/flowseam_accel_aot/<key>-<n>.pt2`` with ``<key>-<n>.json`` (its size
    pattern, output structure and sha256), each written to a temporary file and renamed, so a
    killed or failed compile leaves no half package. A structure whose export or compile failed
    is recorded as ``<key>.failed`` (its reason), so later processes go straight to
    ``torch.compile``. Delete a file, or the directory, to compile again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from flowseam.attention import stock_processor
from flowseam.step_constants import paused
from torch.utils import _pytree as pytree

from . import store
from .store import AOT_ENV, enabled  # noqa: F401 - accel's switch, read when a DiT is built

_LOCK = threading.RLock()
_BLOCKS: list[weakref.ref] = []      # a block's index (its tensor argument to the op) -> block
_EXPORTING = threading.local()      # during an export: attention modules, their outputs' rules
_SIMPLE = (int, float, bool, str, type(None))
_FAILED = object()                  # an export failed for this call structure


class Packages:
    """The packages the blocks of one class (in one model) have loaded: per call structure a
    list of packages (or :data:`_FAILED`), and the paths already loaded."""

    def __init__(self) -> None:
        self.by_call: dict[tuple, list] = {}
        self.paths: set[Path] = set()


def _attention_call(module: Callable[[str], torch.nn.Module], call: str, tensors: list) -> Any:
    name, spec = call.split("|", 1)
    args, kwargs = pytree.tree_unflatten(list(tensors), pytree.treespec_loads(spec))
    return module(name)(*args, **kwargs)


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"an attention module returned {spec}, not only tensors")
    return leaves


def _own(outputs: list[torch.Tensor], inputs: list) -> list[torch.Tensor]:
    """Outputs as the custom op must return them: contiguous (the compiled code reads them with
    the strides the fake implementation gave, which are contiguous) and no input returned."""
    return [t.clone(memory_format=torch.contiguous_format) if any(t is x for x in inputs)
            else t.contiguous() for t in outputs]


@torch.library.custom_op("flowseam_accel::block_attention", mutates_args=())
def block_attention(index: torch.Tensor, call: str,
                    tensors: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """Run attention module ``call`` (``"<name>|<argument structure>"``) of block ``index``
    eagerly on ``tensors`` (its tensor arguments, flattened); its tensor outputs, flattened and
    contiguous."""
    block = _BLOCKS[int(index)]()
    if block is None:
        raise RuntimeError(f"accel: block {int(index)} of an AOT-compiled DiT no longer exists")
    return _own(_flat_outputs(_attention_call(block.get_submodule, call, tensors)), tensors)


@block_attention.register_fake
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


class _AttentionShim(torch.nn.Module):
    """Stands in for an attention module while its block is exported: the graph gets one
    ``block_attention`` call with the module's tensor arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.index: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not all(x is None or isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"attention module {self.name!r} got a non-tensor argument")
        call = f"{self.name}|{pytree.treespec_dumps(spec)}"
        outs = block_attention(self.index, call, leaves)
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


def _state(module: torch.nn.Module) -> tuple:
    return (tuple(module._modules.values()), tuple(module._parameters.values()),
            tuple(module._buffers.values()), len(module._forward_hooks),
            len(module._forward_pre_hooks), _settings(module), module.__dict__.get("forward"))


def _same(module: torch.nn.Module, state: tuple) -> bool:
    now = _state(module)
    return (all(len(a) == len(b) and all(x is y for x, y in zip(a, b))
                for a, b in zip(now[:3], state[:3]))
            and now[3:6] == state[3:6] and now[6] is state[6])


def _plain(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__.split(".")[0] in ("torch", "diffusers") and "forward" not in module.__dict__
            and not module._forward_hooks and not module._forward_pre_hooks)


class AOTBlock:
    """The no-grad forward of one repeated block through a cached AOTInductor package; see the
    module docstring. ``__call__`` returns :data:`NotImplemented` when the call is not one it
    runs (the caller then uses the ``torch.compile`` path)."""

    def __init__(self, block: torch.nn.Module, name: str, packages: Packages) -> None:
        self._block = weakref.ref(block)
        self.name = name
        with _LOCK:
            _BLOCKS.append(self._block)
            self.index = torch.tensor(len(_BLOCKS) - 1)
        self._attention = _attention_names(block)
        # shared by the blocks of one class in one model: fast table and loaded packages
        self._packages = packages
        self._cpu = next(iter(block.parameters()), torch.empty(0)).device.type == "cpu"
        self._said: set[str] = set()
        self._snapshot: list | None = None
        self._cached: dict[str, torch.Tensor] | None = None
        self._settings: tuple = ()

    def _weights(self, block: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The block's parameters and buffers outside its attention modules, or ``None`` when a
        module there is not plain torch/diffusers (see the module docstring).

        Walking the modules costs more than a small block's compiled code, so the result is
        kept with a snapshot of what it depends on (each module's children, parameters,
        buffers, hooks, plain attributes and instance ``forward``), compared on every call: a
        LoRA injection, a replaced parameter, a changed ``eps`` or a new hook is seen at once."""
        snapshot = self._snapshot
        if snapshot is not None and all(_same(m, state) for m, state in snapshot):
            return self._cached
        weights: dict[str, torch.Tensor] | None = {}
        modules = []
        prefixes = tuple(n + "." for n in self._attention)
        for mname, module in block.named_modules():
            if mname in self._attention or mname.startswith(prefixes):
                continue
            modules.append(module)
            if not _plain(module):
                weights = None
            elif weights is not None:
                prefix = f"{mname}." if mname else ""
                weights.update((prefix + n, v) for n, v in module.named_parameters(recurse=False))
                weights.update((prefix + n, v) for n, v in module.named_buffers(recurse=False))
        self._snapshot = [(m, _state(m)) for m in modules]
        self._cached = weights
        self._settings = tuple(_settings(m) for m in modules)
        return weights

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self._block()
        if (block is None or torch.is_grad_enabled() or not self._cpu
                or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks):
            return NotImplemented
        weights = self._weights(block)
        if weights is None or not all(stock_processor(block.get_submodule(n).processor)
                                      for n in self._attention):
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
                self._settings)
        package = self._find(fast, shapes)
        if package is None:
            package = self._build(block, weights, args, kwargs, leaves, fast, shapes)
        if package is _FAILED:
            return NotImplemented
        return package(list(weights.values()) + [self.index] + tensors)

    def _find(self, fast: tuple, shapes: tuple) -> store.Package | object | None:
        """The loaded package for this call, :data:`_FAILED` if its export failed before,
        ``None`` if there is none yet."""
        entry = self._packages.by_call.get(fast, ())
        for package in entry:
            if package is not _FAILED and package.accepts(shapes):
                return package
        return _FAILED if _FAILED in entry else None

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
            "weights": [(n, tuple(w.shape), str(w.dtype)) for n, w in weights.items()],
            "call": spec_str,
            "leaves": [(str(x.dtype), x.dim()) if isinstance(x, torch.Tensor) else repr(x) for x in leaves],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]

    def _build(self, block, weights, args, kwargs, leaves, fast, shapes) -> store.Package | object:
        """Load the package for this call from the store, or export and compile it;
        :data:`_FAILED` (and the ``torch.compile`` path from then on for this call structure) if
        that fails. Called with :data:`_LOCK` held (see :func:`dispatcher`)."""
        entry = self._packages.by_call.setdefault(fast, [])
        key = self._key(block, weights, leaves, fast[0])
        failed = store.recorded_failure(key)
        if failed:   # an earlier process could not export this structure
            self._say(f"accel: {self.name} runs through torch.compile: {failed[1]} "
                      f"(recorded in {failed[0]}; delete it to try again)")
            entry.append(_FAILED)
            return _FAILED
        package, path = store.find(key, shapes, self._packages.paths, entry,
                                   lambda message: self._say(f"accel: {self.name}: {message}"))
        if package is not None:
            return package
        if path is None:   # all size patterns of this key taken
            entry.append(_FAILED)
            return _FAILED
        try:
            meta = _export_and_compile(block, weights, self.index, self._attention, args, kwargs,
                                       path)
        except Exception as exc:  # noqa: BLE001 - any failure: the torch.compile path
            reason, record = store.record_failure(key, exc)
            self._say(f"accel: {self.name} runs through torch.compile: {reason}"
                      + (f" (recorded in {record})" if record else ""))
            entry.append(_FAILED)
            return _FAILED
        package = store.Package(path, meta)
        self._packages.paths.add(path)
        entry.append(package)
        if not package.accepts(shapes):  # cannot happen: exported from these inputs
            entry.append(_FAILED)
            return _FAILED
        return package

    def _say(self, message: str) -> None:
        from flowseam.console import notices_enabled

        if message not in self._said and notices_enabled():
            self._said.add(message)
            print(message, file=sys.stderr)


def _export_and_compile(block, weights, index, attention, args, kwargs, path: Path) -> dict:
    """Export ``block``'s call (parameters and ``index`` as inputs, attention modules as
    ``block_attention`` calls), compile it into the package ``path`` and write its size pattern,
    output structure and sha256 next to it (``.json``) through :func:`flowseam_accel.store.write`
    (a failed compile leaves nothing behind).

    :returns: ``{"pattern": [...], "out": <output treespec>, "sha256": str}`` (see
        :class:`flowseam_accel.store.Package`).
    """
    from torch.export import Dim

    shims = {name: _AttentionShim(name) for name in attention}

    # traced: a copy of the block's module tree (same tensors, its own dicts) whose attention
    # modules are the shims, so the block itself never changes (other threads may run it)
    traced = _structural_copy(block, shims)

    class _Call(torch.nn.Module):
        def forward(self, weights, index, args, kwargs):
            for shim in shims.values():
                shim.index = index
            return torch.func.functional_call(traced, weights, args, kwargs)

    def dims(x):
        return {i: Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None

    args, kwargs = pytree.tree_map(
        lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    dynamic = ({n: None for n in weights}, None, pytree.tree_map(dims, args),
               pytree.tree_map(dims, kwargs))
    saved = {name: block.get_submodule(name) for name in attention}
    _EXPORTING.modules, _EXPORTING.out_specs, _EXPORTING.rules = saved, {}, {}
    # the export runs each attention module once on fake tensors: its routed SDPA call is not
    # a call of the platform's kernel (the count is restored), nor a step's text K/V (paused)
    modes = [m.processor._mode for m in saved.values() if hasattr(m.processor, "_mode")]
    calls = [mode.calls for mode in modes]
    try:
        with torch.no_grad(), store.quiet(), paused():
            _EXPORTING.tracing = True
            program = torch.export.export(_Call(), (weights, index, args, kwargs),
                                          dynamic_shapes=dynamic, strict=False)
            _EXPORTING.tracing = False
            # inductor propagates fake tensors through the graph again: the fake
            # block_attention still needs the attention modules
            return store.write(program, path, skip=len(weights) + 1)
    finally:
        _EXPORTING.modules = None
        for mode, n in zip(modes, calls):
            mode.calls = n


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
