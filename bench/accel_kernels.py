"""Per call on the CPU in float32: accel's compiled solver arithmetic (AOTInductor packages,
``flowseam_accel.compiled.AOTFunction``) against cpu's eager kernels, at the bench's latents and
at a Wan 480p latent, to decide which kernels are worth a package.

Three pairs, alternating in one process after a warm-up, one torch thread, medians of
``--repeats`` blocks:

* the Euler step: a package of ``flowseam_accel.kernels._euler`` with the same dims accel used
  to give it (built here; accel itself no longer compiles it for the CPU), called with the
  flattened float32 latents and ``dt`` as a 0-dim tensor, as accel did (without accel's
  argument checks and autograd wrapper, so the package's side is a lower bound), against
  ``flowseam.ops.eager.flow_match_step`` (checks, then ``torch.add(x, v, alpha=dt)``);
* ``flow_renoise`` and ``flow_sde_step`` (with ``noise``): accel's kernels against cpu's.

The packages go to the inductor cache (``TORCHINDUCTOR_CACHE_DIR``); a first run compiles them
(about 12 CPU s each).

Run: .venv/bin/python bench/accel_kernels.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from step_check import alternate  # bench/step_check.py: blocks of calls, alternating

SHAPES = {"bench latents (2, 16, 5, 8, 8)": (2, 16, 5, 8, 8),
          "Wan 480p latent (1, 16, 21, 60, 104)": (1, 16, 21, 60, 104)}


def _pairs(euler, x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor) -> dict:
    """``{kernel name: (accel's call, cpu's call)}`` on these latents, velocity and noise;
    ``euler`` is the Euler step's package (see the module docstring)."""
    from flowseam.ops import eager
    from flowseam_accel import kernels

    def accel_euler():
        dt = torch.tensor(-0.1)
        return euler(x.reshape(-1), v.reshape(-1), dt).reshape(x.shape)

    return {
        "flow_match_step": (accel_euler, lambda: eager.flow_match_step(x, v, 0.8, 0.7)),
        "flow_renoise": (lambda: kernels.flow_renoise(x, noise, 0.3),
                         lambda: eager.flow_renoise(x, noise, 0.3)),
        "flow_sde_step": (lambda: kernels.flow_sde_step(x, v, 0.8, 0.7, noise=noise),
                          lambda: eager.flow_sde_step(x, v, 0.8, 0.7, noise=noise)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from flowseam_accel import kernels
    from flowseam_accel.compiled import AOTFunction

    euler = AOTFunction(kernels._euler, "flow_match_step", (("N",), ("N",), ()), (torch.float32,))
    g = torch.Generator().manual_seed(0)
    print(f"accel vs cpu per call, float32 on the CPU, one torch thread; load average "
          f"{os.getloadavg()[0]:.1f}")
    for label, shape in SHAPES.items():
        x, v, noise = (torch.randn(shape, generator=g) for _ in range(3))
        reps = 1000 if x.numel() < 100_000 else 40

        for op, (accel_call, cpu_call) in _pairs(euler, x, v, noise).items():
            accel_call(), cpu_call()   # builds or loads the package
            times = alternate({"accel": accel_call, "cpu": cpu_call}, args.repeats, reps)
            a, c = (statistics.median(times[name]) * 1e6 for name in ("accel", "cpu"))
            print(f"  {label:<38} {op:<16} accel {a:9.1f} µs  cpu {c:9.1f} µs  accel/cpu {a / c:.2f}")


if __name__ == "__main__":
    main()
