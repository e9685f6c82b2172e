"""The cpu backend's hook implementations: the terminal fallback of every device chain."""

from __future__ import annotations

import torch
from flowseam import ops
from flowseam.seam import (
    Availability,
    BackendInfo,
    ComponentSpec,
    KernelRegistration,
    hookimpl,
    instantiate,
    torch_dtype,
)
from flowseam.ops import eager as kernels  # the eager-torch implementation of every op contract

from .ltx2 import speed_up_ltx2
from .wan_vae import speed_up_wan_vae


@hookimpl
def flowseam_backend() -> BackendInfo:
    return BackendInfo(device="cpu", priority=0,
                       description="torch on the CPU, float32 (or the dtype asked for)")


@hookimpl
def flowseam_backend_available() -> Availability:
    return Availability(True, "")


@hookimpl
def flowseam_arch_chain() -> list[str]:
    return ["generic"]


@hookimpl
def flowseam_register_kernels() -> list[KernelRegistration]:
    return [
        KernelRegistration(ops.FLOW_MATCH_STEP, kernels.flow_match_step),
        KernelRegistration(ops.FLOW_SDE_STEP, kernels.flow_sde_step),
        KernelRegistration(ops.UNIPC_STEP, kernels.unipc_step),
        KernelRegistration(ops.ATTENTION, kernels.attention),
        KernelRegistration(ops.CACHED_ATTENTION, kernels.cached_attention),
        KernelRegistration(ops.FLOW_RENOISE, kernels.flow_renoise),
        KernelRegistration(ops.SEQUENCE_PARALLEL_ATTENTION, kernels.ulysses_attention),
    ]


@hookimpl
def flowseam_component_kinds() -> tuple[str, ...]:
    return ("*",)  # every kind: cpu is the terminal fallback


@hookimpl
def flowseam_component_dtypes() -> dict[str, tuple[str, ...]]:
    return {"*": ("float32", "bfloat16", "float16")}


@hookimpl
def flowseam_build_component(kind: str, spec: ComponentSpec, device: str):
    """Every kind, with its real class, on the CPU in float32, or in the dtype the spec asks for
    (loaded in it: ``from_pretrained(torch_dtype=...)`` keeps the model's float32 modules); a Wan
    VAE with its convolutions on oneDNN (float32) and its RMS norms as sums of squares
    (:mod:`flowseam_cpu.wan_vae`); LTX-2's video VAE and latent upsampler with their
    convolutions on oneDNN, its DiT's tanh-GELU as a sigmoid (:mod:`flowseam_cpu.ltx2`)."""
    built = instantiate(spec, device="cpu",
                        dtype=torch_dtype(spec.dtype) if spec.dtype else torch.float32)
    if kind == "vae":
        built = speed_up_wan_vae(built)
    return speed_up_ltx2(kind, built)
