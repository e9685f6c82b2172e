"""Scaling on one machine: Ray rollout fleets and torch.distributed (gloo) training steps.

Model: Wan2.1 T2V in the size of bench/generate_vs_diffusers.py (4 layers x width 128, random
weights from ``flowseam.testing.tiny``), SDE rollouts (Flow-GRPO's, with capture) of ``--frames``
frames at 64x64, ``--steps`` denoising steps, CFG 5.0.

1. Rollout throughput (samples/s) of the same ``--samples`` rollouts (each its own seed): in this
   process with one torch thread, on a fleet of 1 Ray worker and on a fleet of 2 Ray workers
   (one torch thread each); alternating, ``--repeats`` rounds, medians.
2. Weight push: the size of one WeightUpdate of the DiT, the seconds to build it (safetensors
   serialization + sha256) and to push it to the 2-worker fleet (object store, checksum check,
   copy into each worker's DiT); and the serialization + sha256 rate (GB/s) on a 256 MiB
   state dict, which docs/scaling.md scales to 1.3B and 14B models.
3. Training steps (flowgrpo, group of ``--group`` samples), each a ``flowseam train`` process:
   1 process with 1 and with 2 torch threads, ``--nproc 2`` (gloo, 1 thread per rank), and one
   process (1 thread) driving a 2-worker Ray fleet (``[ray] rollout_workers = 2``); median seconds
   per step after the first (from each run's metrics.jsonl, rank 0's clock), and for the fleet
   the share of the step spent pushing weights (``seconds_sync``).

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/scale.py [--samples 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rollout_requests(n_parts: int, samples: int, params, step: int):
    """``samples`` rollouts (seeds step*1000 + k) as ``n_parts`` contiguous batches."""
    from flowseam import GenerationRequest, TaskType

    seeds = [step * 1000 + k for k in range(samples)]
    size = -(-samples // n_parts)
    return [GenerationRequest(["a red ball bouncing"] * len(part), TaskType.T2V, params, seeds=part)
            for part in (seeds[i:i + size] for i in range(0, samples, size))]


def train_config(ckpt: Path, out: Path, args, **extra) -> Path:
    cfg = {"model": str(ckpt), "backend": "cpu", "prompts": ["a red ball bouncing", "a blue cube"],
           "reward": "brightness", "group_size": args.group, "steps": args.train_steps, "seed": 0,
           "output_dir": str(out),
           "sampling": {"num_steps": args.steps, "height": 64, "width": 64, "num_frames": args.frames},
           "grpo": {"beta": 0.04, "clip_range": 0.2}, **extra}
    path = out.with_suffix(".yaml")  # JSON is YAML
    path.write_text(json.dumps(cfg))
    return path


def step_seconds(metrics: Path) -> tuple[float, dict[str, float]]:
    """Median seconds per step after the first, and the median of each phase."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    phases = sorted({k for r in records for k in r if k.startswith("seconds_")})
    total = statistics.median(sum(r[k] for k in phases) for r in records)
    return total, {k[8:]: statistics.median(r[k] for r in records) for k in phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8, help="rollouts per measured round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="denoising steps")
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--group", type=int, default=4, help="flowgrpo group size")
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--only", choices=("rollout", "push", "train"), help="run one part (1, 2 or 3)")
    args = ap.parse_args()
    run = {"rollout", "push", "train"} if args.only is None else {args.only}

    import diffusers
    import ray

    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint
    from flowseam.training.fleet import RolloutFleet
    from flowseam.training.weight_sync import WeightRole, WeightUpdate

    diffusers.utils.logging.set_verbosity_error()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="fs-scale-"))
    ckpt = write_tiny_checkpoint("wan2.1-t2v", root / "wan", transformer=dict(
        num_layers=4, num_attention_heads=4, attention_head_dim=32, ffn_dim=256))
    model = flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    params = flowseam.DiffusionParams(num_steps=args.steps, height=64, width=64, num_frames=args.frames,
                                      guidance_scale=5.0, sde_rollout=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; torch "
          f"{torch.__version__}, ray {ray.__version__}")
    print(f"model: Wan2.1 T2V 4 layers x 128 ({sum(p.numel() for p in model.dit.parameters()) / 1e6:.2f} M "
          f"DiT parameters), SDE rollouts of {args.frames} frames 64x64, {args.steps} steps, CFG 5.0")

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 3 actors, 2 busy at once
    fleets = {n: RolloutFleet(model, n, num_cpus=1) for n in (1, 2)} if run & {"rollout", "push"} else {}
    update = WeightUpdate.of(model.dit, model.DIT, WeightRole.STUDENT, 0)
    for fleet in fleets.values():
        fleet.push(update)
    if "rollout" in run:
        rollout_throughput(model, params, fleets, args)
    if "push" in run:
        weight_push(model, update, fleets[2])
    for fleet in fleets.values():
        fleet.shutdown()
    ray.shutdown()  # the fleet run of part 3 starts its own Ray, as `flowseam train` does
    if "train" in run:
        training_steps(ckpt, root, args)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def rollout_throughput(model, params, fleets, args) -> None:
    """1. The same rollouts in-process (1 thread), on 1 and on 2 Ray workers, alternating."""
    from flowseam.loops import ExecutionProfile, run_loop

    threads = torch.get_num_threads()

    def in_process(step):
        torch.set_num_threads(1)
        try:
            for r in rollout_requests(1, args.samples, params, step):
                run_loop(model, r, profile=ExecutionProfile.ROLLOUT)
        finally:
            torch.set_num_threads(threads)

    contenders = {"in-process, 1 thread": (in_process, None),
                  "Ray, 1 worker": (lambda step: fleets[1].rollout(rollout_requests(1, args.samples, params, step)),
                                    fleets[1]),
                  "Ray, 2 workers": (lambda step: fleets[2].rollout(rollout_requests(2, args.samples, params, step)),
                                     fleets[2])}

    def cpu_seconds(fleet):  # CPU time of whoever rolls out
        return time.process_time() if fleet is None else sum(d["cpu_seconds"] for d in fleet.describe())

    for fn, _ in contenders.values():  # warm-up
        fn(0)
    times = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}
    order = list(contenders)
    for r in range(args.repeats):
        order.reverse()
        for name in order:
            fn, fleet = contenders[name]
            c0 = cpu_seconds(fleet)
            times[name].append(timed(lambda: fn(r + 1)))
            cpu[name].append(cpu_seconds(fleet) - c0)
    print(f"\n1. rollout throughput, {args.samples} samples per round, {args.repeats} rounds (median):")
    base = None
    for name in contenders:
        med = statistics.median(times[name])
        rate = args.samples / med
        base = base or rate
        per = statistics.median(cpu[name]) / args.samples
        print(f"  {name:<22} {med:7.2f} s  {rate:6.2f} samples/s  x{rate / base:.2f}  "
              f"CPU {per:.2f} s/sample  (rounds: {', '.join(f'{t:.2f}' for t in times[name])})")
    print("  (CPU s/sample: the rollers' own CPU time, which other jobs on the machine do not inflate;"
          " on idle cores N workers would reach N / that samples/s)")


def weight_push(model, update, fleet) -> None:
    """2. Building a WeightUpdate of the DiT and pushing it to a fleet; serialization and sha256
    rates on a 256 MiB state dict."""
    from safetensors.torch import save as save_safetensors

    from flowseam.training.weight_sync import WeightRole, WeightUpdate

    build = [timed(lambda: WeightUpdate.of(model.dit, model.DIT, WeightRole.STUDENT, 1)) for _ in range(3)]
    push = [timed(lambda: fleet.push(update)) for _ in range(3)]
    big = {f"w{i}": torch.randn(4096, 4096) for i in range(4)}  # 256 MiB of float32
    holder = torch.nn.Module()
    for k, v in big.items():
        holder.register_buffer(k, v)
    rate, cpu_rate, parts = [], [], {"safetensors": [], "sha256": []}
    for _ in range(3):
        c0 = time.process_time()
        rate.append(256 / 1024 / timed(lambda: WeightUpdate.of(holder, "x", WeightRole.STUDENT, 1)))
        c1 = time.process_time()
        data = save_safetensors(big)
        c2 = time.process_time()
        hashlib.sha256(data).hexdigest()
        c3 = time.process_time()
        cpu_rate.append(256 / 1024 / (c1 - c0))
        parts["safetensors"].append(256 / 1024 / (c2 - c1))
        parts["sha256"].append(256 / 1024 / (c3 - c2))
    print(f"\n2. weight push: one update of the DiT = {len(update.data) / 2**20:.2f} MiB; build "
          f"(safetensors + sha256) median {statistics.median(build) * 1e3:.1f} ms; push to 2 workers "
          f"(object store, verify, apply) median {statistics.median(push) * 1e3:.1f} ms")
    print(f"  safetensors + sha256 of a 256 MiB state dict: median {statistics.median(rate):.2f} GB/s "
          f"(wall), {statistics.median(cpu_rate):.2f} GB per CPU second (safetensors alone "
          f"{statistics.median(parts['safetensors']):.2f}, sha256 alone {statistics.median(parts['sha256']):.2f})")


def training_steps(ckpt: Path, root: Path, args) -> None:
    """3. flowgrpo steps as `flowseam train` processes: 1 process (1 and 2 threads), 2 gloo
    ranks, 1 process driving 2 Ray workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    runs = {}
    for name, threads, nproc, extra in (
            ("1 process, 1 thread", 1, None, {}),
            ("1 process, 2 threads", 2, None, {}),
            ("2 ranks (gloo), 1 thread each", 1, 2, {}),
            ("1 process + 2 Ray workers", 1, None, {"ray": {"rollout_workers": 2}})):
        out = root / f"run{len(runs)}"
        argv = [sys.executable, "-m", "flowseam", "train", "--method", "flowgrpo",
                "--config", str(train_config(ckpt, out, args, **extra))]
        argv += ["--nproc", str(nproc)] if nproc else []
        subprocess.run(argv, check=True, env={**env, "OMP_NUM_THREADS": str(threads)}, capture_output=True)
        runs[name] = step_seconds(out / "metrics.jsonl")
    print(f"\n3. flowgrpo step, group of {args.group}, {args.train_steps} steps (median after the first):")
    one = runs["1 process, 1 thread"][0]
    for name, (total, phases) in runs.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        print(f"  {name:<30} {total:7.2f} s/step  x{one / total:.2f} vs 1 process, 1 thread  ({parts})")
    total, phases = runs["1 process + 2 Ray workers"]
    print(f"  weight push share of the fleet's step: {phases.get('sync', 0.0) / total:.1%}")


if __name__ == "__main__":
    main()
