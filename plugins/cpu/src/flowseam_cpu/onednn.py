"""Convolutions through oneDNN on the CPU, for the components the cpu backend builds (the Wan VAE:
:mod:`flowseam_cpu.wan_vae`; LTX-2's video VAE and latent upsampler: :mod:`flowseam_cpu.ltx2`).

For a batch of one with a small ``N * C * D * H`` (at most 20480: torch's ``use_mkldnn``
heuristic in ``aten/src/ATen/native/Convolution.cpp``), which is every convolution of a small
decode, ``nn.Conv3d`` and ``nn.Conv2d`` pick torch's native im2col kernels
(``aten::slow_conv3d_forward``, ``aten::_slow_conv2d_forward``) over oneDNN's, and those are
slow there (figures: docs/benchmarks.md, "The cpu backend's kernels").
:func:`convolutions_on_onednn` makes them call ``aten::mkldnn_convolution`` directly, which
differs from the native kernel by float rounding only. At real sizes (``N * C * D * H`` > 20480)
torch already chooses oneDNN, so nothing changes there.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _conv_forward_onednn(self: torch.nn.Conv2d | torch.nn.Conv3d, input: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.Conv2d``/``nn.Conv3d``'s ``_conv_forward`` through ``aten::mkldnn_convolution`` for
    float32 CPU inputs when gradients are off (decode, encode, upsampling under
    ``torch.no_grad``); a ``padding_mode`` other than ``"zeros"`` (LTX-2's decoder pads
    ``"reflect"``) pads first with ``F.pad``, as ``nn.Conv3d._conv_forward`` does. Any other call
    runs the class's own ``_conv_forward``."""
    if (input.device.type == "cpu" and input.dtype == torch.float32
            and weight.dtype == torch.float32 and not isinstance(self.padding, str)
            and not torch.is_grad_enabled()):
        padding = self.padding
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * len(self.padding)
        return torch.ops.aten.mkldnn_convolution(input, weight, bias, padding, self.stride,
                                                 self.dilation, self.groups)
    return type(self)._conv_forward(self, input, weight, bias)


def convolutions_on_onednn(module: torch.nn.Module) -> int:
    """Route every ``nn.Conv2d`` and ``nn.Conv3d`` of ``module`` through oneDNN (for float32
    CPU inputs with gradients off: :func:`_conv_forward_onednn`), in place; weights, config and
    classes are unchanged.

    :returns: how many convolutions were routed.
    """
    routed = 0
    for sub in module.modules():
        if isinstance(sub, (torch.nn.Conv2d, torch.nn.Conv3d)):
            sub._conv_forward = types.MethodType(_conv_forward_onednn, sub)
            routed += 1
    return routed
