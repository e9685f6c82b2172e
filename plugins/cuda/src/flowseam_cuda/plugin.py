"""The cuda backend's hook implementations (contracts in :mod:`flowseam.seam.hookspecs`).

This module must import on every machine: it imports torch and flowseam only; cupy is imported
by the kernels on first use, and only after :func:`flowseam_backend_available` said yes.
"""

from __future__ import annotations

import flowseam.seam
from flowseam import ops
from flowseam.seam import (
    Availability,
    BackendInfo,
    ComponentSpec,
    KernelRegistration,
    hookimpl,
    hookspecs,
)

from . import components, cupy_kernels, torch_kernels
from .device import arch_chain, torch_device, unavailable_reason


@hookimpl
def flowseam_backend() -> BackendInfo:
    return BackendInfo(device="cuda", priority=100,
                       description="torch on NVIDIA GPUs (bf16 DiT), flash/SDPA attention, "
                                   "cupy fused solver kernels")


@hookimpl
def flowseam_backend_available() -> Availability:
    reason = unavailable_reason()
    return Availability(not reason, reason)


@hookimpl
def flowseam_arch_chain() -> list[str]:
    return arch_chain()  # e.g. ["sm90", "sm80", "generic"] on an H100


@hookimpl
def flowseam_register_kernels() -> list[KernelRegistration]:
    # sm80 and newer: cupy kernels and flash/fused attention; any other GPU: torch ops. The
    # multistep solver (UniPC) runs as core's eager torch kernel on every GPU (generic rung; its
    # work per step is a handful of elementwise passes).
    return [
        KernelRegistration(ops.FLOW_MATCH_STEP, cupy_kernels.flow_match_step, arch="sm80"),
        KernelRegistration(ops.FLOW_SDE_STEP, cupy_kernels.flow_sde_step, arch="sm80"),
        KernelRegistration(ops.ATTENTION, torch_kernels.attention_fast, arch="sm80"),
        KernelRegistration(ops.FLOW_MATCH_STEP, torch_kernels.flow_match_step, arch="generic"),
        KernelRegistration(ops.FLOW_SDE_STEP, torch_kernels.flow_sde_step, arch="generic"),
        KernelRegistration(ops.UNIPC_STEP, torch_kernels.unipc_step, arch="generic"),
        KernelRegistration(ops.ATTENTION, torch_kernels.attention, arch="generic"),
        KernelRegistration(ops.CACHED_ATTENTION, torch_kernels.cached_attention, arch="generic"),
        KernelRegistration(ops.FLOW_RENOISE, torch_kernels.flow_renoise, arch="generic"),
        # the all-to-all over nccl (torch.distributed picks it for CUDA tensors)
        KernelRegistration(ops.SEQUENCE_PARALLEL_ATTENTION, torch_kernels.ulysses_attention,
                           arch="generic"),
    ]


@hookimpl
def flowseam_component_kinds() -> tuple[str, ...]:
    return components.KINDS  # dit, vae, text_encoder, image_encoder; tokenizers stay on cpu


@hookimpl
def flowseam_component_dtypes() -> dict[str, tuple[str, ...]]:
    return {kind: ("float32", "bfloat16", "float16") for kind in components.KINDS}


@hookimpl
def flowseam_build_component(kind: str, spec: ComponentSpec, device: str):
    """The real class on the GPU: dit in bfloat16, the others in float32, unless ``spec.dtype``
    says otherwise (see :mod:`flowseam_cuda.components`)."""
    return components.build(kind, spec)


# Only flowseam's conformance suite calls this hook (on an available backend). It arrived with
# that suite; a core that does not know a hook would mark this plugin broken, so it is defined
# only when the core has it.
if hasattr(hookspecs, "flowseam_conformance_expectations"):

    @hookimpl
    def flowseam_conformance_expectations():
        # the cupy kernels take CUDA tensors; component kinds: the defaults (declared = built here)
        return flowseam.seam.ConformanceExpectations(torch_device=str(torch_device()))
