"""accel's hook implementations (contracts: :mod:`flowseam.seam.hookspecs`). flowseam imports this
module through the entry point ``accel = "flowseam_accel.plugin"`` and calls each hook once,
while plugins are discovered or a Platform is built, never during denoising. Nothing here fails
on a host without the hardware: :func:`flowseam_backend_available` says why it is unusable.
"""

from __future__ import annotations

from flowseam import ops
from flowseam.seam import (
    Availability,
    BackendInfo,
    ComponentSpec,
    ConformanceExpectations,
    KernelRegistration,
    hookimpl,
)

from . import components, kernels
from .device import arch_chain, compile_unsupported_reason, torch_device

#: accel's priority on a GPU (or MPS): above cpu (0), below a dedicated backend such as cuda (100).
PRIORITY_ON_A_GPU = 50
#: accel's priority where its torch device is the CPU: below cpu, so that ``Platform.detect()``
#: picks cpu and a first ``flowseam generate`` compiles nothing; ``Platform("accel")`` (or
#: ``--backend accel``) still selects accel.
PRIORITY_ON_THE_CPU = -10


@hookimpl
def flowseam_backend() -> BackendInfo:
    # The device name is flowseam's, not torch's: "accel" runs on whatever torch_device() picked.
    priority = PRIORITY_ON_THE_CPU if torch_device().type == "cpu" else PRIORITY_ON_A_GPU
    return BackendInfo(device="accel", priority=priority,
                       description="torch.compile'd DiT blocks, VAE and fused solver kernels on "
                                   f"torch device {torch_device()}")


@hookimpl
def flowseam_backend_available() -> Availability:
    reason = compile_unsupported_reason()
    return Availability(not reason, reason)


@hookimpl
def flowseam_arch_chain() -> list[str]:
    return list(arch_chain())


@hookimpl
def flowseam_register_kernels() -> list[KernelRegistration]:
    # Two rungs on purpose. flow_match_step and flow_renoise are written for any device
    # ("generic"), so a lookup walks the whole chain (x86_64-avx2 -> x86_64 -> generic) before it
    # finds them; flow_sde_step is registered at the most specific rung of this host, a direct
    # hit (inductor generates the host's SIMD code, so either is honest). No attention,
    # cached_attention or unipc_step: cpu's eager kernels serve them, shown in explain().
    # sequence_parallel_attention is accel's own, ring attention (cpu's is Ulysses' all-to-all):
    # a split generation on accel names accel's kernel in its provenance.
    return [
        KernelRegistration(ops.FLOW_MATCH_STEP, kernels.flow_match_step, arch="generic"),
        KernelRegistration(ops.FLOW_SDE_STEP, kernels.flow_sde_step, arch=arch_chain()[0]),
        KernelRegistration(ops.FLOW_RENOISE, kernels.flow_renoise, arch="generic"),
        KernelRegistration(ops.SEQUENCE_PARALLEL_ATTENTION, kernels.ring_attention,
                           arch="generic"),
    ]


@hookimpl
def flowseam_component_kinds() -> tuple[str, ...]:
    # ("dit", "vae"); no "text_encoder" on purpose: the cpu fallback runs wherever accel does.
    return tuple(components.BUILDERS)


@hookimpl
def flowseam_component_dtypes() -> dict[str, tuple[str, ...]]:
    # its compiled graphs are float32: a request for another dtype is refused before loading
    return {"dit": ("float32",), "vae": ("float32",)}


@hookimpl
def flowseam_conformance_expectations() -> ConformanceExpectations:
    """accel's promise, stated apart from its declarations so that the conformance suite catches
    a change to either: dit and vae are built here; the text encoders and every other kind
    (LTX-2's connectors, audio VAE, vocoder and latent upsampler among them) fall back to cpu."""
    return ConformanceExpectations(overrides=("dit", "vae"),
                                   falls_back=("text_encoder", "tokenizer", "image_encoder",
                                               "image_processor", "text_connectors", "audio_vae",
                                               "vocoder", "latent_upsampler"),
                                   torch_device=str(torch_device()))


@hookimpl
def flowseam_build_component(kind: str, spec: ComponentSpec, device: str):
    """``dit`` or ``vae`` in float32 on accel's torch device, compiled in place (see
    :mod:`flowseam_accel.components`); None for any other kind (the platform moves on to cpu)."""
    builder = components.BUILDERS.get(kind)
    return builder(spec) if builder is not None else None
