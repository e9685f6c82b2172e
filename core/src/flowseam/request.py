"""Generation requests: the task, its parameters, and the checks every card applies.

A request is a prompt plus :class:`DiffusionParams`; fields left ``None`` take the card's
defaults (:meth:`DiffusionParams.with_defaults`). Each card validates the result before any
model runs, and every error names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidInputError, InvalidParameterError
from .request_fields import normalize_cache, normalize_lora


class TaskType(str, enum.Enum):
    """What a request produces: an image from text, a video from text, a video from an image."""

    T2I = "t2i"
    T2V = "t2v"
    I2V = "i2v"


#: The largest seed a ``torch.Generator`` takes (``manual_seed`` accepts ``[0, 2**64 - 1]``).
MAX_SEED = 2**64 - 1


def _check_number(name: str, value: Any, kind: type, low: float | None, high: float | None) -> Any:
    """``value`` as ``kind`` (int or float) if it is one, finite and in ``[low, high]`` (``low``
    exclusive when given as ``(low,)``, see :data:`_FIELD_RULES`).

    :raises InvalidParameterError: naming ``name`` and the allowed range.
    """
    exclusive = isinstance(low, tuple)
    lo = low[0] if exclusive else low
    allowed = ("an integer" if kind is int else "a finite number") + (
        f" > {lo:g}" if exclusive else f" >= {lo:g}" if lo is not None else "") + (
        f" and <= {high}" if high is not None else "")
    ok_type = (isinstance(value, numbers.Integral) if kind is int else isinstance(value, numbers.Real))
    if isinstance(value, bool) or not ok_type:
        raise InvalidParameterError(name, f"{name}={value!r} must be {allowed}")
    value = kind(value)
    if kind is float and not math.isfinite(value):
        raise InvalidParameterError(name, f"{name}={value!r} must be {allowed}")
    if lo is not None and (value <= lo if exclusive else value < lo):
        raise InvalidParameterError(name, f"{name}={value!r} must be {allowed}")
    if high is not None and value > high:
        raise InvalidParameterError(name, f"{name}={value!r} must be {allowed}")
    return value


#: field → (type, lower bound (a 1-tuple: exclusive), upper bound), checked when the field is set.
_FIELD_RULES: dict[str, tuple[type, Any, Any]] = {
    "num_steps": (int, 1, None),
    "guidance_scale": (float, 0.0, None),
    "guidance_scale_2": (float, 0.0, None),
    "flow_shift": (float, (0.0,), None),
    "seed": (int, 0, MAX_SEED),
    "height": (int, 1, None),
    "width": (int, 1, None),
    "num_frames": (int, 1, None),
    "noise_level": (float, 0.0, None),
    "max_sequence_length": (int, 1, None),
    "chunk_frames": (int, 1, None),
    "local_attn_size": (int, 1, None),
    "sink_size": (int, 0, None),
    "frame_rate": (float, (0.0,), None),
    "audio_guidance_scale": (float, 0.0, None),
    "stages": (int, 1, 2),
    "refine_guidance_scale": (float, 0.0, None),
}


def memory_bytes(params: DiffusionParams, batch: int = 1) -> int:
    """A lower bound of the host memory a request needs, in bytes: the decoded frames in float32
    (``B * F * H * W * 3 * 4``) plus their uint8 copy for writing, and the sigma schedule
    (``num_steps + 1`` float64 sigmas and float32 timesteps, in numpy and torch). Latents and
    activations come on top (card- and model-dependent), so a request refused by this bound
    cannot run anywhere near this machine."""
    frames = batch * (params.num_frames or 1) * (params.height or 1) * (params.width or 1) * 3
    steps = (params.num_steps or 0) + 1
    return frames * (4 + 1) + steps * (8 + 4) * 2


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def check_memory(params: DiffusionParams, batch: int = 1) -> None:
    """Refuse a request whose :func:`memory_bytes` lower bound exceeds this machine's physical
    memory, before anything is allocated.

    :raises InvalidParameterError: saying how much the request needs and how much there is.
    """
    need, have = memory_bytes(params, batch), physical_memory()
    if have is not None and need > have:
        frames, side = params.num_frames or 1, max(params.height or 1, params.width or 1)
        field = ("num_steps" if (params.num_steps or 0) * 24 > need // 2
                 else "num_frames" if frames > side else "height")
        raise InvalidParameterError(
            field, f"this request (batch {batch}, {params.num_frames or 1} frame(s) of "
            f"{params.height}x{params.width}, {params.num_steps} steps) needs at least "
            f"{need / 2**30:,.1f} GiB of memory; this machine has {have / 2**30:,.1f} GiB")


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
        indices) are SDE steps with a log-prob; the others are ODE (Euler) steps, in the causal
        loop Self-Forcing's x0 + re-noise steps, with the window counted per chunk. None: every
        step.
        Training on a window of one or two early steps is Flow-GRPO-Fast (the Flow-GRPO
        repository) and MixGRPO (Li et al. 2025): the reward's spread then comes from the noise
        of those steps only, so the policy gradient is far less noisy per sample.
    :param max_sequence_length: text tokens kept by the text encoder.
    :param lora: the request's LoRA adapter set: a tuple of :class:`flowseam.request_fields.LoraSpec`
        (path, weight, expert); strings ``"PATH[:WEIGHT][@EXPERT]"`` and mappings are converted
        (:func:`flowseam.request_fields.normalize_lora`). Empty: the base model. Each file is read
        once per model and switched per request (:mod:`flowseam.models.adapters`).
    :param cache: the step-cache policy (:class:`flowseam.request_fields.CachePolicy`, or
        ``"NAME:THRESHOLD"``; :func:`flowseam.request_fields.normalize_cache`): skip the DiT on steps
        where its velocity changes little (:mod:`flowseam.loops.step_cache`). None
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
            object.__setattr__(self, "lora", normalize_lora(self.lora))
        elif self.lora is None:
            object.__setattr__(self, "lora", ())
        if self.cache is not None:
            object.__setattr__(self, "cache", normalize_cache(self.cache))
        self.validate()

    def validate(self) -> None:
        """Check every field that is set, before any model loads: integers are integers (not
        floats or bools), numbers are finite and in range, the seed fits a ``torch.Generator``.

        :raises InvalidParameterError: (a ``ValueError``) naming the field, the bad value and what
            is allowed.
        """
        for name, (kind, low, high) in _FIELD_RULES.items():
            value = getattr(self, name)
            if value is None:
                continue
            checked = _check_number(name, value, kind, low, high)
            if checked is not value:
                object.__setattr__(self, name, checked)
        for flag in ("sde_rollout", "kv_cache"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidParameterError(flag, f"{flag}={getattr(self, flag)!r} must be true or false")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidParameterError("negative_prompt", f"negative_prompt={self.negative_prompt!r} "
                                        "must be a string")
        if self.sde_window is not None:
            window = self.sde_window
            ok = (isinstance(window, tuple) and len(window) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in window)
                  and 0 <= window[0] < window[1])
            if not ok or (self.num_steps is not None and window[0] >= self.num_steps):
                raise InvalidParameterError(
                    "sde_window", f"sde_window={window!r} must be [start, end) step indices with "
                    f"0 <= start < end and start < num_steps={self.num_steps}")

    def with_defaults(self, defaults: dict[str, Any]) -> "DiffusionParams":
        """A copy with every ``None`` field filled from ``defaults`` (a card's).

        :raises ValueError: for a :data:`CARD_SPECIFIC` field that is set although ``defaults``
            has no entry for it (the card does not take it).
        """
        for name in CARD_SPECIFIC:
            if getattr(self, name) is not None and name not in defaults:
                raise InvalidInputError(
                    f"{name}={getattr(self, name)!r} is not a parameter of this model "
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
        """One seed per prompt, each in ``[0, 2**64 - 1]`` (what ``torch.Generator.manual_seed``
        takes). Raises ValueError if ``seeds`` has the wrong length or a seed is out of range."""
        n = len(self.prompts)
        if self.seeds is None:
            base = 0 if params.seed is None else params.seed
            if base + n - 1 > MAX_SEED:
                raise InvalidParameterError(
                    "seed", f"seed={base} with {n} samples needs seeds up to {base + n - 1}, over "
                    f"the generator's maximum {MAX_SEED}")
            return [base + i for i in range(n)]
        if len(self.seeds) != n:
            raise InvalidInputError(
                f"seeds has {len(self.seeds)} entries for {n} prompts; give one each")
        return [_check_number("seeds[]", s, int, 0, MAX_SEED) for s in self.seeds]


def check_common(params: DiffusionParams, request: GenerationRequest | None = None) -> None:
    """Checks that hold for every card, after its defaults are filled in: the fields the card
    needs are set, and the request fits in memory (:func:`check_memory`). Raises ValueError
    naming the bad value."""
    params.validate()  # a DiffusionParams changed with object.__setattr__ is checked again
    batch = 1
    if request is not None:
        prompts = request.prompts
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise InvalidInputError(
                f"prompt={request.prompt!r} must be a string or a non-empty list of strings")
        batch = len(prompts)
        request.sample_seeds(params)  # every seed in the generator's range
    for name in ("num_steps", "height", "width"):
        if getattr(params, name) is None:
            raise InvalidParameterError(name, f"{name} is not set and the card has no default")
    check_memory(params, batch)


#: the parameters only the ``wan_causal`` loop implements
CAUSAL_PARAMS = ("chunk_frames", "local_attn_size", "sink_size")


def check_no_causal(params: DiffusionParams, card: str) -> None:
    """Refuse the causal loop's parameters for a card whose loop does not implement them."""
    given = [f"{name}={getattr(params, name)!r}" for name in CAUSAL_PARAMS
             if getattr(params, name) is not None]
    if not params.kv_cache:
        given.append("kv_cache=False")
    if given:
        raise InvalidInputError(f"{', '.join(given)}: {card} does not generate in chunks; these "
                                "parameters are for a causal checkpoint (the wan_causal loop)")


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    """Raise ValueError if ``value`` is not a multiple of ``multiple``, suggesting neighbours."""
    if value % multiple:
        lo = max(multiple, value // multiple * multiple)
        raise InvalidInputError(f"{name}={value} is not divisible by {multiple} ({why}); "
                                f"try {lo} or {lo + multiple}")


def check_frames(num_frames: Any, factor: int, why: str) -> None:
    """Raise ValueError unless ``num_frames`` is ``factor * k + 1`` (a causal video VAE keeps the
    first frame and compresses the others by ``factor``), suggesting the two nearest counts."""
    if not isinstance(num_frames, int) or num_frames < 1 or num_frames % factor != 1 % factor:
        n = num_frames if isinstance(num_frames, int) else 1
        below = max(1, (n - 1) // factor * factor + 1)
        raise InvalidInputError(
            f"num_frames={num_frames!r} is not of the form {factor}k+1 ({why} compresses time by "
            f"{factor}); try {below} or {below + factor}")
