"""``flowseam demo``: the main job on real handwritten digits (see :mod:`flowseam.demo`)."""

from __future__ import annotations

import argparse

from ..errors import FlowseamError, InvalidInputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` command and its options."""
    d = sub.add_parser("demo", help="the main job on real handwritten digits: build or load the "
                                    "demo models, run the text-to-image → image-to-video "
                                    "workflow, post-train it with workflow_rl")
    d.add_argument("--backend", help="backend name (default: cpu; accel first compiles every model "
                                     "with torch.compile, which takes minutes on 2 cores)")
    d.add_argument("--steps", type=int, default=20, help="workflow_rl steps (default 20)")
    d.add_argument("--prompts", type=int, default=4,
                   help="how many of the demo's 10 prompts (default 4)")
    d.add_argument("--group-size", type=int, default=8,
                   help="samples per prompt in RL (default 8)")
    d.add_argument("--eval-seeds", type=int, default=8,
                   help="held-out seeds per prompt for the before/after reward (default 8)")
    d.add_argument("--output", default="outputs/demo",
                   help="where outputs go (default outputs/demo)")
    d.add_argument("--cache", help="where built models go (default $FLOWSEAM_DEMO_CACHE or "
                                   "outputs/models)")
    d.add_argument("--recipes", help="recipe directory (default: the checkout's recipes/)")
    d.add_argument("--build-only", action="store_true", help="build or find the models, then stop")
    d.add_argument("--rebuild", action="store_true", help="build even if a matching model exists")
    d.add_argument("--no-shipped", action="store_true",
                   help="ignore the weights shipped in the package (build into the cache)")
    d.add_argument("--quick", action="store_true",
                   help="build tiny throwaway models in seconds (smoke tests; not a usable demo)")
    d.add_argument("--threads", type=int, help="torch CPU threads (default: half the cores)")
    d.add_argument("--fps", type=int, default=4, help="frames per second of the written videos")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on real handwritten digits (see flowseam.demo.run)."""
    import importlib.util
    from pathlib import Path

    from ..demo.run import PROMPTS, DemoOptions, run_demo

    missing = [m for m in ("sklearn", "matplotlib", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlowseamError(f"flowseam demo needs {', '.join(missing)}: "
                            "pip install 'flowseam[demo]'")
    limits = {"steps": (0, None), "prompts": (1, len(PROMPTS)), "group_size": (2, None),
              "eval_seeds": (1, None), "fps": (1, None), "threads": (1, None)}
    for name, (low, high) in limits.items():
        value = getattr(args, name)
        if value is None:
            continue
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise InvalidInputError(f"--{name.replace('_', '-')}={value} must be {allowed}")
    output = Path(args.output)
    try:  # fail now, not after minutes of work, if the outputs cannot be written
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".flowseam-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FlowseamError(f"--output={args.output!r} is not a writable directory: {exc}") from exc
    run_demo(DemoOptions(
        backend=args.backend, steps=args.steps, prompts=args.prompts, group_size=args.group_size,
        eval_seeds=args.eval_seeds, output=output,
        cache=Path(args.cache) if args.cache else None,
        recipes=Path(args.recipes) if args.recipes else None, build_only=args.build_only,
        rebuild=args.rebuild, quick=args.quick, no_shipped=args.no_shipped, threads=args.threads,
        fps=args.fps))
    return 0

