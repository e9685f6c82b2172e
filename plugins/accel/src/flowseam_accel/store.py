"""The on-disk store of accel's AOTInductor packages, shared by everything accel compiles ahead
of time: the DiT blocks (:mod:`flowseam_accel.aot`) and the solver kernels
(:class:`flowseam_accel.compiled.AOTFunction`, used by :mod:`flowseam_accel.kernels`).

A package is a ``torch.export``'ed program compiled by
``torch._inductor.aoti_compile_and_package`` (torch's documentation "AOTInductor"): a shared
library with a C++ wrapper that a later process loads with
``torch._C._aoti.AOTIModelPackageLoader`` in milliseconds, without importing inductor or
tracing with dynamo, and calls with a flat list of tensors.

Layout
    ``<inductor cache dir>/flowseam_accel_aot/`` (:func:`folder`: under
    ``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``) holds, per key (a hash
    the caller computes from everything the generated code depends on):

    * ``<key>-<n>.pt2``, ``n`` = 0 .. 15: one package per input size pattern;
    * ``<key>-<n>.json``: ``{"pattern": [...], "out": <output treespec>, "sha256": <of the .pt2>}``
      (the pattern: per tensor input, per dimension, an exact size or ``[symbol, low, high]``,
      see :class:`Package`); written last, so a package without one does not count;
    * ``<key>.failed``: why exporting or compiling for that key failed (the caller then takes its
      ``torch.compile`` path, in this process and in later ones; see Failures).

    Every file is written to a temporary file and renamed (:func:`flowseam.media.atomic_path`),
    so a killed or failed compile leaves no half package. Delete a file, or the folder, to
    compile again; a ``.pt2`` that does not load or does not match its ``.json``'s sha256 is
    compiled again.

Failures
    A failed export or compile sends the call to the caller's ``torch.compile`` path, said
    through its notice with the reason. It is recorded in ``<key>.failed`` (and later processes
    go straight to ``torch.compile``) only when it is a property of the program: torch.export
    cannot trace it (a size derived from others, e.g. FLUX.1's rotary size; an attention mask;
    data-dependent control flow), inductor cannot lower it, the C++ compiler rejects the
    generated code. It is not recorded when it says nothing about the program
    (:func:`transient`): a ``MemoryError``, ``torch.OutOfMemoryError`` or torch's
    ``DefaultCPUAllocator: can't allocate memory``; a timeout (``TimeoutError``,
    ``subprocess.TimeoutExpired``; inductor's compile-worker wait re-raises it as a
    ``RuntimeError`` from it); a crashed compile-worker pool (``BrokenProcessPool``); a C++
    compiler killed by a signal (inductor's ``CppCompileError`` is raised from the compiler's
    ``subprocess.CalledProcessError``, whose ``returncode`` is then negative) or whose driver
    says its compiler process was killed or ran out of memory (GCC's ``Killed signal terminated
    program cc1plus`` when the OOM killer picks ``cc1plus``, ``virtual memory exhausted``); nor
    when writing the record is what failed (``OSError``, :class:`flowseam.errors.FlowseamError`).
    An exception counts as transient when it, or one it was raised from or while handling
    (``__cause__``, ``__context__``: inductor re-raises a lowering error ``from None``), is one
    of these (a ``KeyboardInterrupt`` too; raised itself, it is not caught). The process that
    saw a transient failure keeps the ``torch.compile`` path for that key, for every model it
    builds (it does not retry in a loop); the next process tries again. Such failures are
    counted in ``<key>.transient`` (plain text, removed when an export of the key succeeds): the
    :data:`TRANSIENT_LIMIT` th in a row is recorded in ``<key>.failed`` as any other, so a
    compile that runs out of memory on this machine every time is not retried by every process. What the caller was
    handling when the export started (a server retrying after a timeout, a trainer after an
    out-of-memory error) is not looked at, and only inductor's and the compiler's messages are
    read (an export error quotes the user's source). The keys hash torch's version
    (``aot.AOTBlock._key``, ``compiled.AOTFunction._key``), so a torch upgrade looks up new
    keys and retries what failed before.

Switch
    ``FLOWSEAM_ACCEL_AOT=0`` turns the packages off (:func:`enabled`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from flowseam.errors import FlowseamError
from flowseam.media import atomic_path
from flowseam.plugins import env_switch
from torch.utils import _pytree as pytree

AOT_ENV = "FLOWSEAM_ACCEL_AOT"
MAX_PATTERNS = 16   # size patterns (packages) kept per key
TRANSIENT_LIMIT = 3  # failures of the run in a row after which a key is recorded as failed
FAILED = object()   # in a caller's list of packages: exporting or compiling for its key failed


def enabled() -> bool:
    """Whether accel uses AOTInductor packages: ``FLOWSEAM_ACCEL_AOT``, default on (unset or
    empty), read by :func:`flowseam.plugins.env_switch`.

    :raises ValueError: for a value that is neither on (``1``, ``true``, ``yes``, ``on``) nor
        off (``0``, ``false``, ``no``, ``off``), naming it: accel reads it before it loads a DiT.
    """
    return env_switch(AOT_ENV, True)


def folder() -> Path:
    """``<inductor cache dir>/flowseam_accel_aot`` (not created here)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "flowseam_accel_aot"


def count_event(built: bool) -> None:
    """Book that the current call built (``built``) or loaded a package
    (:func:`flowseam_accel.compiled.count_compile_event`)."""
    from . import compiled

    compiled.count_compile_event(built)


class Package:
    """A loaded package and the input sizes it accepts: per tensor argument, per dimension, an
    ``int`` (that exact size) or ``(symbol, low, high)`` (any size in ``[low, high]``, equal
    wherever the symbol recurs).

    :raises ValueError: when ``meta``'s sha256 is not the package's (a ``.json`` and a ``.pt2``
        of two different writes); the loader's ``RuntimeError`` for a damaged package.
    """

    def __init__(self, path: Path, meta: dict) -> None:
        if sha256(path) != meta["sha256"]:
            raise ValueError("the package is not the one its size pattern was written for")
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self.pattern = [[tuple(d) if isinstance(d, list) else d for d in dims]
                        for dims in meta["pattern"]]
        self.out_spec = pytree.treespec_loads(meta["out"])

    def __call__(self, flat: list[torch.Tensor]) -> Any:
        """Run on ``flat`` (the exported program's inputs, in order; the list is consumed);
        the outputs in the program's output structure."""
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def accepts(self, shapes: tuple) -> bool:
        if len(shapes) != len(self.pattern):
            return False
        seen: dict[str, int] = {}
        for shape, dims in zip(shapes, self.pattern):
            if len(shape) != len(dims):
                return False
            for size, d in zip(shape, dims):
                if isinstance(d, int):
                    if size != d:
                        return False
                elif not (d[1] <= size <= d[2]) or seen.setdefault(d[0], size) != size:
                    return False
        return True


def recorded_failure(key: str) -> tuple[Path, str] | None:
    """``(record, reason)`` when an earlier process recorded that ``key`` failed, else ``None``."""
    failed = folder() / f"{key}.failed"
    return (failed, failed.read_text()) if failed.is_file() else None


def record_failure(key: str, exc: BaseException,
                   outer: BaseException | None = None) -> tuple[str, Path | None]:
    """``(reason, record)``: why exporting or compiling for ``key`` failed, recorded in
    ``<key>.failed`` for later processes unless writing was what failed (an ``OSError`` or
    :class:`flowseam.errors.FlowseamError`, e.g. a full disk) or the failure is
    :func:`transient` and fewer than :data:`TRANSIENT_LIMIT` in a row; then ``record`` is
    ``None``. A transient failure is counted in ``<key>.transient`` (see Failures in the module
    docstring)."""
    reason = f"exporting it for AOTInductor failed ({_first_line(exc)})"
    failed = folder() / f"{key}.failed"
    if transient(exc, outer):
        _FAILED_HERE[key] = reason   # this process does not try it again, for any model
        count = _count_transient(key)
        if count < TRANSIENT_LIMIT:
            return f"{reason}; {count} of {TRANSIENT_LIMIT} such failures in a row", None
        reason = f"{reason}; {count} failures of the run in a row"
    elif isinstance(exc, (OSError, FlowseamError)):
        return reason, None
    with contextlib.suppress(OSError, FlowseamError), atomic_path(failed) as tmp:
        tmp.write_text(reason)
    return reason, (failed if failed.is_file() else None)


def _count_transient(key: str) -> int:
    """Add one to ``<key>.transient`` (a count in plain text; 0 if it is missing or unreadable)
    and return the new count (1 if it cannot be written)."""
    path = folder() / f"{key}.transient"
    try:
        count = int(path.read_text()) + 1
    except (OSError, ValueError):
        count = 1
    with contextlib.suppress(OSError, FlowseamError), atomic_path(path) as tmp:
        tmp.write_text(str(count))
    return count


# keys whose export or compile failed transiently in this process: not recorded on disk (the
# next process tries again), but not tried again here, whichever model asks (a new model of
# the same config would otherwise export and compile again, and run out of memory again)
_FAILED_HERE: dict[str, str] = {}


# what a C++ compiler's driver prints when the OOM killer or a signal ended its compiler
# process (GCC: "g++: fatal error: Killed signal terminated program cc1plus"; clang: "unable to
# execute command: Killed") or when that process ran out of memory
_KILLED = re.compile(r"(Killed|Terminated|Interrupt) signal terminated program"
                     r"|unable to execute command: (Killed|Terminated|Interrupt)"
                     r"|virtual memory exhausted|out of memory allocating")
# torch's CPU allocator (c10/core/impl/alloc_cpu.cpp). Stricter than flowseam.faults'
# is_out_of_memory (any RuntimeError saying "can't allocate memory"), which serves blame, not
# recording: torch.export's errors are RuntimeErrors that quote the user's source line
_ALLOCATOR = re.compile(r"DefaultCPUAllocator: can't allocate memory")


def transient(exc: BaseException, outer: BaseException | None = None) -> bool:
    """Whether ``exc`` is a failure of this run, not of the program exported (see Failures in
    the module docstring): it, or an exception in its ``__cause__``/``__context__`` chain, is a
    ``MemoryError``, ``torch.OutOfMemoryError``, ``TimeoutError``,
    ``subprocess.TimeoutExpired``, ``BrokenProcessPool``, ``KeyboardInterrupt``, a
    ``subprocess.CalledProcessError`` of a process killed by a signal (negative
    ``returncode``), or an error whose message is a compiler's or torch's allocator's report of
    a killed process or exhausted memory. ``outer`` (the exception the caller was handling
    when the export started, ``sys.exc_info()``) and its chain are not looked at: Python makes
    it the ``__context__`` of whatever the export raises, and it says nothing about the export.
    Only inductor's errors (``CppCompileError``, a compile worker's) and ``CalledProcessError``
    are read for a compiler's report, only a ``RuntimeError`` for the allocator's: other
    errors' messages quote the user's source code."""
    from concurrent.futures.process import BrokenProcessPool

    kinds = (MemoryError, torch.OutOfMemoryError, TimeoutError, subprocess.TimeoutExpired,
             BrokenProcessPool, KeyboardInterrupt)
    callers = {id(e) for e in _chain(outer)}   # the caller's exception and its chain
    for e in _chain(exc, skip=callers):
        # inductor's errors (CppCompileError, a compile worker's) and the compiler process's
        compiler = (type(e).__module__.startswith("torch._inductor")
                    or isinstance(e, subprocess.CalledProcessError))
        if (isinstance(e, kinds)
                or (compiler and _KILLED.search(f"{e} {getattr(e, 'output', '')}"))
                or (isinstance(e, RuntimeError) and _ALLOCATOR.search(str(e)))
                or (isinstance(e, subprocess.CalledProcessError) and e.returncode < 0)):
            return True
    return False


def _chain(exc: BaseException | None,
           skip: set[int] | frozenset[int] = frozenset()) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling (``__cause__``,
    ``__context__``, recursively), each once, leaving out those whose ``id`` is in ``skip``
    (and what only they lead to)."""
    seen, pending = set(skip), [exc]
    while pending:
        e = pending.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            yield e
            pending += [e.__cause__, e.__context__]


def find(key: str, shapes: tuple, loaded: set[Path], found: list,
         say: Callable[[str], None]) -> tuple[Package | None, Path | None]:
    """Load ``key``'s packages not in ``loaded`` yet, in order, until one accepts ``shapes``.

    Each package loaded is appended to ``found`` and its path added to ``loaded`` (so a process
    loads a package once). A package that does not load is announced through ``say`` and its
    ``.json`` removed (it is compiled again).

    :returns: ``(package, None)`` for a package that accepts ``shapes`` (booked with
        :func:`count_event`); ``(None, path)`` with the path for a new package of ``key``; or
        ``(None, None)`` when all :data:`MAX_PATTERNS` are taken.
    """
    base = folder()
    for suffix in range(MAX_PATTERNS):
        path = base / f"{key}-{suffix}.pt2"
        meta = path.with_suffix(".json")
        if path in loaded:
            continue
        if not meta.exists():
            return None, path
        try:
            package = Package(path, json.loads(meta.read_text()))
        except Exception as exc:  # noqa: BLE001 - damaged, or .json of another .pt2: redo
            say(f"compiling again: the cached package {path} does not load ({_first_line(exc)})")
            meta.unlink(missing_ok=True)
            return None, path
        loaded.add(path)
        found.append(package)
        if package.accepts(shapes):
            count_event(built=False)
            return package, None
    return None, None


def loaded(found: list, shapes: tuple) -> Package | object | None:
    """Among ``found`` (the packages one call structure has loaded, perhaps :data:`FAILED`), the
    one that accepts ``shapes``; :data:`FAILED` if none does and its export failed before;
    ``None`` if there is none yet (then :func:`obtain`)."""
    for package in found:
        if package is not FAILED and package.accepts(shapes):
            return package
    return FAILED if FAILED in found else None


def obtain(key: str, shapes: tuple, paths: set[Path], found: list,
           export: Callable[[Path], dict], say: Callable[[str], None]) -> Package | object:
    """The package of ``key`` for ``shapes``: loaded from the store (:func:`find`), or made by
    ``export(path)`` (which exports, compiles and :func:`write` s it, returning the ``.json``'s
    content) and loaded; appended to ``found``, its path added to ``paths``.

    :returns: the package, or :data:`FAILED` (also appended to ``found``) when an earlier
        process recorded that ``key`` fails, when all size patterns are taken, or when the export,
        compile or load fails (recorded by :func:`record_failure`); each said through ``say``.
    """
    failed = recorded_failure(key)
    if failed:   # an earlier process could not export it
        say(f"runs through torch.compile: {failed[1]} (recorded in {failed[0]}; "
            "delete it to try again)")
        found.append(FAILED)
        return FAILED
    if key in _FAILED_HERE:   # failed transiently in this process (for another model)
        say(f"runs through torch.compile: {_FAILED_HERE[key]} (earlier in this process; "
            "not recorded: the next process tries again)")
        found.append(FAILED)
        return FAILED
    outer = sys.exc_info()[1]
    package, path = find(key, shapes, paths, found, say)
    if package is not None:
        return package
    if path is not None:
        try:
            package = Package(path, export(path))
        except Exception as exc:  # noqa: BLE001 - any failure: the caller's torch.compile path
            reason, record = record_failure(key, exc, outer)
            say(f"runs through torch.compile: {reason}"
                + (f" (recorded in {record})" if record
                   else " (not recorded: the next process tries again)"))
        else:
            (folder() / f"{key}.transient").unlink(missing_ok=True)   # the count is "in a row"
            paths.add(path)
            found.append(package)
            if package.accepts(shapes):   # exported from these shapes: always
                return package
    found.append(FAILED)   # all size patterns taken, or the export failed
    return FAILED


def write(program: torch.export.ExportedProgram, path: Path, skip: int = 0) -> dict:
    """Compile ``program`` into the package ``path`` and write its ``.json`` (size pattern of its
    inputs after the first ``skip``, output structure, sha256), each to a temporary file renamed
    into place, the ``.json`` last.

    :returns: the ``.json``'s content (see :class:`Package`).
    :raises ValueError: when an input size is an expression of others (not a pattern); any
        error of the compile (nothing is left behind).
    """
    inputs = [n for n in program.graph.nodes if n.op == "placeholder"][skip:]
    pattern = [[_dim(size, program.range_constraints) for size in n.meta["val"].shape]
               for n in inputs if isinstance(n.meta.get("val"), torch.Tensor)]
    # atomic_path's temporary file keeps the .pt2 suffix aoti_compile_and_package wants
    with atomic_path(path) as tmp:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        meta = {"pattern": pattern, "out": pytree.treespec_dumps(program.call_spec.out_spec),
                "sha256": sha256(tmp)}
    with atomic_path(path.with_suffix(".json")) as tmp:  # last: then the package counts
        tmp.write_text(json.dumps(meta))
    count_event(built=True)
    return meta


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dim(size, ranges) -> int | list:
    """An exported input size as :class:`Package` checks it: ``int`` or ``[symbol, low, high]``."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    if getattr(expr, "is_number", True):
        return int(expr)
    if not expr.is_symbol:
        raise ValueError(f"an input size is an expression of others ({expr})")
    return [str(expr), int(ranges[expr].lower), _upper(ranges[expr].upper)]


def _upper(value) -> int:
    try:
        return int(value)
    except Exception:  # noqa: BLE001 - torch's int_oo (no upper bound) has no int value
        return sys.maxsize


@contextlib.contextmanager
def quiet():
    """torch.export warns for each size it specializes (0/1), and torch's own pytree code for
    a deprecated spec class it uses itself; both are expected while exporting."""
    import logging
    import warnings

    log = logging.getLogger("torch._export.non_strict_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        log.setLevel(level)
