"""One model's generations split over several processes (:mod:`flowseam.parallel` has the layout,
the process groups and the split hooks).

A card declares what it supports (:class:`SplitSupport`, ``ModelCard.split``); ``flowseam.load``
checks a layout against it before any weights load and, on every rank, installs the split on the
loaded DiT experts (:meth:`ModelSplit.install`), which the model then holds as ``model.parallel``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from .. import ops
from ..attention import route_attention
from ..errors import InvalidInputError
from ..parallel import Parallel, ParallelGroups, SequenceSplit, check_split, takes_any_heads

if TYPE_CHECKING:  # pragma: no cover
    from ..request import DiffusionParams
    from ..seam.platform import Platform


@dataclass(frozen=True)
class SplitSupport:
    """What a card supports of splitting one generation over ranks.

    :param sequence: where its DiT splits and gathers its token sequence; None: its loop cannot
        be split (``--sp`` is refused with ``no_split_reason``).
    :param no_split_reason: why the sequence cannot be split.
    :param cfg_branches: whether it runs CFG as two branches (unconditional, conditional) that
        ``--cfg-parallel`` can put on two groups of ranks.
    :param no_cfg_reason: why it has no branches to put on other ranks.
    :param tokens: ``tokens(params, configs) -> (DiT tokens after patching, text tokens that join
        its self-attention or None)``; ``configs``: the DiT's (``"transformer"``) and the VAE's
        (``"vae"``) ``config.json``. Needed with a ``sequence``.
    """

    sequence: SequenceSplit | None = None
    no_split_reason: str = "its loop has no sequence split"
    cfg_branches: bool = False
    no_cfg_reason: str = "it runs one DiT pass per step"
    tokens: Callable[["DiffusionParams", Mapping[str, Mapping[str, Any]]],
                     tuple[int, int | None]] | None = None

    def __post_init__(self) -> None:
        if self.sequence is not None and self.tokens is None:
            raise ValueError("SplitSupport: a card that splits its sequence says how many tokens "
                             "a request makes (tokens=...)")

    def check_layout(self, parallel: Parallel, heads: Mapping[str, int], name: str,
                     any_heads: bool = False) -> None:
        """Refuse a layout this card cannot run, naming the numbers — from the DiT experts'
        ``config.json`` (``heads``: expert name → attention heads), so that it is refused before
        any weights load. ``any_heads``: the platform's ``sequence_parallel_attention`` takes
        heads ``sp`` does not divide (:func:`flowseam.parallel.takes_any_heads`).

        :raises InvalidInputError: a loop that cannot be split, heads that ``sp`` does not
            divide, or ``cfg`` on a model with no unconditional branch.
        """
        if parallel.sp > 1:
            if self.sequence is None:
                raise InvalidInputError(f"--sp {parallel.sp}: {name} cannot split its "
                                        f"sequence ({self.no_split_reason}); drop --sp")
            for expert, n in heads.items():
                check_split(parallel, heads=int(n), tokens=0, model=f"{name}'s {expert}",
                            any_heads=any_heads)
        if parallel.cfg and not self.cfg_branches:
            raise InvalidInputError(f"--cfg-parallel: {name} has no unconditional "
                                    f"branch to run on other ranks ({self.no_cfg_reason})")

    def check_request(self, parallel: Parallel, params: "DiffusionParams",
                      configs: Mapping[str, Mapping[str, Any]], name: str,
                      any_heads: bool = False) -> None:
        """Refuse a request (``params`` with the defaults filled) that ``parallel`` cannot split:
        tokens after patching (and text tokens that join the self-attention) that ``sp`` does not
        divide, step caching (its decisions would differ per rank), CFG parallelism without CFG.

        :param configs: the DiT's and the VAE's configs, as for :attr:`tokens` (read from
            ``config.json`` before any weights load, or the loaded ones).
        :raises InvalidInputError: naming the numbers.
        """
        if parallel.sp > 1 and self.sequence is not None:
            tokens, text_tokens = self.tokens(params, configs)
            check_split(parallel, heads=int(configs["transformer"]["num_attention_heads"]),
                        tokens=tokens, text_tokens=text_tokens, model=name, any_heads=any_heads)
        if params.cache is not None:
            raise InvalidInputError(
                f"cache={params.cache}: step caching decides per rank from local tokens; it is "
                "not implemented with --sp / --cfg-parallel (drop one)")
        if parallel.cfg and params.guidance_scale <= 1.0:
            raise InvalidInputError(
                f"--cfg-parallel: guidance_scale={params.guidance_scale} runs no unconditional "
                "branch (CFG needs guidance_scale > 1); drop --cfg-parallel")


class ModelSplit:
    """A loaded model whose every generation runs over ``layout.world_size`` ranks (this process
    is one): its DiT experts' token sequence split per the card's :class:`SplitSupport`, their
    self-attention through the platform's ``sequence_parallel_attention`` op, and with ``cfg``
    one CFG branch per group of ranks. Build it with :meth:`install` on every rank.

    :ivar groups: this rank's :class:`~flowseam.parallel.ParallelGroups`.
    """

    def __init__(self, groups: ParallelGroups, support: SplitSupport, name: str,
                 configs: Mapping[str, Mapping[str, Any]], attention: Any, any_heads: bool,
                 modules: set[int], hooks: set[Callable]) -> None:
        self.groups = groups
        self.support, self.name, self.configs = support, name, configs
        self._attention, self._any_heads = attention, any_heads
        self._modules, self._hooks = modules, hooks

    @classmethod
    def install(cls, layout: Parallel, support: SplitSupport, experts: Mapping[str, torch.nn.Module],
                platform: "Platform", name: str,
                configs: Mapping[str, Mapping[str, Any]]) -> "ModelSplit":
        """Split ``experts`` (every rank calls this, a collective: the process groups are created
        here), after checking ``layout`` against the card (:meth:`SplitSupport.check_layout`).

        :param configs: the DiT's and the VAE's configs (:meth:`SplitSupport.check_request`).
        :raises InvalidInputError: as :meth:`SplitSupport.check_layout`.
        :raises FlowseamError: when this process is not one of ``layout.world_size`` ranks.
        """
        any_heads = takes_any_heads(platform)
        support.check_layout(layout, {n: e.config.num_attention_heads for n, e in experts.items()},
                             name, any_heads)
        groups = ParallelGroups.create(layout)
        local = platform.kernels.get(ops.ATTENTION)
        hooks: set[Callable] = set()
        if layout.sp > 1:
            split_attention = functools.partial(
                platform.kernels.get(ops.SEQUENCE_PARALLEL_ATTENTION), group=groups.sp_group,
                attention=local)
            sequence = support.sequence

            def self_attention(q, k, v, attn_mask=None, scale=None):
                if attn_mask is not None:
                    raise InvalidInputError("sequence-parallel self-attention takes no mask")
                return split_attention(q, k, v, scale=scale)

            for expert in experts.values():
                hooks |= sequence.install(expert, groups)
                route_attention(expert, local, choose=lambda proc: local if sequence.is_cross(proc)
                                else self_attention)
        return cls(groups, support, name, configs, local, any_heads,
                   {id(e) for e in experts.values()}, hooks)

    @property
    def layout(self) -> Parallel:
        return self.groups.parallel

    @property
    def rank(self) -> int:
        return self.groups.rank

    def __str__(self) -> str:
        return f"{self.layout} (rank {self.rank})"

    def check(self, params: "DiffusionParams") -> None:
        """Refuse a request this split cannot run (:meth:`SplitSupport.check_request`).

        :raises InvalidInputError: naming the numbers.
        """
        self.support.check_request(self.layout, params, self.configs, self.name, self._any_heads)

    def agreed(self, step_callback: Callable | None) -> Callable:
        """The step callback every rank runs (:meth:`ParallelGroups.agreed`): when any rank's
        raises, every rank stops at that step."""
        return self.groups.agreed(step_callback)

    def runs_cfg_branches(self, dit: torch.nn.Module) -> bool:
        """Whether ``dit`` runs one CFG branch on this rank's group (the branches are then
        exchanged with :meth:`gather_branches`)."""
        return self.layout.cfg and self.is_split(dit)

    def cfg_branch(self) -> int:
        """This rank's CFG branch (0: unconditional, 1: conditional)."""
        return self.groups.cfg_rank

    def gather_branches(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """``[unconditional, conditional]`` velocities from this rank's one branch."""
        return self.groups.gather_branches(mine)

    def is_split(self, dit: torch.nn.Module) -> bool:
        """Whether ``dit`` runs split over the ranks (one of the model's own experts; a
        trainer's copy does not)."""
        return id(dit) in self._modules

    def unsplit_copy(self, module: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
        """``copy.deepcopy(module)`` running on one rank: a split DiT's copy loses the split
        hooks and attends with the platform's ``attention`` (a trainer's policy and reference
        copies: an update runs each sample's whole sequence on one rank). ``memo``: deepcopy's
        (tensors mapped to themselves are shared, not copied)."""
        clone = copy.deepcopy(module, memo)
        if self.is_split(module):
            SequenceSplit.remove_hooks(clone, self._hooks)
            route_attention(clone, self._attention)
        return clone
