"""One generation over several processes: Ulysses sequence parallelism and CFG parallelism.

Model: Wan2.1 T2V with random weights from ``flowseam.testing.tiny`` (``--layers`` layers,
``--heads`` heads x ``--head-dim``, ffn 2 x width; the tiny VAE and text encoder), one T2V
generation of ``--frames`` frames at ``--height`` x ``--width``, ``--steps`` Euler steps, CFG 5.0:
``F' * (H/16) * (W/16)`` tokens after patching (``F' = (frames - 1)//4 + 1``), enough for the
self-attention to dominate the DiT's FLOPs from about 4k tokens at width 128.

Each run is a FRESH process (or ``torchrun --standalone`` job), one torch thread a rank unless said:

* ``1 process``: plain ``python``, one torch thread (the baseline the speed-ups are over);
* ``1 process, N threads``: the same with ``N`` torch threads (as many as the split runs' ranks:
  what one process on the same cores does without splitting);
* ``--sp N``: N ranks, each with 1/N of the tokens (``flowseam.Parallel(sp=N)``);
* ``--cfg-parallel``: the two CFG branches on two groups of N/2 ranks
  (``Parallel(sp=N/2, cfg=True)``; for N = 2: one rank per branch, no sequence split).

``--repeats`` rounds, each running the four configurations, the order reversed every round.
Every process runs with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then serves every tensor above
128 KiB with its own mapping and returns it when the tensor is freed (its default threshold
grows to 32 MiB as large blocks are freed, which would keep freed activations resident), so the
resident set follows the live tensors and the "activations" figure below measures them.
In every run the worker loads the model, runs a 1-step warm-up at the same size, then the
measured generation (``decode=False`` unless ``--decode``). Reported per configuration:

* the denoise's wall seconds (``LoopResult.seconds["denoise"]``, the slowest rank), median over
  rounds, and the speed-up over 1 process (goal >= 1.6x on 2 ranks);
* memory per rank: the process's peak RSS over the whole run (load, warm-up, measured
  generation: ``resource.getrusage(...).ru_maxrss`` before the measured run, ``VmHWM`` after),
  its RSS after the load (weights, torch, diffusers), and "activations": the measured run's
  peak RSS (``VmHWM``, reset just before it by writing 5 to /proc/self/clear_refs, ``proc(5)``)
  minus the RSS at its start — activations, all-to-all buffers, allocator slack (the warm-up
  already paid the first-call costs); on cuda also ``torch.cuda.max_memory_allocated`` of the
  measured run;
* bytes per denoising step and rank, sent to other ranks: computed from the Ulysses formula
  (``ulysses_attention``'s docstring: 4 tensors x (N-1)/N x Bf*H*(S/N)*D x itemsize per
  self-attention layer and DiT forward, Bf the forward's batch: 2B with CFG batched, B with
  ``--cfg-parallel``) plus the DiT output's all-gather ((N-1) x Bf*(S/N)*C_out*itemsize) and the
  CFG branches' exchange (the velocity's size), and measured by wrapping
  ``torch.distributed.all_to_all_single`` / ``all_gather`` / ``all_reduce`` / ``broadcast`` in
  the worker (``all_to_all_single``: its input's bytes x (N-1)/N; ``all_gather``: the tensor's
  bytes x (N-1), what a ring sends; ``all_reduce``/``broadcast``: the tensor's bytes);
* max |diff| of the final latents (``--decode``: also the frames) against the 1-process run of
  the same round (expected ~1e-6: the same math, summed in another order).

Ends with a markdown table for docs/benchmarks.md, and the command that made it.

Run: .venv/bin/python bench/parallel.py [--repeats 3] [--steps 10] [--frames 13] [--height 512]
[--width 512] [--layers 4] [--heads 4] [--head-dim 32] [--sp 2] [--decode] [--backend cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
PROMPT, NEGATIVE = "a red ball bouncing on a wooden floor", "blurry, low quality"
GUIDANCE = 5.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    """The peak resident set since the last reset (``VmHWM`` in /proc/self/status)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def tokens_of(frames: int, height: int, width: int) -> int:
    """Wan2.1's DiT tokens: VAE factors 4 (time), 8 (space), patch (1, 2, 2)."""
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def configurations(sp: int) -> dict[str, tuple[int, bool, int]]:
    """name → (sp, cfg, torch threads per rank) of the four runs: 1 process with 1 thread and
    with ``sp`` threads, ``--sp sp``, ``--cfg-parallel`` on ``sp`` ranks in all (two groups of
    ``sp/2``)."""
    cfg_name = "--cfg-parallel" + (f" --sp {sp // 2}" if sp > 2 else "")
    return {"1 process": (1, False, 1), f"1 process, {sp} threads": (1, False, sp),
            f"--sp {sp}": (sp, False, 1), cfg_name: (sp // 2, True, 1)}


def computed_bytes(args, sp: int, cfg: bool) -> dict[str, float]:
    """Bytes one rank sends to the others per denoising step (float32 on cpu, bf16 on cuda),
    from the formulas in the module docstring."""
    itemsize = 4 if args.backend == "cpu" else 2
    S = tokens_of(args.frames, args.height, args.width)
    B = 1
    Bf = B if cfg else 2 * B  # the batch of one DiT forward (CFG batched on one rank group)
    H, D, L = args.heads, args.head_dim, args.layers
    out = {"all_to_all": 0.0, "gather_output": 0.0, "cfg_exchange": 0.0}
    if sp > 1:
        out["all_to_all"] = L * 4 * (sp - 1) / sp * Bf * H * (S // sp) * D * itemsize
        out["gather_output"] = (sp - 1) * Bf * (S // sp) * 16 * 4 * itemsize  # proj_out: C*p_h*p_w
    if cfg:
        latent = 16 * ((args.frames - 1) // 4 + 1) * (args.height // 8) * (args.width // 8)
        # gather_branches: the branch's whole velocity (the DiT output is gathered over the
        # sp group first) goes to the one rank of the other branch holding the same shard
        out["cfg_exchange"] = B * latent * itemsize
    return out


# -- the worker: one rank of one run --------------------------------------------------------
class Counter:
    """Bytes sent to other ranks by the torch.distributed collectives the worker wraps."""

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = {}
        self.sent: dict[str, float] = {}

    def add(self, name: str, sent: float) -> None:
        if self.active:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.sent[name] = self.sent.get(name, 0.0) + sent


def wrap_collectives(counter: Counter) -> None:
    """Replace ``torch.distributed``'s collectives with counting wrappers (flowseam calls them
    as ``dist.<name>`` at call time, so the module attribute is what runs)."""
    import torch.distributed as dist

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def size(group) -> int:
        return dist.get_world_size(group)

    a2a, gather, reduce, bcast = (dist.all_to_all_single, dist.all_gather, dist.all_reduce,
                                  dist.broadcast)

    def all_to_all_single(output, input, *a, group=None, **kw):
        n = size(group)
        counter.add("all_to_all_single", nbytes(input) * (n - 1) / n)
        return a2a(output, input, *a, group=group, **kw)

    def all_gather(tensor_list, tensor, group=None, *a, **kw):
        counter.add("all_gather", nbytes(tensor) * (size(group) - 1))
        return gather(tensor_list, tensor, group, *a, **kw)

    def all_reduce(tensor, *a, **kw):
        counter.add("all_reduce", nbytes(tensor))
        return reduce(tensor, *a, **kw)

    def broadcast(tensor, *a, **kw):
        counter.add("broadcast", nbytes(tensor))
        return bcast(tensor, *a, **kw)

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
    dist.all_reduce, dist.broadcast = all_reduce, broadcast


def save_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def worker(args) -> None:
    torch.set_num_threads(args.run_threads)
    import diffusers

    import flowseam
    from flowseam import DiffusionParams, GenerationRequest, TaskType
    from flowseam.loops import run_loop

    diffusers.utils.logging.set_verbosity_error()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    counter = Counter()
    if world > 1:
        wrap_collectives(counter)
    parallel = flowseam.Parallel(sp=args.run_sp, cfg=args.run_cfg) if world > 1 else None
    model = flowseam.load(args.ckpt, flowseam.Platform(args.backend), parallel=parallel,
                          quiet=True)
    cuda = args.backend == "cuda"
    rss_load = rss_bytes()

    def request(steps: int) -> GenerationRequest:
        params = DiffusionParams(num_steps=steps, guidance_scale=GUIDANCE, height=args.height,
                                 width=args.width, num_frames=args.frames,
                                 negative_prompt=NEGATIVE)
        return GenerationRequest([PROMPT], TaskType.T2V, params, seeds=[7])

    run_loop(model, request(1), decode=False)  # warm-up: first-call costs, connections
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM (proc(5)): the measured run's
        f.write("5")
    rss_start = rss_bytes()
    counter.active = True
    t0 = time.perf_counter()
    result = run_loop(model, request(args.steps), decode=args.decode)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    counter.active = False
    peak_run = peak_rss_bytes()
    peak = max(peak_before, peak_run, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out = Path(args.out)
    record = {"rank": rank, "world": world, "denoise_s": result.seconds["denoise"],
              "run_s": wall, "rss_load": rss_load, "peak_rss": peak,
              "rss_start": rss_start, "peak_run": peak_run,
              "cuda_peak": torch.cuda.max_memory_allocated() if cuda else None,
              "calls": counter.calls, "sent": counter.sent, "steps": args.steps}
    save_atomic(out / f"rank{rank}.json", lambda p: p.write_text(json.dumps(record)))
    if rank == 0:
        latents = result.latents.float().cpu().numpy()
        save_atomic(out / "latents.npy", lambda p: np.save(open(p, "wb"), latents))
        if args.decode:
            save_atomic(out / "frames.npy", lambda p: np.save(open(p, "wb"), result.frames))


# -- the driver -----------------------------------------------------------------------------
def launch(args, ckpt: Path, sp: int, cfg: bool, threads: int, out: Path) -> dict:
    """One fresh run of (sp, cfg) with ``threads`` torch threads a rank; returns its ranks'
    records and rank 0's outputs."""
    out.mkdir(parents=True)
    world = sp * (2 if cfg else 1)
    worker_args = ["--worker", "--ckpt", str(ckpt), "--out", str(out), "--run-sp", str(sp),
                   "--run-threads", str(threads), *(["--run-cfg"] if cfg else []), *(["--decode"] if args.decode else []),
                   "--backend", args.backend, "--steps", str(args.steps), "--frames",
                   str(args.frames), "--height", str(args.height), "--width", str(args.width),
                   "--layers", str(args.layers), "--heads", str(args.heads), "--head-dim",
                   str(args.head_dim)]
    script = str(Path(__file__).resolve())
    if world == 1:
        cmd = [sys.executable, script, *worker_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), script, *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": "131072"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"run failed ({shlex.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    res = {"ranks": ranks, "process_s": time.perf_counter() - t0,
           "latents": np.load(out / "latents.npy")}
    if args.decode:
        res["frames"] = np.load(out / "frames.npy")
    return res


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--frames", type=int, default=13)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--sp", type=int, default=2,
                    help="ranks per parallel run (even; --cfg-parallel runs two groups of sp/2)")
    ap.add_argument("--decode", action="store_true",
                    help="decode with the VAE too (compares frames as well as latents)")
    ap.add_argument("--backend", default="cpu")
    # the worker's own options (set by the driver)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run-sp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-cfg", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    S = tokens_of(args.frames, args.height, args.width)
    if args.sp < 2 or args.sp % 2:
        ap.error(f"--sp {args.sp}: must be an even number >= 2 (--cfg-parallel uses sp/2 ranks "
                 "per branch)")
    if args.heads % args.sp or S % args.sp:
        ap.error(f"--sp {args.sp} must divide --heads ({args.heads}) and the tokens ({S})")
    if args.height % 16 or args.width % 16 or (args.frames - 1) % 4:
        ap.error("height and width must be multiples of 16, frames 4k+1")

    import diffusers

    from flowseam.testing.tiny import write_tiny_checkpoint

    diffusers.utils.logging.set_verbosity_error()
    root = Path(tempfile.mkdtemp(prefix="fs-parallel-"))
    width = args.heads * args.head_dim
    ckpt = write_tiny_checkpoint("wan2.1-t2v", root / "wan", transformer=dict(
        num_layers=args.layers, num_attention_heads=args.heads,
        attention_head_dim=args.head_dim, ffn_dim=2 * width))
    command = "python bench/parallel.py " + shlex.join(sys.argv[1:])
    configs = configurations(args.sp)
    load0 = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} CPUs, load average {load0:.2f} at start; torch "
          f"{torch.__version__}; backend {args.backend}, 1 torch thread a rank")
    print(f"model: Wan2.1 T2V {args.layers} layers x width {width} ({args.heads} heads x "
          f"{args.head_dim}), {args.frames} frames {args.height}x{args.width} = {S} tokens, "
          f"{args.steps} steps, CFG {GUIDANCE}, decode {'on' if args.decode else 'off'}")

    runs: dict[str, list[dict]] = {name: [] for name in configs}
    order = list(configs.items())
    for i in range(args.repeats):
        order.reverse()
        for name, (sp, cfg, threads) in order:
            res = launch(args, ckpt, sp, cfg, threads, root / f"r{i}-{sp}-{int(cfg)}-{threads}")
            runs[name].append(res)
            print(f"  round {i + 1} {name:<16} denoise "
                  f"{max(r['denoise_s'] for r in res['ranks']):.3f} s "
                  f"(process {res['process_s']:.1f} s)", flush=True)

    base = runs["1 process"]
    med = {n: statistics.median(max(r["denoise_s"] for r in res["ranks"]) for res in rs)
           for n, rs in runs.items()}
    rows = []
    for name, (sp, cfg, _threads) in configs.items():
        rs = runs[name]
        world = sp * (2 if cfg else 1)
        peak = max(r["peak_rss"] for res in rs for r in res["ranks"])
        load = max(r["rss_load"] for res in rs for r in res["ranks"])
        act = max(r["peak_run"] - r["rss_start"] for res in rs for r in res["ranks"])
        cuda_peak = [r["cuda_peak"] for res in rs for r in res["ranks"] if r["cuda_peak"]]
        comp = computed_bytes(args, sp, cfg)
        comp_total = sum(comp.values())
        sent = [sum(v for k, v in r["sent"].items() if k != "all_reduce") / r["steps"]
                for res in rs for r in res["ranks"]]
        a2a = [r["sent"].get("all_to_all_single", 0.0) / r["steps"]
               for res in rs for r in res["ranks"]]
        diff = max(float(np.abs(res["latents"] - b["latents"]).max()) for res, b in zip(rs, base))
        fdiff = (max(float(np.abs(res["frames"] - b["frames"]).max()) for res, b in zip(rs, base))
                 if args.decode else None)
        rows.append(dict(name=name, world=world, med=med[name], load=load,
                         runs=[max(r["denoise_s"] for r in res["ranks"]) for res in rs],
                         speedup=med["1 process"] / med[name], peak=peak, act=act,
                         cuda_peak=max(cuda_peak) if cuda_peak else None,
                         comp_a2a=comp["all_to_all"], comp_total=comp_total,
                         meas_a2a=max(a2a), meas_total=max(sent), diff=diff, fdiff=fdiff))

    print(f"load average {os.getloadavg()[0]:.2f} at the end\n")
    for r in rows:
        print(f"  {r['name']:<16} ranks {r['world']}  denoise median {r['med']:.3f} s (runs: "
              f"{', '.join(f'{t:.3f}' for t in r['runs'])})  speed-up {r['speedup']:.2f}x")
        print(f"  {'':<16} per rank: peak RSS {mib(r['peak'])} MiB, after load {mib(r['load'])} "
              f"MiB, activations {mib(r['act'])} MiB"
              + (f", cuda max allocated {mib(r['cuda_peak'])} MiB" if r["cuda_peak"] else ""))
        print(f"  {'':<16} bytes sent/step/rank: all-to-all computed {r['comp_a2a']:,.0f}, "
              f"measured {r['meas_a2a']:,.0f}; all collectives computed {r['comp_total']:,.0f}, "
              f"measured {r['meas_total']:,.0f} (without the per-step stop flag's all_reduce)")
        print(f"  {'':<16} max |latents - 1 process| {r['diff']:.2e}"
              + (f", frames {r['fdiff']:.2e}" if r["fdiff"] is not None else ""))

    print(f"\n`{command}` ({args.repeats} rounds, fresh processes, 1 torch thread a rank but where said, "
          f"load average {load0:.1f} → {os.getloadavg()[0]:.1f}; Wan2.1 T2V {args.layers} × "
          f"{width}, {S} tokens, {args.steps} steps, CFG {GUIDANCE}; peak RSS of the whole run, "
          "\"activations\" = the measured run's peak RSS (VmHWM reset at its start) − its RSS "
          "then):\n")
    print("| run | ranks | denoise (median s) | speed-up | peak RSS / rank (MiB) | after load "
          "(MiB) | activations (MiB) | all-to-all / step / rank, computed → measured (MiB) | all collectives "
          "/ step / rank, computed → measured (MiB) | max \\|Δ latents\\| |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['name']}` | {r['world']} | {r['med']:.2f} | {r['speedup']:.2f}× | "
              f"{mib(r['peak'])} | {mib(r['load'])} | {mib(r['act'])} | "
              f"{mib(r['comp_a2a'])} → {mib(r['meas_a2a'])} | "
              f"{mib(r['comp_total'])} → {mib(r['meas_total'])} | {r['diff']:.1e}"
              + (f" (frames {r['fdiff']:.1e})" if r["fdiff"] is not None else "") + " |")


if __name__ == "__main__":
    main()
