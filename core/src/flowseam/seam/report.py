"""The backend report ``flowseam backends`` prints: every plugin with its status, ops and component
kinds, then how the platform resolves every op and component (:meth:`Platform.explain`)."""

from __future__ import annotations

from typing import Any

from .discovery import discover, raise_if_broken
from ..errors import FlowseamError
from .platform import Platform
from .tables import format_table, terminal_width


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
