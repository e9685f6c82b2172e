"""The flowseam command line (also python -m flowseam)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any, Sequence

from .console import backend_rows, enable_notices, print_backend_table, quiet_libraries
from .errors import FlowseamError, InvalidInputError, PluginFaultError


def cmd_backends(args: argparse.Namespace) -> int:
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


#: request fields → the generate flags that set them (errors speak the command line's words)
GENERATE_FLAGS = {
    "num_steps": "--steps", "guidance_scale": "--guidance", "flow_shift": "--flow-shift",
    "num_frames": "--frames", "negative_prompt": "--negative-prompt", "height": "--height",
    "width": "--width", "max_sequence_length": "--max-sequence-length", "seed": "--seed",
    "prompt": "--prompt", "chunk_frames": "--chunk-frames", "local_attn_size": "--local-attn-size",
    "sink_size": "--sink-size", "guidance_scale_2": "--guidance-2", "stages": "--stages",
    "audio_guidance_scale": "--audio-guidance", "frame_rate": "--fps", "cache": "--cache",
    "lora": "--lora", "fps": "--fps",
}


def in_cli_words(message: str) -> str:
    """A library error about a request, in the generate command's words: ``num_frames=6 ...``
    → ``--frames=6 ...``, ``pass image= (...)`` → ``pass --image PATH``."""
    import re

    fields = "|".join(GENERATE_FLAGS)
    message = re.sub(r"pass image= \([^)]*\([^)]*\)[^)]*\)", "pass --image PATH", message)
    message = re.sub(rf"^({fields})\b(?!=)", lambda m: GENERATE_FLAGS[m.group(1)], message)
    return re.sub(rf"(?<![\w-])({fields})=", lambda m: f"{GENERATE_FLAGS[m.group(1)]}=", message)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate an image or video (or run a workflow) and write it atomically; errors about the
    request are reported with the command's flags (an error about one parameter whose message
    does not show the flag is prefixed with it: ``--steps: this request ... needs at least``).

    Everything that can be checked without weights is checked before any model loads: every
    numeric option (finite, in range, the request's memory against this machine's, with the
    defaults read from ``model_index.json`` and ``flowseam.json``), the conditioning image (read
    and converted here), the checkpoints' folders and the output path (writable).
    """
    try:
        return _generate(args)
    except PluginFaultError:
        raise  # names the plugin; exit 3 (a KernelArgumentError is also a ValueError)
    except ValueError as exc:
        message = in_cli_words(str(exc))
        flag = GENERATE_FLAGS.get(getattr(exc, "field", ""))
        if flag and flag not in message:
            message = f"{flag}: {message}"
        raise InvalidInputError(message) from exc


def _check_image_flag(args: argparse.Namespace) -> None:
    """--image against the checkpoint's card (read from model_index.json, before any model
    loads): an image-to-video model needs one, the others take none."""
    from .loading import read_card
    from .request import TaskType

    card = read_card(args.model[0])
    if TaskType.I2V in card.tasks and args.image is None:
        raise InvalidInputError(f"--image is required: {args.model[0]} is {card.name}, image to video "
                         "(pass --image PATH: the first frame)")
    if TaskType.I2V not in card.tasks and args.image is not None:
        raise InvalidInputError(f"--image: {args.model[0]} is {card.name}, which takes no image")


def _generate(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from . import media
    from .defaults import read_checkpoint_defaults
    from .loading import load, read_card, resolve_checkpoint
    from .platform import Platform
    from .request import DiffusionParams, check_memory
    from .workflows import WORKFLOWS

    quiet_libraries()
    suffix = Path(args.output).suffix.lower()
    if args.stream and (suffix != ".mp4" or args.workflow is not None):
        raise InvalidInputError(f"--stream writes one model's video progressively as .mp4; got --output "
                         f"{args.output}" + (f" and --workflow {args.workflow}" if args.workflow else ""))
    if suffix not in media.IMAGE_SUFFIXES + media.VIDEO_SUFFIXES + media.AUDIO_SUFFIXES:
        raise InvalidInputError(f"--output {args.output}: unsupported suffix {suffix!r}; use .png for "
                         "images, .mp4 or .gif for videos, .wav for the sound alone")
    if args.fps is not None:
        media.check_fps(args.fps)
    image = media.read_image(args.image) if args.image is not None else None  # missing, bomb...
    if args.workflow is not None:
        if args.workflow not in WORKFLOWS:
            raise InvalidInputError(f"--workflow {args.workflow!r} is unknown; available: {sorted(WORKFLOWS)}")
        if len(args.model) != 2:
            raise InvalidInputError(f"--workflow {args.workflow} needs two --model checkpoints (text-to-"
                             f"image, then image-to-video); got {len(args.model)}")
    elif len(args.model) != 1:
        raise InvalidInputError(f"give one --model (got {len(args.model)}); two are for --workflow t2i-i2v")
    else:
        _check_image_flag(args)
    if args.stream and args.image is not None:
        raise InvalidInputError("--stream generates from text; --image is for image-to-video")
    params = DiffusionParams(num_steps=args.steps, guidance_scale=args.guidance, seed=args.seed,
                             height=args.height, width=args.width, num_frames=args.frames,
                             negative_prompt=args.negative_prompt, flow_shift=args.flow_shift,
                             chunk_frames=args.chunk_frames, local_attn_size=args.local_attn_size,
                             sink_size=args.sink_size, guidance_scale_2=args.guidance_2,
                             stages=args.stages, audio_guidance_scale=args.audio_guidance,
                             max_sequence_length=args.max_sequence_length,
                             lora=tuple(args.lora or ()), cache=args.cache)
    for spec in params.lora:  # before any model loads
        if not Path(spec.path).is_file():
            raise InvalidInputError(f"--lora {spec.path} does not exist")
        if args.workflow is not None:
            raise InvalidInputError("--lora applies to one model; a --workflow runs two")
    ignore = tuple(args.ignore_scheduler_option or ())
    backends = args.backend or [None]
    if len(backends) > (2 if args.workflow else 1):
        raise InvalidInputError(f"--backend given {len(backends)} times; once, or once per workflow stage")
    # the cards (from model_index.json alone) give the defaults the memory check needs
    stages = WORKFLOWS[args.workflow].stage_params(params) if args.workflow else (params,)
    for model_path, stage in zip(args.model, stages):
        root = resolve_checkpoint(model_path)
        check_memory(stage.with_defaults({**read_card(root).defaults,
                                          **read_checkpoint_defaults(root)}))
    media.check_writable(args.output)
    platforms = [Platform(b) if b else Platform.detect() for b in backends]
    platform = platforms[0]
    started = time.perf_counter()
    if args.workflow is not None:
        # each stage keeps its own platform resolution (a second --backend sets stage 2's)
        t2i = load(args.model[0], platform=platform, ignore_scheduler_options=ignore)
        i2v = load(args.model[1], platform=platforms[-1], ignore_scheduler_options=ignore)
        _check_sound(args.output, suffix, i2v)
        workflow = WORKFLOWS[args.workflow](t2i, i2v)
        image_params, video_params = stages
        result = workflow.run(args.prompt, t2i_params=image_params,
                              i2v_params=_with_frame_rate(video_params, i2v, args.fps),
                              seed=args.seed, progress=True)
        frames, models, runs = result.frames, [t2i, i2v], result.stages
    elif args.stream:
        model = load(args.model[0], platform=platform, ignore_scheduler_options=ignore)
        chunks = model.generate_stream(args.prompt, params=params)  # refuses a non-causal model
        with media.StreamingVideoWriter(args.output, fps=args.fps or 8) as writer:
            for chunk in chunks:
                writer.write(chunk.frames[0])
                if chunk.index == 0:
                    print(f"time-to-first-chunk: {chunk.seconds:.2f} s ({chunk.frames.shape[1]} "
                          f"frame(s) written to {args.output} while the rest is generated)",
                          flush=True)
        result = chunk.result
        seconds = time.perf_counter() - started
        print(f"wrote {args.output} ({writer.frames} frame(s) of {chunk.frames.shape[2]}x"
              f"{chunk.frames.shape[3]}, {result.chunks} chunks, streamed) in {seconds:.2f} s | "
              f"{model.provenance()}")
        return 0
    else:
        model = load(args.model[0], platform=platform, ignore_scheduler_options=ignore)
        _check_sound(args.output, suffix, model)
        result = model.generate(args.prompt, image=image,
                                params=_with_frame_rate(params, model, args.fps), progress=True)
        frames, models, runs = result.frames, [model], [result]
    stage = result.stages[-1] if args.workflow is not None else result
    if frames.shape[1] > 1 and suffix in media.IMAGE_SUFFIXES:
        raise InvalidInputError(f"--output {args.output}: this request makes a {frames.shape[1]}-frame "
                         "video; use .mp4 or .gif")
    audio = stage.audio[0] if stage.audio is not None else None
    if audio is not None and suffix == ".gif":
        print("flowseam: note: a GIF has no audio track; the audio is dropped (use .mp4 for video "
              "with sound, or .wav for the sound alone)", file=sys.stderr)
        audio = None
    fps = args.fps or stage.params.frame_rate or 8
    media.write_output(args.output, frames[0], fps=fps, audio=audio, sample_rate=stage.sample_rate)
    seconds = time.perf_counter() - started
    what = (f"{audio.shape[1] / stage.sample_rate:.2f} s of {audio.shape[0]}-channel audio at "
            f"{stage.sample_rate} Hz" if suffix in media.AUDIO_SUFFIXES else
            f"{frames.shape[1]} frame(s) of {frames.shape[2]}x{frames.shape[3]}"
            + (f" with {audio.shape[0]}-channel AAC audio" if audio is not None else ""))
    # one line: the output, then per model where its parts came from and the solver that ran
    lora = f" | {models[0].adapters.describe(params.lora)}" if params.lora else ""
    cached = [r.cache for r in runs if r.cache]
    if cached:
        lora += " | cache " + ", ".join(f"{c['policy']}: {c['steps_computed']} steps computed, "
                                        f"{c['steps_skipped']} skipped" for c in cached)
    print(f"wrote {args.output} ({what}) in {seconds:.2f} s{lora} | "
          + " | ".join(f"{m.provenance(solver=False)}; {r.solver or m.solver_line()}"
                       for m, r in zip(models, runs)))
    return 0


def _check_sound(output: str, suffix: str, model) -> None:
    """A ``.wav`` output needs a model that makes sound (raised before generating)."""
    from . import media

    if suffix in media.AUDIO_SUFFIXES and not model.card.audio:
        raise InvalidInputError(f"--output {output}: {model.card.name} makes no sound; use .png, .mp4 "
                         "or .gif")


def _with_frame_rate(params, model, fps: float | None):
    """``--fps`` is a generation parameter for cards that take one (LTX-2), else playback only."""
    return params.replace(frame_rate=fps) if "frame_rate" in model.card.defaults else params


def show_config(name: str, method: Any) -> str:
    """What ``flowseam train --method NAME --show-config`` prints: the method's summary and
    every config key with its default, as TOML (or its docstring, for a method that does not
    publish its keys)."""
    import inspect

    from .training.config import as_toml

    doc = inspect.getdoc(method) or ""
    summary = first_sentence(doc)
    module_doc = inspect.getdoc(inspect.getmodule(method)) or ""
    if not hasattr(method, "default_config"):
        return (f"# {name}: {summary}\n# this method does not publish its config keys "
                f"(no default_config()); its documentation:\n\n{module_doc or doc}\n")
    head = f"{name}: {summary}\nEvery key with its default; a commented key has none (required, " \
           "or chosen at run time).\nSee the method's documentation for what each means:\n" \
           f"python -c \"import {method.__module__} as m; help(m)\""
    return as_toml(method.default_config(), tuple(getattr(method, "CONFIG_TABLES", ())), head)


def _set_override(config: dict, override: str) -> None:
    """``--set KEY=VALUE``: a top-level key, or ``table.key`` (the value parsed as JSON when it
    can be, else kept as a string)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise InvalidInputError(f"--set {override!r} must look like key=value or table.key=value")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    *tables, last = key.split(".")
    target = config
    for table in tables:
        target = target.setdefault(table, {})
        if not isinstance(target, dict):
            raise InvalidInputError(f"--set {override!r}: {table!r} is not a table of the config")
    target[last] = parsed


def cmd_train(args: argparse.Namespace) -> int:
    """Run a registered training method with a TOML/YAML config (on ``--nproc`` ranks)."""
    import os

    from .training import get_method
    from .training.config import load_config

    quiet_libraries()
    method = get_method(args.method)  # unknown → error listing the registered methods
    if args.show_config:
        print(show_config(args.method, method), end="")
        return 0
    if not args.config:
        raise InvalidInputError("--config is required (a .toml or .yaml file); --show-config prints "
                         f"every key of {args.method}'s config with its default")
    config = load_config(args.config)
    for override in args.set or []:
        _set_override(config, override)
    if args.output_dir:
        config["output_dir"] = args.output_dir
    if args.nproc is not None and args.nproc < 1:
        raise InvalidInputError(f"--nproc={args.nproc} must be >= 1")
    launcher = args.nproc is not None and args.nproc > 1 and "WORLD_SIZE" not in os.environ
    if launcher:  # not yet a rank
        check = getattr(method, "check_world_size", None)
        if check is not None:
            check(config, args.nproc)  # e.g. a batch that does not split: fail before spawning
    if not config.get("output_dir"):
        raise InvalidInputError("the run needs somewhere to write its trained model: set output_dir in "
                         "the config, or pass --output-dir DIR")
    if launcher:
        from .training.distributed import launch

        argv = ["train", "--method", args.method, "--config", args.config]
        argv += [a for s in args.set or [] for a in ("--set", s)]
        argv += ["--output-dir", config["output_dir"]]
        return launch(argv, args.nproc)
    summary = method(config).run(progress=True)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for the run
    last = summary["records"][-1] if summary["records"] else {}
    shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in last.items()
             if k.startswith(("step", "reward_mean", "loss", "ratio", "t2i_ratio", "i2v_ratio"))}
    print(f"{args.method}: {summary['steps']} steps; last: {shown}")
    out = config["output_dir"]
    for stage, paths in (summary.get("exported") or {}).items():
        where = f" ({stage})" if len(summary["exported"]) > 1 else ""
        print(f"model{where}: {paths['model']} (diffusers format: flowseam generate --model "
              f"{paths['model']} ...)")
        if "lora" in paths:
            print(f"lora{where}: {paths['lora']} (diffusers: pipe.load_lora_weights)")
    print(f"checkpoints: {out}/checkpoints; metrics: {out}/metrics.jsonl")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the models over HTTP (see flowseam.serve)."""
    import os

    from .serve.server import ServeOptions, run

    return run(ServeOptions(
        models=args.model, workflow=args.workflow, backends=args.backend or [], host=args.host,
        port=args.port, api_key=args.api_key or os.environ.get("FLOWSEAM_API_KEY"),
        max_queue=args.max_queue, max_batch=args.max_batch, output_dir=args.output_dir,
        expire_after=args.expire_after, max_upload_mb=args.max_upload_mb,
        log_level=args.log_level, threads=args.threads, loras=args.lora or []))


def cmd_models(args: argparse.Namespace) -> int:
    """Where the demo models are installed, and how to generate with them."""
    from pathlib import Path

    from .console import format_table, terminal_width
    from .demo.build import default_cache_dir, demo_models

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


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on real handwritten digits (see flowseam.demo.run)."""
    import importlib.util
    from pathlib import Path

    from .demo.run import PROMPTS, DemoOptions, run_demo

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


def _registered_methods_text() -> str:
    """The train command's epilog: the registered methods (discovered when help is shown)."""
    from .training import registered_methods

    try:
        methods = registered_methods()
    except Exception as exc:  # help must still print
        return f"(cannot list the training methods: {type(exc).__name__}: {exc})"
    lines = ["registered methods (--method NAME --show-config prints the keys of its config",
             "with their defaults):"]
    for name, cls in sorted(methods.items()):
        lines.append(f"  {name:<14}{first_sentence(cls.__doc__)}")
    return "\n".join(lines)


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring, as plain text (no RST ``literal`` markup)."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a callable (computed only when help is shown, so
    that building the parser never discovers plugins), printed as is."""

    def format_help(self) -> str:
        epilog = self.epilog
        if callable(epilog):
            self.epilog = epilog()
        try:
            return super().format_help()
        finally:
            self.epilog = epilog


class _HelpFormatter(argparse.HelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # preformatted (an epilog listing methods): keep its lines
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flowseam", description="Serve and RL-post-train flow-matching diffusion models "
                                     "through backend plugins.",
        epilog="Run flowseam COMMAND --help for a command's options.",
        formatter_class=_HelpFormatter)
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print flowseam's version and its installed plugins', then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)
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

    g = sub.add_parser(
        "generate", help="generate an image or a video from a checkpoint",
        description="Generate an image or a video from a diffusers-format checkpoint (or run a "
                    "cross-model workflow) and write it atomically. Every sampling option left "
                    "unset takes the checkpoint's own serving default (its flowseam.json), else "
                    "the model card's default.",
        epilog="Example, with a demo model (flowseam models lists where they are): flowseam "
               "generate --model DIR/digits-t2i --prompt 'a handwritten digit seven' "
               "--output seven.png")
    g.add_argument("--model", action="append", required=True, metavar="PATH",
                   help="diffusers-format checkpoint directory or hub id (twice for --workflow)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", help="conditioning image for image-to-video")
    g.add_argument("--workflow", help="a cross-model workflow, e.g. t2i-i2v")
    g.add_argument("--steps", type=int, help="denoising steps")
    g.add_argument("--guidance", type=float, help="guidance scale")
    g.add_argument("--guidance-2", type=float,
                   help="guidance scale of the low-noise expert of a two-expert (Wan2.2) model "
                        "(default: --guidance)")
    g.add_argument("--flow-shift", type=float,
                   help="override the flow shift of the checkpoint's scheduler (default: the "
                        "checkpoint's own)")
    g.add_argument("--ignore-scheduler-option", action="append", metavar="NAME",
                   help="a scheduler_config.json option flowseam does not implement, to ignore "
                        "with a warning instead of refusing (repeatable; _class_name runs the "
                        "card's default scheduler)")
    g.add_argument("--negative-prompt")
    g.add_argument("--cache", metavar="NAME:THRESHOLD",
                   help="adaptive step caching: skip the DiT on steps where its velocity "
                        "changes little (reuse or extrapolate, e.g. extrapolate:0.1); off by default")
    g.add_argument("--lora", action="append", metavar="PATH[:WEIGHT][@EXPERT]",
                   help="a LoRA .safetensors file (diffusers/peft, kohya or ComfyUI layout) with "
                        "its weight (default 1.0) and, for Wan2.2, the expert (transformer_2); "
                        "repeat for several adapters")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default 0)")
    g.add_argument("--frames", type=int, help="video length in frames (Wan: 4k+1)")
    g.add_argument("--height", type=int, help="pixels")
    g.add_argument("--width", type=int, help="pixels")
    g.add_argument("--fps", type=float,
                   help="frames per second of a written video (> 0; default 8; LTX-2 generates "
                        "for this frame rate, its card default 24)")
    g.add_argument("--stages", type=int, choices=(1, 2),
                   help="LTX-2: 1 = generate at --height x --width; 2 (default) = half size, "
                        "latent upsample x2, refine")
    g.add_argument("--audio-guidance", type=float, help="LTX-2: CFG scale of the audio")
    g.add_argument("--max-sequence-length", type=int, metavar="N",
                   help="text tokens the text encoder keeps (sample with what the model was "
                        "trained with); with --workflow, the text-to-image stage's")
    g.add_argument("--backend", action="append",
                   help="backend name (default: the highest-priority available); with --workflow, "
                        "give it twice to choose each stage's backend")
    g.add_argument("--output", required=True,
                   help=".png for images, .mp4 or .gif for videos (an LTX-2 .mp4 has an AAC "
                        "sound track; a .gif drops it), .wav for the sound alone")
    g.add_argument("--stream", action="store_true",
                   help="causal checkpoints: write the .mp4 chunk by chunk as it is generated "
                        "(playable while written) and print the time to the first chunk")
    g.add_argument("--chunk-frames", type=int,
                   help="causal checkpoints: latent frames per chunk (default the checkpoint's)")
    g.add_argument("--local-attn-size", type=int,
                   help="causal checkpoints: rolling window in latent frames (default none)")
    g.add_argument("--sink-size", type=int,
                   help="causal checkpoints: first latent frames kept in the window")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser(
        "train", help="run a training method (finetune, flowgrpo, workflow_rl, ...)",
        description="Run a registered training method with a TOML or YAML config. The run "
                    "writes its metrics, its checkpoints (always one at the last step) and, at "
                    "the end, the trained model in diffusers format (OUTPUT_DIR/model, what "
                    "flowseam generate --model takes; a LoRA run also writes "
                    "OUTPUT_DIR/pytorch_lora_weights.safetensors). Rerunning the same command "
                    "resumes from the latest checkpoint.",
        epilog=_registered_methods_text, formatter_class=_HelpFormatter)
    t.add_argument("--method", required=True, help="a registered training method (listed below)")
    t.add_argument("--config", metavar="FILE", help="a .toml or .yaml config file")
    t.add_argument("--show-config", action="store_true",
                   help="print every key of the method's config with its default, then exit")
    t.add_argument("--output-dir", metavar="DIR",
                   help="where the run writes (overrides the config's output_dir)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, TABLE.KEY for a key of a table "
                        "(e.g. sampling.height=64); the value is parsed as JSON when it can be")
    t.add_argument("--nproc", type=int, metavar="N",
                   help="data-parallel training on N ranks of this machine (torchrun: gloo on CPU, "
                        "nccl on GPU, one GPU per rank); rank 0 writes metrics and checkpoints")
    t.set_defaults(func=cmd_train)

    from .serve.server import ServeOptions as serve_defaults

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: images, video jobs with "
                                     "progress and cancellation, a web page")
    s.add_argument("--model", action="append", required=True, metavar="PATH",
                   help="diffusers-format checkpoint directory or hub id (repeat to serve several; "
                        "each is served under its directory's name)")
    s.add_argument("--workflow",
                   help="also serve a cross-model workflow, e.g. t2i-i2v (its stages: the first "
                        "text-to-image and the first image-to-video --model)")
    s.add_argument("--backend", action="append",
                   help="backend name (default: the highest-priority available); once, or once "
                        "per --model")
    s.add_argument("--host", default=serve_defaults.host,
                   help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=serve_defaults.port,
                   help="port (default %(default)s; 0: a free one)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                                     "/health (default: $FLOWSEAM_API_KEY; none: no key)")
    s.add_argument("--max-queue", type=int, default=serve_defaults.max_queue,
                   help="jobs that may wait per model before requests get 429 (default "
                        "%(default)s)")
    s.add_argument("--max-batch", type=int, default=serve_defaults.max_batch,
                   help="samples one loop run may batch (default %(default)s; 1: no batching)")
    s.add_argument("--output-dir", default=serve_defaults.output_dir,
                   help="the job table and outputs (default %(default)s)")
    s.add_argument("--expire-after", type=float, default=serve_defaults.expire_after,
                   help="seconds finished outputs and their jobs are kept (default %(default)s)")
    s.add_argument("--max-upload-mb", type=float, default=serve_defaults.max_upload_mb,
                   help="largest request body, in MiB (default %(default)s)")
    s.add_argument("--log-level", default=serve_defaults.log_level,
                   help="uvicorn and server log level (default %(default)s)")
    s.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's, one per core); on a shared or "
                        "small CPU machine fewer threads than cores often run faster")
    s.add_argument("--lora", action="append", metavar="PATH",
                   help="a LoRA .safetensors file loaded at start into every model it fits; "
                        "requests name loaded files in their 'lora' field (repeatable)")
    s.set_defaults(func=cmd_serve)

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
    return parser


#: Exit statuses: 2 for bad input (an option, a file, a config), 3 for a plugin that failed at
#: run time (the message names it), 143 after SIGTERM. A traceback (exit 1) is a flowseam bug.
EXIT_USAGE, EXIT_PLUGIN_FAULT, EXIT_TERMINATED = 2, 3, 128 + signal.SIGTERM


#: Set by the SIGTERM handler. The ``SystemExit`` it raises unwinds the command, unless the
#: handler happened to run inside a finalizer (``__del__``, a weakref callback), where CPython
#: prints the exception and drops it; :func:`main` then still exits 143, never 0.
_sigterm_received = threading.Event()


def _terminate(signum, frame):  # SIGTERM unwinds like Ctrl-C: temporary files are removed
    _sigterm_received.set()
    raise SystemExit(EXIT_TERMINATED)


class _Version(argparse.Action):
    """``--version``, printed as is (argparse's own action rewraps the text)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """``flowseam 0.1.0`` and the version of every installed plugin distribution (without
    importing them)."""
    from importlib import metadata

    from . import __version__
    from .plugins import ENTRY_POINT_GROUP

    dists = sorted({f"{ep.dist.metadata['Name']} {ep.dist.version}"
                    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
                    if ep.dist is not None and ep.dist.metadata["Name"] != "flowseam"})
    return f"flowseam {__version__}" + (f" (plugins: {', '.join(dists)})" if dists else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; see :data:`EXIT_USAGE` and the others for the exit statuses.

    While a command runs, SIGTERM raises ``SystemExit(143)`` in the main thread, so that
    ``finally`` blocks run: an output being written, a checkpoint being saved, leave no
    temporary file behind (the default SIGTERM action would kill the process on the spot).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    enable_notices()  # a backend compiling on its first call says so (flowseam.console.long_wait)
    previous = None
    if threading.current_thread() is threading.main_thread():
        _sigterm_received.clear()
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's final flush
        # a SIGTERM whose SystemExit a finalizer swallowed: the work finished (outputs whole,
        # no temporary file), but the process was told to stop, and says so
        return EXIT_TERMINATED if _sigterm_received.is_set() else status
    except PluginFaultError as exc:
        print(f"flowseam: plugin fault: {exc}", file=sys.stderr)
        return EXIT_PLUGIN_FAULT
    except (FlowseamError, ValueError) as exc:
        print(f"flowseam: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader went away (flowseam backends --json | head): stop quietly, as cat does.
        # Point stdout at devnull so that the interpreter's final flush cannot raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
