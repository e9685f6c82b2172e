"""What compiling the Wan VAE's decode with inductor would buy accel, and what it would cost: the
evidence behind accel not building the ``vae`` (``flowseam_accel.components``' docstring) and
behind ``bench/backends.py``'s accel/cpu ratio staying above 0.5.

The VAE of ``bench/backends.py``'s checkpoint (``flowseam.testing.tiny``, 17 frames at 64x64, so
latents ``(1, 16, 5, 8, 8)`` float32) is loaded through the cpu backend (its convolutions on
oneDNN, its RMS norms as sums of squares: ``flowseam_cpu.wan_vae``). Its ``decode`` is timed
eager, as both backends run it today, against a copy under ``torch.compile`` (inductor) with
``torch._inductor.config.freezing`` off, then on, each in a new process with a fresh inductor
cache. Printed per variant: the compile's CPU seconds (inductor's C++ compiler included:
``TORCHINDUCTOR_COMPILE_THREADS=1``), the median decode of each (eager and compiled calls
alternate, so their ratio compares them under the same load), and the max-abs difference from
the eager output.

Freezing folds the weights in as constants and prepacks the convolutions' weights for oneDNN;
without it inductor calls torch's native convolution, which picks its slow kernel at these sizes
(``flowseam_cpu.onednn``). The compiled copy runs its convolutions through ``nn.Conv3d`` again:
dynamo cannot trace cpu's direct ``aten.mkldnn_convolution`` call.

diffusers decodes one latent frame per decoder call, threading a causal-conv cache between them,
so dynamo unrolls the loop and specializes the graph to the frame count: every new frame count is
a new compile of that size. Prints one line per variant. One torch thread (as ``bench/backends.py
--threads 1``).

Run: .venv/bin/python bench/vae_compile.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backends import _cpu_seconds  # bench/backends.py: this process's and its children's CPU s


def _one(variant: str, repeats: int) -> None:
    """Time one variant in this process and print its line (run in a fresh process per variant:
    inductor's config and caches are process-wide)."""
    import diffusers
    import torch

    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint("wan2.1-t2v", Path(tempfile.mkdtemp(prefix="fs-bench-")) / "wan")
    vae = flowseam.load(ckpt, platform=flowseam.Platform("cpu")).components["vae"]
    latents = torch.randn(1, vae.config.z_dim, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = vae.decode(latents).sample
        compiled_vae = copy.deepcopy(vae)   # the eager one keeps cpu's oneDNN calls
        for module in compiled_vae.modules():  # which dynamo cannot trace
            module.__dict__.pop("_conv_forward", None)
        torch._inductor.config.freezing = variant == "compiled, freezing"
        decode = torch.compile(compiled_vae.decode)
        c0 = _cpu_seconds()
        decode(latents)
        compile_s = _cpu_seconds() - c0
        diff = (decode(latents).sample - reference).abs().max().item()
        times = {"eager": [], variant: []}
        for _ in range(repeats):  # alternating, so both see the same load
            for name, call in (("eager", vae.decode), (variant, decode)):
                t0 = time.perf_counter()
                call(latents)
                times[name].append(time.perf_counter() - t0)
    eager, this = (statistics.median(times[k]) for k in ("eager", variant))
    print(f"  {variant:<20} decode median {this * 1e3:6.1f} ms (eager in the same run "
          f"{eager * 1e3:6.1f} ms, ratio {this / eager:.2f}); compile {compile_s:5.1f} CPU s; "
          f"max diff from eager {diff:.1e}; load average {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child process
    args = ap.parse_args()
    if args.variant:
        return _one(args.variant, args.repeats)
    print("Wan VAE decode of (1, 16, 5, 8, 8) latents -> 17 frames 64x64, cpu backend's build, "
          f"one torch thread; load average {os.getloadavg()[0]:.1f}", flush=True)
    for variant in ("compiled", "compiled, freezing"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="fs-inductor-"),
                   TORCHINDUCTOR_COMPILE_THREADS="1")
        subprocess.run([sys.executable, __file__, "--variant", variant,
                        "--repeats", str(args.repeats)], env=env, check=True)


if __name__ == "__main__":
    main()
