"""A real-size checkpoint: flowseam against diffusers on load time, generation time and memory.

The checkpoint has the published Wan2.1-T2V-1.3B-Diffusers transformer (30 layers, 12 heads x 128,
ffn 8960, text_dim 4096: 1.42 B parameters) and VAE (``AutoencoderKLWan``'s defaults, which are the
published ones: base_dim 96, dim_mult [1, 2, 4, 4], 2 res blocks: 0.13 B), random weights in
float32, a 1-layer UMT5 text encoder with the real d_model 4096 (64 heads x 64, d_ff 10240,
flowseam's 192-token test tokenizer), and the UniPC flow scheduler config that checkpoint ships.
It is written once (about 7 GB) under ``--cache`` and reused.

Every measurement is a FRESH process (``--worker``), flowseam and diffusers alternating, the
order reversed every round; each process loads the checkpoint, then generates one video:

* flowseam: ``flowseam.load(dir, Platform("cpu"), dtype=..., offload=..., vae_tiling=...)``,
  then ``model.generate(...)``;
* diffusers: ``WanPipeline.from_pretrained(dir, torch_dtype=...)`` (plus ``vae.enable_tiling()``
  for ``--tiling``), then ``pipe(...)``;

and reports the load seconds, the generate seconds, the peak RSS of the load (VmHWM right
after it) and of the whole process (VmHWM at the end), and the frames (saved, then compared
between the two libraries of the same round: max |difference|). The weights' bytes are the
safetensors files' tensor bytes, so "peak load RSS / weights" says how many copies a load held.

Configurations (``--configs``): ``fp32``, ``bf16`` (diffusers' documented Wan recipe: the
pipeline in ``torch_dtype=torch.bfloat16`` with the VAE loaded in float32; flowseam
``dtype="*=bfloat16,vae=float32"``. A bfloat16 VAE is no choice on a CPU without bfloat16
instructions: one 64x64 frame takes either library about 170 s to decode there),
``bf16-all`` (every component in bfloat16), ``fp32-text-offload`` (flowseam frees the text
encoder once the prompt is encoded; diffusers has no CPU-host equivalent, so its run is the
plain one) and ``fp32-tiling`` (both decode with the VAE's own tiling).

``--train``: one ``flowgrpo`` step on the real-size DiT instead (LoRA rank 32 on
``to_q/to_k/to_v/to_out.0``, gradient checkpointing, a group of 2 at ``--height`` x ``--width``,
one frame, 2 SDE steps, KL to the reference on), in float32 and in bfloat16 (the VAE, which only
decodes the rollouts for the reward, in float32) with float32 master weights
(``mixed_precision = "bf16"``): seconds and the peak RSS of the whole process.

``--load-only``: the loads alone, no generation (so that more rounds fit: a load's seconds are
mostly the same library imports in both, and a shared machine's noise is of their size), with
each round's load ratio as well as the ratio of the medians.

``--vae``: the decode alone (flowseam's ``model.decode`` of seeded latents: the real-size VAE),
untiled and with ``--vae-tiling``, at ``--frames`` x ``--height`` x ``--width``, at about twice the
frames (``2 * frames - 1``: the VAE's 4k+1 rule) and at twice the width: the decode's own peak
memory (the process's VmHWM, reset with /proc/self/clear_refs just before it, minus its RSS then;
glibc's mmap threshold fixed at 128 KiB so freed activations leave the resident set) and its
seconds. At the first size diffusers decodes the same latents too (``AutoencoderKLWan`` as
``WanPipeline`` calls it, untiled and after ``vae.enable_tiling()``), so flowseam's tiled-vs-untiled
difference is set against diffusers' own.

Run: .venv/bin/python bench/real_size.py [--repeats 2] [--steps 2] [--height 240] [--width 416]
     [--frames 5] [--configs fp32,bf16] [--threads 2] [--cache DIR] [--train | --vae |
     --load-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = "a red fox running through fresh snow, cinematic"
NEGATIVE = "blurry, low quality"
GUIDANCE = 5.0

#: diffusers' Wan2.1-T2V-1.3B-Diffusers transformer/config.json (the published values)
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                   in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                   num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                   eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
#: its vae/config.json: AutoencoderKLWan's defaults
VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True, True], dropout=0.0)
#: umT5-XXL's layer shape, one layer
TEXT_ENCODER = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128)
#: its scheduler/scheduler_config.json
SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                 flow_shift=3.0, solver_order=2, solver_type="bh2", lower_order_final=True,
                 final_sigmas_type="zero", timestep_spacing="linspace", predict_x0=True,
                 beta_start=0.0001, beta_end=0.02, beta_schedule="linear")

CONFIGS = {
    "fp32": dict(dtype=None, offload=None, tiling=False),
    "bf16": dict(dtype="*=bfloat16,vae=float32", offload=None, tiling=False),
    "bf16-all": dict(dtype="bfloat16", offload=None, tiling=False),
    "fp32-text-offload": dict(dtype=None, offload="text_encoder", tiling=False),
    "fp32-tiling": dict(dtype=None, offload=None, tiling=True),
}


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def weights_bytes(root: Path) -> int:
    """The tensor bytes of every safetensors file under ``root`` (file size minus headers)."""
    total = 0
    for path in root.rglob("*.safetensors"):
        with open(path, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        total += path.stat().st_size - 8 - header
    return total


def write_checkpoint(root: Path) -> Path:
    from flowseam.testing.tiny import write_tiny_checkpoint

    path = root / "wan2.1-t2v-1.3b"
    if (path / "model_index.json").is_file() and (path / "transformer").is_dir():
        return path
    print(f"writing the real-size checkpoint to {path} (once)", flush=True)
    t0 = time.perf_counter()
    write_tiny_checkpoint("wan2.1-t2v", path, scheduler_class="UniPCMultistepScheduler",
                          transformer=TRANSFORMER, vae=VAE, text_encoder=TEXT_ENCODER,
                          scheduler=SCHEDULER)
    print(f"  written in {time.perf_counter() - t0:.0f} s: {weights_bytes(path) / 2**30:.2f} GiB "
          "of weights", flush=True)
    return path


# -- a worker: one library, one configuration, one fresh process ---------------------------------
def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    config = CONFIGS[args.config]
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.library == "flowseam":
        import flowseam
        from flowseam import DiffusionParams

        model = flowseam.load(args.ckpt, flowseam.Platform("cpu"), quiet=True,
                              dtype=config["dtype"], offload=config["offload"],
                              vae_tiling=config["tiling"])
        load_s, load_peak = time.perf_counter() - t0, peak_rss()
        if args.load_only:
            return _report(args, out, load_s, load_peak, None, None)
        t1 = time.perf_counter()
        frames = model.generate(PROMPT, seeds=[args.seed], params=DiffusionParams(
            num_steps=args.steps, height=args.height, width=args.width, num_frames=args.frames,
            guidance_scale=GUIDANCE, negative_prompt=NEGATIVE)).frames[0]
    else:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        dtypes = dict(p.split("=") for p in config["dtype"].split(",")) if config["dtype"] and \
            "=" in config["dtype"] else {"*": config["dtype"] or "float32"}
        extra = {}
        if "vae" in dtypes:  # the VAE in its own dtype: diffusers' Wan examples load it apart
            extra["vae"] = diffusers.AutoencoderKLWan.from_pretrained(
                args.ckpt, subfolder="vae", torch_dtype=getattr(torch, dtypes["vae"]))
        pipe = diffusers.WanPipeline.from_pretrained(args.ckpt, torch_dtype=getattr(
            torch, dtypes["*"]), **extra)
        pipe.set_progress_bar_config(disable=True)
        if config["tiling"]:
            pipe.vae.enable_tiling()
        load_s, load_peak = time.perf_counter() - t0, peak_rss()
        if args.load_only:
            return _report(args, out, load_s, load_peak, None, None)
        t1 = time.perf_counter()
        frames = pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=args.steps,
                      height=args.height, width=args.width, num_frames=args.frames,
                      guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(args.seed),
                      output_type="np").frames[0]
    _report(args, out, load_s, load_peak, time.perf_counter() - t1, frames)


def _report(args, out: Path, load_s: float, load_peak: int, generate_s: float | None,
            frames) -> None:
    if frames is not None:
        np.save(out / f"{args.library}.npy", np.asarray(frames, np.float32))
    (out / f"{args.library}.json").write_text(json.dumps({
        "load_s": load_s, "generate_s": generate_s, "load_peak": load_peak, "peak": peak_rss()}))


def train_worker(args) -> None:
    """One flowgrpo step with LoRA rank 32 on the real-size DiT (``--train``)."""
    import torch

    from flowseam.training.flowgrpo import FlowGRPO

    torch.set_num_threads(args.threads)
    bf16 = args.config == "bf16"
    t0 = time.perf_counter()
    method = FlowGRPO(dict(
        model=args.ckpt, backend="cpu", prompts=[PROMPT], reward="brightness", group_size=2,
        steps=1, seed=args.seed, dtype="*=bfloat16,vae=float32" if bf16 else None,
        gradient_checkpointing=True,
        sampling=dict(num_steps=2, height=args.height, width=args.width, num_frames=1,
                      guidance_scale=GUIDANCE),
        lora=dict(rank=32), grpo=dict(beta=0.04),
        optim=dict(mixed_precision="bf16" if bf16 else "no")))
    load_s = time.perf_counter() - t0
    record = method.train_step()
    Path(args.out, "train.json").write_text(json.dumps({
        "load_s": load_s, "step_s": time.perf_counter() - t0 - load_s, "peak": peak_rss(),
        "ratio_dev": record["ratio_dev_first_epoch"], "updated": record["updated"]}))


def vae_worker(args) -> None:
    """One decode (``--vae``): ``args.config`` is ``tiled`` or ``untiled``, flowseam's, or
    ``diffusers-tiled`` / ``diffusers-untiled``: diffusers' VAE decoding the same latents as
    ``WanPipeline`` does (un-normalised with the VAE's latents_mean/std, then postprocessed)."""
    import torch

    torch.set_num_threads(args.threads)
    shape = (1, 16, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed))
    if args.config.startswith("diffusers"):
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        vae = AutoencoderKLWan.from_pretrained(args.ckpt, subfolder="vae").eval()
        if args.config == "diffusers-tiled":
            vae.enable_tiling()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

        def decode(latents, params):
            with torch.no_grad():
                video = vae.decode(latents * std + mean, return_dict=False)[0]
            return VideoProcessor(vae_scale_factor=8).postprocess_video(video, output_type="np")
    else:
        import flowseam

        model = flowseam.load(args.ckpt, flowseam.Platform("cpu"), quiet=True,
                              vae_tiling=args.config == "tiled")
        decode = model.decode
    params = flowseam_params(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = int(re.search(r"^VmRSS:\s+(\d+) kB", open("/proc/self/status").read(),
                          re.M).group(1)) * 1024
    t0 = time.perf_counter()
    frames = decode(latents, params)
    Path(args.out, "vae.json").write_text(json.dumps({
        "seconds": time.perf_counter() - t0, "decode_peak": peak_rss() - start,
        "shape": list(frames.shape)}))
    np.save(Path(args.out, "frames.npy"), frames)


def flowseam_params(args):
    from flowseam import DiffusionParams

    return DiffusionParams(height=args.height, width=args.width, num_frames=args.frames)


def vae(args, ckpt: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="fs-real-vae-"))
    sizes = [(args.frames, args.height, args.width), (2 * args.frames - 1, args.height, args.width),
             (args.frames, args.height, 2 * args.width)]
    rows = []
    for i, (frames, height, width) in enumerate(sizes):
        got = {}
        configs = ("untiled", "tiled") + (("diffusers-untiled", "diffusers-tiled") if i == 0 else ())
        for config in configs:
            out = root / f"{config}-{frames}-{height}-{width}"
            out.mkdir()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--library", "vae",
                   "--config", config, "--ckpt", str(ckpt), "--out", str(out), "--height",
                   str(height), "--width", str(width), "--frames", str(frames), "--threads",
                   str(args.threads), "--seed", str(args.seed)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
                   "MALLOC_MMAP_THRESHOLD_": "131072"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"vae {config} failed:\n{proc.stderr[-4000:]}")
            got[config] = json.loads((out / "vae.json").read_text())
            got[config]["frames"] = np.load(out / "frames.npy")
            print(f"  {frames} frames {height}x{width} {config}: "
                  f"{got[config]['seconds']:.1f} s, decode peak "
                  f"{got[config]['decode_peak'] / 2**20:.0f} MiB", flush=True)
        diff = float(np.abs(got["tiled"]["frames"] - got["untiled"]["frames"]).max())
        rows.append((frames, height, width, got["untiled"], got["tiled"], diff))
        if i == 0:
            ref = {c: got[f"diffusers-{c}"]["frames"] for c in ("tiled", "untiled")}
            against = {c: float(np.abs(got[c]["frames"] - ref[c]).max()) for c in ref}
            own = float(np.abs(ref["tiled"] - ref["untiled"]).max())
    command = "python bench/real_size.py " + shlex.join(sys.argv[1:])
    print(f"\n`{command}`: the real-size Wan VAE's decode, fresh process each\n")
    print("| frames × size | untiled: s, decode peak MiB | tiled: s, decode peak MiB | "
          "max \\|tiled − untiled\\| |")
    print("|---|---|---|---|")
    for frames, height, width, u, t, diff in rows:
        print(f"| {frames} × {height}×{width} | {u['seconds']:.1f}, "
              f"{u['decode_peak'] / 2**20:.0f} | {t['seconds']:.1f}, "
              f"{t['decode_peak'] / 2**20:.0f} | {diff:.1e} |")
    print(f"\nAt {sizes[0][0]} × {sizes[0][1]}×{sizes[0][2]}: diffusers' own max |tiled − untiled| "
          f"{own:.1e}; flowseam against diffusers: untiled {against['untiled']:.1e}, tiled "
          f"{against['tiled']:.1e}")


def run_worker(args, ckpt: Path, library: str, config: str, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--library", library,
           "--config", config, "--ckpt", str(ckpt), "--out", str(out), "--steps",
           str(args.steps), "--height", str(args.height), "--width", str(args.width),
           "--frames", str(args.frames), "--threads", str(args.threads), "--seed", str(args.seed)]
    cmd += ["--load-only"] if args.load_only else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{library} {config} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / f"{library}.json").read_text())


def med(runs: list[dict], key: str) -> float:
    """The median of ``key`` over a library's runs."""
    return statistics.median(r[key] for r in runs)


def load_peaks(f: list[dict], d: list[dict], weights: int) -> str:
    """The table cell of the load's peak RSS: flowseam / diffusers, MiB (× the weights)."""
    return (f"{med(f, 'load_peak') / 2**20:.0f} ({med(f, 'load_peak') / weights:.2f}) / "
            f"{med(d, 'load_peak') / 2**20:.0f} ({med(d, 'load_peak') / weights:.2f})")


def _load_table(configs, results, weights: int) -> None:
    print("| configuration | load s, flowseam / diffusers (medians) | each round's load ratio "
          "(median) | peak RSS of the load, MiB (× weights) |")
    print("|---|---|---|---|")
    for config in configs:
        f, d = results[config]["flowseam"], results[config]["diffusers"]
        rounds = [a["load_s"] / b["load_s"] for a, b in zip(f, d)]
        print(f"| {config} | {med(f, 'load_s'):.1f} / {med(d, 'load_s'):.1f} "
              f"({med(f, 'load_s') / med(d, 'load_s'):.2f}) | "
              f"{', '.join(f'{x:.2f}' for x in rounds)} ({statistics.median(rounds):.2f}) | "
              f"{load_peaks(f, d, weights)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--height", type=int, default=240)
    ap.add_argument("--width", type=int, default=416)
    ap.add_argument("--frames", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="fp32,bf16")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/flowseam-bench"))
    ap.add_argument("--write-only", action="store_true", help="write the checkpoint and stop")
    ap.add_argument("--vae", action="store_true",
                    help="the decode alone, untiled and tiled, at three sizes (and diffusers')")
    ap.add_argument("--train", action="store_true",
                    help="one flowgrpo step with LoRA rank 32 on the real-size DiT, fp32 and bf16")
    ap.add_argument("--load-only", action="store_true",
                    help="load each library, generate nothing (more rounds for the load time)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--library", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return {"train": train_worker, "vae": vae_worker}.get(args.library, worker)(args)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")

    ckpt = write_checkpoint(Path(args.cache))
    if args.write_only:
        return
    weights = weights_bytes(ckpt)
    if args.train:
        return train(args, ckpt)
    if args.vae:
        return vae(args, ckpt)
    print(f"checkpoint {ckpt}: {weights / 2**30:.2f} GiB of float32 weights; {args.frames} frames "
          f"{args.height}x{args.width}, {args.steps} steps, CFG {GUIDANCE}, {args.threads} torch "
          f"threads; load average {os.getloadavg()[0]:.1f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="fs-real-size-"))
    results: dict[str, dict[str, list]] = {c: {"flowseam": [], "diffusers": [], "diff": [], "rel": []}
                                          for c in configs}
    for i in range(args.repeats):
        for config in configs:
            out = root / f"{config}-{i}"
            out.mkdir()
            order = ["flowseam", "diffusers"] if i % 2 == 0 else ["diffusers", "flowseam"]
            for library in order:
                r = run_worker(args, ckpt, library, config, out)
                results[config][library].append(r)
                generate = "" if args.load_only else f"generate {r['generate_s']:7.1f} s, "
                print(f"  round {i + 1} {config:<18} {library:<9} load {r['load_s']:6.1f} s, "
                      f"{generate}load peak {r['load_peak'] / 2**20:7.0f} MiB, peak "
                      f"{r['peak'] / 2**20:7.0f} MiB", flush=True)
            if args.load_only:
                continue
            a, b = (np.load(out / f"{lib}.npy") for lib in ("flowseam", "diffusers"))
            results[config]["diff"].append(float(np.abs(a - b).max()))
            results[config]["rel"].append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))

    command = "python bench/real_size.py " + shlex.join(sys.argv[1:])
    print(f"\n`{command}` ({args.repeats} rounds, fresh processes; load average "
          f"{os.getloadavg()[0]:.1f} at the end; weights {weights / 2**30:.2f} GiB):\n")
    if args.load_only:
        return _load_table(configs, results, weights)
    print("| configuration | load s, flowseam / diffusers | generate s, flowseam / diffusers "
          "| peak RSS of the load, MiB (× weights) | peak RSS, MiB | max \\|Δ frames\\| "
          "| ‖Δ‖ / ‖diffusers‖ |")
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        f, d = results[config]["flowseam"], results[config]["diffusers"]
        print(f"| {config} | {med(f, 'load_s'):.1f} / {med(d, 'load_s'):.1f} "
              f"({med(f, 'load_s') / med(d, 'load_s'):.2f}) | {med(f, 'generate_s'):.1f} / "
              f"{med(d, 'generate_s'):.1f} ({med(f, 'generate_s') / med(d, 'generate_s'):.2f}) | "
              f"{load_peaks(f, d, weights)} | "
              f"{med(f, 'peak') / 2**20:.0f} / {med(d, 'peak') / 2**20:.0f} | "
              f"{max(results[config]['diff']):.1e} | {max(results[config]['rel']):.1e} |")


def train(args, ckpt: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="fs-real-train-"))
    rows = []
    for config in ("fp32", "bf16"):
        out = root / config
        out.mkdir()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--library", "train",
               "--config", config, "--ckpt", str(ckpt), "--out", str(out), "--height",
               str(args.height), "--width", str(args.width), "--threads", str(args.threads),
               "--seed", str(args.seed)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"train {config} failed:\n{proc.stderr[-4000:]}")
        r = json.loads((out / "train.json").read_text())
        rows.append((config, r))
        print(f"  {config}: load {r['load_s']:.1f} s, step {r['step_s']:.1f} s, peak "
              f"{r['peak'] / 2**30:.2f} GiB, first-epoch |ratio - 1| {r['ratio_dev']:.1e}, "
              f"updated {r['updated']}", flush=True)
    command = "python bench/real_size.py " + shlex.join(sys.argv[1:])
    print(f"\n`{command}`: one flowgrpo step, LoRA rank 32, gradient checkpointing, group of 2 "
          f"at {args.height}x{args.width}, 2 SDE steps, CFG {GUIDANCE}, KL on\n")
    print("| run | load s | step s | peak RSS GiB | first-epoch \\|ratio - 1\\| |")
    print("|---|---|---|---|---|")
    for config, r in rows:
        print(f"| {config} | {r['load_s']:.1f} | {r['step_s']:.1f} | {r['peak'] / 2**30:.2f} | "
              f"{r['ratio_dev']:.1e} |")


if __name__ == "__main__":
    main()
