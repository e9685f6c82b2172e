"""GRPO on a language model's sampled tokens (the prompt-refiner side of ``unified_rl``).

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3): for each sampled sequence ``o_i`` with advantage
``A_i`` and each of its tokens ``t``, the PPO clipped term
``min(r A_i, clip(r, 1 - ε, 1 + ε) A_i)`` with ``r = π_θ(o_t | ·) / π_old(o_t | ·)``, minus
``β`` × the per-token KL to a frozen reference, estimated as
``π_ref/π_θ - log(π_ref/π_θ) - 1`` (their eq. 4); averaged over the tokens of a sequence, then
over the sequences. ``π_old`` is the behaviour log-prob the rollout stored
(:class:`flowseam.prompt_refiner.RefinerRollout`), so on the first inner epoch every ratio is 1
(C2).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import FlowseamError
from ..prompt_refiner import PromptRefiner, RefinerRollout
from .config import ConfigSection, NonNegativeFloat, PositiveFloat, PositiveInt
from .grpo import UpdateStats

class LMGRPOConfig(ConfigSection):
    """GRPO hyper-parameters of the language model (the ``[lm_grpo]`` table), typed and
    range-checked like every config section (:mod:`flowseam.training.config`).

    :param clip_range: PPO ratio clip ε > 0 (DeepSeekMath's 0.2).
    :param adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]``; > 0.
    :param beta: coefficient of the per-token KL to the frozen initial LM, >= 0 (0: no reference).
    :param inner_epochs: PPO epochs (one optimizer step each) over each batch of rewrites, >= 1.
    :param max_grad_norm: gradient clipping, > 0.
    :param eps: added to the group std of the advantages, > 0.
    """

    clip_range: PositiveFloat = 0.2
    adv_clip_max: PositiveFloat = 5.0
    beta: NonNegativeFloat = 0.0
    inner_epochs: PositiveInt = 1
    max_grad_norm: PositiveFloat = 1.0
    eps: PositiveFloat = 1e-4


def lm_grpo_update(refiner: PromptRefiner, policy: torch.nn.Module, reference: torch.nn.Module | None,
                   rollout: RefinerRollout, advantages: torch.Tensor, trained: torch.Tensor,
                   optimizer: torch.optim.Optimizer, cfg: LMGRPOConfig,
                   after_step: Callable[[], None] | None = None) -> UpdateStats:
    """GRPO update of ``policy`` (the trainer's copy of the refiner's LM) on ``rollout``.

    The whole rollout batch is recomputed in one forward, exactly as it was sampled (the same
    rows, buffer, mask and position ids: :meth:`PromptRefiner.token_log_probs`); rows that are
    not trained weigh 0. Per inner epoch one optimizer step, then ``after_step()`` (a
    WeightSyncPlan's sync). With no trained row nothing is updated.

    :param advantages: ``(B,)`` one advantage per rewrite.
    :param trained: ``(B,)`` bool: the rows to learn from (their group had a finite reward and
        a non-zero spread).
    :returns: per-token ratios (all epochs, and the first epoch's), clip fractions, approximate
        KL ``0.5 E[(log r)²]``, KL to the reference and gradient norms (before clipping), of the
        trained rows' sampled tokens.
    """
    stats = UpdateStats()
    mask = rollout.completion_mask
    rows = trained.bool() & mask.any(dim=1)
    if not bool(rows.any()):
        return stats
    counted = mask & rows[:, None]
    token_weight = mask.float() / mask.float().sum(dim=1, keepdim=True).clamp(min=1.0)
    row_weight = rows.float() / rows.float().sum()
    adv = advantages.float()[:, None]
    old = rollout.log_probs
    trainable = [p for p in policy.parameters() if p.requires_grad]
    for epoch in range(cfg.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        new = refiner.token_log_probs(rollout, lm=policy)
        log_ratio = torch.where(mask, new - old, torch.zeros_like(new))
        ratio = torch.exp(log_ratio)
        terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - cfg.clip_range, 1.0 + cfg.clip_range))
        if cfg.beta > 0 and reference is not None:
            with torch.no_grad():
                ref = refiner.token_log_probs(rollout, lm=reference)
            d = torch.where(mask, ref - new, torch.zeros_like(new))
            kl = torch.exp(d) - d - 1.0
            terms = terms + cfg.beta * kl
            stats.kl_ref.append(float(kl.detach()[counted].mean()))
        loss = ((terms * token_weight).sum(dim=1) * row_weight).sum()
        if not torch.isfinite(loss):
            raise FlowseamError(f"the language model's GRPO loss is {float(loss)} at inner epoch "
                                f"{epoch}: the refiner produced non-finite log-probs")
        loss.backward()
        detached = ratio.detach()[counted]
        stats.ratios.append(detached)
        if epoch == 0:
            stats.first_epoch_ratios.append(detached)
        stats.clipped.append(float(((detached - 1.0).abs() > cfg.clip_range).float().mean()))
        stats.approx_kl.append(float(0.5 * (log_ratio.detach()[counted] ** 2).mean()))
        stats.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)))
        optimizer.step()
        if after_step is not None:
            after_step()
    return stats
