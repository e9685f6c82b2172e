"""``flowseam backends``: every discovered plugin and how the platform resolves every op and
component kind."""

from __future__ import annotations

import argparse
import json
import sys

from ..seam.report import backend_rows, print_backend_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``backends`` command and its options."""
    p = sub.add_parser("backends", help="list every discovered plugin and the resolved platform",
                       description="List every discovered plugin (backends, then the plugins "
                                   "that register training methods and rewards) and how the "
                                   "platform resolves every op and component kind.")
    p.add_argument("--backend", metavar="NAME",
                   help="show the platform of this backend (default: the highest-priority "
                        "available one)")
    p.add_argument("--json", action="store_true", help="print a JSON list of plugin objects")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any plugin is broken")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the long form: every op at every arch rung, implementation ids, "
                        "tracebacks of broken plugins")
    p.set_defaults(func=cmd_backends)


def cmd_backends(args: argparse.Namespace) -> int:
    """Print the plugins and the platform (a table, or JSON); 1 with ``--strict`` if one is
    broken."""
    rows, platform = backend_rows(strict=False, backend=args.backend)
    broken = [r for r in rows if r["status"] == "broken"]
    if args.json:
        for r in rows:
            if not args.verbose:
                r.pop("traceback", None)
        print(json.dumps(rows, indent=2))
    else:
        print_backend_table(rows, platform, verbose=args.verbose)
    if args.strict and broken:
        names = ", ".join(r["name"] for r in broken)
        print(f"flowseam: broken plugin(s): {names} (--strict)", file=sys.stderr)
        return 1
    return 0

