"""The values of a request's two policy fields, parsed and checked where the request is made.

:class:`~flowseam.request.DiffusionParams` takes them in any form users write (a string from the
CLI, a mapping from the HTTP API or a TOML file, the object itself) and keeps the one hashable
form defined here: ``lora``, a tuple of :class:`LoraSpec` (:func:`normalize_lora`), the adapter
set that :class:`flowseam.models.adapters.AdapterSet` switches the model's DiT experts to; ``cache``, a
:class:`CachePolicy` or None (:func:`normalize_cache`), the policy that
:class:`flowseam.loops.step_cache.StepCache` runs in the loop. Parsing needs neither a model nor
a loop, so it lives here, in the seam below both: a request is checked before any model loads,
and :mod:`flowseam.request` imports nothing above the seam. :mod:`flowseam.models.adapters` and
:mod:`flowseam.loops.step_cache` re-export these names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidInputError


@dataclass(frozen=True)
class LoraSpec:
    """One adapter of a request's set.

    :param path: a ``.safetensors`` LoRA file (diffusers/peft, kohya or ComfyUI layout).
    :param weight: its scale (diffusers' ``set_adapters`` weight): 1.0 applies it as trained,
        0 not at all; negative values are allowed (as in diffusers).
    :param expert: the DiT expert it applies to (``"transformer_2"`` for Wan2.2's low-noise
        expert); None: the first expert (what ``load_lora_weights`` loads into).
    """

    path: str
    weight: float = 1.0
    expert: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """``PATH[:WEIGHT][@EXPERT]`` (``--lora``). :raises ValueError: for a weight that is
        not a number, or an empty path."""
        path, expert = text, None
        match = re.fullmatch(r"(.*)@([A-Za-z_][A-Za-z0-9_]*)", path)
        if match:
            path, expert = match.groups()
        weight = 1.0
        head, sep, tail = path.rpartition(":")
        if sep and head and not tail.startswith(("/", "\\")):
            try:
                weight = float(tail)
            except ValueError:
                raise InvalidInputError(
                    f"--lora {text!r}: weight {tail!r} is not a number; write "
                    "PATH[:WEIGHT][@EXPERT], e.g. style.safetensors:0.8") from None
            path = head
        if not path:
            raise InvalidInputError(f"--lora {text!r} names no file; write PATH[:WEIGHT][@EXPERT]")
        return cls(path, weight, expert)

    @property
    def key(self) -> tuple[str, str | None]:
        """(absolute path, expert): what identifies a loaded adapter."""
        return str(Path(self.path).expanduser().resolve()), self.expert


_SPEC_KEYS = ("path", "weight", "expert")


def normalize_lora(value: Any) -> tuple[LoraSpec, ...]:
    """A request's adapter set as a hashable tuple of :class:`LoraSpec` from what users pass:
    None, a spec, ``"PATH[:WEIGHT][@EXPERT]"``, a mapping ``{"path", "weight", "expert"}`` (the
    HTTP API, TOML), or a list of those.

    :raises ValueError: for anything else, or one adapter named twice for the same expert.
    """
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    specs = []
    for item in items:
        if isinstance(item, LoraSpec):
            specs.append(item)
        elif isinstance(item, str):
            specs.append(LoraSpec.parse(item))
        elif isinstance(item, dict) and "path" in item and set(item) <= set(_SPEC_KEYS):
            weight = item.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise InvalidInputError(f"lora weight={weight!r} must be a number")
            specs.append(LoraSpec(str(item["path"]), float(weight), item.get("expert")))
        else:
            raise InvalidInputError(f"lora={item!r}: give 'PATH[:WEIGHT][@EXPERT]' or "
                                    "{'path': ..., 'weight': ..., 'expert': ...}")
    keys = [s.key for s in specs]
    twice = sorted({k[0] for k in keys if keys.count(k) > 1})
    if twice:
        raise InvalidInputError(
            f"lora names {', '.join(twice)} twice; give each adapter once, with "
            "its weight")
    return tuple(specs)


#: step-cache policy name → how a skipped step's velocity is predicted
#: (:meth:`flowseam.loops.step_cache.StepCache.velocity`)
POLICIES = ("reuse", "extrapolate")


@dataclass(frozen=True)
class CachePolicy:
    """A request's step-cache policy (hashable; ``DiffusionParams.cache``).

    :param name: ``"reuse"`` or ``"extrapolate"`` (:data:`POLICIES`).
    :param threshold: the accumulated relative change of the velocity at which the DiT runs
        again (>= 0; 0 computes every step).
    :param warmup: the first steps always computed (>= 2).
    :param max_skips: the most consecutive steps a branch may skip.
    :param in_rollouts: allow the policy in RL rollouts with capture (off: such a rollout is
        refused, since its log-probs would not be those of the model that is trained).
    """

    name: str
    threshold: float
    warmup: int = 2
    max_skips: int = 3
    in_rollouts: bool = False

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InvalidInputError(
                f"cache={self.name!r} is unknown; policies: {', '.join(POLICIES)}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not self.threshold >= 0:
            raise InvalidInputError(f"cache threshold={self.threshold!r} must be a number >= 0")
        if not isinstance(self.warmup, int) or self.warmup < 2:
            raise InvalidInputError(
                f"cache warmup={self.warmup!r} must be an integer >= 2 (two computed "
                "steps measure the velocity's rate of change)")
        if not isinstance(self.max_skips, int) or self.max_skips < 1:
            raise InvalidInputError(f"cache max_skips={self.max_skips!r} must be an integer >= 1")

    @classmethod
    def parse(cls, text: str) -> "CachePolicy":
        """``NAME:THRESHOLD`` (``--cache extrapolate:0.1``). :raises ValueError: naming the
        value and what is allowed."""
        match = re.fullmatch(r"([a-z_]+):([0-9.eE+-]+)", text.strip())
        if not match:
            raise InvalidInputError(f"--cache {text!r} must be NAME:THRESHOLD with NAME one of "
                                    f"{', '.join(POLICIES)}, e.g. extrapolate:0.1")
        try:
            threshold = float(match.group(2))
        except ValueError:
            raise InvalidInputError(f"--cache {text!r}: threshold {match.group(2)!r} is not a "
                                    "number") from None
        return cls(match.group(1), threshold)

    def __str__(self) -> str:
        return f"{self.name}:{self.threshold:g}"


def normalize_cache(value) -> CachePolicy | None:
    """A request's cache policy from None, a :class:`CachePolicy`, ``"NAME:THRESHOLD"`` or a
    mapping ``{"name", "threshold", ...}`` (the HTTP API, TOML). :raises ValueError: otherwise."""
    if value is None or isinstance(value, CachePolicy):
        return value
    if isinstance(value, str):
        return CachePolicy.parse(value)
    if isinstance(value, dict) and "name" in value and "threshold" in value:
        unknown = set(value) - set(CachePolicy.__dataclass_fields__)
        if unknown:
            raise InvalidInputError(f"cache has unknown keys {sorted(unknown)}; allowed: "
                                    f"{sorted(CachePolicy.__dataclass_fields__)}")
        return CachePolicy(**value)
    raise InvalidInputError(
        f"cache={value!r}: give 'NAME:THRESHOLD' or {{'name': ..., 'threshold': ...}}")
