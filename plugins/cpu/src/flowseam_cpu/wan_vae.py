"""Two CPU speed-ups for diffusers' Wan VAE (``AutoencoderKLWan``), applied by the cpu backend
to every Wan VAE it builds. Both leave the module's weights, config and class unchanged and its
output the same to float rounding. They answer what ``bench/generate_vs_diffusers.py --profile``
names first for the VAE decode (the figures: docs/benchmarks.md, "The cpu backend's kernels"):

* **Convolutions through oneDNN** (:func:`flowseam_cpu.onednn.convolutions_on_onednn`): torch's
  CPU heuristic picks its slow native kernels for every causal conv of a small decode.
* **RMS norm as a sum of squares** (:func:`_rms_norm_forward`): ``WanRMS_norm`` calls
  ``F.normalize(x, dim=1)``, whose ``linalg_vector_norm`` over the channel dimension of an
  NCDHW tensor is slow on CPU; ``x * rsqrt(max(sum(x**2, dim), eps**2))`` is the same norm.
"""

from __future__ import annotations

import types

import torch

from .onednn import convolutions_on_onednn

_EPS_SQUARED = 1e-24  # F.normalize's eps (1e-12), squared: it bounds ||x||^2 instead of ||x||


def _rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``WanRMS_norm.forward`` as ``x * rsqrt(max(sum(x**2, dim), eps**2))``, which is
    ``F.normalize``'s ``x / max(||x||, eps)`` with ``eps = 1e-12``, then diffusers'
    ``* scale * gamma + bias``; equal to diffusers' to float rounding. Half-precision inputs are
    normalised in float32, as in diffusers."""
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dim = 1 if self.channel_first else -1
    scale = torch.rsqrt((work * work).sum(dim, keepdim=True).clamp_min(_EPS_SQUARED))
    return (work * scale).to(x.dtype) * self.scale * self.gamma + self.bias


def speed_up_wan_vae(vae: torch.nn.Module) -> torch.nn.Module:
    """Route ``vae``'s 3-D convolutions through oneDNN and compute its RMS norms as sums of
    squares (see the module docstring); returns ``vae`` itself, changed in place.

    A module other than diffusers' ``AutoencoderKLWan`` is returned untouched.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, WanRMS_norm

    if not isinstance(vae, AutoencoderKLWan):
        return vae
    convolutions_on_onednn(vae)
    for module in vae.modules():
        if isinstance(module, WanRMS_norm):
            module.forward = types.MethodType(_rms_norm_forward, module)
    return vae
