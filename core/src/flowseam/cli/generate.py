"""``flowseam generate``: an image, a video or a sound from a checkpoint (or a cross-model
workflow), its errors in the command's words."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import media
from ..errors import InvalidInputError
from ..quiet import quiet_libraries
from ..request import DiffusionParams
from ..seam.platform import Platform
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
    _add_sampling_options(g)
    add_parallel_options(g, "rank 0 writes the output")
    add_memory_options(g)
    g.add_argument("--backend", action="append",
                   help="backend name (default: the highest-priority available); with --workflow, "
                        "give it twice to choose each stage's backend")
    g.add_argument("--output", required=True,
                   help=".png for images, .mp4 or .gif for videos (an LTX-2 .mp4 has an AAC "
                        "sound track; a .gif drops it), .wav for the sound alone")
    _add_causal_options(g)
    g.set_defaults(func=cmd_generate)


def _add_sampling_options(g: argparse.ArgumentParser) -> None:
    """The request's sampling options: steps, guidance, scheduler, LoRA, cache, size, LTX-2's."""
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


def _add_causal_options(g: argparse.ArgumentParser) -> None:
    """The options of causal checkpoints: streaming and the chunked attention window."""
    g.add_argument("--stream", action="store_true",
                   help="causal checkpoints: write the .mp4 chunk by chunk as it is generated "
                        "(playable while written) and print the time to the first chunk")
    g.add_argument("--chunk-frames", type=int,
                   help="causal checkpoints: latent frames per chunk (default the checkpoint's)")
    g.add_argument("--local-attn-size", type=int,
                   help="causal checkpoints: rolling window in latent frames (default none)")
    g.add_argument("--sink-size", type=int,
                   help="causal checkpoints: first latent frames kept in the window")


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


@dataclass
class _Plan:
    """What ``flowseam generate`` runs, every part checked before any model loads."""

    params: DiffusionParams
    #: one per model: ``(params,)``, or a workflow's stages' params
    stages: tuple[DiffusionParams, ...]
    #: one per model (a workflow's second stage may name its own backend)
    platforms: list[Platform]
    parallel: "Parallel | None"
    suffix: str
    image: Any
    ignore: tuple[str, ...]

    @property
    def rank(self) -> int:
        """This process's rank (0 without ``--nproc``): rank 0 writes and reports."""
        return int(os.environ.get("RANK", "0")) if self.parallel is not None else 0

    def load(self, args: argparse.Namespace, index: int) -> Any:
        """The ``index``-th ``--model``, loaded on its platform (split over the ranks)."""
        from ..loading import load

        return load(args.model[index], platform=self.platforms[min(index, len(self.platforms) - 1)],
                    ignore_scheduler_options=self.ignore, parallel=self.parallel,
                    quiet=self.rank != 0, **memory_options(args))


def _generate(args: argparse.Namespace) -> int:
    """Check everything that needs no weights, start the ranks of ``--nproc``, then run one of
    the three modes: a workflow of two models, a streamed video, or one model's output."""
    from ..launch import launch
    from ..parallel import is_rank_of

    plan = _plan(args)
    if plan.parallel is not None and not is_rank_of(plan.parallel.world_size):
        return launch(args.argv, plan.parallel.world_size)
    if args.workflow is not None:
        return _run_workflow(args, plan)
    if args.stream:
        return _run_stream(args, plan)
    return _run_single(args, plan)


def _plan(args: argparse.Namespace) -> _Plan:
    """The options checked against each other, the checkpoints' cards and serving defaults, this
    machine's memory and ranks and the output path: everything but the weights.

    :raises InvalidInputError: naming the option.
    """
    from ..loading import check_load_options
    from ..workflows import WORKFLOWS

    quiet_libraries()
    suffix = _check_output(args)
    image = media.read_image(args.image) if args.image is not None else None  # missing, bomb...
    _check_models(args)
    params = _params(args)
    backends = args.backend or [None]
    if len(backends) > (2 if args.workflow else 1):
        raise InvalidInputError(
            f"--backend given {len(backends)} times; once, or once per workflow stage")
    stages = WORKFLOWS[args.workflow].stage_params(params) if args.workflow else (params,)
    _check_memory(args.model, stages)
    media.check_writable(args.output)
    platforms = [Platform(b) if b else Platform.detect() for b in backends]
    for path, stage_platform in zip(args.model, platforms * 2):  # before any weights load
        check_load_options(path, stage_platform, **memory_options(args))
    return _Plan(params, stages, platforms, _parallel(args, stages, platforms), suffix, image,
                 tuple(args.ignore_scheduler_option or ()))


def _check_output(args: argparse.Namespace) -> str:
    """``--output``'s suffix, checked against ``--stream`` and ``--workflow``; ``--fps``."""
    from pathlib import Path

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
    return suffix


def _check_models(args: argparse.Namespace) -> None:
    """One ``--model`` (two with ``--workflow``, which must be known), and ``--image`` where the
    card takes one."""
    from ..workflows import WORKFLOWS

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


def _params(args: argparse.Namespace) -> DiffusionParams:
    """The request's parameters from the options; ``--lora`` files must exist."""
    from pathlib import Path

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
    return params


def _check_memory(models: list[str], stages: tuple[DiffusionParams, ...]) -> None:
    """Each stage's request against this machine's memory, with the defaults its card and its
    checkpoint's ``flowseam.json`` give (read from the files alone)."""
    from ..checkpoint_defaults import read_checkpoint_defaults
    from ..loading import read_card, resolve_checkpoint
    from ..request import check_memory

    for model_path, stage in zip(models, stages):
        root = resolve_checkpoint(model_path)
        check_memory(stage.with_defaults({**read_card(root).defaults,
                                          **read_checkpoint_defaults(root)}))


def _run_workflow(args: argparse.Namespace, plan: _Plan) -> int:
    """``--workflow``: the text-to-image stage, then image-to-video from its image."""
    from ..workflows import WORKFLOWS

    started = time.perf_counter()
    t2i, i2v = plan.load(args, 0), plan.load(args, 1)
    _check_sound(args.output, plan.suffix, i2v)
    image_params, video_params = plan.stages
    result = WORKFLOWS[args.workflow](t2i, i2v).run(
        args.prompt, t2i_params=image_params,
        i2v_params=_with_frame_rate(video_params, i2v, args.fps), seed=args.seed,
        progress=plan.rank == 0)
    if plan.rank != 0:  # every rank holds the frames; rank 0 writes them and reports
        return 0
    return _write(args, plan, result.frames, result.stages[-1], [t2i, i2v], result.stages, started)


def _run_stream(args: argparse.Namespace, plan: _Plan) -> int:
    """``--stream``: a causal model's video written chunk by chunk as it is generated."""
    started = time.perf_counter()
    model = plan.load(args, 0)
    chunks = model.generate_stream(args.prompt, params=plan.params)  # refuses a non-causal model
    with media.StreamingVideoWriter(args.output, fps=args.fps or 8) as writer:
        for chunk in chunks:
            writer.write(chunk.frames[0])
            if chunk.index == 0:
                print(f"time-to-first-chunk: {chunk.seconds:.2f} s ({chunk.frames.shape[1]} "
                      f"frame(s) written to {args.output} while the rest is generated)",
                      flush=True)
    seconds = time.perf_counter() - started
    print(f"wrote {args.output} ({writer.frames} frame(s) of {chunk.frames.shape[2]}x"
          f"{chunk.frames.shape[3]}, {chunk.result.chunks} chunks, streamed) in {seconds:.2f} s | "
          f"{model.provenance()}")
    return 0


def _run_single(args: argparse.Namespace, plan: _Plan) -> int:
    """One model's image, video or sound."""
    started = time.perf_counter()
    model = plan.load(args, 0)
    _check_sound(args.output, plan.suffix, model)
    result = model.generate(args.prompt, image=plan.image,
                            params=_with_frame_rate(plan.params, model, args.fps),
                            progress=plan.rank == 0)
    if plan.rank != 0:  # every rank holds the frames; rank 0 writes them and reports
        return 0
    return _write(args, plan, result.frames, result, [model], [result], started)


def _write(args: argparse.Namespace, plan: _Plan, frames: Any, last: Any, models: list,
           runs: list, started: float) -> int:
    """Write the output atomically (``last``: the run whose sound and frame rate it takes) and
    print one line: what was written, then per model where its parts came from and the solver
    that ran."""
    if frames.shape[1] > 1 and plan.suffix in media.IMAGE_SUFFIXES:
        raise InvalidInputError(
            f"--output {args.output}: this request makes a {frames.shape[1]}-frame "
            "video; use .mp4 or .gif")
    audio = last.audio[0] if last.audio is not None else None
    if audio is not None and plan.suffix == ".gif":
        print("flowseam: note: a GIF has no audio track; the audio is dropped (use .mp4 for video "
              "with sound, or .wav for the sound alone)", file=sys.stderr)
        audio = None
    fps = args.fps or last.params.frame_rate or 8
    media.write_output(args.output, frames[0], fps=fps, audio=audio, sample_rate=last.sample_rate)
    seconds = time.perf_counter() - started
    what = (f"{audio.shape[1] / last.sample_rate:.2f} s of {audio.shape[0]}-channel audio at "
            f"{last.sample_rate} Hz" if plan.suffix in media.AUDIO_SUFFIXES else
            f"{frames.shape[1]} frame(s) of {frames.shape[2]}x{frames.shape[3]}"
            + (f" with {audio.shape[0]}-channel AAC audio" if audio is not None else ""))
    extra = f" | {models[0].adapters.describe(plan.params.lora)}" if plan.params.lora else ""
    cached = [r.cache for r in runs if r.cache]
    if cached:
        extra += " | cache " + ", ".join(f"{c['policy']}: {c['steps_computed']} steps computed, "
                                         f"{c['steps_skipped']} skipped" for c in cached)
    print(f"wrote {args.output} ({what}) in {seconds:.2f} s{extra} | "
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
    if suffix in media.AUDIO_SUFFIXES and not model.card.audio:
        raise InvalidInputError(
            f"--output {output}: {model.card.name} makes no sound; use .png, .mp4 "
            "or .gif")


def _with_frame_rate(params, model, fps: float | None):
    """``--fps`` is a generation parameter for cards that take one (LTX-2), else playback only."""
    return params.replace(frame_rate=fps) if "frame_rate" in model.card.defaults else params

