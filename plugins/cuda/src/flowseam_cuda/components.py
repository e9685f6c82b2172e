"""The cuda backend's component builders: the real classes on the GPU.

``dit`` in bfloat16 (the solver kernels still do their arithmetic in float32); ``vae``,
``text_encoder`` and ``image_encoder`` in float32; ``spec.dtype`` overrides. Key decision:
weights are loaded on the CPU in the target dtype (``from_pretrained(torch_dtype=...)``), so no
float32 copy of a bf16 model is ever made and the model's ``_keep_in_fp32_modules`` (diffusers'
and transformers' list of numerically sensitive submodules, e.g. Wan's time embedder and norms)
stay float32; then they move to torch's current CUDA device
(:func:`flowseam_cuda.device.torch_device`). A component built from a config (no checkpoint) is
cast by :func:`cast_keeping_fp32_modules`, the same rule. Attention is not chosen here: flowseam
routes it through the platform's ``attention`` op (:mod:`flowseam_cuda.torch_kernels`).
Tokenizers and processors are not GPU objects; those kinds are left to cpu.
"""

from __future__ import annotations

import itertools

import torch
from flowseam.seam import ComponentSpec, instantiate

from .device import torch_device

#: Default dtype per kind, when the spec does not name one.
DEFAULT_DTYPES = {"dit": torch.bfloat16, "vae": torch.float32, "text_encoder": torch.float32,
                  "image_encoder": torch.float32}

KINDS = tuple(DEFAULT_DTYPES)

_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


def resolve_dtype(kind: str, spec: ComponentSpec) -> torch.dtype:
    """``spec.dtype`` if given, else the kind's default.

    :raises ValueError: naming ``spec.dtype`` when it is not a float dtype name.
    """
    if spec.dtype is None:
        return DEFAULT_DTYPES[kind]
    name = str(spec.dtype).removeprefix("torch.")
    if name not in _FLOAT_DTYPES:
        raise ValueError(f"component {spec.name!r}: dtype={spec.dtype!r} is not one of "
                         f"{sorted(_FLOAT_DTYPES)}")
    return _FLOAT_DTYPES[name]


def cast_keeping_fp32_modules(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``module``'s floating parameters and buffers to ``dtype``, except those inside a
    submodule named in ``module._keep_in_fp32_modules``, which become float32 (the rule of
    diffusers' and transformers' ``from_pretrained(torch_dtype=...)``; a plain
    ``module.to(bfloat16)`` would cast those modules too)."""
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if not tensor.is_floating_point():
            continue
        parts = name.split(".")
        target = torch.float32 if any(k in parts for k in keep) else dtype
        if tensor.dtype != target:
            tensor.data = tensor.data.to(target)
    return module


def build(kind: str, spec: ComponentSpec) -> torch.nn.Module | None:
    """Build ``spec`` as ``kind`` on the GPU in its dtype (table above); None for other kinds."""
    if kind not in DEFAULT_DTYPES:
        return None
    dtype = resolve_dtype(kind, spec)
    # loaded on the CPU in the target dtype (from_pretrained(torch_dtype=...): keep-in-float32
    # modules stay float32, no float32 copy first), then moved to the GPU
    module = instantiate(spec, device="cpu", dtype=dtype if spec.path is not None else None)
    if isinstance(module, torch.nn.Module):
        if spec.path is None:  # built from a config: cast as from_pretrained would have
            cast_keeping_fp32_modules(module, dtype)
        module = module.to(torch_device())
    return module
