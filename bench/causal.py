"""The wan_causal loop: time-to-first-chunk, KV cache vs full recompute, memory with a window.

A small but non-trivial causal Wan config (4 layers, inner width 128 = 4 heads x 32, ffn 256;
128x128 px = 16x16 latents / 2x2 patches = 64 tokens per latent frame; 7 chunks of 3 latent
frames = 81 frames; Self-Forcing's 4 steps, no CFG), random weights written by
``flowseam.testing.tiny.write_tiny_checkpoint("wan2.1-causal-t2v", ...)``. Three measurements:

1. time-to-first-chunk vs the whole video's time (streamed, decoded chunk by chunk);
2. KV-cached vs full recompute (``kv_cache=False``: the whole prefix with the block-causal mask
   at every step), alternating after a warm-up, median wall seconds of the loop's run to the
   latents and their ratio (goal <= 0.5), and the max difference of their outputs. The VAE decode
   is left out of this ratio on purpose and reported beside it: it is the same work on both sides
   (the KV cache changes only the DiT passes), and the tiny VAE here costs most of the streamed
   time while in real Wan2.1 the DiT passes dominate. At 64x64 (16 tokens per frame) the ratio
   is about 1: the DiT's per-call overhead dominates and the KV path's extra cache pass per
   chunk (5 DiT calls against 4) eats the saving, so the bench uses 128x128;
3. memory as the video grows 7 → 14 → 28 chunks (2x, 4x), without and with a rolling window
   (``local_attn_size=9, sink_size=3`` latent frames): the KV cache's peak bytes (exact, summed
   over layers) and the peak resident-memory growth of the run (the kernel's peak RSS, reset
   before the run; denoising only: the VAE's memory does not depend on the video's length when
   it streams).

Run: .venv/bin/python bench/causal.py [--repeats 3] [--backend cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from generate_vs_diffusers import PeakRSS  # noqa: E402  (bench/ is the script's directory)

PROMPT = "a red ball rolling on the grass"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-chunks", type=int, default=28, help="the memory sweep: 7, 14, 28")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", type=int, default=128, help="height and width in pixels")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import flowseam
    from flowseam import DiffusionParams
    from flowseam.quiet import quiet_libraries
    from flowseam.testing.tiny import write_tiny_checkpoint

    quiet_libraries()
    root = Path(tempfile.mkdtemp(prefix="flowseam-bench-causal-"))
    ckpt = write_tiny_checkpoint(
        "wan2.1-causal-t2v", root / "ckpt",
        transformer=dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, ffn_dim=256))
    model = flowseam.load(ckpt, platform=flowseam.Platform(args.backend))
    base = DiffusionParams(num_frames=81, height=args.size, width=args.size, seed=0)  # 7 chunks

    def stream(params, decode=True):
        first = total = None
        cache_bytes = 0
        request = flowseam.GenerationRequest(PROMPT, flowseam.TaskType.T2V, params)
        for chunk in flowseam.stream_loop(model, request, decode=decode):
            if chunk.index == 0:
                first = chunk.seconds
            if chunk.result is not None:
                total = chunk.seconds
                cache_bytes = chunk.result.kv_cache_peak_bytes
                latents = chunk.result.latents
                denoise = chunk.result.seconds["denoise"]
        return first, total, cache_bytes, latents, denoise

    def latents_only(params):
        request = flowseam.GenerationRequest(PROMPT, flowseam.TaskType.T2V, params)
        start = time.perf_counter()
        result = flowseam.run_loop(model, request, decode=False)
        return time.perf_counter() - start, result.latents

    # warm-up (both paths)
    stream(base)
    stream(base.replace(kv_cache=False))

    firsts, totals, fulls, kv_s, full_s = [], [], [], [], []
    for _ in range(args.repeats):
        f, t, _, _, _ = stream(base)
        firsts.append(f)
        totals.append(t)
        fulls.append(stream(base.replace(kv_cache=False))[1])
        seconds, cached = latents_only(base)
        kv_s.append(seconds)
        seconds, full = latents_only(base.replace(kv_cache=False))
        full_s.append(seconds)
    diff = float((cached - full).abs().max())
    med = statistics.median
    print(f"backend {args.backend}, 81 frames at {args.size}x{args.size} (21 latent frames, 7 chunks "
          f"of 3), 4 steps, {args.repeats} alternating repeats, medians:")
    print(f"  time-to-first-chunk {med(firsts):.3f} s, whole video {med(totals):.3f} s "
          f"(first chunk at {med(firsts) / med(totals):.0%} of the video's time)")
    print(f"  KV-cached vs full recompute, the loop to the latents: {med(kv_s):.3f} s vs "
          f"{med(full_s):.3f} s: ratio {med(kv_s) / med(full_s):.3f} (goal <= 0.5); "
          f"max |diff| {diff:.2e}")
    print(f"  the same streamed and decoded (the VAE's identical work included): {med(totals):.3f} s"
          f" vs {med(fulls):.3f} s: ratio {med(totals) / med(fulls):.3f}")

    print("  memory as the video grows (frames dropped as they stream):")
    print(f"  {'chunks':>6} {'window':>14} {'KV cache peak':>14} {'RSS growth':>11} {'seconds':>8}")
    for window in (None, (9, 3)):
        for chunks in [c for c in (7, 14, 28) if c <= args.max_chunks]:
            params = base.replace(num_frames=4 * (3 * chunks - 1) + 1)
            if window is not None:
                params = params.replace(local_attn_size=window[0], sink_size=window[1])
            with PeakRSS() as rss:
                _, total, cache_bytes, _, _ = stream(params, decode=False)
            label = "none" if window is None else f"{window[0]} (sink {window[1]})"
            print(f"  {chunks:>6} {label:>14} {cache_bytes / 2**20:>11.2f} MiB "
                  f"{rss.growth / 2**20:>7.1f} MiB {total:>8.2f}")


if __name__ == "__main__":
    main()
