"""Benchmark the cuda backend's cupy solver kernels against torch eager on this GPU.

For each op, dtype and latent size it times the cupy kernel (the ``sm80`` registration) and the
torch fallback (the ``generic`` registration, plain eager torch) with CUDA events, and reports
the *effective* bandwidth: the bytes the op must move at minimum (read each input once, write
each output once) divided by the time, next to the device's theoretical peak
(2 x memory clock x bus width from ``torch.cuda.get_device_properties``, or a table of
datasheet figures). Both implementations are charged the same bytes, so the ratio of their
GB/s is their speed ratio. Runs in well under a minute.

    python plugins/cuda/bench_kernels.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from flowseam_cuda import cupy_kernels, torch_kernels

#: Datasheet peak memory bandwidth, GB/s, by a substring of the device name (first match wins).
PEAK_GBS = (("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350),
            ("GH200", 4000), ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935),
            ("A100", 1555), ("L40S", 864), ("L4", 300), ("A10G", 600), ("RTX 4090", 1008))

#: Latent sizes: Wan 2.1 480p 81 frames (1 x 16 x 21 x 60 x 104), 720p x 4, and a large batch.
SHAPES = {"wan480p": (1, 16, 21, 60, 104), "wan720p_b4": (4, 16, 21, 90, 160),
          "large_b8": (8, 16, 32, 128, 128)}


def peak_bandwidth(props) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from)."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "2 x memory_clock_rate x memory_bus_width"
    for key, gbs in PEAK_GBS:
        if key in props.name:
            return float(gbs), f"datasheet ({key})"
    return None, "unknown"


def time_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median milliseconds per call over ``repeats`` runs of ``iters`` calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return statistics.median(runs)


def cases(shape, dtype):
    """[(op name, bytes it must move at minimum, cupy call, torch eager call)] for one size."""
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    v = torch.randn(shape, device="cuda", generator=g).to(dtype)
    noise = torch.randn(shape, device="cuda", generator=g)
    n, s = x.numel(), x.element_size()
    prev = cupy_kernels.flow_sde_step(x, v, 0.6, 0.5, noise=noise).sample
    return [
        ("flow_match_step", n * 3 * s,
         lambda: cupy_kernels.flow_match_step(x, v, 0.6, 0.5),
         lambda: torch_kernels.flow_match_step(x, v, 0.6, 0.5)),
        # reads x, v, noise (f32); writes sample, mean (f32)
        ("flow_sde_step rollout", n * (s + s + 4 + s + 4),
         lambda: cupy_kernels.flow_sde_step(x, v, 0.6, 0.5, noise=noise),
         lambda: torch_kernels.flow_sde_step(x, v, 0.6, 0.5, noise=noise)),
        # reads x, v, prev_sample; writes mean (f32)
        ("flow_sde_step recompute", n * (s + s + s + 4),
         lambda: cupy_kernels.flow_sde_step(x, v, 0.6, 0.5, prev_sample=prev),
         lambda: torch_kernels.flow_sde_step(x, v, 0.6, 0.5, prev_sample=prev)),
    ]


def max_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item()
    return max(max_diff(a.sample, b.sample), max_diff(a.log_prob, b.log_prob), max_diff(a.mean, b.mean))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="only the smallest size")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    peak, peak_source = peak_bandwidth(props)
    report = {"device": props.name, "capability": list(torch.cuda.get_device_capability(0)),
              "torch": torch.__version__, "cupy": cupy_kernels._cupy().__version__,
              "peak_gbs": peak, "peak_source": peak_source, "results": []}
    print(f"{props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, "
          f"cupy {report['cupy']}; peak {peak and round(peak)} GB/s ({peak_source})")

    # first launch of each kernel variant = NVRTC compile (or cupy's disk cache)
    start = time.perf_counter()
    x = torch.randn(2, 8, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        cupy_kernels.flow_match_step(xd, xd, 0.6, 0.5)
        cupy_kernels.flow_sde_step(xd, xd, 0.6, 0.5, prev_sample=cupy_kernels.flow_sde_step(xd, xd, 0.6, 0.5).sample)
    torch.cuda.synchronize()
    report["kernel_compile_s"] = time.perf_counter() - start
    print(f"cupy kernel compile/load: {report['kernel_compile_s']:.2f} s")

    header = f"{'op':<24}{'dtype':<6}{'size':<12}{'cupy ms':>9}{'GB/s':>8}{'%peak':>7}" \
             f"{'torch ms':>10}{'GB/s':>8}{'%peak':>7}{'speedup':>9}{'max|diff|':>11}"
    print(header)
    print("-" * len(header))
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    for size, shape in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            for op, nbytes, run_cupy, run_torch in cases(shape, dtype):
                iters = max(3, min(200, int(2e10 // max(nbytes, 1))))
                ms_c, ms_t = time_ms(run_cupy, iters), time_ms(run_torch, iters)
                gbs_c, gbs_t = nbytes / ms_c / 1e6, nbytes / ms_t / 1e6
                diff = max_diff(run_cupy(), run_torch())
                pct = (lambda gbs: 100 * gbs / peak) if peak else (lambda gbs: float("nan"))
                row = {"op": op, "dtype": str(dtype).removeprefix("torch."), "size": size,
                       "shape": list(shape), "bytes": nbytes, "cupy_ms": ms_c, "torch_ms": ms_t,
                       "cupy_gbs": gbs_c, "torch_gbs": gbs_t, "cupy_pct_peak": pct(gbs_c),
                       "torch_pct_peak": pct(gbs_t), "speedup": ms_t / ms_c, "max_abs_diff": diff}
                report["results"].append(row)
                print(f"{op:<24}{row['dtype'][:5]:<6}{size:<12}{ms_c:>9.3f}{gbs_c:>8.0f}{pct(gbs_c):>7.1f}"
                      f"{ms_t:>10.3f}{gbs_t:>8.0f}{pct(gbs_t):>7.1f}{ms_t / ms_c:>8.2f}x{diff:>11.2e}")
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
