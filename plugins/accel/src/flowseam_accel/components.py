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

    A block's call without gradients (generation, serving, RL rollouts) runs an AOTInductor
    package of the block instead (:mod:`flowseam_accel.aot`): the same computation, compiled
    ahead of time with the parameters as inputs, the attention projections and RoPE inside, and
    only the platform's attention kernel and the text keys/values reused across steps called
    back eagerly, cached on disk, so a later process loads it in milliseconds instead of tracing the block
    with dynamo (the warm-cache start in ``bench/backends.py --cold``). Calls with gradients (a
    trainer's recompute), adapters (peft layers), hooks, stateful attention processors (the
    causal KV cache) or a non-CPU device take the ``torch.compile`` path described above.

``vae`` is not built here: it falls back to cpu
    accel compiled a VAE's ``encoder`` and ``decoder`` until 2026-12 and stopped. The Wan VAE's
    causal conv3d does not lower with symbolic sizes, so those graphs were shape-specialized,
    and the causal-conv cache (a list of tensors threaded between per-chunk calls) made every
    cache state a graph of its own: four signatures per video shape, 676 s of a 782 s cold start
    on two CPU cores and 54 s of a warm-cache start, again for every new frame count. cpu's
    eager build runs its convolutions on oneDNN (``flowseam_cpu.wan_vae``) and has nothing to
    compile (accel/cpu with it: ``bench/backends.py``, in the README's benchmark table).
    Measured again on 2026-12-02 (``bench/vae_compile.py``, ``bench/backends.py``'s VAE, one
    thread, load 2.0): ``torch.compile`` of ``decode`` is slower than cpu's eager build (242 vs
    148 ms) after 294 CPU s of compiling; with inductor's ``freezing`` (weights folded in,
    prepacked for oneDNN) it is faster (85 vs 181 ms) after 255 CPU s, again for every new frame
    count. That would take ~100 ms off a ~470 ms accel generation at four times the 60 s
    cold-start budget, so it stays off. So
    ``vae`` is not among :func:`flowseam_accel.plugin.flowseam_component_kinds`; the platform
    builds it on cpu and records the fallback (``platform.explain()``, ``model.provenance()`` says "(fallback)").
    On a CUDA host that keeps the VAE on the CPU, next to the text encoder; a GPU backend that
    wants the VAE on the device builds it itself (flowseam-cuda does).

Other kinds are not declared (see :func:`flowseam_accel.plugin.flowseam_component_kinds`) and
fall back to cpu; ``text_encoder`` is left out on purpose, so that fallback is exercised.

The DiT's blocks are compiled with ``dynamic=True``: sizes are symbols in the graph, so one graph
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

from . import aot
from .compiled import compile_module
from .device import torch_device

_COMPILE_OPTIONS = {"dynamic": True}


def build_dit(spec: ComponentSpec) -> torch.nn.Module:
    """``spec``'s transformer in float32 on accel's device, its repeated blocks compiled in place
    (see :func:`compile_repeated_blocks`)."""
    aot.enabled()  # a bad FLOWSEAM_ACCEL_AOT is refused before the weights load
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
    use_aot = aot.enabled()
    packages: dict[type, aot.Packages] = {}  # shared by the blocks of a class
    for block in blocks:
        entry = f"{name}.{type(block).__name__}"
        timed = compile_module(block, entry, **_COMPILE_OPTIONS)._compiled_call_impl
        if use_aot:
            shared = packages.setdefault(type(block), aot.Packages())
            timed.fn = aot.dispatcher(block, entry, shared, timed.fn)
    return module


BUILDERS = {"dit": build_dit}
