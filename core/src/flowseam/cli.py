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


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate an image or video (or run a workflow) and write it atomically."""
    import time
    from pathlib import Path

    from . import media
    from .loading import load
    from .platform import Platform
    from .request import DiffusionParams
    from .workflows import WORKFLOWS

    _quiet_libraries()
    suffix = Path(args.output).suffix.lower()
    if suffix not in media.IMAGE_SUFFIXES + media.VIDEO_SUFFIXES:
        raise ValueError(f"--output {args.output}: unsupported suffix {suffix!r}; use .png for "
                         "images, .mp4 or .gif for videos")
    if args.image is not None and not Path(args.image).is_file():
        raise ValueError(f"--image {args.image} does not exist")
    if args.workflow is not None:
        if args.workflow not in WORKFLOWS:
            raise ValueError(f"--workflow {args.workflow!r} is unknown; available: {sorted(WORKFLOWS)}")
        if len(args.model) != 2:
            raise ValueError(f"--workflow {args.workflow} needs two --model checkpoints (text-to-"
                             f"image, then image-to-video); got {len(args.model)}")
    elif len(args.model) != 1:
        raise ValueError(f"give one --model (got {len(args.model)}); two are for --workflow t2i-i2v")
    params = DiffusionParams(num_steps=args.steps, guidance_scale=args.guidance, seed=args.seed,
                             height=args.height, width=args.width, num_frames=args.frames,
                             negative_prompt=args.negative_prompt, flow_shift=args.flow_shift)
    backends = args.backend or [None]
    if len(backends) > (2 if args.workflow else 1):
        raise ValueError(f"--backend given {len(backends)} times; once, or once per workflow stage")
    platforms = [Platform(b) if b else Platform.detect() for b in backends]
    platform = platforms[0]
    started = time.perf_counter()
    if args.workflow is not None:
        # each stage keeps its own platform resolution (a second --backend sets stage 2's)
        t2i, i2v = load(args.model[0], platform=platform), load(args.model[1], platform=platforms[-1])
        workflow = WORKFLOWS[args.workflow](t2i, i2v)
        image_params = params.replace(num_frames=None, negative_prompt=None)
        result = workflow.run(args.prompt, t2i_params=image_params, i2v_params=params,
                              seed=args.seed, progress=True)
        frames, models = result.frames, [t2i, i2v]
    else:
        model = load(args.model[0], platform=platform)
        result = model.generate(args.prompt, image=args.image, params=params, progress=True)
        frames, models = result.frames, [model]
    if frames.shape[1] > 1 and suffix in media.IMAGE_SUFFIXES:
        raise ValueError(f"--output {args.output}: this request makes a {frames.shape[1]}-frame "
                         "video; use .mp4 or .gif")
    media.write_output(args.output, frames[0], fps=args.fps)
    seconds = time.perf_counter() - started
    print(f"wrote {args.output} ({frames.shape[1]} frame(s) of {frames.shape[2]}x{frames.shape[3]}) "
          f"in {seconds:.2f} s | " + " | ".join(m.provenance() for m in models))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Run a registered training method with a TOML/YAML config."""
    from .training import get_method
    from .training.config import load_config

    _quiet_libraries()
    method = get_method(args.method)  # unknown → error listing the registered methods
    config = load_config(args.config)
    for override in args.set or []:
        key, sep, value = override.partition("=")
        if not sep:
            raise ValueError(f"--set {override!r} must look like key=value")
        import json
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    summary = method(config).run(progress=True)
    last = summary["records"][-1] if summary["records"] else {}
    shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in last.items()
             if k.startswith(("step", "reward_mean", "loss", "ratio", "t2i_ratio", "i2v_ratio"))}
    print(f"{args.method}: {summary['steps']} steps; last: {shown}")
    if config.get("output_dir"):
        print(f"metrics: {config['output_dir']}/metrics.jsonl")
    return 0


def _quiet_libraries() -> None:
    """Keep the console to flowseam's own progress bar and summary: diffusers' and transformers'
    info logs and weight-loading bars are silenced (warnings and errors still show)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowseam", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list every discovered plugin and the resolved platform")
    p.add_argument("--json", action="store_true", help="print a JSON list of plugin objects")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any plugin is broken")
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of broken plugins")
    p.set_defaults(func=cmd_backends)

    g = sub.add_parser("generate", help="generate an image or a video from a checkpoint")
    g.add_argument("--model", action="append", required=True, metavar="PATH",
                   help="diffusers-format checkpoint directory or hub id (twice for --workflow)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", help="conditioning image for image-to-video")
    g.add_argument("--workflow", help="a cross-model workflow, e.g. t2i-i2v")
    g.add_argument("--steps", type=int, help="denoising steps (card default if unset)")
    g.add_argument("--guidance", type=float, help="guidance scale")
    g.add_argument("--flow-shift", type=float, help="flow shift of the sigma schedule")
    g.add_argument("--negative-prompt")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--frames", type=int, help="video length in frames (Wan: 4k+1)")
    g.add_argument("--height", type=int, help="pixels")
    g.add_argument("--width", type=int, help="pixels")
    g.add_argument("--fps", type=int, default=8, help="frames per second of a written video")
    g.add_argument("--backend", action="append",
                   help="backend name (default: the highest-priority available); with --workflow, "
                        "give it twice to choose each stage's backend")
    g.add_argument("--output", required=True, help=".png for images, .mp4 or .gif for videos")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="run a training method (finetune, flowgrpo, workflow_rl, ...)")
    t.add_argument("--method", required=True, help="a registered training method")
    t.add_argument("--config", required=True, help="a .toml or .yaml config file")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a top-level config key (value parsed as JSON when it can be)")
    t.set_defaults(func=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FlowseamError, ValueError) as exc:
        print(f"flowseam: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
