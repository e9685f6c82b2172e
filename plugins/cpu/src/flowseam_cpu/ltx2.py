"""CPU speed-ups for LTX-2's components, applied by the cpu backend to every one it builds.
Weights, config and classes are unchanged; each is what ``bench/ltx2_vs_diffusers.py --profile``
names (torch 2.13, one thread), and the outputs equal diffusers' within float rounding (the
parity tests in ``tests/test_ltx2.py``, 1e-5):

* **Convolutions through oneDNN** (kinds ``vae`` and ``latent_upsampler``:
  ``AutoencoderKLLTX2Video``, ``LTX2LatentUpsamplerModel``; :mod:`flowseam_cpu.onednn`): the
  decoder's and the upsampler's convolutions of a small two-stage run, e.g.
  ``(1, 8, 19, 34, 34)`` with 8 output channels, 3x3x3, are below torch's oneDNN threshold and
  ran ``aten::slow_conv3d_forward``.
* **The DiT's tanh-approximate GELU as a sigmoid** (kind ``dit``,
  ``LTX2VideoTransformer3DModel``, its feed-forwards' ``GELU(approximate="tanh")``): torch's CPU
  kernel for ``F.gelu(x, approximate="tanh")`` is slow (2.5-3.9 ms for ``(2, 576, 512)``
  float32, 5 % of the bench's run, against 0.6 ms for the exact GELU). Here it is
  ``x * sigmoid(2u)`` with ``u = sqrt(2/pi) * (x + 0.044715 x^3)``, which is the same function
  (``0.5 * (1 + tanh(u)) = sigmoid(2u)``; the tanh form of Hendrycks & Gimpel, 2016) in 1.6 ms,
  within 5e-7 of the float64 value like torch's own kernel (4e-7). It runs with gradients on too,
  so a trainer's recompute (flowgrpo) computes the very velocity its rollout did.
"""

from __future__ import annotations

import math
import types

import torch

from .onednn import convolutions_on_onednn

_TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)


def _gelu_tanh_as_sigmoid(self: torch.nn.Module, gate: torch.Tensor) -> torch.Tensor:
    if self.approximate != "tanh" or gate.device.type != "cpu":
        return type(self).gelu(self, gate)
    if torch.is_grad_enabled() and gate.requires_grad:  # autograd needs the out-of-place form
        inner = (gate * gate * (0.044715 * _TWO_SQRT_2_OVER_PI) + _TWO_SQRT_2_OVER_PI) * gate
        return torch.sigmoid(inner) * gate
    inner = gate * gate
    inner.mul_(0.044715 * _TWO_SQRT_2_OVER_PI).add_(_TWO_SQRT_2_OVER_PI).mul_(gate)
    return inner.sigmoid_().mul_(gate)


def speed_up_ltx2(kind: str, built: torch.nn.Module) -> torch.nn.Module:
    """``built`` (a component of ``kind``) with the speed-ups above when it is LTX-2's DiT, video
    VAE or latent upsampler; any other module is returned untouched. Returns ``built`` itself,
    changed in place."""
    if "ltx2" not in type(built).__module__:  # not LTX-2's: no need to import its classes
        return built
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.models.activations import GELU
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    if (kind == "vae" and isinstance(built, AutoencoderKLLTX2Video)) or (
            kind == "latent_upsampler" and isinstance(built, LTX2LatentUpsamplerModel)):
        convolutions_on_onednn(built)
    elif kind == "dit" and isinstance(built, LTX2VideoTransformer3DModel):
        for module in built.modules():
            if isinstance(module, GELU):
                module.gelu = types.MethodType(_gelu_tanh_as_sigmoid, module)
    return built
