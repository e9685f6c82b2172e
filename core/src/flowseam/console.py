"""What the command line and the demo print: the backend table, and quiet libraries.

Shared by :mod:`flowseam.cli` and :mod:`flowseam.demo` (which must not import each other).
"""

from __future__ import annotations

from .errors import FlowseamError


def backend_rows(strict: bool) -> tuple[list[dict], str | None]:
    """(one ``flowseam backends --json`` row per plugin, the detected platform's explain())."""
    from .platform import Platform
    from .plugins import discover, raise_if_broken

    reg = discover()
    if strict:
        raise_if_broken(reg)
    active: set[str] = set()
    explain = None
    try:
        platform = Platform.detect(registry=reg)
    except FlowseamError:
        platform = None
    if platform is not None:
        active = {p["name"] for p in platform.to_dict()["plugins"]}
        explain = platform.explain()
    conflicts = reg.name_conflicts()
    rows = []
    for rec in sorted(reg.records.values(), key=lambda r: (r.backend is None, -r.priority, r.name)):
        row = rec.summary()
        if rec.name in active or (rec.usable and rec.backend is None):
            row["status"] = "active"
        row["conflicts"] = [str(c) for c in conflicts if rec.name in c.plugins]
        rows.append(row)
    return rows, explain


def print_backend_table(rows: list[dict] | None = None, explain: str | None = None,
                        verbose: bool = False) -> None:
    """Print what ``flowseam backends`` prints: every plugin with its status, then how the
    platform resolved every op and component. ``rows``/``explain`` default to a discovery."""
    if rows is None:
        rows, explain = backend_rows(strict=False)
    cols = [("name", lambda r: r["name"]), ("distribution", lambda r: r["distribution"]),
            ("version", lambda r: r["version"]), ("status", lambda r: r["status"]),
            ("device", lambda r: r["device"] or "-"),
            ("ops", lambda r: ", ".join(r["ops"]) or "-"),
            ("components", lambda r: ", ".join(r["components"]) or "-"),
            ("methods", lambda r: ", ".join(r["methods"] + r["rewards"]) or "-")]
    cells = [[get(r) for _, get in cols] for r in rows]
    widths = [max([len(name)] + [len(c[i]) for c in cells]) + 2 for i, (name, _) in enumerate(cols)]
    header = "".join(f"{name:<{w}}" for (name, _), w in zip(cols, widths)).rstrip()
    print(header)
    print("-" * len(header))
    for r, row in zip(rows, cells):
        print("".join(f"{c:<{w}}" for c, w in zip(row, widths)).rstrip())
        if r["reason"]:
            print(f"  reason: {r['reason']}")
        for patch in r.get("patches") or ():
            print(f"  patches torch: {patch}")
        for conflict in r.get("conflicts") or ():
            print(f"  name conflict: {conflict} (use '<plugin>:<name>' or block one)")
        if verbose and r.get("traceback"):
            print("\n".join(f"    {line}" for line in r["traceback"].splitlines()))
    if not rows:
        print("(no flowseam plugins installed: pip install flowseam-cpu)")
    if explain:
        print()
        print(explain)


def quiet_libraries() -> None:
    """Keep the console to flowseam's own progress bar and summary: diffusers' and transformers'
    info logs and weight-loading bars are silenced (warnings and errors still show)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
