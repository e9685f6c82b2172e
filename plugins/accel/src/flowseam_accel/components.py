"""accel's component builders: the real diffusers classes, in float32 on accel's torch device,
compiled in place.

``dit`` (``WanTransformer3DModel``, ``FluxTransformer2DModel``, ...)
    Regional compilation (torch's recipe, the same choice as diffusers'
    ``ModelMixin.compile_repeated_blocks``): every block whose class the model lists in
    ``_repeated_blocks`` (``WanTransformerBlock``; ``FluxTransformerBlock`` and
    ``FluxSingleTransformerBlock``) is compiled in place with ``nn.Module.compile`` (see
    :func:`flowseam_accel.compiled.compile_module`). The blocks of one class share their
    ``forward`` code, and with torch's default ``inline_inbuilt_nn_modules`` their parameters
    are graph inputs, so dynamo traces and inductor compiles one block and every other block
    reuses its graphs: the compile cost no longer grows with the depth of the model, and a new
    input shape costs one block's graphs. The embeddings, the output head and the attention
    processors (which :mod:`flowseam.attention` keeps eager, between a block's graphs) run
    eagerly, as they do in diffusers' own regional compilation. A DiT without
    ``_repeated_blocks`` is compiled whole. Either way the model stays the same object of the
    same class, with its ``config``, parameters and attention processors, and loops call it as
    before. Compile and run seconds are booked per block class (``"dit:transformer.WanTransformerBlock"``).

``vae`` (``AutoencoderKLWan``, ``AutoencoderKL``, ...)
    A diffusers VAE is used through ``encode()`` / ``decode()``, never ``forward()``, so compiling
    the top-level module would compile nothing that runs. Its heavy work lives in two submodules,
    ``vae.encoder`` and ``vae.decoder`` (all the convolutions, norms and attention); those are
    compiled in place, and the Python around them stays eager: diffusers' frame-chunking loop,
    tiling and slicing, the ``DiagonalGaussianDistribution``, the quant convs, the clamp. The
    public API is untouched.

    The Wan VAE calls its encoder once per chunk of frames and threads a causal-conv cache
    (a list of tensors, ``None`` at the first chunk) between calls; dynamo guards on that list, so
    each submodule compiles once per *cache state*: the first chunk, the second chunk (a one-frame
    cache) and the steady state (two frames). That is at most three graphs per shape, reused for
    every later chunk, video and VAE instance of the same config.

Other kinds are not declared (see :func:`flowseam_accel.plugin.flowseam_component_kinds`) and
fall back to cpu; ``text_encoder`` is left out on purpose, so that fallback is exercised.

The DiT's blocks are compiled with ``dynamic=True`` (the VAE's encoder and decoder stay
``dynamic=False``, one graph per shape and cache state: inductor fails to lower the Wan VAE's
causal conv3d with symbolic sizes): sizes are symbols in the graph, so one graph
serves every resolution, frame count and text length, and a given shape always runs the same
graph (serve and rollout are numerically the same, the first run and the hundredth alike). torch
still specializes sizes 0 and 1, so a batch of one (CFG off, or a single sample) compiles its
own graphs once, next to those of larger batches. With ``dynamic=False`` every new shape was
a new compile of every graph, and a conformance run, which tries many shapes, reached dynamo's
``recompile_limit`` (8 per function, after which new shapes run eagerly); ``dynamic=None``
(torch's automatic dynamic shapes) would swap a shape's specialized graph for a dynamic one
after the second shape, so the same request could give different bits before and after.
"""

from __future__ import annotations

import torch
from flowseam import ComponentSpec
from flowseam.components import instantiate

from .compiled import compile_module
from .device import torch_device

_COMPILE_OPTIONS = {"dynamic": True}
#: The VAE stays shape-specialized: inductor 2.13 fails to lower the Wan VAE's causal conv3d with
#: symbolic sizes (ValueRangeError on the padded input, seen on the wan2.1-i2v encoder).
_VAE_COMPILE_OPTIONS = {"dynamic": False}

#: The submodules of a diffusers VAE that do its work; compiled where present.
VAE_SUBMODULES = ("encoder", "decoder")


def build_dit(spec: ComponentSpec) -> torch.nn.Module:
    """``spec``'s transformer in float32 on accel's device, its repeated blocks compiled in place
    (see :func:`compile_repeated_blocks`)."""
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    return compile_repeated_blocks(module, f"dit:{spec.name}")


def compile_repeated_blocks(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Compile in place every submodule of ``module`` whose class name is in
    ``module._repeated_blocks``, each timed under ``"<name>.<class name>"``; ``module`` itself,
    timed under ``name``, when it lists no repeated block or none is found.

    :returns: ``module`` (the same object).
    """
    repeated = set(getattr(module, "_repeated_blocks", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in repeated]
    if not blocks:
        return compile_module(module, name, **_COMPILE_OPTIONS)
    for block in blocks:
        compile_module(block, f"{name}.{type(block).__name__}", **_COMPILE_OPTIONS)
    return module


def build_vae(spec: ComponentSpec) -> torch.nn.Module | None:
    """``spec``'s autoencoder in float32 on accel's device with ``encoder`` and ``decoder``
    compiled in place; None (decline, so cpu builds it) for a VAE class without either."""
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    parts = [name for name in VAE_SUBMODULES if isinstance(getattr(module, name, None), torch.nn.Module)]
    if not parts:
        return None
    for name in parts:
        compile_module(getattr(module, name), f"vae:{spec.name}.{name}", **_VAE_COMPILE_OPTIONS)
    return module


BUILDERS = {"dit": build_dit, "vae": build_vae}
