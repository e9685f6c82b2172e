"""What flowseam prints: the backend table, quiet libraries, and notices of long waits.

Shared by :mod:`flowseam.cli`, :mod:`flowseam.demo` (which must not import each other), the
loaders and the backends (:func:`long_wait`).

It stands above :mod:`flowseam.platform` (the backend table reports a platform), so the platform
never imports it: the table layout both print with is :func:`flowseam.tables.format_table`,
re-exported here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .errors import FlowseamError
from .platform import Platform
from .plugins import discover, raise_if_broken
from .tables import format_table


def backend_rows(strict: bool, backend: str | None = None) -> tuple[list[dict], Any]:
    """(one ``flowseam backends --json`` row per plugin, the platform or None).

    The platform is ``Platform(backend)`` when a backend is named, else the detected one (None
    when no backend is available); the plugins it uses get the status ``active``.

    :raises BackendUnavailableError: if ``backend`` is unknown or unusable (listing every backend).
    """
    reg = discover()
    if strict:
        raise_if_broken(reg)
    if backend is not None:
        platform = Platform(backend, registry=reg)
    else:
        try:
            platform = Platform.detect(registry=reg)
        except FlowseamError:
            platform = None
    active = {p["name"] for p in platform.to_dict()["plugins"]} if platform is not None else set()
    conflicts = reg.name_conflicts()
    rows = []
    for rec in sorted(reg.records.values(), key=lambda r: (r.backend is None, -r.priority, r.name)):
        row = rec.summary()
        if rec.name in active or (rec.usable and rec.backend is None):
            row["status"] = "active"
        row["conflicts"] = [str(c) for c in conflicts if rec.name in c.plugins]
        rows.append(row)
    return rows, platform


def terminal_width(default: int = 100) -> int:
    """The width to format tables for: the terminal's when stdout is one, else ``default``."""
    import shutil
    import sys

    if sys.stdout.isatty():
        return max(60, shutil.get_terminal_size((default, 24)).columns)
    return default


def _ops_cell(row: dict, verbose: bool) -> str:
    """``["flow_match_step@generic", "flow_match_step@sm80"]`` → ``flow_match_step
    (generic,sm80)``: each op once with its arch rungs (the long form with ``verbose``)."""
    if verbose:
        return ", ".join(row["ops"]) or "-"
    by_op: dict[str, list[str]] = {}
    for item in row["ops"]:
        op, _, arch = item.partition("@")
        by_op.setdefault(op, []).append(arch)
    return ", ".join(f"{op} ({','.join(archs)})" for op, archs in by_op.items()) or "-"


def print_backend_table(rows: list[dict] | None = None, platform: Any = None,
                        verbose: bool = False, backend: str | None = None,
                        width: int | None = None) -> None:
    """Print what ``flowseam backends`` prints: the backends with their status, ops and
    component kinds; the other plugins with the training methods and rewards they register;
    then how the platform resolves every op and component.

    Tables wrap their lists to fit ``width`` (default: the terminal's, else 100 columns);
    ``verbose`` prints the long form (every op at every arch rung, unwrapped) and the tracebacks
    of broken plugins and the kernels' implementation ids. ``rows`` and ``platform`` default to
    a discovery and ``backend``'s platform (the detected one if None).
    """
    import textwrap

    if rows is None:
        rows, platform = backend_rows(strict=False, backend=backend)
    width = width or terminal_width()
    if verbose:
        width = 10 ** 6
    backends = [r for r in rows if r["device"] or r["status"] == "broken" and not r["methods"]]
    others = [r for r in rows if r not in backends]

    def reasons(r: dict) -> None:
        if r["reason"]:
            print(textwrap.fill(r["reason"], width, initial_indent="  reason: ",
                                subsequent_indent="          ", break_on_hyphens=False))
        for patch in r.get("patches") or ():
            print(f"  patches torch: {patch}")
        for conflict in r.get("conflicts") or ():
            print(f"  name conflict: {conflict} (use '<plugin>:<name>' or block one)")
        if verbose and r.get("traceback"):
            print("\n".join(f"    {line}" for line in r["traceback"].splitlines()))

    def table(header: list[str], cells: list[list[str]], group: list[dict], wrap: tuple) -> None:
        lines = format_table(header, cells, width, wrap)
        print("\n".join(lines[:2]))
        body = lines[2:]
        starts = [i for i, line in enumerate(body) if line and not line.startswith(" ")]
        for n, r in enumerate(group):
            end = starts[n + 1] if n + 1 < len(starts) else len(body)
            print("\n".join(body[starts[n]:end]))
            reasons(r)

    if backends:
        table(["backend", "distribution", "version", "status", "device", "ops", "components"],
              [[r["name"], r["distribution"], r["version"], r["status"], r["device"] or "-",
                _ops_cell(r, verbose), ", ".join(r["components"]) or "-"] for r in backends],
              backends, (5, 6))
    if others:
        print()
        table(["plugin", "distribution", "version", "status", "methods", "rewards"],
              [[r["name"], r["distribution"], r["version"], r["status"],
                ", ".join(r["methods"]) or "-", ", ".join(r["rewards"]) or "-"] for r in others],
              others, (4, 5))
    if not rows:
        print("(no flowseam plugins installed: pip install flowseam-cpu)")
    if platform is not None:
        print()
        print(platform.explain(verbose=verbose, width=width))


@contextlib.contextmanager
def hub_output(verbose: bool = False) -> Iterator[None]:
    """Within the block, unless ``verbose``: huggingface_hub's progress bars (a checkpoint's
    download) are off, as :func:`library_output` turns them off, without importing diffusers and
    transformers; the previous setting is restored on exit."""
    if verbose:
        yield
        return
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            enable_progress_bars()


@contextlib.contextmanager
def library_output(verbose: bool = False) -> Iterator[None]:
    """Within the block, unless ``verbose``: diffusers' and transformers' log messages below
    ERROR (their "experimental feature" and fallback notices) and their progress bars (weight
    loading, shard writing) are off. Their previous settings are restored on exit, so a
    program's own choices survive a call to :func:`flowseam.load`."""
    if verbose:
        yield
        return
    import diffusers
    import transformers

    libs = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs]
    for lib in libs:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, (level, bars) in zip(libs, saved):
            lib.set_verbosity(level)
            (lib.enable_progress_bar if bars else lib.disable_progress_bar)()


#: whether :func:`long_wait` tells the user (the command line turns it on)
_NOTICES = False


def enable_notices(on: bool = True) -> None:
    """Turn :func:`long_wait`'s notices on (the ``flowseam`` command does; a program that wants
    them calls this) or off (the default for library use)."""
    global _NOTICES
    _NOTICES = on


def notices_enabled() -> bool:
    """Whether :func:`long_wait` tells the user (:func:`enable_notices`)."""
    return _NOTICES


class Wait:
    """What :func:`long_wait` yields: set :attr:`outcome` to finish its closing line
    (``"compiled"``, ``"ready (compiled before)"``)."""

    outcome = "done"


@contextlib.contextmanager
def long_wait(message: str) -> Iterator[Wait]:
    """Tell the user about a one-off wait that would otherwise look like a hang, such as a
    backend compiling a model on its first call. While the block runs, ``message`` and the
    seconds elapsed on stderr (one line that ticks on a terminal; a start and an end line in a
    log), then ``<message>: <outcome> in N s``. Silent unless notices are on
    (:func:`enable_notices`). For backends: ``from flowseam.console import long_wait``."""
    import sys
    import threading
    import time

    wait = Wait()
    if not _NOTICES:
        yield wait
        return
    stream, start = sys.stderr, time.perf_counter()
    ticking = stream.isatty()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            stream.write(f"\r{message} ... {time.perf_counter() - start:.0f} s")
            stream.flush()

    stream.write(f"{message} ...{'' if ticking else chr(10)}")
    stream.flush()
    thread = threading.Thread(target=tick, daemon=True) if ticking else None
    if thread is not None:
        thread.start()
    try:
        yield wait
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        stream.write(f"{chr(13) if ticking else ''}{message}: {wait.outcome} in "
                     f"{time.perf_counter() - start:.1f} s\n")
        stream.flush()


def quiet_libraries() -> None:
    """Keep the console to flowseam's own progress bar and summary: diffusers' and transformers'
    info logs and weight-loading bars are silenced (warnings and errors still show)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
