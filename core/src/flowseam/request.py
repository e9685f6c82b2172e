"""Generation requests: the task, its parameters, and the checks every card applies.

A request is a prompt plus :class:`DiffusionParams`; fields left ``None`` take the card's
defaults (:meth:`DiffusionParams.with_defaults`). Each card validates the result before any
model runs, and every error names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class TaskType(str, enum.Enum):
    """What a request produces: an image from text, a video from text, a video from an image."""

    T2I = "t2i"
    T2V = "t2v"
    I2V = "i2v"


@dataclass(frozen=True)
class DiffusionParams:
    """Sampling parameters. ``None`` means "the card's default".

    :param num_steps: denoising steps (>= 1).
    :param guidance_scale: classifier-free guidance scale (Wan: CFG with the negative prompt when
        > 1; FLUX.1-dev: the distilled guidance embedding, no second pass).
    :param guidance_scale_2: the guidance scale of the low-noise expert of a two-expert model
        (Wan2.2's ``transformer_2``); None: ``guidance_scale``. Refused for one-expert models.
    :param flow_shift: overrides the flow shift of the checkpoint's scheduler,
        ``sigma' = shift * sigma / (1 + (shift - 1) * sigma)`` (SD3 / Wan): ``shift`` of a
        FlowMatchEuler scheduler, ``flow_shift`` of UniPC, and turns dynamic shifting off. None
        (the default): the checkpoint's own setting (see :mod:`flowseam.schedulers`).
    :param seed: seeds the initial latents (and SDE noise) through a ``torch.Generator``.
    :param height, width: output size in pixels.
    :param num_frames: video length in frames (Wan: 4k+1); 1 for images.
    :param negative_prompt: the CFG negative prompt (Wan).
    :param sde_rollout: use Flow-GRPO's SDE step (``flow_sde_step``) instead of the ODE step.
    :param noise_level: the SDE step's noise level (Flow-GRPO's ``a``, default 0.7).
    :param sde_window: with ``sde_rollout``, only the steps ``start <= i < end`` (0-based step
        indices) are SDE steps with a log-prob; the others are ODE steps. None: every step.
        Training on a window of one or two early steps is Flow-GRPO-Fast (the Flow-GRPO
        repository) and MixGRPO (Li et al. 2025): the reward's spread then comes from the noise
        of those steps only, so the policy gradient is far less noisy per sample.
    :param max_sequence_length: text tokens kept by the text encoder.
    :param lora: the request's LoRA adapter set: a tuple of :class:`flowseam.adapters.LoraSpec`
        (path, weight, expert); strings ``"PATH[:WEIGHT][@EXPERT]"`` and mappings are converted
        (:func:`flowseam.adapters.normalize_lora`). Empty: the base model. Each file is read
        once per model and switched per request (:mod:`flowseam.adapters`).
    :param cache: the step-cache policy (:class:`flowseam.loops.step_cache.CachePolicy`, or
        ``"NAME:THRESHOLD"``): skip the DiT on steps where its velocity changes little. None
        (the default): every step computed. Flow-match loop only (Wan T2V/I2V, FLUX.1).
    :param chunk_frames: (``wan_causal`` loop) latent frames per chunk (Self-Forcing's
        ``num_frame_per_block``).
    :param local_attn_size: (``wan_causal``) the rolling window: latent frames a chunk attends
        to, itself included; None: every earlier frame.
    :param sink_size: (``wan_causal``) the first latent frames, always attended (with a window).
    :param kv_cache: (``wan_causal``) reuse the keys/values of earlier chunks; False recomputes
        the whole prefix with a block-causal mask at every step (the parity reference; slow).
    :param frame_rate: frames per second of the video (LTX-2: its RoPE positions and the audio
        length follow it, and a written video plays at it).
    :param audio_guidance_scale: CFG scale of the audio (LTX-2; ``guidance_scale`` is the video's).
    :param stages: 1 (generate at height x width) or 2 (LTX-2's recipe: generate at half the size,
        upsample the latents x2, re-noise, refine).
    :param refine_sigmas: the sigmas of stage 2 (the re-noise level is the first); LTX-2's
        distilled ``(0.909375, 0.725, 0.421875)`` by default.
    :param refine_guidance_scale: the CFG scale of stage 2, video and audio (1 = no CFG).

    The last five are LTX-2 parameters (:data:`CARD_SPECIFIC`): a card that has no default for
    one refuses it (:meth:`with_defaults`) rather than ignore it.
    """

    num_steps: int | None = None
    guidance_scale: float | None = None
    flow_shift: float | None = None
    seed: int | None = 0
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    negative_prompt: str | None = None
    sde_rollout: bool = False
    noise_level: float = 0.7
    sde_window: tuple[int, int] | None = None
    max_sequence_length: int | None = None
    chunk_frames: int | None = None
    local_attn_size: int | None = None
    sink_size: int | None = None
    kv_cache: bool = True
    guidance_scale_2: float | None = None
    frame_rate: float | None = None
    audio_guidance_scale: float | None = None
    stages: int | None = None
    refine_sigmas: tuple[float, ...] | None = None
    refine_guidance_scale: float | None = None
    lora: tuple = ()
    cache: Any = None

    def __post_init__(self) -> None:
        for name in ("sde_window", "refine_sigmas"):  # TOML/YAML give lists; keep params hashable
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.lora:
            from .adapters import normalize_lora

            object.__setattr__(self, "lora", normalize_lora(self.lora))
        elif self.lora is None:
            object.__setattr__(self, "lora", ())
        if self.cache is not None:
            from .loops.step_cache import normalize_cache

            object.__setattr__(self, "cache", normalize_cache(self.cache))

    def with_defaults(self, defaults: dict[str, Any]) -> "DiffusionParams":
        """A copy with every ``None`` field filled from ``defaults`` (a card's).

        :raises ValueError: for a :data:`CARD_SPECIFIC` field that is set although ``defaults``
            has no entry for it (the card does not take it).
        """
        for name in CARD_SPECIFIC:
            if getattr(self, name) is not None and name not in defaults:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a parameter of this model "
                                 "(it applies to LTX-2 checkpoints); leave it unset")
        filled = {k: v for k, v in defaults.items()
                  if k in self.__dataclass_fields__ and getattr(self, k) is None}
        return dataclasses.replace(self, **filled)

    def replace(self, **changes: Any) -> "DiffusionParams":
        return dataclasses.replace(self, **changes)


#: DiffusionParams fields only some cards take (LTX-2's); other cards refuse them.
CARD_SPECIFIC = ("frame_rate", "audio_guidance_scale", "stages", "refine_sigmas",
                 "refine_guidance_scale")


@dataclass
class GenerationRequest:
    """One request: prompts, an optional conditioning image, and its parameters.

    :param prompt: one prompt or a list (one sample each; B = len).
    :param image: for I2V, a PIL image, a path to one, or an ``(H, W, 3)`` float array in [0, 1];
        it becomes the first frame.
    :param seeds: one seed per sample; default ``params.seed + i``. Every sample gets its own
        ``torch.Generator`` (initial latents and SDE noise), never one seed for the group.
    """

    prompt: str | list[str]
    task: TaskType
    params: DiffusionParams = field(default_factory=DiffusionParams)
    image: Any = None
    seeds: list[int] | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def sample_seeds(self, params: DiffusionParams) -> list[int]:
        """One seed per prompt. Raises ValueError if ``seeds`` has the wrong length."""
        n = len(self.prompts)
        if self.seeds is None:
            base = 0 if params.seed is None else params.seed
            return [base + i for i in range(n)]
        if len(self.seeds) != n:
            raise ValueError(f"seeds has {len(self.seeds)} entries for {n} prompts; give one each")
        return [int(s) for s in self.seeds]


def check_common(params: DiffusionParams, request: GenerationRequest | None = None) -> None:
    """Checks that hold for every card. Raises ValueError naming the bad value."""
    if request is not None:
        prompts = request.prompts
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"prompt={request.prompt!r} must be a string or a non-empty list of strings")
    if not isinstance(params.num_steps, int) or params.num_steps < 1:
        raise ValueError(f"num_steps={params.num_steps!r} must be an integer >= 1")
    if params.guidance_scale is not None and params.guidance_scale < 0:
        raise ValueError(f"guidance_scale={params.guidance_scale!r} must be >= 0")
    if params.flow_shift is not None and params.flow_shift <= 0:
        raise ValueError(f"flow_shift={params.flow_shift!r} must be > 0")
    for name in ("height", "width"):
        value = getattr(params, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of pixels")
    if params.negative_prompt is not None and not isinstance(params.negative_prompt, str):
        raise ValueError(f"negative_prompt={params.negative_prompt!r} must be a string")
    if params.noise_level < 0:
        raise ValueError(f"noise_level={params.noise_level!r} must be >= 0")
    if params.sde_window is not None:
        window = params.sde_window
        ok = (isinstance(window, (tuple, list)) and len(window) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in window)
              and 0 <= window[0] < window[1])
        if not ok or window[0] >= params.num_steps:
            raise ValueError(f"sde_window={window!r} must be [start, end) step indices with "
                             f"0 <= start < end and start < num_steps={params.num_steps}")


#: the parameters only the ``wan_causal`` loop implements
CAUSAL_PARAMS = ("chunk_frames", "local_attn_size", "sink_size")


def check_no_causal(params: DiffusionParams, card: str) -> None:
    """Refuse the causal loop's parameters for a card whose loop does not implement them."""
    given = [f"{name}={getattr(params, name)!r}" for name in CAUSAL_PARAMS
             if getattr(params, name) is not None]
    if not params.kv_cache:
        given.append("kv_cache=False")
    if given:
        raise ValueError(f"{', '.join(given)}: {card} does not generate in chunks; these "
                         "parameters are for a causal checkpoint (the wan_causal loop)")


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    """Raise ValueError if ``value`` is not a multiple of ``multiple``, suggesting neighbours."""
    if value % multiple:
        lo = max(multiple, value // multiple * multiple)
        raise ValueError(f"{name}={value} is not divisible by {multiple} ({why}); "
                         f"try {lo} or {lo + multiple}")


def check_frames(num_frames: Any, factor: int, why: str) -> None:
    """Raise ValueError unless ``num_frames`` is ``factor * k + 1`` (a causal video VAE keeps the
    first frame and compresses the others by ``factor``), suggesting the two nearest counts."""
    if not isinstance(num_frames, int) or num_frames < 1 or num_frames % factor != 1 % factor:
        n = num_frames if isinstance(num_frames, int) else 1
        below = max(1, (n - 1) // factor * factor + 1)
        raise ValueError(
            f"num_frames={num_frames!r} is not of the form {factor}k+1 ({why} compresses time by "
            f"{factor}); try {below} or {below + factor}")
