"""flowseam vs diffusers: the same Wan2.1 T2V generation, alternating in one process.

A small but non-trivial Wan config (4 layers, inner width 128 = 4 heads x 32, ffn 256; 17 frames
at 64x64; 10 steps; CFG on, guidance 5.0), random weights written by
``flowseam.testing.tiny.write_tiny_checkpoint``. Both sides load the same checkpoint; after one
warm-up run each, they alternate ``--repeats`` times. Reports the median wall and CPU seconds of
each, the ratios flowseam/diffusers (goal <= 0.6, issue 19), the max-abs difference of their
outputs, the peak resident-memory growth of each run (Linux's peak RSS, ``VmHWM``, reset before
each run: :class:`PeakRSS`) and the load average before and after. On the shared machine
measure with ``--threads 1``: the CPU seconds of a one-thread run are the work done, whatever the
load; torch's two threads on two busy cores mostly wait for each other.
``--scheduler unipc`` writes the checkpoint with UniPC in the flow configuration that the real
Wan2.1-Diffusers checkpoints ship (both sides then run it: flowseam's ``unipc_step`` op, diffusers'
``UniPCMultistepScheduler``); the default is FlowMatchEuler.

``--profile N`` then runs each side once more under ``torch.profiler`` and prints its N top ops
by self CPU time (what to change first, and the before/after of a change).

Run: .venv/bin/python bench/generate_vs_diffusers.py [--repeats 5] [--backend cpu] [--threads 1]
[--scheduler unipc] [--profile 12]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (``VmHWM`` in /proc/self/status)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class PeakRSS:
    """Peak RSS growth (bytes) while the block runs: the kernel's own peak (``VmHWM``), reset on
    entry by writing 5 to /proc/self/clear_refs (Linux >= 4.0, ``proc(5)``), minus the RSS then.

    Exact, and nothing runs beside the measured block: a thread that sampled /proc/self/statm
    every 2 ms (as this bench first did) missed peaks shorter than that and took ~0.5 CPU s and
    the GIL from every 10 s run (12 % of an LTX-2 two-stage run at one thread), which pulled both
    sides' times and their ratio toward each other."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = rss_bytes()
        return self

    def __exit__(self, *exc):
        self.peak = peak_rss_bytes()
        self.growth = self.peak - self.start


def bench_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """``--repeats``, ``--backend``, ``--steps``: the options every flowseam-vs-peer benchmark has."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def alternate(contenders: dict, repeats: int) -> tuple[dict, dict]:
    """Run every ``contenders[name]()`` ``repeats`` times, alternating who goes first (allocator
    reuse favours the second); returns ``(seconds, peak RSS growth in bytes)`` per name."""
    times, _, peaks = alternate_timed(contenders, repeats)
    return times, peaks


def alternate_timed(contenders: dict, repeats: int) -> tuple[dict, dict, dict]:
    """:func:`alternate`, also returning each run's CPU seconds (``time.process_time``: every
    thread of the process, so torch's intra-op threads too): ``(wall seconds, CPU seconds,
    peak RSS growth in bytes)`` per name. On a shared, loaded machine the CPU seconds of a
    one-thread run (``--threads 1``) measure the work done; wall seconds measure the wait."""
    times = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}
    peaks = {name: [] for name in contenders}
    order = list(contenders.items())
    for _ in range(repeats):
        order.reverse()
        for name, fn in order:
            with PeakRSS() as mem:
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            peaks[name].append(mem.growth)
    return times, cpu, peaks


def report(times: dict, peaks: dict, goal: float, cpu: dict | None = None) -> None:
    """One line per contender (median, every run, peak RSS growth), then the ratio of the first
    to the second (wall seconds, and CPU seconds when ``cpu`` is given)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in times:
        print(f"  {name:<10} median {med[name]:.3f} s  (runs: "
              f"{', '.join(f'{t:.3f}' for t in times[name])}); peak RSS growth "
              f"{max(peaks[name]) / 2**20:.1f} MiB")
        if cpu is not None:
            print(f"  {'':<10} CPU    {statistics.median(cpu[name]):.3f} s  (runs: "
                  f"{', '.join(f'{t:.3f}' for t in cpu[name])})")
    first, second = list(times)
    print(f"  ratio {first}/{second} = {med[first] / med[second]:.3f} wall"
          + (f", {statistics.median(cpu[first]) / statistics.median(cpu[second]):.3f} CPU"
             if cpu is not None else "") + f"  (goal <= {goal})")


def profile(contenders: dict, top: int) -> None:
    """Run every ``contenders[name]()`` once more under ``torch.profiler`` and print its ``top``
    ops by self CPU time (nothing when ``top`` is 0)."""
    for name, fn in contenders.items() if top else ():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        print(f"  {name}: top {top} ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    ap = bench_parser(__doc__, steps=10)
    ap.add_argument("--scheduler", choices=("euler", "unipc"), default="euler")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default: torch's choice, one per core)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print each side's N top ops by self CPU time (torch.profiler)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scheduler_class = {"euler": "FlowMatchEulerDiscreteScheduler",
                       "unipc": "UniPCMultistepScheduler"}[args.scheduler]

    import diffusers

    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint

    diffusers.utils.logging.set_verbosity_error()
    root = Path(tempfile.mkdtemp(prefix="fs-bench-"))
    ckpt = write_tiny_checkpoint("wan2.1-t2v", root / "wan", scheduler_class=scheduler_class,
                                 transformer=dict(num_layers=4, num_attention_heads=4,
                                                  attention_head_dim=32, ffn_dim=256))
    H = W = 64
    F = 17
    prompt, negative = "a red ball bouncing on a wooden floor", "blurry, low quality"

    model = flowseam.load(ckpt, platform=flowseam.Platform(args.backend), quiet=True)
    params = flowseam.DiffusionParams(num_steps=args.steps, guidance_scale=5.0, height=H, width=W,
                                      num_frames=F, seed=0, negative_prompt=negative)
    pipe = diffusers.WanPipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)

    def run_flowseam():
        return model.generate(prompt, params=params).frames

    def run_diffusers():
        return pipe(prompt=prompt, negative_prompt=negative, num_inference_steps=args.steps,
                    guidance_scale=5.0, height=H, width=W, num_frames=F,
                    generator=torch.Generator().manual_seed(0), output_type="np").frames

    ours, theirs = run_flowseam(), run_diffusers()  # warm-up (and parity)
    load = os.getloadavg()[0]
    times, cpu, peaks = alternate_timed({"flowseam": run_flowseam, "diffusers": run_diffusers},
                                        args.repeats)
    print(f"Wan2.1 T2V, 4 layers x width 128, {F} frames {H}x{W}, {args.steps} steps, CFG 5.0; "
          f"{scheduler_class}; backend {args.backend}; torch threads {torch.get_num_threads()}; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  {model.solver.describe()}")
    report(times, peaks, goal=0.6, cpu=cpu)
    print(f"  max |flowseam - diffusers| = {np.abs(ours - theirs).max():.2e}")
    profile({"flowseam": run_flowseam, "diffusers": run_diffusers}, args.profile)


if __name__ == "__main__":
    main()
