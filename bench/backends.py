"""The same generation on the cpu backend and on the accel backend (torch.compile).

A small Wan2.1 T2V config (4 layers x width 128, 17 frames at 64x64, 10 steps, CFG 5.0; random
weights from ``flowseam.testing.tiny``), loaded once per backend from the same checkpoint. After a
warm-up run each (accel compiles there), the two alternate ``--repeats`` times. Prints the median
seconds of each, the ratio accel/cpu, the max-abs difference of their outputs, and accel's compile
seconds as booked by ``flowseam_accel.compile_report()`` (separately from its run seconds).

The first run in a fresh environment pays the full inductor compile; later processes reuse the
on-disk cache (see flowseam_accel's docstring), so run it twice to see both.

Run: .venv/bin/python bench/backends.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import diffusers

    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint

    diffusers.utils.logging.set_verbosity_error()
    ckpt = write_tiny_checkpoint("wan2.1-t2v", Path(tempfile.mkdtemp(prefix="fs-bench-")) / "wan",
                                 transformer=dict(num_layers=4, num_attention_heads=4,
                                                  attention_head_dim=32, ffn_dim=256))
    params = flowseam.DiffusionParams(num_steps=args.steps, guidance_scale=5.0, height=64, width=64,
                                      num_frames=17, seed=0, negative_prompt="blurry")
    models = {name: flowseam.load(ckpt, platform=flowseam.Platform(name)) for name in ("cpu", "accel")}
    import flowseam_accel

    outputs, warm = {}, {}
    for name, model in models.items():  # warm-up: accel compiles here
        t0 = time.perf_counter()
        outputs[name] = model.generate("a red ball", params=params).frames
        warm[name] = time.perf_counter() - t0
    compile_s = flowseam_accel.compile_report()["compile_s"]
    times = {name: [] for name in models}
    order = list(models)
    for _ in range(args.repeats):
        order.reverse()
        for name in order:
            t0 = time.perf_counter()
            models[name].generate("a red ball", params=params)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = flowseam_accel.compile_report()
    print(f"Wan2.1 T2V 4 layers x 128, 17 frames 64x64, {args.steps} steps, CFG 5.0")
    for name in models:
        print(f"  {name:<6} warm-up {warm[name]:.2f} s; median {med[name]:.3f} s "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[name])})")
    print(f"  ratio accel/cpu = {med['accel'] / med['cpu']:.3f}")
    print(f"  accel compile seconds: {compile_s:.1f} during warm-up, {report['compile_s']:.1f} in all "
          f"({report['compiles']} compiled signatures); accel run seconds {report['run_s']:.1f}")
    print(f"  max |accel - cpu| = {np.abs(outputs['accel'] - outputs['cpu']).max():.2e}")
    print("  where each came from:")
    for model in models.values():
        print("   ", model.provenance())


if __name__ == "__main__":
    main()
