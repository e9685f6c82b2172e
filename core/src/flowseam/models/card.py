"""ModelCard: the declarative description of one model family — the pipeline class it reads in
``model_index.json``, its components, DiT experts, loop, defaults, validation rules and what it
supports of splitting a generation over ranks. A card is data; its :class:`~flowseam.models.
instance.ModelInstance` subclass implements the step bodies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..request import TaskType
from ..schedulers import EULER, SolverConfig, resolve_solver
from .split import SplitSupport


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a card: its folder/name in the checkpoint and its kind.

    :param required: False for a component the card can run without (its ``purpose`` says what
        needs it).
    :param cls: the class that loads the component when ``model_index.json`` does not declare it
        (``"diffusers.pipelines.ltx2.LTX2LatentUpsamplerModel"``: LTX-2's converter writes the
        latent upsampler into its own ``latent_upsampler/`` folder, outside the pipeline);
        None: only a component ``model_index.json`` declares is loaded.
    :param purpose: what needs an optional component (shown when it is missing).
    """

    name: str
    kind: str
    required: bool = True
    cls: str | None = None
    purpose: str = ""


@dataclass(frozen=True)
class ModelCard:
    """A declarative description of one model.

    :param name: the card's id (``"wan2.1-t2v"``).
    :param pipeline_class: the ``_class_name`` in ``model_index.json`` that selects this card.
    :param tasks: the tasks it serves.
    :param components: its components in load order.
    :param loops: the loops it runs (``"flow_match"``, with SERVE and ROLLOUT profiles).
    :param defaults: default :class:`DiffusionParams` values (the request's; none of them is a
        scheduler setting: those come from the checkpoint).
    :param rules: the validation rules, in words (shown by errors and docs).
    :param instance: the :class:`ModelInstance` subclass implementing its step bodies.
    :param experts: the component names of its DiT experts, high-noise first.
    :param default_scheduler: the scheduler class when the checkpoint has no scheduler config.
    :param scheduler_defaults: scheduler class → key → value, applied only to keys the
        checkpoint's ``scheduler_config.json`` leaves out (source ``"card default"``).
    :param passes_mu: whether the card's diffusers pipeline passes the resolution-dependent
        ``mu`` that dynamic shifting needs (FluxPipeline yes, WanPipeline no).
    :param pipeline_options: ``model_index.json`` keys that configure the pipeline rather than
        name a component (``boundary_ratio``), with the values the card accepts checked at load.
    :param solver_from_scheduler: whether the checkpoint's scheduler decides the solver (False
        for a loop with its own sampler, such as the causal one; its scheduler is then reported
        as not used, and the instance describes its sampler in :meth:`ModelInstance.solver_line`).
    :param audio: whether it makes sound (``LoopResult.audio``), as LTX-2 does.
    :param split: what it supports of splitting one generation over ranks (sequence and CFG
        parallelism); by default nothing.
    """

    name: str
    pipeline_class: str
    tasks: tuple[TaskType, ...]
    components: tuple[ComponentEntry, ...]
    defaults: dict[str, Any]
    rules: tuple[str, ...]
    instance: type  # the ModelInstance subclass
    loops: tuple[str, ...] = ("flow_match",)
    experts: tuple[str, ...] = ("transformer",)
    default_scheduler: str = EULER
    scheduler_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    passes_mu: bool = False
    pipeline_options: tuple[str, ...] = ()
    solver_from_scheduler: bool = True
    audio: bool = False
    split: SplitSupport = SplitSupport()

    @property
    def task(self) -> TaskType:
        return self.tasks[0]

    def resolve_solver(self, scheduler_config: Mapping[str, Any] | None, *,
                       file: str = "scheduler/scheduler_config.json",
                       ignore: Iterable[str] = (), index_class: str | None = None) -> SolverConfig:
        """This card's solver for a checkpoint's scheduler config (:func:`flowseam.schedulers.
        resolve_solver` with the card's defaults). :raises FlowseamError: for what it refuses."""
        return resolve_solver(scheduler_config, card=self.name,
                              default_class=self.default_scheduler,
                              card_defaults=self.scheduler_defaults, passes_mu=self.passes_mu,
                              file=file, ignore=ignore, index_class=index_class)
