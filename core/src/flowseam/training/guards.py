"""Non-finite numbers stop a training run before they reach the weights or a checkpoint.

A NaN loss, reward-weighted loss or gradient makes :func:`clip_gradients` raise before the
optimizer steps (so the weights are still the last finite ones); weights that became non-finite
anyway (an overflow) make :func:`check_finite_weights` raise, which the shared outer loop calls
after every step and :class:`~flowseam.training.common.RunFiles` before writing a checkpoint. A
checkpoint therefore never holds NaN or infinite weights, and a resumed run starts from finite
ones.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..errors import FlowseamError


class NonFiniteTrainingError(FlowseamError):
    """A loss, gradient or weight of a training run is NaN or infinite; the run stopped before
    the optimizer step or checkpoint that would have kept it."""


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, what: str) -> float:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, refusing a non-finite total norm.

    :param what: where the gradients come from (``"flowgrpo step 3"``), for the message.
    :returns: the total norm before clipping, as a float.
    :raises NonFiniteTrainingError: if the norm is NaN or infinite (call it before
        ``optimizer.step()``: the weights then stay finite).
    """
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    value = float(getattr(norm, "full_tensor", lambda: norm)())  # a DTensor under FSDP2
    if not math.isfinite(value):
        raise NonFiniteTrainingError(
            f"{what}: the gradient norm is {value} (a non-finite loss or gradient); the run stops "
            "before the optimizer step, so no weight and no checkpoint holds it. Lower the "
            "learning rate, or check the reward and the data for NaN or infinite values")
    return value


def _all_finite(t: torch.Tensor) -> bool:
    ok = torch.isfinite(t.detach()).all()
    return bool(getattr(ok, "full_tensor", lambda: ok)())  # a DTensor shard under FSDP2


def check_finite_weights(modules: dict[str, torch.nn.Module], what: str) -> None:
    """Every trainable parameter of ``modules`` (name → module) must be finite.

    :raises NonFiniteTrainingError: naming the module and the first non-finite parameters.
    """
    for name, module in modules.items():
        bad = [n for n, p in module.named_parameters() if p.requires_grad and not _all_finite(p)]
        if bad:
            raise NonFiniteTrainingError(
                f"{what}: {len(bad)} trainable parameter(s) of {name!r} are not finite "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); the run stops and no "
                "checkpoint is written with them. Lower the learning rate")
