"""CPU speed-ups for LTX-2's components, applied by the cpu backend to every one it builds.
Weights, config and classes are unchanged, and the outputs equal diffusers' within float
rounding (the parity tests in ``tests/test_ltx2.py``, 1e-5). Each answers what
``bench/ltx2_vs_diffusers.py --profile`` names (the figures: docs/benchmarks.md, "The cpu
backend's kernels"):

* **Convolutions through oneDNN** (kinds ``vae`` and ``latent_upsampler``;
  :mod:`flowseam_cpu.onednn`): the decoder's and the upsampler's convolutions of a small
  two-stage run are below torch's oneDNN threshold, where torch's own kernel is slow.
* **The DiT's tanh-approximate GELU as a sigmoid** (kind ``dit``): torch's CPU kernel for
  ``F.gelu(x, approximate="tanh")`` is slow; ``x * sigmoid(2u)`` is the same function
  (:func:`_gelu_tanh_as_sigmoid`). It runs with gradients on too, so a trainer's recompute
  (flowgrpo) computes the very velocity its rollout did.
"""

from __future__ import annotations

import math
import types

import torch

from .onednn import convolutions_on_onednn

_TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)


def _gelu_tanh_as_sigmoid(self: torch.nn.Module, gate: torch.Tensor) -> torch.Tensor:
    """diffusers ``GELU.gelu`` for ``approximate="tanh"`` on the CPU as ``gate * sigmoid(2u)``,
    ``u = sqrt(2/pi) * (gate + 0.044715 gate^3)``: the same function, since
    ``0.5 * (1 + tanh(u)) = sigmoid(2u)`` (the tanh form of Hendrycks & Gimpel, 2016), as close
    to the float64 value as torch's own kernel. In place without gradients, out of place when
    autograd records; any other GELU, or a tensor off the CPU, runs diffusers' own ``gelu``."""
    if self.approximate != "tanh" or gate.device.type != "cpu":
        return type(self).gelu(self, gate)
    if torch.is_grad_enabled() and gate.requires_grad:  # autograd needs the out-of-place form
        inner = (gate * gate * (0.044715 * _TWO_SQRT_2_OVER_PI) + _TWO_SQRT_2_OVER_PI) * gate
        return torch.sigmoid(inner) * gate
    inner = gate * gate
    inner.mul_(0.044715 * _TWO_SQRT_2_OVER_PI).add_(_TWO_SQRT_2_OVER_PI).mul_(gate)
    return inner.sigmoid_().mul_(gate)


def speed_up_ltx2(kind: str, built: torch.nn.Module) -> torch.nn.Module:
    """``built`` (a component of ``kind``) with the speed-ups above when it is LTX-2's DiT
    (``LTX2VideoTransformer3DModel``: its feed-forwards' ``GELU(approximate="tanh")``), video
    VAE (``AutoencoderKLLTX2Video``) or latent upsampler (``LTX2LatentUpsamplerModel``: their
    convolutions, e.g. ``(1, 8, 19, 34, 34)`` with 8 output channels, 3x3x3, in a small two-stage
    run, which torch ran with ``aten::slow_conv3d_forward``); any other module is returned
    untouched. Returns ``built`` itself, changed in place."""
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
