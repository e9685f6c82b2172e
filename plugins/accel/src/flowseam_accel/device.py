"""Which torch device accel runs on, its arch chain, and whether torch.compile works there.

Detected once per process and cheap (nothing is compiled); the hooks only read these answers.
The arch chain, most specific rung first (a kernel registered at a rung runs on every host whose
chain contains it): on the CPU ``<machine>-<isa>`` from ``torch.backends.cpu.get_cpu_capability()``
(the SIMD level inductor vectorizes for; the x86 levels nest: ``["x86_64-avx512",
"x86_64-avx2", "x86_64", "generic"]``), then ``<machine>``, then ``generic``; on CUDA
``["cuda-sm<major><minor>", "cuda", "generic"]``; on MPS ``["mps", "generic"]``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import sys

import torch

#: Environment variable that forces accel's torch device (``cpu``, ``cuda:1``, ``mps``).
DEVICE_ENV = "FLOWSEAM_ACCEL_DEVICE"

_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
# x86 SIMD levels (get_cpu_capability()'s names), weakest first: each runs the ones below it
_X86_LADDER = ("avx2", "avx512")


def forced_device_problem() -> str:
    """Why ``FLOWSEAM_ACCEL_DEVICE`` names no usable device here, or ``""`` (also when unset)."""
    forced = os.environ.get(DEVICE_ENV, "").strip()
    try:
        dev = torch.device(forced) if forced else None
    except RuntimeError as exc:
        return f"{DEVICE_ENV}={forced!r} is not a torch device: {exc}"
    count = {"cpu": lambda: 1, "cuda": torch.cuda.device_count,
             "mps": lambda: int(torch.backends.mps.is_available())}.get(getattr(dev, "type", "cpu"))
    if count is None:
        return f"{DEVICE_ENV}={forced!r}: accel runs on cpu, cuda[:N] or mps"
    if dev is not None and (dev.index or 0) >= count():
        return f"{DEVICE_ENV}={forced!r}, but torch {torch.__version__} sees {count()} {dev.type}"
    return ""


@functools.cache
def torch_device() -> torch.device:
    """The device accel builds on: a usable override, else cuda, else mps, else cpu."""
    forced = os.environ.get(DEVICE_ENV, "").strip()
    if forced and not forced_device_problem():
        return torch.device(forced)
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_arch_chain(machine: str, capability: str) -> list[str]:
    """The CPU arch chain for ``machine`` (``platform.machine()``) and ``capability``
    (``torch.backends.cpu.get_cpu_capability()``: ``"AVX512"``, ``"AVX2"``, ``"SVE256"``,
    ``"DEFAULT"``, ``"NO AVX"``, ...). Pure function; see the module docstring."""
    machine = _MACHINE_ALIASES.get(machine.strip().lower(), machine.strip().lower())
    isa = capability.strip().lower().replace(" ", "")
    rungs: list[str] = []
    if machine and isa not in ("", "default", "noavx"):
        if machine == "x86_64" and isa in _X86_LADDER:
            levels = _X86_LADDER[:_X86_LADDER.index(isa) + 1]
            rungs += [f"{machine}-{level}" for level in reversed(levels)]
        else:
            rungs.append(f"{machine}-{isa}")
    if machine:
        rungs.append(machine)
    return rungs + ["generic"]


@functools.cache
def arch_chain() -> tuple[str, ...]:
    """accel's arch chain on this host, most specific first, ending in ``"generic"``."""
    dev = torch_device()
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return (f"cuda-sm{major}{minor}", "cuda", "generic")
    if dev.type == "mps":
        return ("mps", "generic")
    return tuple(cpu_arch_chain(platform.machine(), torch.backends.cpu.get_cpu_capability()))


@functools.cache
def compile_unsupported_reason() -> str:
    """Why ``torch.compile`` cannot run on accel's device here, or ``""`` when it can.

    Cheap checks only (no compilation): inductor has its code generator for the device: a C++
    compiler for the CPU (``$CXX``, else ``g++``; ``clang++`` on macOS), triton for CUDA; and,
    where this process has imported dynamo already, dynamo supports this Python (torch's own
    check). Discovery runs in every flowseam process, and importing dynamo costs two seconds on
    a small CPU, so a process that has not imported it leaves that check to the first compile:
    on a Python torch.compile does not support, that compile fails naming accel and torch's
    reason.
    """
    if forced_device_problem():
        return forced_device_problem()
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile (accel needs torch>=2.6)"
    if "torch._dynamo" in sys.modules:
        try:
            from torch._dynamo.eval_frame import check_if_dynamo_supported

            check_if_dynamo_supported()
        except Exception as exc:  # torch says why (Python version, free-threaded build, ...)
            return f"torch.compile does not support this Python ({sys.version.split()[0]}): {exc}"
    dev = torch_device()
    if dev.type == "cpu":
        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if not shutil.which(cxx):
            return (f"torch.compile's CPU code generator needs a C++ compiler and {cxx!r} is not "
                    "on PATH; install one (e.g. apt-get install g++) or set CXX")
    elif dev.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs triton, which is not installed; pip install triton"
    return ""
