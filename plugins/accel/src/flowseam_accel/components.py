"""accel's component builders: the real diffusers classes, in float32 on accel's torch device,
compiled in place with ``torch.compile``.

In place (``nn.Module.compile``) means the object keeps its class, config, parameters, attention
processors and methods; only ``module(...)`` runs compiled code, so loops, adapters (LoRA
hot-swap) and the conformance suite call it exactly as they call cpu's build.
``copy.deepcopy`` (a trainer's policy copy) drops the compiled code: the copy runs eagerly.
The ``dit`` compiles its repeated blocks with dynamic shapes (:func:`compile_repeated_blocks`),
the ``vae`` its ``encoder`` and ``decoder`` with one graph per shape (:func:`build_vae`); each
function says why. Every other kind (``text_encoder`` on purpose, the image encoder, LTX-2's
connectors, audio VAE, vocoder and latent upsampler) is not declared and falls back to cpu,
which the platform records.
"""

from __future__ import annotations

import torch
from flowseam.seam import ComponentSpec, instantiate

from .compiled import time_methods
from .device import torch_device


def build_dit(spec: ComponentSpec) -> torch.nn.Module:
    """``spec``'s transformer (``WanTransformer3DModel``, ``FluxTransformer2DModel``,
    ``LTX2VideoTransformer3DModel``) in float32 on accel's device, its repeated blocks compiled
    in place (:func:`compile_repeated_blocks`), its ``forward`` timed as ``"dit:<name>"``
    (``compile_report``).

    :raises FlowseamError: from :func:`flowseam.seam.components.instantiate` (class or files).
    """
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    return compile_repeated_blocks(module, f"dit:{spec.name}")


def compile_repeated_blocks(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Compile in place every block of ``module`` listed in its ``_repeated_blocks`` (diffusers'
    ``compile_repeated_blocks``) and time ``module``'s calls under ``name``; a module without
    repeated blocks is compiled whole, untimed (the timer would be traced into the graph).

    Regional compilation (torch's recipe): the blocks of one class share their code and their
    parameters are graph inputs, so dynamo traces and inductor compiles one block and every
    other block of the class reuses its graphs: compile time does not grow with the depth of
    the model. The embeddings, the output head and the attention processors (kept eager by
    :mod:`flowseam.attention`, so every attention call still goes through the platform's
    ``attention`` kernel) run eagerly between them. ``dynamic=True``: one graph serves every
    resolution, frame count and text length, and a given shape always runs the same graph, so
    serve and rollout agree bit for bit (torch still specializes sizes 0 and 1: a batch of one
    compiles once more). torch's automatic dynamic shapes would swap a shape's specialized
    graph for a dynamic one after the second shape, and the same request could change its bits.

    :returns: ``module`` (the same object).
    """
    regional = getattr(module, "compile_repeated_blocks", None)  # a diffusers ModelMixin's
    try:
        if regional is None:
            raise ValueError(f"{type(module).__name__} is not a diffusers model")
        regional(dynamic=True)
    except ValueError:  # diffusers: no _repeated_blocks, or none of them in the model
        module.compile(dynamic=True)
        return module
    time_methods(module, ("forward",), name)
    return module


def build_vae(spec: ComponentSpec) -> torch.nn.Module | None:
    """``spec``'s autoencoder (``AutoencoderKLWan``, ``AutoencoderKL``,
    ``AutoencoderKLLTX2Video``) in float32 on accel's device, its ``encoder`` and ``decoder``
    compiled in place and its ``encode`` / ``decode`` timed as ``"vae:<name>.encode"`` /
    ``".decode"``; None (declined: cpu builds it) for a VAE class with neither submodule.

    A diffusers VAE is used through ``encode()`` and ``decode()``, whose work lives in
    ``encoder`` and ``decoder``; the Python around them (frame-by-frame loop, tiling, the latent
    distribution) stays eager. ``dynamic=False``, one graph per shape: inductor cannot lower the
    Wan VAE's causal ``Conv3d`` padding with symbolic sizes. The Wan VAE threads a causal-conv
    cache between its per-frame calls and dynamo guards on it, so a shape compiles once per
    cache state (first frame, second, steady) and later frames, videos and VAE instances of that
    config reuse those graphs.

    :raises FlowseamError: from :func:`flowseam.seam.components.instantiate` (class or files).
    """
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    parts = [p for p in (getattr(module, "encoder", None), getattr(module, "decoder", None))
             if isinstance(p, torch.nn.Module)]
    if not parts:
        return None
    for part in parts:
        part.compile(dynamic=False)
    time_methods(module, ("encode", "decode"), f"vae:{spec.name}")
    return module


BUILDERS = {"dit": build_dit, "vae": build_vae}
