"""Dispatch overhead of the kernel seam.

Measures (1) nanoseconds per ``platform.kernels.get(op)`` and (2) the overhead of calling the
bound ``flow_match_step`` kernel versus the bare torch expression it computes
(``torch.add(x, v, alpha=dt)``) on a 1M-element float32 latents tensor, alternating the two in
one process after a warm-up and reporting medians and their ratio.

Goals (issue 2): get <= 1 µs; bound-call overhead <= 5 %. Issue 11 named every kernel fault
(the call runs inside a ``try``) and checks each step's output in the loop; the script reports
the wrapper alone and the output check, so their cost can be compared before and after.

Large-tensor timings are noisy on a shared 2-core machine, so the overhead is reported two ways:
the ratio of the minimum times (bound vs bare, alternating blocks), and the per-call overhead
measured on a 4-element tensor (where the arithmetic is negligible) divided by the bare 1M time.

Run: .venv/bin/python bench/dispatch.py [--backend cpu] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import flowseam
from flowseam import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="kernel calls per timed block")
    args = ap.parse_args()

    platform = flowseam.Platform(args.backend)
    kernels = platform.kernels
    n = 1_000_000
    number = 200_000
    get_ns = min(timeit.repeat(lambda: kernels.get(ops.FLOW_MATCH_STEP), number=number, repeat=5))
    get_ns = get_ns / number * 1e9
    bare_lambda_ns = min(timeit.repeat(lambda: None, number=number, repeat=5)) / number * 1e9

    x = torch.randn(n)
    v = torch.randn(n)
    sigma, sigma_next = 0.75, 0.7
    dt = sigma_next - sigma
    step = kernels.get(ops.FLOW_MATCH_STEP)

    def bare():
        for _ in range(args.calls):
            torch.add(x, v, alpha=dt)

    def bound():
        for _ in range(args.calls):
            step(x, v, sigma, sigma_next)

    for f in (bare, bound, bare, bound):  # warm-up
        f()
    t_bare, t_bound = [], []
    for _ in range(args.repeats):
        for f, sink in ((bare, t_bare), (bound, t_bound)):
            t0 = time.perf_counter()
            f()
            sink.append((time.perf_counter() - t0) / args.calls)
    mb, mk = min(t_bare), min(t_bound)
    xs, vs = torch.randn(4), torch.randn(4)
    tiny_bare = min(timeit.repeat(lambda: torch.add(xs, vs, alpha=dt), number=20000, repeat=7)) / 20000
    tiny_bound = min(timeit.repeat(lambda: step(xs, vs, sigma, sigma_next), number=20000, repeat=7)) / 20000
    per_call = tiny_bound - tiny_bare
    # the seam's own wrapper (BoundKernel: a call inside a try) around a function doing nothing
    noop = lambda *a: None  # noqa: E731
    wrapped = flowseam.BoundKernel(noop, step.provenance)
    t_noop = min(timeit.repeat(lambda: noop(x, v, sigma, sigma_next), number=number, repeat=7))
    t_wrapped = min(timeit.repeat(lambda: wrapped(x, v, sigma, sigma_next), number=number, repeat=7))
    wrapper = (t_wrapped - t_noop) / number
    # the loop's output check after each step (shape, dtype, device, one sum: its finiteness)
    from flowseam.loops.checks import check_step

    out = step(x, v, sigma, sigma_next)
    t_check = min(timeit.repeat(lambda: check_step(None, 0, step, x, v, out, sigma, sigma_next),
                                number=50, repeat=7)) / 50
    print(f"platform: {platform!r}; kernel {step.impl_id}")
    print(f"kernels.get(op): {get_ns:.0f} ns per lookup (timeit of an empty lambda: {bare_lambda_ns:.0f} ns)"
          f"  goal <= 1000 ns")
    print(f"flow_match_step on {n:,} float32 elements: bare torch {mb * 1e6:.1f} µs, bound kernel "
          f"{mk * 1e6:.1f} µs (min of {args.repeats} blocks x {args.calls} calls; median ratio "
          f"{statistics.median(t_bound) / statistics.median(t_bare):.4f})")
    print(f"bound/bare = {mk / mb:.4f}  (overhead {100 * (mk / mb - 1):+.2f} %, goal <= 5 %)")
    print(f"per-call overhead (wrapper + argument checks, 4-element tensors): {per_call * 1e9:.0f} ns "
          f"= {100 * per_call / mb:.2f} % of the bare 1M-element step")
    print(f"BoundKernel wrapper alone (call inside a try, no-op function): {wrapper * 1e9:.0f} ns "
          f"= {100 * wrapper / mb:.3f} % of the bare 1M-element step")
    print(f"loop output check after a step (shape/dtype/device, the finiteness of one sum over {n:,} elements): "
          f"{t_check * 1e6:.1f} µs = {100 * t_check / mb:.1f} % of the bare step (a DiT forward "
          "per step costs far more)")


if __name__ == "__main__":
    main()
