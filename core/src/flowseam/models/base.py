"""ModelCard (what a model is) and ModelInstance (a loaded model driven by the shared loop).

A card is declarative: the pipeline class it reads in ``model_index.json``, its components (name
in the checkpoint → component kind), its DiT experts, its loops, its defaults (request and
scheduler) and its validation rules. A :class:`ModelInstance` holds the components the platform
built for it and the solver its checkpoint's scheduler resolved to (:attr:`ModelInstance.solver`),
and implements the card-specific step bodies the shared loop (:mod:`flowseam.loops`) calls:
``check``, ``encode``, ``schedule``, ``prepare_latents``, ``velocity`` and ``decode``.

Experts. A model has one DiT (Wan2.1, FLUX.1) or several experts that split the denoising steps
between them by timestep (Wan2.2 A14B: ``transformer`` for the high-noise steps ``t >=
boundary_ratio * num_train_timesteps``, ``transformer_2`` for the rest, as diffusers'
``WanPipeline`` does). :attr:`ModelInstance.experts` maps their component names to the modules,
:meth:`ModelInstance.expert_at` says which one owns a timestep, every ``BehaviorRecord`` names the
expert that ran its step, and ``velocity(..., expert=name, dit=module)`` evaluates one expert
(with that expert's guidance scale), optionally with a trainer's copy of it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Mapping

import numpy as np
import torch

from .. import runner
from ..adapters import AdapterSet
from ..seam.components import compute_dtype
from ..errors import InvalidInputError
from ..noise import draw_noise  # noqa: F401  (re-exported: cards draw latents with it)
from ..request import DiffusionParams, GenerationRequest, TaskType
from ..schedulers import EULER, Schedule, SolverConfig, resolve_solver

if TYPE_CHECKING:  # pragma: no cover
    from ..parallel import Parallel
    from ..seam.platform import Platform


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
    """

    name: str
    pipeline_class: str
    tasks: tuple[TaskType, ...]
    components: tuple[ComponentEntry, ...]
    defaults: dict[str, Any]
    rules: tuple[str, ...]
    instance: type["ModelInstance"]
    loops: tuple[str, ...] = ("flow_match",)
    experts: tuple[str, ...] = ("transformer",)
    default_scheduler: str = EULER
    scheduler_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    passes_mu: bool = False
    pipeline_options: tuple[str, ...] = ()
    solver_from_scheduler: bool = True
    audio: bool = False

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


@dataclass
class Conditioning:
    """What the DiT is conditioned on for one request (card-specific fields in ``extra``)."""

    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: the text of a CFG batch per tuple of branches, concatenated once per condition, so every
    #: step hands the DiT the same tensor (:mod:`flowseam.step_constants`)
    batched_text: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False,
                                                              compare=False)


class ModelInstance:
    """A loaded model: components built through ``platform.build_component``.

    Subclasses implement the card-specific step bodies. Public entry point: :meth:`generate`.

    :ivar versions: weights version per component name; a WeightSyncPlan bumps it, and every cache
        keyed on weights (text embeddings) includes it.
    """

    card: ModelCard
    #: the component names of the denoiser, VAE and text encoder in this card's checkpoint
    DIT: ClassVar[str] = "transformer"
    #: an image-to-video card that takes a list of images, one per prompt, in one request (a
    #: batch of B first frames); the others take one image per request
    IMAGE_PER_SAMPLE: ClassVar[bool] = False
    #: where the DiT's token sequence is split and gathered for sequence parallelism
    #: (:class:`flowseam.parallel.SequenceSplit`); None: the card's loop cannot be split
    SEQUENCE_SPLIT: ClassVar[Any] = None
    #: why a card without :attr:`SEQUENCE_SPLIT` cannot be split (shown when ``--sp`` is refused)
    NO_SPLIT_REASON: ClassVar[str] = "its loop has no sequence split"

    def __init__(self, card: ModelCard, platform: "Platform", components: dict[str, Any],
                 path: Path | None, solver: SolverConfig | None, *,
                 scheduler_config: Mapping[str, Any] | None = None,
                 pipeline_config: Mapping[str, Any] | None = None) -> None:
        self.card = card
        self.platform = platform
        self.components = components
        self.path = path
        #: the resolved solver: scheduler class, op, settings and their sources (None for a card
        #: whose loop has its own sampler, ``ModelCard.solver_from_scheduler=False``)
        self.solver = solver
        #: the checkpoint's scheduler_config.json as read (None: the checkpoint has none)
        self.scheduler_config = dict(scheduler_config) if scheduler_config is not None else None
        #: the checkpoint's model_index.json (pipeline options such as ``boundary_ratio``)
        self.pipeline_config = dict(pipeline_config or {})
        self.versions: dict[str, int] = {name: 0 for name in components}
        self._text_cache: dict[tuple, Any] = {}
        #: name → ComponentRecord (where the platform built each component, and why there)
        self.component_records: dict[str, Any] = {}
        #: components model_index.json declares that this card does not load, with the reason
        self.unused_components: dict[str, str] = {}
        #: the checkpoint's own serving defaults (``flowseam.json``'s ``serve`` table)
        self.serve_defaults: dict[str, Any] = {}
        #: this rank's :class:`~flowseam.parallel.ParallelGroups` when one generation is split
        #: over several processes (:meth:`parallelize`), else None
        self.parallel = None
        self._parallel_modules: set[int] = set()
        self._split_hooks: set[Any] = set()
        #: name → (kind, ComponentSpec) of every built component (:func:`flowseam.load`), to
        #: build a released one again
        self.component_specs: dict[str, tuple[str, Any]] = {}
        #: ``flowseam.load``'s memory options (:class:`flowseam.memory.MemoryOptions`)
        self.memory: Any = None
        self._execution_device: torch.device | None = None

    def provenance(self, solver: bool = True) -> str:
        """One line: where each component (device/plugin, dtype) and each kernel (its
        implementation id) came from — whatever fell back past the platform's first device is
        marked ``(fallback)`` — and (``solver=True``) the solver with its schedule settings and
        where each came from."""
        kinds = ("dit", "vae", "text_encoder", "image_encoder", "text_connectors", "audio_vae",
                 "vocoder", "latent_upsampler")
        first = self.platform.device_chain[0]
        comps = ", ".join(f"{n}={r.device}/{r.plugin} {r.dtype or '-'}"
                          f"{' (fallback)' if r.fallback else ''}"
                          for n, r in self.component_records.items() if r.kind in kinds)
        kern = ", ".join(f"{op}={k.impl_id}{' (fallback)' if k.provenance.device != first else ''}"
                         for op, k in self.platform.kernels.resolved().items())
        line = f"[{self.card.name}] components: {comps}; kernels: {kern}"
        if self.parallel is not None:
            line += f"; parallel: {self.parallel.parallel} (rank {self.parallel.rank})"
        if self.unused_components:
            line += "; not loaded: " + ", ".join(f"{n} ({why})"
                                                 for n, why in self.unused_components.items())
        return line + (f"; {self.solver_line()}" if solver else "")

    def solver_line(self) -> str:
        """One line: the solver, its schedule settings and where each came from (the load line,
        also in :meth:`provenance`)."""
        return self.solver.describe()

    # -- solver and experts --------------------------------------------------------------------
    def schedule(self, params: DiffusionParams, latents: torch.Tensor) -> Schedule:
        """The request's schedule: the checkpoint's solver with the request's overrides
        (:meth:`SolverConfig.for_request`), its sigmas and DiT timesteps computed by the
        diffusers scheduler class as the card's pipeline calls it (:meth:`timestep_args`)."""
        solver = self.solver.for_request(params)
        sigmas, timesteps = solver.timesteps(params.num_steps, device=latents.device,
                                             **self.timestep_args(params, latents, solver))
        return Schedule(sigmas, timesteps, solver)

    def timestep_args(self, params: DiffusionParams, latents: torch.Tensor,
                      solver: SolverConfig) -> dict[str, Any]:
        """The extra ``set_timesteps`` arguments of the card's pipeline (custom ``sigmas``,
        ``mu``); none by default (``set_timesteps(num_steps)``, as WanPipeline calls it)."""
        return {}

    def with_scheduler(self, overrides: Mapping[str, Any], *,
                       ignore: Iterable[str] = ()) -> "ModelInstance":
        """This model with its scheduler config changed, sharing every component (no reload):
        the analogue of ``pipe.scheduler = X.from_config(pipe.scheduler.config, **overrides)``.

        :param overrides: ``scheduler_config.json`` keys to set; with a different
            ``"_class_name"`` the checkpoint's keys the new class does not have are dropped (as
            ``from_config`` drops them). Their source reads ``"override"``.
        :raises FlowseamError: for options flowseam does not implement (as at load).
        """
        import inspect

        import diffusers

        base = dict(self.scheduler_config or {})
        cls_name = overrides.get("_class_name", base.get("_class_name"))
        if cls_name != base.get("_class_name") and hasattr(diffusers, str(cls_name)):
            keys = inspect.signature(getattr(diffusers, cls_name).__init__).parameters
            base = {k: v for k, v in base.items() if k in keys or k.startswith("_")}
        raw = {**base, **overrides}
        solver = self.card.resolve_solver(raw, file=f"{self.solver.file} (with overrides)",
                                          ignore=ignore)
        sources = {k: ("override" if k in overrides else v) for k, v in solver.sources.items()}
        clone = copy.copy(self)
        clone.solver = SolverConfig(solver.scheduler_class, solver.config, sources,
                                    solver.ignored, solver.file)
        clone.scheduler_config = raw
        return clone

    @property
    def adapters(self) -> "AdapterSet":
        """The model's LoRA adapters (:class:`flowseam.adapters.AdapterSet`): read once, switched
        per request by the loop (``DiffusionParams.lora``)."""
        if getattr(self, "_adapters", None) is None:
            self._adapters = AdapterSet(self)
        return self._adapters

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """The DiT experts, high-noise first: component name → module (one for Wan2.1/FLUX.1)."""
        return {name: self.components[name] for name in self.card.experts if name in self.components}

    @property
    def boundary_timestep(self) -> float | None:
        """``boundary_ratio * num_train_timesteps`` for a two-expert model (diffusers'
        WanPipeline): ``transformer`` runs the steps whose timestep is >= it, ``transformer_2``
        the others. None for a one-expert model."""
        ratio = self.pipeline_config.get("boundary_ratio")
        if ratio is None or len(self.card.experts) < 2:
            return None
        return float(ratio) * self.solver.num_train_timesteps

    def expert_at(self, timestep: torch.Tensor | float) -> str:
        """The component name of the expert that denoises at ``timestep`` (a scalar or the
        first element of a ``(B,)`` tensor), compared as diffusers compares it
        (``t >= boundary_timestep``)."""
        boundary = self.boundary_timestep
        if boundary is None:
            return self.card.experts[0]
        t = timestep.reshape(-1)[0] if torch.is_tensor(timestep) else torch.tensor(float(timestep))
        return self.card.experts[0] if bool(t >= boundary) else self.card.experts[1]

    def guidance_for(self, expert: str, params: DiffusionParams) -> float:
        """The guidance scale of ``expert``: ``guidance_scale`` for the first (high-noise)
        expert, ``guidance_scale_2`` (default: ``guidance_scale``) for the second."""
        if expert == self.card.experts[0] or params.guidance_scale_2 is None:
            return params.guidance_scale
        return params.guidance_scale_2

    def check_experts(self, params: DiffusionParams) -> None:
        """``guidance_scale_2`` only for a two-expert model (diffusers raises likewise)."""
        if params.guidance_scale_2 is not None and self.boundary_timestep is None:
            raise InvalidInputError(
                f"guidance_scale_2={params.guidance_scale_2!r} is for two-expert "
                f"(Wan2.2) models; {self.card.name} has one DiT")
        if params.guidance_scale_2 is not None and params.guidance_scale_2 < 0:
            raise InvalidInputError(f"guidance_scale_2={params.guidance_scale_2!r} must be >= 0")

    # -- the public API --------------------------------------------------------------------
    def generate(self, prompt: str | list[str], *, image: Any = None,
                 params: DiffusionParams | None = None, seeds: list[int] | None = None,
                 progress: bool = False) -> Any:
        """Serve one request through the card's loop (flow-match, or the causal one).

        The loop is :func:`flowseam.loops.run_loop` (``ExecutionProfile.SERVE``), reached through
        :mod:`flowseam.runner`: the loops stand above the models, so this layer calls the entry
        point they register instead of importing them.

        :param prompt: one prompt, or a list (one sample each).
        :param image: the conditioning image for I2V (PIL image, path, or ``(H, W, 3)`` float
            array in [0, 1]).
        :param seeds: one seed per sample (default ``params.seed + i``).
        :returns: a :class:`flowseam.loops.LoopResult`; ``.frames`` is ``(B, F, H, W, 3)``
            float32 in [0, 1] (F = 1 for images).
        :raises ValueError: for invalid parameters (naming the value and what is allowed).
        """
        request = GenerationRequest(prompt=prompt, task=self.card.task,
                                    params=params or DiffusionParams(), image=image, seeds=seeds)
        return runner.run(self, request, progress=progress)

    def generate_stream(self, prompt: str | list[str], *, params: DiffusionParams | None = None,
                        seeds: list[int] | None = None, progress: bool = False) -> Iterator[Any]:
        """Serve one request chunk by chunk (a causal checkpoint: the ``wan_causal`` loop),
        yielding each :class:`flowseam.loops.Chunk` as soon as it is decoded: ``.frames``
        ``(B, f, H, W, 3)`` float32 in [0, 1], ``.seconds`` since the request started; the last
        chunk's ``.result`` is the whole video's :class:`~flowseam.loops.LoopResult`. The loop is
        :func:`flowseam.loops.stream_loop`, reached through :mod:`flowseam.runner` (as
        :meth:`generate`).

        :raises ValueError: if the card's loop does not stream, or for invalid parameters
            (before any model runs: the parameters are checked on the first ``next()``).
        """
        request = GenerationRequest(prompt=prompt, task=self.card.task,
                                    params=params or DiffusionParams(), seeds=seeds)
        return runner.stream(self, request, progress=progress)

    @property
    def defaults(self) -> dict[str, Any]:
        """The values a request's unset parameters take: the checkpoint's serving defaults
        (:attr:`serve_defaults`) over the card's (precedence: :mod:`flowseam.defaults`)."""
        return {**self.card.defaults, **self.serve_defaults}

    @property
    def dit(self) -> torch.nn.Module:
        return self.components[self.DIT]

    def component_device(self, name: str) -> torch.device:
        """Where component ``name`` runs: its parameters' device, or with ``offload="model"``
        the accelerator every component is moved to for its forward."""
        if self._execution_device is not None:
            return self._execution_device
        module = self.components[name]
        try:
            return next(module.parameters()).device
        except (StopIteration, AttributeError):
            return torch.device("cpu")

    def component_dtype(self, name: str) -> torch.dtype:
        """The dtype the loop hands component ``name`` its inputs in: its parameters' lowest
        precision (``bfloat16`` for a bf16 model that keeps its norms in float32, as diffusers'
        ``_keep_in_fp32_modules`` do; the model upcasts inside those), float32 for an object
        without floating-point parameters."""
        return compute_dtype(self.components[name])

    def bump_version(self, name: str) -> int:
        """Mark ``name``'s weights as changed; caches keyed on them miss from now on."""
        self.versions[name] = self.versions.get(name, 0) + 1
        return self.versions[name]

    def cached_text(self, key: tuple, compute) -> Any:
        """``compute()`` cached under ``key`` (which must include the encoder weights version)."""
        if key not in self._text_cache:
            if len(self._text_cache) > 256:
                self._text_cache.clear()
            self._text_cache[key] = compute()
        return self._text_cache[key]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} card={self.card.name!r} platform={self.platform.name!r}>"

    # -- set-up while loading ---------------------------------------------------------------------
    @classmethod
    def check_index(cls, index: dict[str, Any], source: str = "model_index.json") -> None:
        """Validate card-specific settings in the checkpoint's ``model_index.json`` before any
        component loads (none here).

        :raises ValueError: for settings the card does not implement.
        """

    def read_index(self, index: dict[str, Any], source: str = "model_index.json") -> None:
        """Take card-specific settings from ``model_index.json`` (none here)."""

    #: suffixes of the qualified names of the DiT submodules that compute from the text alone;
    #: inside a loop run they reuse their outputs across steps (:mod:`flowseam.step_constants`)
    STEP_CONSTANTS: ClassVar[tuple[str, ...]] = ()

    def install_step_constants(self) -> None:
        """Let every DiT expert's :attr:`STEP_CONSTANTS` reuse their outputs across the steps of
        a loop run (:func:`flowseam.step_constants.install`)."""
        from ..step_constants import install

        for expert in self.experts.values():
            install(expert, self.STEP_CONSTANTS)

    def route_attention(self) -> None:
        """Send every attention call of every DiT expert through the platform's ``attention`` op
        (:func:`flowseam.attention.route_attention`); a loop with its own attention pattern
        (the causal loop's KV cache) routes more."""
        from .. import ops
        from ..attention import route_attention

        attention = self.platform.kernels.get(ops.ATTENTION)
        for expert in self.experts.values():
            route_attention(expert, attention)

    # -- memory (flowseam.memory) ---------------------------------------------------------------
    #: the order a request runs the kinds in (offload="model" chains its hooks in it)
    RUN_ORDER: ClassVar[tuple[str, ...]] = ("text_encoder", "image_encoder", "text_connectors",
                                            "dit", "latent_upsampler", "vae", "audio_vae",
                                            "vocoder")

    def configure_memory(self, memory: Any) -> None:
        """Apply :func:`flowseam.load`'s memory options (:mod:`flowseam.memory`) to the built
        components: VAE tiling and slicing, and for ``offload="model"`` the offload hooks.
        ``offload="text_encoder"`` acts after each encoding (:meth:`release_encoders`)."""
        from ..memory import Components, MemoryOptions, offload_model

        self.memory = memory if memory is not None else MemoryOptions()
        self.components = Components(self.components)
        if self.memory.vae_tiling:
            self.components["vae"].enable_tiling(**self.memory.tiling_args)
        if self.memory.vae_slicing:
            self.components["vae"].enable_slicing()
        if self.memory.offload == "model":
            device = next(m.parameters()).device if (m := self.dit) is not None else None
            order = [name for kind in self.RUN_ORDER
                     for name, (k, _) in self.component_specs.items()
                     if k == kind and isinstance(self.components[name], torch.nn.Module)]
            offload_model([self.components[n] for n in order], device)
            self._execution_device = device

    def memory_advice(self, kinds: tuple[str, ...]) -> str:
        """What lowers the memory a component of ``kinds`` needs (:func:`flowseam.memory.advice`;
        the loops name it when a component runs out of memory)."""
        from ..memory import MemoryOptions, advice

        dtypes = {kind: spec.dtype for kind, spec in self.component_specs.values() if spec.dtype}
        return advice(kinds, self.memory or MemoryOptions(), dtypes)

    def release_encoders(self) -> None:
        """With ``offload="text_encoder"``, free the text encoders once a request's prompts are
        encoded (the loops call it after encoding); a prompt the cache misses later builds them
        again through the platform, as :func:`flowseam.load` did."""
        if self.memory is None or self.memory.offload != "text_encoder":
            return
        import gc

        for name, (kind, spec) in self.component_specs.items():
            if kind == "text_encoder" and not self.components.is_released(name):
                self.components.release(name, lambda kind=kind, spec=spec:
                                        self.platform.build_component(kind, spec))
        gc.collect()

    # -- one generation over several processes ----------------------------------------------
    @classmethod
    def check_parallel_layout(cls, parallel: "Parallel", heads: Mapping[str, int],
                              name: str, any_heads: bool = False) -> None:
        """Refuse a :class:`~flowseam.parallel.Parallel` layout this card cannot run, naming the
        numbers — from the DiT experts' ``config.json`` (``heads``: expert name → attention
        heads), so :func:`flowseam.load` refuses it before any weights load. ``any_heads``: the
        platform's ``sequence_parallel_attention`` takes heads ``sp`` does not divide
        (:func:`flowseam.parallel.takes_any_heads`).

        :raises InvalidInputError: a loop that cannot be split, heads that ``sp`` does not
            divide, or ``cfg`` on a model with no unconditional branch.
        """
        if parallel.sp > 1:
            if cls.SEQUENCE_SPLIT is None:
                raise InvalidInputError(f"--sp {parallel.sp}: {name} cannot split its "
                                        f"sequence ({cls.NO_SPLIT_REASON}); drop --sp")
            from ..parallel import check_split

            for expert, n in heads.items():
                check_split(parallel, heads=int(n), tokens=0, model=f"{name}'s {expert}",
                            any_heads=any_heads)
        if parallel.cfg and not cls.HAS_CFG_BRANCHES:
            raise InvalidInputError(f"--cfg-parallel: {name} has no unconditional "
                                    f"branch to run on other ranks ({cls.NO_CFG_REASON})")

    #: whether the card runs CFG as two branches (conditional, unconditional) that
    #: ``--cfg-parallel`` can put on two groups of ranks
    HAS_CFG_BRANCHES: ClassVar[bool] = False
    NO_CFG_REASON: ClassVar[str] = "it runs one DiT pass per step"

    def parallelize(self, parallel: "Parallel") -> None:
        """Split every generation of this model over ``parallel.world_size`` ranks (this process
        is one; every rank calls it, and then runs the same requests): the DiT experts' token
        sequence per :attr:`SEQUENCE_SPLIT`, their self-attention through the platform's
        ``sequence_parallel_attention`` op, and with ``cfg`` one CFG branch per group of ranks
        (:mod:`flowseam.parallel`).

        :raises InvalidInputError: as :meth:`check_parallel_layout`.
        :raises FlowseamError: when this process is not one of ``parallel.world_size`` ranks.
        """
        import functools

        from .. import ops
        from ..attention import route_attention
        from ..parallel import ParallelGroups

        from ..parallel import takes_any_heads

        self.check_parallel_layout(parallel, {n: e.config.num_attention_heads
                                              for n, e in self.experts.items()}, self.card.name,
                                   takes_any_heads(self.platform))
        groups = ParallelGroups.create(parallel)
        if parallel.sp > 1:
            local = self.platform.kernels.get(ops.ATTENTION)
            split_attention = functools.partial(
                self.platform.kernels.get(ops.SEQUENCE_PARALLEL_ATTENTION),
                group=groups.sp_group, attention=local)
            split = self.SEQUENCE_SPLIT

            def self_attention(q, k, v, attn_mask=None, scale=None):
                if attn_mask is not None:
                    raise InvalidInputError("sequence-parallel self-attention takes no mask")
                return split_attention(q, k, v, scale=scale)

            for expert in self.experts.values():
                self._split_hooks |= split.install(expert, groups)
                route_attention(expert, local, choose=lambda name: local if split.is_cross(name)
                                else self_attention)
        self._parallel_modules = {id(e) for e in self.experts.values()}
        self.parallel = groups

    def unsplit_copy(self, module: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
        """``copy.deepcopy(module)`` (one of this model's components), running on one rank: a
        split DiT's copy loses the split hooks and attends with the platform's ``attention``
        (a trainer's policy and reference copies: an update runs each sample's whole sequence
        on one rank). For a model that is not split, the deepcopy itself. ``memo``: deepcopy's
        (tensors mapped to themselves are shared, not copied)."""
        import copy

        from .. import ops
        from ..attention import route_attention

        clone = copy.deepcopy(module, memo)
        if id(module) in self._parallel_modules:
            from ..parallel import SequenceSplit

            SequenceSplit.remove_hooks(clone, self._split_hooks)
            route_attention(clone, self.platform.kernels.get(ops.ATTENTION))
        return clone

    def is_split(self, dit: torch.nn.Module) -> bool:
        """Whether ``dit`` runs split over this model's ranks (one of its own experts after
        :meth:`parallelize`; a trainer's copy does not)."""
        return self.parallel is not None and id(dit) in self._parallel_modules

    def check_parallel(self, params: DiffusionParams) -> None:
        """Refuse a request the model's split cannot run (:meth:`check_parallel_request`);
        nothing when the model is not split.

        :raises InvalidInputError: naming the numbers.
        """
        if self.parallel is None:
            return
        from ..parallel import takes_any_heads

        configs = {name: self.components[name].config for name in (self.DIT, "vae")}
        self.check_parallel_request(self.parallel.parallel, params, configs, self.card.name,
                                    takes_any_heads(self.platform))

    @classmethod
    def check_parallel_request(cls, parallel: "Parallel", params: DiffusionParams,
                               configs: Mapping[str, Mapping[str, Any]], name: str,
                               any_heads: bool = False) -> None:
        """Refuse a request (``params`` with the defaults filled) that ``parallel`` cannot split:
        tokens after patching (and text tokens that join the self-attention) that ``sp`` does
        not divide, step caching (its decisions would differ per rank), CFG parallelism without
        CFG. ``configs``: the DiT's and the VAE's configs (read from ``config.json`` before any
        weights load, :func:`flowseam.loading.check_parallel_checkpoint`, or the loaded ones).

        :raises InvalidInputError: naming the numbers.
        """
        from ..parallel import check_split

        if parallel.sp > 1:
            tokens, text_tokens = cls.sequence_tokens(params, configs)
            check_split(parallel, heads=int(configs[cls.DIT]["num_attention_heads"]),
                        tokens=tokens, text_tokens=text_tokens, model=name, any_heads=any_heads)
        if params.cache is not None:
            raise InvalidInputError(
                f"cache={params.cache}: step caching decides per rank from local tokens; it is "
                "not implemented with --sp / --cfg-parallel (drop one)")
        if parallel.cfg and params.guidance_scale <= 1.0:
            raise InvalidInputError(
                f"--cfg-parallel: guidance_scale={params.guidance_scale} runs no unconditional "
                "branch (CFG needs guidance_scale > 1); drop --cfg-parallel")

    @classmethod
    def sequence_tokens(cls, params: DiffusionParams,
                        configs: Mapping[str, Mapping[str, Any]]) -> tuple[int, int | None]:
        """(the DiT's tokens after patching for ``params``, the text tokens that join its
        self-attention or None) — for the cards with a :attr:`SEQUENCE_SPLIT`; ``configs`` as
        for :meth:`check_parallel_request`."""
        raise NotImplementedError

    # -- step bodies (card-specific) -----------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        """Fill :attr:`defaults` into ``request.params``' unset fields and validate the request.

        :raises ValueError: naming the bad value and what is allowed (the card's ``rules``).
        """
        raise NotImplementedError

    def check_image(self, request: GenerationRequest) -> None:
        """An image-to-video card needs ``request.image``, which is read and converted to RGB
        here (``request.image`` becomes the PIL image; :func:`flowseam.media.read_image`), so a
        bad file fails before any model runs; the other cards take none. A card with
        :attr:`IMAGE_PER_SAMPLE` also takes a list of images, one per prompt (``request.image``
        becomes a list of PIL images).

        :raises ValueError: naming the card and what to pass or use instead, or the image and
            what is wrong with it (for a list: its index), or a list whose length is not the
            number of prompts.
        """
        if TaskType.I2V in self.card.tasks:
            if request.image is None:
                raise InvalidInputError(
                    f"{self.card.name} is image-to-video: pass image= (a PIL image, "
                    "a path, or an (H, W, 3) float array in [0, 1])")
            from ..media import read_image

            if not isinstance(request.image, (list, tuple)):
                request.image = read_image(request.image)
                return
            n = len(request.prompts)
            if not self.IMAGE_PER_SAMPLE:
                raise InvalidInputError(
                    f"{self.card.name} takes one image per request; got a list of "
                    f"{len(request.image)} images (run one request per image)")
            if len(request.image) != n:
                raise InvalidInputError(
                    f"image is a list of {len(request.image)} images for {n} "
                    "prompt(s); give one image per prompt, or one image for all")
            images = []
            for k, image in enumerate(request.image):
                try:
                    images.append(read_image(image))
                except ValueError as e:
                    raise InvalidInputError(f"image[{k}]: {e}") from None
            request.image = images
        elif request.image is not None:
            what = {TaskType.T2V: "text-to-video", TaskType.T2I: "text-to-image"}[self.card.task]
            raise InvalidInputError(f"{self.card.name} is {what} and takes no image; use an "
                                    "image-to-video checkpoint (wan2.1-i2v, ltx2-i2v)")

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        """Text (and image) conditioning for the B prompts: ``prompt_embeds (B, L, D)`` in the
        DiT's dtype, ``negative_embeds`` when CFG is on, card-specific tensors in ``extra``.
        Cached per (text-encoder weights version, prompt)."""
        raise NotImplementedError

    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        """Initial noise ``(B, ...)`` float32 (card layout), row b drawn from ``generators[b]``;
        may add per-request conditioning to ``cond.extra`` (I2V condition, Flux position ids)."""
        raise NotImplementedError

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 params: DiffusionParams, dit: torch.nn.Module | None = None,
                 expert: str | None = None) -> torch.Tensor:
        """The (guided) velocity at ``latents`` ``(B, ...)`` and ``timestep`` ``(B,)``, latents'
        shape, in the DiT's dtype.

        :param expert: which DiT expert (component name) runs, with its guidance scale; default
            the one that owns ``timestep`` (:meth:`expert_at`).
        :param dit: a module to run instead of that expert's (a trainer's copy of it).
        :raises ValueError: for an expert name the model does not have.
        """
        raise NotImplementedError

    def num_branches(self, cond: Conditioning) -> int:
        """How many guidance branches :meth:`branch_velocity` has (2 for CFG; 1 by default)."""
        return 1

    def branch_velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                        params: DiffusionParams, branches: list[int],
                        dit: torch.nn.Module | None = None,
                        expert: str | None = None) -> list[torch.Tensor]:
        """The unguided velocity of each of ``branches`` (one DiT call), for a step cache that
        keeps one history per branch (:mod:`flowseam.loops.step_cache`); :meth:`guide`
        combines them. One branch by default: the velocity itself."""
        return [self.velocity(latents, timestep, cond, params, dit=dit, expert=expert)]

    def guide(self, branches: list[torch.Tensor], params: DiffusionParams, expert: str) -> torch.Tensor:
        """The guided velocity from every branch's velocity (the one branch by default)."""
        return branches[0]

    def _expert(self, timestep: torch.Tensor, expert: str | None,
                dit: torch.nn.Module | None) -> tuple[str, torch.nn.Module]:
        """(expert name, module) for :meth:`velocity`."""
        name = self.expert_at(timestep) if expert is None else expert
        experts = self.experts
        if name not in experts:
            raise InvalidInputError(
                f"expert={name!r}: {self.card.name} has experts {sorted(experts)}")
        return name, experts[name] if dit is None else dit

    def decode(self, latents: torch.Tensor, params: DiffusionParams) -> np.ndarray:
        """Final latents → frames ``(B, F, H, W, 3)`` float32 in [0, 1] (F = 1 for images)."""
        raise NotImplementedError

    #: ``Conditioning.extra`` keys shared by every row of a batch (not stacked by
    #: :meth:`stack_conditions`), e.g. Flux's position ids.
    SHARED_CONDITION_KEYS: ClassVar[tuple[str, ...]] = ()

    def condition(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        """Everything the DiT is conditioned on for ``request`` (what :meth:`encode` and
        :meth:`prepare_latents` compute, without keeping the noise): text embeddings and, for
        I2V, the image condition. Used to cache conditions for training (``finetune``)."""
        cond = self.encode(request, params)
        generators = [torch.Generator().manual_seed(s) for s in request.sample_seeds(params)]
        self.prepare_latents(request, params, generators, cond)
        return cond

    def stack_conditions(self, conds: list[Conditioning]) -> Conditioning:
        """One batch from single-sample conditions: tensors are concatenated along the batch
        axis, :attr:`SHARED_CONDITION_KEYS` are taken from the first, other values listed.

        :raises ValueError: for an empty list.
        """
        if not conds:
            raise InvalidInputError("stack_conditions needs at least one Conditioning")
        first = conds[0]
        cat = lambda xs: torch.cat(xs, dim=0) if xs[0] is not None else None  # noqa: E731
        extra: dict[str, Any] = {}
        for key, value in first.extra.items():
            if key in self.SHARED_CONDITION_KEYS:
                extra[key] = value
            elif torch.is_tensor(value):
                extra[key] = torch.cat([c.extra[key] for c in conds], dim=0)
            else:
                extra[key] = [c.extra[key] for c in conds]
        return Conditioning(prompt_embeds=cat([c.prompt_embeds for c in conds]),
                            negative_embeds=cat([c.negative_embeds for c in conds]), extra=extra)

    def encode_latents(self, frames: np.ndarray | torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        """The inverse of :meth:`decode` (VAE mean, normalised as the DiT sees latents): frames
        ``(B, F, H, W, 3)`` in [0, 1] → latents of :meth:`prepare_latents`' shape, float32.
        Used by the flow-matching loss of the ``finetune`` method."""
        raise NotImplementedError


def frames_to_pixels(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``(B, F, H, W, 3)`` in [0, 1] → ``(B, 3, F, H, W)`` float32 in [-1, 1]."""
    x = torch.as_tensor(np.asarray(frames, dtype=np.float32)) if not torch.is_tensor(frames) else frames.float()
    return x.permute(0, 4, 1, 2, 3) * 2.0 - 1.0


def postprocess(decoded: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1] → float32 numpy in [0, 1] with channels last (diffusers'
    ``VaeImageProcessor.postprocess(..., "np")``: ``(x * 0.5 + 0.5).clamp(0, 1)``)."""
    out = (decoded * 0.5 + 0.5).clamp(0, 1)
    if out.ndim == 5:  # (B, C, F, H, W) -> (B, F, H, W, C)
        return out.permute(0, 2, 3, 4, 1).float().cpu().numpy()
    return out.permute(0, 2, 3, 1).float().cpu().numpy()[:, None]  # (B, 1, H, W, C)
