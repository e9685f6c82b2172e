"""ModelCard (what a model is) and ModelInstance (a loaded model driven by the shared loop).

A card is declarative: the pipeline class it reads in ``model_index.json``, its components (name
in the checkpoint → component kind), its loops, its defaults and its validation rules. A
:class:`ModelInstance` holds the components the platform built for it, and implements the
card-specific step bodies the shared loop (:mod:`flowseam.loops`) calls: ``check``, ``encode``,
``schedule``, ``prepare_latents``, ``velocity`` and ``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import numpy as np
import torch

from ..noise import draw_noise  # noqa: F401  (re-exported: cards draw latents with it)
from ..request import DiffusionParams, GenerationRequest, TaskType

if TYPE_CHECKING:  # pragma: no cover
    from ..loops import Chunk, LoopResult
    from ..platform import Platform


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a card: its folder/name in the checkpoint and its kind."""

    name: str
    kind: str
    required: bool = True


@dataclass(frozen=True)
class ModelCard:
    """A declarative description of one model.

    :param name: the card's id (``"wan2.1-t2v"``).
    :param pipeline_class: the ``_class_name`` in ``model_index.json`` that selects this card.
    :param tasks: the tasks it serves.
    :param components: its components in load order.
    :param loops: the loops it runs (``"flow_match"``, with SERVE and ROLLOUT profiles).
    :param defaults: default :class:`DiffusionParams` values.
    :param rules: the validation rules, in words (shown by errors and docs).
    :param instance: the :class:`ModelInstance` subclass implementing its step bodies.
    """

    name: str
    pipeline_class: str
    tasks: tuple[TaskType, ...]
    components: tuple[ComponentEntry, ...]
    defaults: dict[str, Any]
    rules: tuple[str, ...]
    instance: type["ModelInstance"]
    loops: tuple[str, ...] = ("flow_match",)

    @property
    def task(self) -> TaskType:
        return self.tasks[0]


@dataclass
class Conditioning:
    """What the DiT is conditioned on for one request (card-specific fields in ``extra``)."""

    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelInstance:
    """A loaded model: components built through ``platform.build_component``.

    Subclasses implement the card-specific step bodies. Public entry point: :meth:`generate`.

    :ivar versions: weights version per component name; a WeightSyncPlan bumps it, and every cache
        keyed on weights (text embeddings) includes it.
    """

    card: ModelCard
    #: the component names of the denoiser, VAE and text encoder in this card's checkpoint
    DIT: ClassVar[str] = "transformer"

    def __init__(self, card: ModelCard, platform: "Platform", components: dict[str, Any],
                 path: Path | None, scheduler_config: dict[str, Any]) -> None:
        self.card = card
        self.platform = platform
        self.components = components
        self.path = path
        self.scheduler_config = dict(scheduler_config)
        self.versions: dict[str, int] = {name: 0 for name in components}
        self._text_cache: dict[tuple, Any] = {}
        #: name → ComponentRecord (where the platform built each component, and why there)
        self.component_records: dict[str, Any] = {}

    def provenance(self) -> str:
        """One line: where each component and the serve kernels came from."""
        comps = ", ".join(f"{n}={r.device}/{r.plugin}{' (fallback)' if r.fallback else ''}"
                          for n, r in self.component_records.items() if r.kind in ("dit", "vae", "text_encoder", "image_encoder"))
        kern = ", ".join(f"{op}={k.impl_id}" for op, k in self.platform.kernels.resolved().items())
        return f"[{self.card.name}] components: {comps}; kernels: {kern}"

    # -- the public API --------------------------------------------------------------------
    def generate(self, prompt: str | list[str], *, image: Any = None,
                 params: DiffusionParams | None = None, seeds: list[int] | None = None,
                 progress: bool = False) -> "LoopResult":
        """Serve one request through the card's loop (flow-match, or the causal one).

        :param prompt: one prompt, or a list (one sample each).
        :param image: the conditioning image for I2V (PIL image, path, or ``(H, W, 3)`` float
            array in [0, 1]).
        :param seeds: one seed per sample (default ``params.seed + i``).
        :returns: a :class:`flowseam.loops.LoopResult`; ``.frames`` is ``(B, F, H, W, 3)``
            float32 in [0, 1] (F = 1 for images).
        :raises ValueError: for invalid parameters (naming the value and what is allowed).
        """
        from ..loops import ExecutionProfile, run_loop

        request = GenerationRequest(prompt=prompt, task=self.card.task,
                                    params=params or DiffusionParams(), image=image, seeds=seeds)
        return run_loop(self, request, profile=ExecutionProfile.SERVE, progress=progress)

    def generate_stream(self, prompt: str | list[str], *, params: DiffusionParams | None = None,
                        seeds: list[int] | None = None, progress: bool = False) -> Iterator["Chunk"]:
        """Serve one request chunk by chunk (a causal checkpoint: the ``wan_causal`` loop),
        yielding each :class:`flowseam.loops.Chunk` as soon as it is decoded: ``.frames``
        ``(B, f, H, W, 3)`` float32 in [0, 1], ``.seconds`` since the request started; the last
        chunk's ``.result`` is the whole video's :class:`~flowseam.loops.LoopResult`.

        :raises ValueError: if the card's loop does not stream, or for invalid parameters
            (before any model runs: the parameters are checked on the first ``next()``).
        """
        from ..loops import ExecutionProfile, stream_loop

        request = GenerationRequest(prompt=prompt, task=self.card.task,
                                    params=params or DiffusionParams(), seeds=seeds)
        return stream_loop(self, request, profile=ExecutionProfile.SERVE, progress=progress)

    @property
    def dit(self) -> torch.nn.Module:
        return self.components[self.DIT]

    def component_device(self, name: str) -> torch.device:
        module = self.components[name]
        try:
            return next(module.parameters()).device
        except (StopIteration, AttributeError):
            return torch.device("cpu")

    def component_dtype(self, name: str) -> torch.dtype:
        try:
            return next(self.components[name].parameters()).dtype
        except (StopIteration, AttributeError):
            return torch.float32

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

    def route_attention(self) -> None:
        """Send every attention call of the DiT through the platform's ``attention`` op
        (:func:`flowseam.attention.route_attention`); a loop with its own attention pattern
        (the causal loop's KV cache) routes more."""
        from .. import ops
        from ..attention import route_attention

        route_attention(self.dit, self.platform.kernels.get(ops.ATTENTION))

    # -- step bodies (card-specific) -----------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        """Fill the card's defaults into ``request.params`` and validate the request.

        :raises ValueError: naming the bad value and what is allowed (the card's ``rules``).
        """
        raise NotImplementedError

    def encode(self, request: GenerationRequest, params: DiffusionParams) -> Conditioning:
        """Text (and image) conditioning for the B prompts: ``prompt_embeds (B, L, D)`` in the
        DiT's dtype, ``negative_embeds`` when CFG is on, card-specific tensors in ``extra``.
        Cached per (text-encoder weights version, prompt)."""
        raise NotImplementedError

    def schedule(self, params: DiffusionParams, latents: torch.Tensor) -> tuple[list[float], torch.Tensor]:
        """``(sigmas, timesteps)``: N + 1 sigmas from 1 down to 0 (Python floats) and the N
        timesteps ``(N,)`` float32 the DiT is given, with the flow shift applied."""
        raise NotImplementedError

    def prepare_latents(self, request: GenerationRequest, params: DiffusionParams,
                        generators: list[torch.Generator], cond: Conditioning) -> torch.Tensor:
        """Initial noise ``(B, ...)`` float32 (card layout), row b drawn from ``generators[b]``;
        may add per-request conditioning to ``cond.extra`` (I2V condition, Flux position ids)."""
        raise NotImplementedError

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 params: DiffusionParams, dit: torch.nn.Module | None = None) -> torch.Tensor:
        """The (guided) velocity at ``latents`` ``(B, ...)`` and ``timestep`` ``(B,)``, latents'
        shape, in the DiT's dtype. ``dit`` overrides the instance's DiT (a trainer's copy)."""
        raise NotImplementedError

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
            raise ValueError("stack_conditions needs at least one Conditioning")
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
