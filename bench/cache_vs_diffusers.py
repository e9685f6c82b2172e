"""Adaptive step caching: flowseam's cache policies vs diffusers' First-Block Cache, same weights.

The weights are the demo's digit models (``flowseam/demo/weights``: ``digits-t2i``, a
``FluxPipeline``, and ``digits-i2v``, a ``WanImageToVideoPipeline``), trained on real handwritten
digits, so consecutive denoising steps are correlated as in a real model (random weights make
every cache look good or bad by accident). Sampling: the recipes' ``[serve]`` settings (32x32,
9 frames for the video, guidance 1.0 for the video: no CFG branch) with ``--steps`` steps.

In one process, after a warm-up of each, the runs alternate ``--repeats`` times: flowseam
uncached, flowseam with each policy and threshold, diffusers uncached, diffusers with
``transformer.enable_cache(FirstBlockCacheConfig(threshold))`` for each threshold. Reported per
row: the median denoising seconds, the speed-up over the same library's uncached median, and
the PSNR of the decoded frames against the same library's uncached frames (frames in [0, 1]:
``10 log10(1 / MSE)``). Denoising time: flowseam's ``LoopResult.seconds["denoise"]``; diffusers'
from the first transformer call's start to the last one's end (forward hooks), which also spans
its scheduler steps. The goal (issue 15): at PSNR >= 30 dB, flowseam's speed-up >= 1.8x and >=
diffusers' best at the same PSNR; the last lines say whether it holds.

Run: .venv/bin/python bench/cache_vs_diffusers.py [--model t2i|i2v|both] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import flowseam
from flowseam import DiffusionParams

WEIGHTS = Path(flowseam.__file__).parent / "demo" / "weights"
THRESHOLDS = {"reuse": (0.05, 0.1, 0.2), "extrapolate": (0.05, 0.1, 0.2, 0.4)}
FBC_THRESHOLDS = (0.02, 0.05, 0.1, 0.2)
PROMPTS = {"t2i": "a handwritten digit three", "i2v": "a handwritten digit three moving left"}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


class DenoiseTimer:
    """Seconds from the first transformer call's start to the last call's end (diffusers)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.first = self.last = None
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_):
        if self.first is None:
            self.first = time.perf_counter()

    def _post(self, *_):
        self.last = time.perf_counter()

    def reset(self) -> None:
        self.first = self.last = None

    @property
    def seconds(self) -> float:
        return self.last - self.first


def first_frame() -> np.ndarray:
    """The conditioning image of the video model: the text-to-image model's digit three."""
    t2i = flowseam.load(WEIGHTS / "digits-t2i", platform=flowseam.Platform("cpu"), quiet=True)
    params = DiffusionParams(num_steps=20, height=32, width=32, max_sequence_length=32)
    return t2i.generate(PROMPTS["t2i"], params=params).frames[0, 0]


def bench(kind: str, steps: int, repeats: int, guidance: float | None) -> list[dict]:
    import diffusers
    from diffusers import FirstBlockCacheConfig
    from PIL import Image

    path = WEIGHTS / f"digits-{kind}"
    model = flowseam.load(path, platform=flowseam.Platform("cpu"), quiet=True)
    image = first_frame() if kind == "i2v" else None
    base = dict(num_steps=steps, height=32, width=32, seed=3)
    if kind == "t2i":
        base.update(max_sequence_length=32)
    else:
        base.update(num_frames=9, flow_shift=1.0,
                    guidance_scale=1.0 if guidance is None else guidance)
    if kind == "t2i" and guidance is not None:
        base.update(guidance_scale=guidance)
    params = DiffusionParams(**base)

    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    if kind == "i2v":  # the recipe's flow shift (the checkpoint's scheduler has shift 1.0 too)
        pipe.scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config, shift=1.0)
    timer = DenoiseTimer(pipe.transformer)
    d_args = dict(prompt=PROMPTS[kind], num_inference_steps=steps, height=32, width=32,
                  output_type="np")
    if kind == "t2i":
        d_args.update(max_sequence_length=32, guidance_scale=params.guidance_scale or 3.5)
    else:
        d_args.update(num_frames=9, guidance_scale=params.guidance_scale,
                      image=Image.fromarray((image * 255).round().astype(np.uint8)))

    def ours(policy):
        out = model.generate(PROMPTS[kind], image=image, params=params.replace(cache=policy))
        return out.seconds["denoise"], out.frames[0], out.cache

    def theirs(threshold):
        if threshold is not None:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        timer.reset()
        out = pipe(**d_args, generator=torch.Generator().manual_seed(3))
        frames = out.images[:, None] if kind == "t2i" else out.frames
        if threshold is not None:
            pipe.transformer.disable_cache()
        return timer.seconds, frames[0], None

    runs = [("flowseam", None, lambda: ours(None))]
    runs += [("flowseam", f"{name}:{t:g}", (lambda n=name, t=t: ours(f"{n}:{t}")))
             for name, ts in THRESHOLDS.items() for t in ts]
    runs += [("diffusers", None, lambda: theirs(None))]
    runs += [("diffusers", f"fbc:{t:g}", (lambda t=t: theirs(t))) for t in FBC_THRESHOLDS]
    seconds: dict[tuple, list[float]] = {(lib, name): [] for lib, name, _ in runs}
    frames, caches = {}, {}
    for lib, name, run in runs:  # warm-up
        run()
    for _ in range(repeats):
        for lib, name, run in runs:
            s, f, c = run()
            seconds[(lib, name)].append(s)
            frames[(lib, name)], caches[(lib, name)] = f, c
    rows = []
    for lib, name, _ in runs:
        median = statistics.median(seconds[(lib, name)])
        uncached = statistics.median(seconds[(lib, None)])
        c = caches[(lib, name)]
        rows.append(dict(model=kind, library=lib, policy=name or "uncached", seconds=median,
                         speedup=uncached / median,
                         psnr=psnr(frames[(lib, name)], frames[(lib, None)]),
                         computed=f"{c['steps_computed']}/{steps}" if c else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("t2i", "i2v", "both"), default="both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--guidance", type=float, default=None,
                    help="guidance scale (default: the recipe's; > 1 on i2v runs CFG's two branches)")
    args = ap.parse_args()
    torch.manual_seed(0)
    kinds = ("t2i", "i2v") if args.model == "both" else (args.model,)
    print(f"torch threads {torch.get_num_threads()}; {args.steps} steps; median of {args.repeats} "
          "alternating runs after a warm-up")
    print(f"{'model':5} {'library':9} {'policy':16} {'denoise s':>9} {'speed-up':>8} {'PSNR dB':>8} "
          f"{'DiT steps':>9}")
    for kind in kinds:
        rows = bench(kind, args.steps, args.repeats, args.guidance)
        for r in rows:
            print(f"{r['model']:5} {r['library']:9} {r['policy']:16} {r['seconds']:9.3f} "
                  f"{r['speedup']:7.2f}x {r['psnr']:8.1f} {r['computed']:>9}")
        good = lambda lib: [r for r in rows if r["library"] == lib and r["policy"] != "uncached"  # noqa: E731
                            and r["psnr"] >= 30]
        ours_best = max((r["speedup"] for r in good("flowseam")), default=0.0)
        theirs_best = max((r["speedup"] for r in good("diffusers")), default=0.0)
        verdict = ours_best >= 1.8 and ours_best >= theirs_best
        print(f"{kind}: at PSNR >= 30 dB flowseam's best speed-up {ours_best:.2f}x, diffusers' "
              f"First-Block Cache {theirs_best:.2f}x; goal (>= 1.8x and >= diffusers): "
              f"{'holds' if verdict else 'does not hold'}")


if __name__ == "__main__":
    main()
