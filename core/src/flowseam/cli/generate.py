"""``flowseam generate``: an image, a video or a sound from a checkpoint (or a cross-model
workflow), its errors in the command's words."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from ..quiet import quiet_libraries
from ..errors import InvalidInputError
from .parsing import add_memory_options, add_parallel_options, memory_options

if TYPE_CHECKING:  # pragma: no cover
    from ..parallel import Parallel


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``generate`` command and its options."""
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
                        "changes little (reuse or extrapolate, e.g. extrapolate:0.1); off by "
                        "default")
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
    add_parallel_options(g, "rank 0 writes the output")
    add_memory_options(g)
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
    except InvalidInputError as exc:  # flowseam's own; any other ValueError is a bug (exit 1)
        message = in_cli_words(str(exc))
        flag = GENERATE_FLAGS.get(getattr(exc, "field", ""))
        if flag and flag not in message:
            message = f"{flag}: {message}"
        raise InvalidInputError(message) from exc


def _check_image_flag(args: argparse.Namespace) -> None:
    """--image against the checkpoint's card (read from model_index.json, before any model
    loads): an image-to-video model needs one, the others take none."""
    from ..loading import read_card
    from ..request import TaskType

    card = read_card(args.model[0])
    if TaskType.I2V in card.tasks and args.image is None:
        raise InvalidInputError(
            f"--image is required: {args.model[0]} is {card.name}, image to video "
            "(pass --image PATH: the first frame)")
    if TaskType.I2V not in card.tasks and args.image is not None:
        raise InvalidInputError(f"--image: {args.model[0]} is {card.name}, which takes no image")


def _generate(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from .. import media
    from ..checkpoint_defaults import read_checkpoint_defaults
    from ..loading import check_load_options, load, read_card, resolve_checkpoint
    from ..parallel import is_rank_of, launch
    from ..seam.platform import Platform
    from ..request import DiffusionParams, check_memory
    from ..workflows import WORKFLOWS

    quiet_libraries()
    suffix = Path(args.output).suffix.lower()
    if args.stream and (suffix != ".mp4" or args.workflow is not None):
        raise InvalidInputError(
            f"--stream writes one model's video progressively as .mp4; got --output "
            f"{args.output}" + (f" and --workflow {args.workflow}" if args.workflow else ""))
    if suffix not in media.IMAGE_SUFFIXES + media.VIDEO_SUFFIXES + media.AUDIO_SUFFIXES:
        raise InvalidInputError(
            f"--output {args.output}: unsupported suffix {suffix!r}; use .png for "
            "images, .mp4 or .gif for videos, .wav for the sound alone")
    if args.fps is not None:
        media.check_fps(args.fps)
    image = media.read_image(args.image) if args.image is not None else None  # missing, bomb...
    if args.workflow is not None:
        if args.workflow not in WORKFLOWS:
            raise InvalidInputError(
                f"--workflow {args.workflow!r} is unknown; available: {sorted(WORKFLOWS)}")
        if len(args.model) != 2:
            raise InvalidInputError(
                f"--workflow {args.workflow} needs two --model checkpoints (text-to-"
                f"image, then image-to-video); got {len(args.model)}")
    elif len(args.model) != 1:
        raise InvalidInputError(
            f"give one --model (got {len(args.model)}); two are for --workflow t2i-i2v")
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
        raise InvalidInputError(
            f"--backend given {len(backends)} times; once, or once per workflow stage")
    # the cards (from model_index.json alone) give the defaults the memory check needs
    stages = WORKFLOWS[args.workflow].stage_params(params) if args.workflow else (params,)
    for model_path, stage in zip(args.model, stages):
        root = resolve_checkpoint(model_path)
        check_memory(stage.with_defaults({**read_card(root).defaults,
                                          **read_checkpoint_defaults(root)}))
    media.check_writable(args.output)
    platforms = [Platform(b) if b else Platform.detect() for b in backends]
    platform = platforms[0]
    for path, stage_platform in zip(args.model, platforms * 2):  # before any weights load
        check_load_options(path, stage_platform, **memory_options(args))
    parallel = _parallel(args, stages, platforms)
    rank = int(os.environ.get("RANK", "0")) if parallel is not None else 0
    if parallel is not None and not is_rank_of(parallel.world_size):  # start the ranks
        return launch(args.argv, parallel.world_size)
    started = time.perf_counter()
    if args.workflow is not None:
        # each stage keeps its own platform resolution (a second --backend sets stage 2's)
        t2i = load(args.model[0], platform=platform, ignore_scheduler_options=ignore,
                   parallel=parallel, quiet=rank != 0, **memory_options(args))
        i2v = load(args.model[1], platform=platforms[-1], ignore_scheduler_options=ignore,
                   parallel=parallel, quiet=rank != 0, **memory_options(args))
        _check_sound(args.output, suffix, i2v)
        workflow = WORKFLOWS[args.workflow](t2i, i2v)
        image_params, video_params = stages
        result = workflow.run(args.prompt, t2i_params=image_params,
                              i2v_params=_with_frame_rate(video_params, i2v, args.fps),
                              seed=args.seed, progress=rank == 0)
        frames, models, runs = result.frames, [t2i, i2v], result.stages
        if rank != 0:  # every rank holds the frames; rank 0 writes them and reports
            return 0
    elif args.stream:
        model = load(args.model[0], platform=platform, ignore_scheduler_options=ignore,
                     **memory_options(args))
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
        model = load(args.model[0], platform=platform, ignore_scheduler_options=ignore,
                     parallel=parallel, quiet=rank != 0, **memory_options(args))
        _check_sound(args.output, suffix, model)
        result = model.generate(args.prompt, image=image,
                                params=_with_frame_rate(params, model, args.fps),
                                progress=rank == 0)
        frames, models, runs = result.frames, [model], [result]
        if rank != 0:  # every rank holds the frames; rank 0 writes them and reports
            return 0
    stage = result.stages[-1] if args.workflow is not None else result
    if frames.shape[1] > 1 and suffix in media.IMAGE_SUFFIXES:
        raise InvalidInputError(
            f"--output {args.output}: this request makes a {frames.shape[1]}-frame "
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


def _parallel(args: argparse.Namespace, stages: tuple, platforms: list) -> "Parallel | None":
    """The layout ``--nproc``/``--sp``/``--cfg-parallel`` ask for (None: one process), checked
    against this machine and each checkpoint, with its stage's parameters, before any model
    loads (:mod:`flowseam.parallel`)."""
    from ..loading import check_parallel_checkpoint
    from ..parallel import check_ranks, parallel_from_options

    parallel = parallel_from_options(args.nproc, args.sp, args.cfg_parallel)
    if parallel is None:
        return None
    if args.stream:
        raise InvalidInputError("--nproc/--sp/--cfg-parallel split a generation; --stream (the "
                                "causal loop, chunk by chunk) is not split (drop one)")
    check_ranks(parallel, platforms[0])
    for path, stage, platform in zip(args.model, stages, platforms * 2):
        check_parallel_checkpoint(path, parallel, stage, platform)
    return parallel


def _check_sound(output: str, suffix: str, model) -> None:
    """A ``.wav`` output needs a model that makes sound (raised before generating)."""
    from .. import media

    if suffix in media.AUDIO_SUFFIXES and not model.card.audio:
        raise InvalidInputError(
            f"--output {output}: {model.card.name} makes no sound; use .png, .mp4 "
            "or .gif")


def _with_frame_rate(params, model, fps: float | None):
    """``--fps`` is a generation parameter for cards that take one (LTX-2), else playback only."""
    return params.replace(frame_rate=fps) if "frame_rate" in model.card.defaults else params

