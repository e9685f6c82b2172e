"""Whether the cuda backend can run here, on which torch device, and its arch chain.

Nothing in this module imports cupy at import time: flowseam imports every plugin on every
machine, and on a machine without CUDA this backend must import cleanly and say why it is
unavailable (:func:`unavailable_reason`). The arch chain, most specific rung first, runs from
the device's own compute capability (``sm<major><minor>``, for arch-specific instructions)
through ``sm80`` (the Ampere baseline every later GPU keeps; the cupy kernels register there)
to ``generic`` (torch ops only): :func:`arch_chain_for` has each rung and examples.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

#: The feature-baseline rungs below a device's own rung, newest first, with the capability
#: each needs.
BASELINE_RUNGS = (("sm80", (8, 0)),)

CUPY_INSTALL_HINT = "pip install 'flowseam-cuda[cupy]' (cupy-cuda12x; [cupy-cuda13] for CUDA 13)"


def arch_chain_for(capability: tuple[int, int]) -> list[str]:
    """The arch chain of a GPU of compute ``capability`` ``(major, minor)``. Pure function
    (testable without a GPU).

    Rungs, most specific first (a kernel registered at a rung runs on every GPU whose chain
    contains it):

    ``sm<major><minor>``
        The device's own compute capability: kernels that use arch-specific instructions
        (e.g. Hopper's wgmma/TMA at ``sm90``, which Blackwell does not run) register here.
    ``sm80``
        The Ampere feature baseline that every later GPU keeps (native bf16 conversion
        instructions, ``cp.async``); listed for capability 8.0 and newer. The cupy kernels are
        registered here (they convert bf16 with ``cvt.rn.bf16.f32``).
    ``generic``
        Any CUDA device torch supports; only torch ops (the fallbacks).

    Examples: (9, 0) H100/H200 -> ``["sm90", "sm80", "generic"]``; (8, 0) A100 ->
    ``["sm80", "generic"]``; (8, 9) L40S -> ``["sm89", "sm80", "generic"]``; (10, 0) B200 ->
    ``["sm100", "sm80", "generic"]``; (7, 5) T4 -> ``["sm75", "generic"]``.
    """
    major, minor = int(capability[0]), int(capability[1])
    own = f"sm{major}{minor}"
    chain = [own]
    chain += [rung for rung, needs in BASELINE_RUNGS if (major, minor) >= needs and rung != own]
    return chain + ["generic"]


def torch_device() -> torch.device:
    """The GPU components are built on: torch's current CUDA device (``cuda:0`` unless the
    process called ``torch.cuda.set_device``, as one rank per GPU does)."""
    return torch.device("cuda", torch.cuda.current_device())


def arch_chain() -> list[str]:
    """This process's arch chain, from the current device's compute capability."""
    return arch_chain_for(torch.cuda.get_device_capability(torch_device()))


def _torch_cuda_problem() -> str:
    if torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build, so no CUDA device is visible; "
                "install a CUDA build of torch")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            "(no GPU or driver, or CUDA_VISIBLE_DEVICES hides them)")


def _cupy_problem(check_device: bool) -> str:
    if importlib.util.find_spec("cupy") is None:
        return f"cupy is not installed; {CUPY_INSTALL_HINT}"
    if not check_device:  # importing cupy on a machine without CUDA proves nothing
        return ""
    try:
        cupy = importlib.import_module("cupy")
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a broken cupy (wrong CUDA major, missing libs) must not break us
        return f"cupy does not work: {type(exc).__name__}: {exc}; {CUPY_INSTALL_HINT}"
    if count < 1:
        return "cupy sees no CUDA device"
    return ""


def unavailable_reason() -> str:
    """Why the cuda backend cannot run in this process, naming everything missing; ``""`` when
    it can. Never raises."""
    torch_problem = _torch_cuda_problem()
    problems = [torch_problem, _cupy_problem(check_device=not torch_problem)]
    return "; ".join(p for p in problems if p)
