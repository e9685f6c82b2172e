"""``flowseam models``: where the demo's models are installed and how to generate with them."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``models`` command and its options."""
    m = sub.add_parser("models", help="list where the demo models are installed",
                       description="List the demo's models (digits-t2i: FLUX.1 architecture, "
                                   "text to image; digits-i2v: Wan2.1 I2V, image to video): where "
                                   "each is installed (the cache flowseam demo builds into, and "
                                   "the weights shipped in the package), its serving defaults, "
                                   "and how to generate with it.")
    m.add_argument("--cache", help="the demo's model cache (default $FLOWSEAM_DEMO_CACHE or "
                                   "outputs/models)")
    m.add_argument("--json", action="store_true", help="print a JSON list")
    m.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    """Where the demo models are installed, and how to generate with them."""
    from pathlib import Path

    from ..seam.tables import format_table, terminal_width
    from ..demo.build import default_cache_dir, demo_models

    cache = Path(args.cache) if args.cache else default_cache_dir()
    rows = demo_models(cache)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no demo model found (looked in {cache} and in the package's shipped weights); "
              "flowseam demo --build-only builds them")
        return 0

    def serve(r: dict) -> str:
        d = r["serve"]
        size = f"{d['width']}x{d['height']}" if "width" in d and "height" in d else None
        parts = [f"{d['num_steps']} steps" if "num_steps" in d else None, size,
                 f"{d['num_frames']} frames" if "num_frames" in d else None,
                 f"{d['max_sequence_length']} text tokens" if "max_sequence_length" in d else None]
        return ", ".join(p for p in parts if p) or "-"

    table = [[r["name"], r["card"] or "-", r["source"] + ("" if r["matches_recipe"] else
                                                         " (stale: its recipe changed)"),
              serve(r)] for r in rows]
    lines = format_table(["model", "card", "from", "serving defaults"], table, terminal_width(),
                         wrap=(3,))
    print("\n".join(lines[:2]))
    for r, line in zip(rows, lines[2:]):
        print(f"{line}\n  {r['path']}")
    used = {}
    for r in rows:  # the one flowseam demo uses: the first matching place
        if r["matches_recipe"]:
            used.setdefault(r["name"], r["path"])
    if "digits-t2i" in used:
        print(f"\ntry: flowseam generate --model {used['digits-t2i']} "
              "--prompt 'a handwritten digit seven' --output seven.png")
    if "digits-i2v" in used:
        print(f"     flowseam generate --model {used['digits-i2v']} --image seven.png "
              "--prompt 'a handwritten digit seven moving left' --output seven.gif")
    return 0

