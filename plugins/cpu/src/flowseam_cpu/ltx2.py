"""A CPU speed-up for LTX-2's video VAE (``AutoencoderKLLTX2Video``) and latent upsampler
(``LTX2LatentUpsamplerModel``), applied by the cpu backend to every one it builds (kinds ``vae``
and ``latent_upsampler``): their ``nn.Conv3d``/``nn.Conv2d`` run through oneDNN
(:mod:`flowseam_cpu.onednn`). Weights, config and classes are unchanged.

``bench/ltx2_vs_diffusers.py --profile`` names ``aten::slow_conv3d_forward`` for them (torch 2.13,
one thread): the decoder's and the upsampler's convolutions of a small two-stage run, e.g.
``(1, 8, 19, 34, 34)`` with 8 output channels, 3x3x3, are below torch's oneDNN threshold. The
frames equal diffusers' within float rounding (the parity tests in ``tests/test_ltx2.py``).
"""

from __future__ import annotations

import torch

from .onednn import convolutions_on_onednn


def speed_up_ltx2(kind: str, built: torch.nn.Module) -> torch.nn.Module:
    """``built`` (a component of ``kind``) with its convolutions on oneDNN when it is LTX-2's
    video VAE or latent upsampler; any other module is returned untouched. Returns ``built``
    itself, changed in place."""
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    if (kind == "vae" and isinstance(built, AutoencoderKLLTX2Video)) or (
            kind == "latent_upsampler" and isinstance(built, LTX2LatentUpsamplerModel)):
        convolutions_on_onednn(built)
    return built
