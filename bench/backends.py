"""The same generation on the cpu backend and on the accel backend (torch.compile), accel's
compile cost cold and warm, and what makes it recompile.

A small Wan2.1 T2V config (4 layers x width 128, 17 frames at 64x64, 10 steps, CFG 5.0; random
weights from ``flowseam.testing.tiny``), loaded once per backend from the same checkpoint. The
first generation on each is the *start* (accel compiles there); then the two alternate
``--repeats`` times. Prints the median seconds of each, the ratio accel/cpu, the max-abs
difference of their outputs, and accel's compile seconds per compiled entry point as booked by
``flowseam_accel.compile_report()`` (apart from its run seconds).

Then the recompiles: accel generates once more with a changed input shape (9 frames instead of
17), with CFG off (guidance 1.0: the DiT's batch is 1 instead of 2) and with the first shape
again, and prints how many compiled signatures and seconds each added (from the same report)
and dynamo's own count of graphs built.

``--cold`` points ``TORCHINDUCTOR_CACHE_DIR`` at a fresh empty directory before torch is
imported, so the start pays the full inductor compile (reproducible whatever ran before); then
the same command is run again in a new process on that now filled directory (``--cache-dir``),
which is the warm-cache start a user sees in every later process: torch.compile's own FX graph
and AOTAutograd caches serve it (dynamo still traces; inductor loads instead of compiling, and
the compile report then books the tracing and loading as compiling). Without either option the
default cache directory is used as it is. Inductor compiles with one thread
(``TORCHINDUCTOR_COMPILE_THREADS=1``, unless set), so the CPU seconds printed next to the wall
seconds include the C++ compiler's: on a shared machine they are the figure that does not
depend on what else runs. ``--threads 1`` runs torch with one intra-op thread (as
``bench/generate_vs_diffusers.py --threads 1``): torch's two threads on two busy cores mostly
wait for each other, which says more about the load than about either backend.

Run: .venv/bin/python bench/backends.py --cold [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler inductor runs):
    on a shared machine the wall clock also counts other jobs' time, this does not."""
    import resource

    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def _compile_lines(report: dict) -> list[str]:
    return [f"    {name:<40} {e['compile_s']:6.1f} s compiling, {e['compiles']} signature(s), "
            f"{e['run_s']:6.2f} s running, {e['calls']} calls"
            for name, e in report["entries"].items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cold", action="store_true",
                    help="compile into a fresh inductor cache dir, then rerun warm on it")
    ap.add_argument("--cache-dir", help="TORCHINDUCTOR_CACHE_DIR for this run")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default: torch's choice, one per core)")
    ap.add_argument("--start-only", action="store_true",
                    help="only load accel and time its first generation (used by --cold)")
    args = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="fs-inductor-") if args.cold else args.cache_dir
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch is imported
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    import diffusers
    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint

    diffusers.utils.logging.set_verbosity_error()
    ckpt = write_tiny_checkpoint("wan2.1-t2v", Path(tempfile.mkdtemp(prefix="fs-bench-")) / "wan",
                                 transformer=dict(num_layers=4, num_attention_heads=4,
                                                  attention_head_dim=32, ffn_dim=256))
    params = flowseam.DiffusionParams(num_steps=args.steps, guidance_scale=5.0, height=64, width=64,
                                      num_frames=17, seed=0, negative_prompt="blurry")
    import flowseam_accel

    names = ("accel",) if args.start_only else ("cpu", "accel")
    models, load, outputs, start = {}, {}, {}, {}
    cpu_s = {}
    for name in names:
        t0 = time.perf_counter()
        models[name] = flowseam.load(ckpt, platform=flowseam.Platform(name))
        load[name] = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), _cpu_seconds()
        outputs[name] = models[name].generate("a red ball", params=params).frames
        start[name], cpu_s[name] = time.perf_counter() - t0, _cpu_seconds() - c0
    report = flowseam_accel.compile_report()
    print(f"Wan2.1 T2V 4 layers x 128, 17 frames 64x64, {args.steps} steps, CFG 5.0; "
          f"torch threads {torch.get_num_threads()}; inductor cache "
          f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}")
    print(f"  accel start: load {load['accel']:.2f} s, first generation {start['accel']:.2f} s "
          f"({cpu_s['accel']:.1f} CPU s), of which {report['compile_s']:.1f} s in compiling calls "
          f"({report['compiles']} signatures; {_graphs()} graphs built, "
          f"{_cache_hits()} FX graph cache hits); load average "
          f"{os.getloadavg()[0]:.1f}")
    print("\n".join(_compile_lines(report)))
    if args.start_only:
        return

    times = {name: [] for name in models}
    cpu_times = {name: [] for name in models}
    order = list(models)
    for _ in range(args.repeats):
        order.reverse()
        for name in order:
            t0, c0 = time.perf_counter(), _cpu_seconds()
            models[name].generate("a red ball", params=params)
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(_cpu_seconds() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    for name in models:
        print(f"  {name:<6} first {start[name]:.2f} s; median {med[name]:.3f} s wall, "
              f"{cpu_med[name]:.3f} CPU s (runs: {', '.join(f'{t:.3f}' for t in times[name])})")
    print(f"  ratio accel/cpu = {med['accel'] / med['cpu']:.3f} wall, "
          f"{cpu_med['accel'] / cpu_med['cpu']:.3f} CPU; load average {os.getloadavg()[0]:.1f}")
    print(f"  max |accel - cpu| = {np.abs(outputs['accel'] - outputs['cpu']).max():.2e}")

    print("  recompiles on accel (new signatures / seconds compiling / graphs built):")
    changes = [("shape: 9 frames", dict(num_frames=9)),
               ("CFG off (guidance 1.0)", dict(guidance_scale=1.0)), ("first shape again", {})]
    for label, change in changes:
        before, graphs = flowseam_accel.compile_report(), _graphs()
        t0 = time.perf_counter()
        models["accel"].generate("a red ball", params=dataclasses.replace(params, **change))
        seconds = time.perf_counter() - t0
        after = flowseam_accel.compile_report()
        print(f"    {label:<24} {after['compiles'] - before['compiles']} signatures, "
              f"{after['compile_s'] - before['compile_s']:.1f} s compiling, "
              f"{_graphs() - graphs} graphs; generation {seconds:.2f} s")
    print("  where each came from:")
    for model in models.values():
        print("   ", model.provenance())
    if args.cold:
        print("  warm-cache start (a new process on the same inductor cache):", flush=True)
        subprocess.run([sys.executable, __file__, "--start-only", "--cache-dir", cache_dir,
                        "--steps", str(args.steps), "--threads", str(args.threads)], check=True)


if __name__ == "__main__":
    main()
