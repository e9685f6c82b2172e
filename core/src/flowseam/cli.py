"""The ``flowseam`` command line (also ``python -m flowseam``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .errors import FlowseamError


def _backend_rows(strict: bool) -> tuple[list[dict], str | None]:
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
    rows = []
    for rec in sorted(reg.records.values(), key=lambda r: (r.backend is None, -r.priority, r.name)):
        row = rec.summary()
        if rec.name in active or (rec.usable and rec.backend is None):
            row["status"] = "active"
        rows.append(row)
    return rows, explain


def cmd_backends(args: argparse.Namespace) -> int:
    rows, explain = _backend_rows(strict=False)
    broken = [r for r in rows if r["status"] == "broken"]
    if args.json:
        for r in rows:
            if not args.verbose:
                r.pop("traceback", None)
        print(json.dumps(rows, indent=2))
    else:
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
            if args.verbose and r.get("traceback"):
                print("\n".join(f"    {line}" for line in r["traceback"].splitlines()))
        if not rows:
            print("(no flowseam plugins installed: pip install flowseam-cpu)")
        if explain:
            print()
            print(explain)
    if args.strict and broken:
        names = ", ".join(r["name"] for r in broken)
        print(f"flowseam: broken plugin(s): {names} (--strict)", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowseam", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list every discovered plugin and the resolved platform")
    p.add_argument("--json", action="store_true", help="print a JSON list of plugin objects")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any plugin is broken")
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of broken plugins")
    p.set_defaults(func=cmd_backends)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except FlowseamError as exc:
        print(f"flowseam: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
