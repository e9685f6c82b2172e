"""Cost of the loops' per-step output check (``flowseam.loops.checks.check_step``) on the success path.

Two comparisons, each timed in alternating blocks in one process (medians and minimums):

1. On a 1M-element float32 latents tensor: the exact finiteness test
   (``torch.isfinite(x).all()``, what every step ran before) against the cheap one ``check_step``
   now runs (``torch.isfinite(x.sum())``: one reduction and no temporary; the exact test only when
   that sum is not finite), and both against the bare ``flow_match_step`` on the same tensor.
2. ``check_step`` against one real denoising step of a tiny Wan2.1 T2V checkpoint (written by
   ``flowseam.testing.tiny``): the step's seconds are the loop's own ``seconds["denoise"]`` over
   its steps (the DiT's velocity plus the kernel step), the check timed on latents of the
   request's shape.

Run: .venv/bin/python bench/step_check.py [--repeats 15] [--frames 9 --size 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import flowseam
from flowseam import ops
from flowseam.loops.checks import check_step


def alternate(fns: dict, repeats: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each function, ``repeats`` blocks of ``calls`` calls, alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    platform = flowseam.Platform("cpu")
    step = platform.kernels.get(ops.FLOW_MATCH_STEP)
    n = 1_000_000
    x, v = torch.randn(n), torch.randn(n)
    out = step(x, v, 0.75, 0.7)
    t = alternate({"bare step": lambda: torch.add(x, v, alpha=-0.05),
                   "exact isfinite(x).all()": lambda: bool(torch.isfinite(out).all()),
                   "cheap isfinite(x.sum())": lambda: bool(torch.isfinite(out.sum())),
                   "check_step": lambda: check_step(None, 0, step, x, v, out, 0.75, 0.7)},
                  args.repeats, args.calls)
    bare = statistics.median(t["bare step"])
    print(f"torch threads {torch.get_num_threads()}; {n:,} float32 elements; medians of "
          f"{args.repeats} alternating blocks x {args.calls} calls (min in brackets)")
    for name, values in t.items():
        med = statistics.median(values)
        print(f"  {name:<26} {med * 1e6:9.1f} µs ({min(values) * 1e6:.1f})  = "
              f"{100 * med / bare:6.1f} % of the bare step")
    exact, cheap = statistics.median(t["exact isfinite(x).all()"]), statistics.median(t["cheap isfinite(x.sum())"])
    print(f"  cheap / exact = {cheap / exact:.3f}")

    from flowseam.testing.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = flowseam.load(write_tiny_checkpoint("wan2.1-t2v", Path(tmp) / "t2v"),
                              platform=platform, quiet=True)
        params = flowseam.DiffusionParams(num_steps=args.steps, height=args.size, width=args.size,
                                          num_frames=args.frames)
        model.generate("a cat", params=params)  # warm-up
        per_step, checks = [], []
        for _ in range(max(3, args.repeats // 3)):
            result = model.generate("a cat", params=params)
            per_step.append(result.seconds["denoise"] / args.steps)
            lat = result.latents
            vel = torch.randn_like(lat)
            checks.append(min(timeit_once(lambda: check_step(model, 0, step, lat, vel, lat, 0.75, 0.7))
                              for _ in range(args.calls)))
        s, c = statistics.median(per_step), statistics.median(checks)
        print(f"tiny Wan2.1 T2V, latents {tuple(lat.shape)} ({lat.numel():,} elements): one "
              f"denoising step {s * 1e3:.2f} ms (DiT velocity + kernel), check_step {c * 1e6:.1f} µs"
              f" = {100 * c / s:.2f} % of the step")


def timeit_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
