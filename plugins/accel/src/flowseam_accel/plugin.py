"""accel's hook implementations: what flowseam asks a backend, and accel's answers.

This module is the plugin: flowseam imports it through the entry point
``accel = "flowseam_accel.plugin"`` (group ``flowseam.plugins``) and calls the functions marked
``@hookimpl``; the hook contracts are in :mod:`flowseam.hookspecs`. Every hook is called once,
while plugins are discovered or a Platform is built, never during denoising, so it is fine for
them to do a little detection work. Nothing here may fail on a host without the hardware: an
unusable host is reported through :func:`flowseam_backend_available`.
"""

from __future__ import annotations

from flowseam import (
    Availability,
    BackendInfo,
    ComponentSpec,
    ConformanceExpectations,
    KernelRegistration,
    hookimpl,
    ops,
)

from . import components, kernels
from .device import arch_chain, compile_unsupported_reason


@hookimpl
def flowseam_backend() -> BackendInfo:
    # The device name is flowseam's, not torch's: "accel" runs on whatever torch_device() picked.
    # Priority 50: preferred over cpu (0), below a dedicated vendor backend such as cuda (100).
    return BackendInfo(device="accel", priority=50,
                       description="torch.compile'd DiT blocks and fused solver kernels on the best "
                                   "torch device of the host")


@hookimpl
def flowseam_backend_available() -> Availability:
    reason = compile_unsupported_reason()
    return Availability(not reason, reason)


@hookimpl
def flowseam_arch_chain() -> list[str]:
    return list(arch_chain())


@hookimpl
def flowseam_register_kernels() -> list[KernelRegistration]:
    # Two rungs on purpose. flow_match_step is written for any device ("generic"), so a lookup
    # walks the whole chain (x86_64-avx512 -> x86_64-avx2 -> x86_64 -> generic) before it finds
    # it; flow_sde_step is registered at the most specific rung of this host, a direct hit.
    # (inductor generates the SIMD code of the host, so either registration is honest.)
    # accel registers no attention kernel, neither plain nor cached (the causal loop's), and no
    # unipc_step: those ops fall back to cpu's (eager torch on accel's
    # tensors), visibly in platform.explain(). It does fuse the causal loop's re-noising step
    # (generic rung).
    return [
        KernelRegistration(ops.FLOW_MATCH_STEP, kernels.flow_match_step, arch="generic"),
        KernelRegistration(ops.FLOW_SDE_STEP, kernels.flow_sde_step, arch=arch_chain()[0]),
        KernelRegistration(ops.FLOW_RENOISE, kernels.flow_renoise, arch="generic"),
    ]


@hookimpl
def flowseam_component_kinds() -> tuple[str, ...]:
    # No "text_encoder" on purpose: it falls back to cpu, visibly in platform.explain(). No
    # "vae" either: cpu's eager oneDNN VAE compiles nothing (see components).
    return tuple(components.BUILDERS)


@hookimpl
def flowseam_conformance_expectations() -> ConformanceExpectations:
    """accel's promise, stated independently of its declarations so that the conformance suite
    catches a change to either: the dit is built here; the vae, text encoders (and the other
    kinds, LTX-2's connectors, audio VAE, vocoder and latent upsampler among them) fall back to
    cpu."""
    return ConformanceExpectations(overrides=("dit",),
                                   falls_back=("vae", "text_encoder", "tokenizer", "image_encoder",
                                               "image_processor", "text_connectors", "audio_vae",
                                               "vocoder", "latent_upsampler"))


@hookimpl
def flowseam_build_component(kind: str, spec: ComponentSpec, device: str):
    """``dit`` in float32 on accel's torch device, its repeated blocks compiled in place (see
    :mod:`flowseam_accel.components`); None for any other kind (the platform moves on to cpu)."""
    builder = components.BUILDERS.get(kind)
    return builder(spec) if builder is not None else None

