"""Running a plugin's code at discovery so that it cannot hang, kill or corrupt the host process.

Discovery imports each plugin and calls its declaration hooks in this process (the kernels and
components it returns are used here), each through :func:`run_plugin_code`: on a daemon thread
that the host waits for at most ``FLOWSEAM_PLUGIN_TIMEOUT`` seconds, with ``os._exit`` turned
into :class:`PluginExitError` and ``print()`` sent to stderr; a plugin that trips a guard is
``broken`` and the host goes on. :func:`patch_watch` records the torch globals a plugin's code
replaced: patching is reported, not refused. What each guard does, and what none can catch (a
segfault, ``SIGKILL``, a call that blocks holding the GIL): docs/writing-a-backend.md,
"Discovery cannot hang, kill or corrupt the host".
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

from ..errors import InvalidInputError

#: Seconds discovery waits for one plugin's import (and for each of its hook calls).
DEFAULT_TIMEOUT = 60.0
TIMEOUT_VAR = "FLOWSEAM_PLUGIN_TIMEOUT"


class PluginExitError(SystemExit):
    """Raised in place of ``os._exit(code)`` while plugin code runs at discovery."""


class PluginTimeoutError(Exception):
    """A plugin's code did not finish within ``FLOWSEAM_PLUGIN_TIMEOUT`` seconds."""


def plugin_timeout() -> float | None:
    """``FLOWSEAM_PLUGIN_TIMEOUT`` in seconds (default 60); None (no limit) for ``0``.

    :raises ValueError: for a value that is not a number >= 0.
    """
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise InvalidInputError(
            f"{TIMEOUT_VAR}={raw!r} must be a number of seconds >= 0 (0: no limit)")
    return value or None


def run_plugin_code(fn: Callable[[], Any], what: str, timeout: float | None) -> Any:
    """``fn()`` on a daemon thread, with stdout sent to stderr and ``os._exit`` turned into
    :class:`PluginExitError`; returns its result or re-raises its exception.

    Code that does not finish in time is left running in the background (Python cannot stop a
    thread) and dies with the process; discovery imports torch before any plugin, so such a
    thread never holds torch's import lock. ``os._exit`` called in the plugin's thread raises
    :class:`PluginExitError` there (a ``SystemExit``, as ``sys.exit`` raises already); called by
    another thread meanwhile, it names what was running on stderr and lets the process exit.

    :param what: what the code does, for messages (``"importing plugin 'x' (dist 1.0)"``).
    :raises PluginTimeoutError: if it has not finished after ``timeout`` seconds.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"flowseam: {what}", daemon=True)
    real_exit = os._exit

    def guarded_exit(code: int = 0) -> None:
        if threading.current_thread() is worker:
            raise PluginExitError(f"called os._exit({code}) while {what}")
        print(f"flowseam: os._exit({code}) called while {what}; the process exits", file=sys.stderr)
        real_exit(code)

    with contextlib.redirect_stdout(sys.stderr):
        os._exit = guarded_exit
        try:
            worker.start()
            worker.join(timeout)
        finally:
            os._exit = real_exit
    if worker.is_alive():
        raise PluginTimeoutError(
            f"did not finish {what} within {timeout:g} s ({TIMEOUT_VAR}; it keeps running in a "
            "background thread until the process exits)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- torch globals ------------------------------------------------------------------------------

def _namespaces() -> dict[str, Any]:
    import torch
    import torch.nn.functional

    return {"torch": torch, "torch.nn.functional": torch.nn.functional,
            "torch.nn.init": torch.nn.init, "torch.linalg": torch.linalg,
            "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module}


def _flags() -> dict[str, Any]:
    import torch

    return {
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
    }


def torch_snapshot() -> dict[str, dict[str, Any]] | None:
    """The namespace dict of each watched torch namespace (a shallow copy), and the global flags
    (under ``"flag:"``); None when torch is not imported (then nothing can have patched it).
    Copies, not a walk over the names: discovery takes two snapshots around every plugin's code,
    and :func:`patched` reads the names only of a namespace that changed."""
    if "torch" not in sys.modules:
        return None
    snap = {prefix: dict(vars(ns)) for prefix, ns in _namespaces().items()}
    snap["flag:"] = _flags()
    return snap


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two namespace copies hold the same objects (identity first: a C-level compare)."""
    try:
        return a == b
    except Exception:  # a value whose == is not a bool (a tensor): compare name by name
        return False


def _torch_own(value: Any) -> bool:
    """Whether ``value``'s code lives in torch's own package: torch wraps some of its functions
    when a submodule is first imported (``torch._dynamo`` wraps ``torch.manual_seed``), which is
    not a plugin patching torch."""
    import torch

    code = getattr(getattr(value, "__func__", value), "__code__", None)
    root = os.path.dirname(torch.__file__) + os.sep
    return code is not None and os.path.abspath(code.co_filename).startswith(root)


def patched(before: dict[str, dict[str, Any]] | None,
            after: dict[str, dict[str, Any]] | None) -> list[str]:
    """The public callables (``"torch.nn.functional.softmax"``) whose value was replaced (not by
    torch itself) or deleted between two snapshots, and each changed flag as
    ``"name: old -> new"``."""
    if before is None or after is None:
        return []
    out = [f"{name}: {old} -> {after['flag:'][name]}" for name, old in before["flag:"].items()
           if after["flag:"][name] != old]
    for prefix, names in before.items():
        if prefix == "flag:" or _same(names, after[prefix]):
            continue
        now = after[prefix]
        for name, old in names.items():
            if name.startswith("_") or not callable(old):
                continue
            new = now.get(name, "<deleted>")
            if new is not old and not _torch_own(new):
                out.append(f"{prefix}.{name}")
    return out


@contextlib.contextmanager
def patch_watch(record: Any, when: str) -> Iterator[None]:
    """Record on ``record.patches`` every torch global the code in the block replaced, as
    ``"<name> (<when>)"``. Reporting only: nothing is undone or refused.

    Watched: the public functions of ``torch``, ``torch.nn.functional``, ``torch.nn.init`` and
    ``torch.linalg``, the methods of ``torch.Tensor`` and ``torch.nn.Module``, and the global
    flags (default dtype, grad mode, deterministic algorithms, TF32, matmul precision, cuDNN).
    ``flowseam backends`` and ``platform.explain()`` show what a plugin replaced
    (``PluginRecord.patches``)."""
    before = torch_snapshot()
    try:
        yield
    finally:
        found = patched(before, torch_snapshot())
        if found and hasattr(record, "patches"):
            record.patches.extend(f"{name} ({when})" for name in found
                                  if f"{name} ({when})" not in record.patches)
