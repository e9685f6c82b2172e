"""accel's component builders: the real diffusers classes, in float32 on accel's torch device,
compiled in place.

``dit`` (``WanTransformer3DModel``, ``FluxTransformer2DModel``, ...)
    The whole module is compiled with ``nn.Module.compile`` (see
    :func:`flowseam_accel.compiled.compile_module`): it stays the same object of the same class,
    with its ``config``, parameters and attention processors, and loops call it as before.

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

Every component is compiled with ``dynamic=False``: one specialized graph per input shape, and
a given shape always runs the same graph (serve and rollout are numerically the same). Past
``torch._dynamo.config.recompile_limit`` distinct shapes (8 by default) dynamo runs new shapes
eagerly, with a warning.
"""

from __future__ import annotations

import torch
from flowseam import ComponentSpec
from flowseam.components import instantiate

from .compiled import compile_module
from .device import torch_device

_COMPILE_OPTIONS = {"dynamic": False}

#: The submodules of a diffusers VAE that do its work; compiled where present.
VAE_SUBMODULES = ("encoder", "decoder")


def build_dit(spec: ComponentSpec) -> torch.nn.Module:
    """``spec``'s transformer in float32 on accel's device, compiled in place."""
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    return compile_module(module, f"dit:{spec.name}", **_COMPILE_OPTIONS)


def build_vae(spec: ComponentSpec) -> torch.nn.Module | None:
    """``spec``'s autoencoder in float32 on accel's device with ``encoder`` and ``decoder``
    compiled in place; None (decline, so cpu builds it) for a VAE class without either."""
    module = instantiate(spec, device=str(torch_device()), dtype=torch.float32)
    parts = [name for name in VAE_SUBMODULES if isinstance(getattr(module, name, None), torch.nn.Module)]
    if not parts:
        return None
    for name in parts:
        compile_module(getattr(module, name), f"vae:{spec.name}.{name}", **_COMPILE_OPTIONS)
    return module


BUILDERS = {"dit": build_dit, "vae": build_vae}
