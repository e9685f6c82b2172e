"""``flowseam demo``: the main job on real handwritten digits (see :mod:`flowseam.demo`)."""

from __future__ import annotations

import argparse

from ..errors import FlowseamError, InvalidInputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` command and its options."""
    d = sub.add_parser("demo", help="the main job on real handwritten digits: build or load the "
                                    "demo models, run the text-to-image → image-to-video "
                                    "workflow, post-train it with workflow_rl (--world text: "
                                    "a model that renders text, post-trained on an OCR reward)")
    d.add_argument("--world", default="digits",
                   help="which demo world: digits (default: the text-to-image -> image-to-video "
                        "workflow on handwritten digits, post-trained with workflow_rl) or text "
                        "(a text-to-image model that renders short strings, post-trained with "
                        "flowgrpo on the ocr reward, PP-OCRv4)")
    d.add_argument("--backend", help="backend name (default: cpu; accel first compiles every model "
                                     "with torch.compile, which takes minutes on 2 cores)")
    d.add_argument("--steps", type=int, help="RL steps (digits: default 20; text: default 160)")
    d.add_argument("--prompts", type=int,
                   help="how many of the world's prompts (digits: of 10, default 4; text: of 24, "
                        "default 24)")
    d.add_argument("--group-size", type=int, help="samples per prompt in RL (default 8)")
    d.add_argument("--eval-seeds", type=int,
                   help="held-out seeds per prompt for the before/after reward (digits: default "
                        "8; text: per seed set, default 4)")
    d.add_argument("--seed-sets", type=int,
                   help="text world: disjoint held-out seed sets, whose per-set spread under a "
                        "constant-reward control is the noise the gain is compared with "
                        "(default 4)")
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
    d.add_argument("--fps", type=int,
                   help="digits world: frames per second of the written videos (default 4)")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on real handwritten digits, or the text world (see flowseam.demo.run).

    :raises InvalidInputError: for an unknown ``--world`` (naming the allowed ones) or an option
        out of range, before any model loads."""
    import importlib.util
    from pathlib import Path

    from ..demo.build import check_world
    from ..demo.run import PROMPTS, DemoOptions, run_demo
    from ..demo.text import WORDS
    from ..demo.text_run import TEXT_DEFAULTS, run_text_demo

    check_world(args.world)
    needs = ("sklearn", "matplotlib", "peft") if args.world == "digits" else \
        ("matplotlib", "peft", "rapidocr_onnxruntime")
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise FlowseamError(f"flowseam demo --world {args.world} needs {', '.join(missing)}: "
                            "pip install 'flowseam[demo]'")
    if args.world == "text" and args.fps is not None:
        raise InvalidInputError(f"--fps={args.fps} is for --world digits; the text world writes "
                                "images, no videos")
    if args.world == "digits" and args.seed_sets is not None:
        raise InvalidInputError(f"--seed-sets={args.seed_sets} is for --world text; the digits "
                                "world evaluates one set of --eval-seeds (its control is "
                                "bench/demo_rl_control.py)")
    defaults = TEXT_DEFAULTS if args.world == "text" else \
        dict(steps=20, prompts=4, group_size=8, eval_seeds=8, fps=4)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    n_prompts = len(WORDS) if args.world == "text" else len(PROMPTS)
    limits = {"steps": (0, None), "prompts": (1, n_prompts), "group_size": (2, None),
              "eval_seeds": (1, None), "seed_sets": (2, None), "fps": (1, None),
              "threads": (1, None)}
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
    run = run_text_demo if args.world == "text" else run_demo
    run(DemoOptions(
        backend=args.backend, steps=args.steps, prompts=args.prompts, group_size=args.group_size,
        eval_seeds=args.eval_seeds, output=output,
        cache=Path(args.cache) if args.cache else None,
        recipes=Path(args.recipes) if args.recipes else None, build_only=args.build_only,
        rebuild=args.rebuild, quick=args.quick, no_shipped=args.no_shipped, threads=args.threads,
        fps=args.fps, world=args.world, seed_sets=args.seed_sets))
    return 0

