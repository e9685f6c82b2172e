"""ModelInstance: a loaded model — the card's step bodies and its public API.

A :class:`ModelInstance` holds the components the platform built for a checkpoint and the solver
its scheduler config resolved to, serves requests (:meth:`~ModelInstance.generate`, through the
card's loop: :func:`flowseam.loops.run_loop`) and implements the card-specific step bodies the loop
calls (``check``, ``encode``, ``prepare_latents``, ``schedule``, ``velocity``, ``decode``; each
loop module says which it calls). What is not card-specific it holds as objects of their own:
its DiT experts (:class:`~flowseam.models.experts.Experts`), where its components run
(:class:`~flowseam.models.placement.Placement`), its LoRA adapters
(:class:`~flowseam.models.adapters.AdapterSet`) and, split over ranks, its
:class:`~flowseam.models.split.ModelSplit`.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Mapping

import numpy as np
import torch

from .. import ops
from ..attention import route_attention
from ..errors import InvalidInputError
from ..loops import Chunk, LoopResult, run_loop, stream_loop
from ..media import read_image
from ..memory import Components, MemoryOptions
from ..noise import draw_noise  # noqa: F401  (re-exported: cards draw latents with it)
from ..request import DiffusionParams, GenerationRequest, TaskType
from ..schedulers import Schedule, SolverConfig
from ..seam.components import compute_dtype
from ..step_constants import install as install_step_constants
from .adapters import AdapterSet
from .card import ModelCard
from .experts import Experts
from .placement import Placement

if TYPE_CHECKING:  # pragma: no cover
    from ..seam.platform import Platform
    from .split import ModelSplit


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
    """A loaded model: components built through ``platform.build_component``, the card's step
    bodies (subclasses implement them) and the public API (:meth:`generate`).

    :ivar versions: weights version per component name; a WeightSyncPlan bumps it, and every cache
        keyed on weights (text embeddings) includes it.
    :ivar experts: the DiT experts (:class:`~flowseam.models.experts.Experts`): which one runs a
        step, with which guidance scale.
    :ivar placement: where the components run (:class:`~flowseam.models.placement.Placement`).
    :ivar parallel: a :class:`~flowseam.models.split.ModelSplit` when every generation is split
        over several processes (``flowseam.load(parallel=...)``), else None.
    """

    #: the component name of the denoiser in this card's checkpoint
    DIT: ClassVar[str] = "transformer"
    #: an image-to-video card that takes a list of images, one per prompt, in one request (a
    #: batch of B first frames); the others take one image per request
    IMAGE_PER_SAMPLE: ClassVar[bool] = False
    #: suffixes of the qualified names of the DiT submodules that compute from the text alone;
    #: inside a loop run they reuse their outputs across steps (:mod:`flowseam.step_constants`)
    STEP_CONSTANTS: ClassVar[tuple[str, ...]] = ()
    #: ``Conditioning.extra`` keys shared by every row of a batch (not stacked by
    #: :meth:`stack_conditions`), e.g. Flux's position ids.
    SHARED_CONDITION_KEYS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, card: ModelCard, platform: "Platform", components: Mapping[str, Any],
                 path: Path | None, solver: SolverConfig | None, *,
                 scheduler_config: Mapping[str, Any] | None = None,
                 pipeline_config: Mapping[str, Any] | None = None,
                 records: Mapping[str, Any] | None = None,
                 specs: Mapping[str, tuple[str, Any]] | None = None,
                 memory: MemoryOptions | None = None) -> None:
        self.card = card
        self.platform = platform
        self.components = Components(components)
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
        self.component_records: dict[str, Any] = dict(records or {})
        #: components model_index.json declares that this card does not load, with the reason
        self.unused_components: dict[str, str] = {}
        #: the checkpoint's own serving defaults (``flowseam.json``'s ``serve`` table)
        self.serve_defaults: dict[str, Any] = {}
        self.experts = Experts(card.experts, self.components, self._boundary_timestep(),
                               card.name)
        self.placement = Placement(self.components, specs or {}, memory or MemoryOptions(),
                                   platform.build_component)
        self.parallel: "ModelSplit | None" = None
        self._adapters: AdapterSet | None = None

    def _boundary_timestep(self) -> float | None:
        """``boundary_ratio * num_train_timesteps`` for a two-expert model (diffusers'
        WanPipeline), else None."""
        ratio = self.pipeline_config.get("boundary_ratio")
        if ratio is None or len(self.card.experts) < 2 or self.solver is None:
            return None
        return float(ratio) * self.solver.num_train_timesteps

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
            line += f"; parallel: {self.parallel}"
        if self.unused_components:
            line += "; not loaded: " + ", ".join(f"{n} ({why})"
                                                 for n, why in self.unused_components.items())
        return line + (f"; {self.solver_line()}" if solver else "")

    def solver_line(self) -> str:
        """One line: the solver, its schedule settings and where each came from (the load line,
        also in :meth:`provenance`)."""
        return self.solver.describe()

    # -- the public API ------------------------------------------------------------------------
    def generate(self, prompt: str | list[str], *, image: Any = None,
                 params: DiffusionParams | None = None, seeds: list[int] | None = None,
                 progress: bool = False) -> LoopResult:
        """Serve one request through the card's loop (:func:`flowseam.loops.run_loop`,
        ``ExecutionProfile.SERVE``).

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
        return run_loop(self, request, progress=progress)

    def generate_stream(self, prompt: str | list[str], *, params: DiffusionParams | None = None,
                        seeds: list[int] | None = None, progress: bool = False) -> Iterator[Chunk]:
        """Serve one request chunk by chunk (a causal checkpoint: the ``wan_causal`` loop),
        yielding each :class:`flowseam.loops.Chunk` as soon as it is decoded: ``.frames``
        ``(B, f, H, W, 3)`` float32 in [0, 1], ``.seconds`` since the request started; the last
        chunk's ``.result`` is the whole video's :class:`~flowseam.loops.LoopResult`
        (:func:`flowseam.loops.stream_loop`).

        :raises ValueError: if the card's loop does not stream, or for invalid parameters
            (before any model runs: the parameters are checked on the first ``next()``).
        """
        request = GenerationRequest(prompt=prompt, task=self.card.task,
                                    params=params or DiffusionParams(), seeds=seeds)
        return stream_loop(self, request, progress=progress)

    @property
    def adapters(self) -> AdapterSet:
        """The model's LoRA adapters (:class:`~flowseam.models.adapters.AdapterSet`): read once,
        switched per request by the loop (``DiffusionParams.lora``)."""
        if self._adapters is None:
            self._adapters = AdapterSet(self.card.name, self.card.pipeline_class, self.experts)
        return self._adapters

    @property
    def defaults(self) -> dict[str, Any]:
        """The values a request's unset parameters take: the checkpoint's serving defaults
        (:attr:`serve_defaults`) over the card's (precedence: :mod:`flowseam.checkpoint_defaults`)."""
        return {**self.card.defaults, **self.serve_defaults}

    @property
    def dit(self) -> torch.nn.Module:
        return self.components[self.DIT]

    def component_device(self, name: str) -> torch.device:
        """Where component ``name`` runs (:meth:`Placement.device`)."""
        return self.placement.device(name)

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

    # -- the 0.1 names of what the experts do, until flowseam 0.3 ------------------------------
    def expert_at(self, timestep: torch.Tensor | float) -> str:
        """Deprecated: :meth:`Experts.at` (``model.experts.at(timestep)``)."""
        warnings.warn("model.expert_at(t) moved to model.experts.at(t) (the old name goes in "
                      "flowseam 0.3)", DeprecationWarning, stacklevel=2)
        return self.experts.at(timestep)

    @property
    def boundary_timestep(self) -> float | None:
        """Deprecated: ``model.experts.boundary_timestep``."""
        warnings.warn("model.boundary_timestep moved to model.experts.boundary_timestep (the old "
                      "name goes in flowseam 0.3)", DeprecationWarning, stacklevel=2)
        return self.experts.boundary_timestep

    # -- the solver --------------------------------------------------------------------------
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
        clone.experts = Experts(self.card.experts, self.components, clone._boundary_timestep(),
                                self.card.name)
        return clone

    # -- set-up while loading ---------------------------------------------------------------------
    @classmethod
    def check_index(cls, index: dict[str, Any], source: str = "model_index.json") -> None:
        """Validate card-specific settings in the checkpoint's ``model_index.json`` before any
        component loads (none here).

        :raises ValueError: for settings the card does not implement.
        """

    def read_index(self, index: dict[str, Any], source: str = "model_index.json") -> None:
        """Take card-specific settings from ``model_index.json`` (none here)."""

    def install_step_constants(self) -> None:
        """Let every DiT expert's :attr:`STEP_CONSTANTS` reuse their outputs across the steps of
        a loop run (:func:`flowseam.step_constants.install`)."""
        for expert in self.experts.values():
            install_step_constants(expert, self.STEP_CONSTANTS)

    def route_attention(self) -> None:
        """Send every attention call of every DiT expert through the platform's ``attention`` op
        (:func:`flowseam.attention.route_attention`); a loop with its own attention pattern
        (the causal loop's KV cache) routes more."""
        attention = self.platform.kernels.get(ops.ATTENTION)
        for expert in self.experts.values():
            route_attention(expert, attention)

    # -- step bodies (card-specific) -----------------------------------------------------------
    def validate(self, request: GenerationRequest) -> DiffusionParams:
        """The request's parameters with the defaults filled, checked as this model runs them:
        the card's rules (:meth:`check`) and, for a model split over ranks, what the split
        divides (:meth:`ModelSplit.check`).

        :raises ValueError: naming the bad value and what is allowed.
        """
        params = self.check(request)
        if self.parallel is not None:
            self.parallel.check(params)
        return params

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
            the one that owns ``timestep`` (:meth:`Experts.at`).
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

    def decode(self, latents: torch.Tensor, params: DiffusionParams) -> np.ndarray:
        """Final latents → frames ``(B, F, H, W, 3)`` float32 in [0, 1] (F = 1 for images)."""
        raise NotImplementedError

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
