"""Running a model in less memory: component offload, VAE tiling and slicing.

What ``flowseam.load(offload=..., vae_tiling=..., vae_slicing=...)`` and the commands'
``--offload``, ``--vae-tiling`` and ``--vae-slicing`` ask for, checked against the checkpoint and
the platform before any weights load (:meth:`MemoryOptions.check_against`), then applied to the
built model (:class:`Components`, :func:`offload_model`). Each is the mechanism diffusers users
know: ``offload="model"`` is ``pipe.enable_model_cpu_offload()`` (accelerate's
``cpu_offload_with_hook`` chained in the order a request runs the components), ``vae_tiling``
and ``vae_slicing`` the VAE's ``enable_tiling()`` and ``enable_slicing()``;
``offload="text_encoder"`` frees the text encoders once a request's prompts are encoded, and a
later prompt the cache misses builds them again through the platform. docs/memory.md says what
each saves and when each is refused (no accelerator to offload to; tiling in the causal loop).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import InvalidInputError

#: what ``offload`` may be
OFFLOAD = ("model", "text_encoder")


@dataclass(frozen=True)
class MemoryOptions:
    """The memory options of one loaded model (module docstring).

    :param offload: None, ``"model"`` or ``"text_encoder"``.
    :param vae_tiling: False, True (diffusers' default tiles) or ``enable_tiling``'s arguments.
    :param vae_slicing: decode one sample at a time.
    """

    offload: str | None = None
    vae_tiling: bool = False
    vae_slicing: bool = False
    tiling_args: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def check(cls, offload: str | None, vae_tiling: Any, vae_slicing: Any) -> "MemoryOptions":
        """Validate the values alone (no checkpoint needed).

        :raises InvalidInputError: naming the value and what is allowed.
        """
        name = None if offload in (None, "none") else str(offload).replace("-", "_")
        if name is not None and name not in OFFLOAD:
            raise InvalidInputError(f"offload={offload!r}: use model or text_encoder (or none)")
        args: dict[str, Any] = {}
        if isinstance(vae_tiling, dict):
            args, vae_tiling = dict(vae_tiling), True
        if not isinstance(vae_tiling, bool) or not isinstance(vae_slicing, bool):
            raise InvalidInputError(f"vae_tiling={vae_tiling!r} and vae_slicing={vae_slicing!r} "
                                    "must be true or false (vae_tiling: or a dict of tile sizes)")
        return cls(name, vae_tiling, vae_slicing, args)

    def check_against(self, card: Any, plan: list[tuple[Any, str]], platform: Any) -> None:
        """Refuse, before any weights load, what this checkpoint or platform cannot do: offload
        with nothing to offload to, tiling or slicing on a VAE class without it (or tile
        arguments it does not take), tiling in the causal loop.

        :param plan: ``(ComponentEntry, dotted class)`` of every component to build.
        :raises InvalidInputError: naming the option, the class or the platform.
        """
        if self.offload == "model":
            devices = {platform.component_plan(e.kind)[0] for e, _ in plan}
            if devices <= {"cpu"}:
                raise InvalidInputError(
                    f"offload=model: platform {platform.name!r} builds every component on the "
                    "CPU, so there is no accelerator to offload from (use offload text_encoder "
                    "to free the text encoder once the prompt is encoded, or --dtype bfloat16)")
        if not (self.vae_tiling or self.vae_slicing):
            return
        vae = [cls for e, cls in plan if e.kind == "vae" and e.name == "vae"]
        if not vae:
            raise InvalidInputError(f"vae_tiling/vae_slicing: {card.name} has no vae")
        from .seam.components import import_class

        vae_cls = import_class(vae[0])
        for option, method in (("vae_tiling", "enable_tiling"), ("vae_slicing", "enable_slicing")):
            if getattr(self, option) and not callable(getattr(vae_cls, method, None)):
                raise InvalidInputError(f"{option}: {vae_cls.__name__} has no {method}(); "
                                        f"{card.name}'s VAE decodes whole")
        if self.vae_tiling and "wan_causal" in card.loops:
            raise InvalidInputError(
                f"vae_tiling: {card.name} decodes chunk by chunk through the VAE's causal cache "
                "(streaming), which tiled decoding cannot do; leave tiling off")
        if self.tiling_args:
            allowed = [p for p in inspect.signature(vae_cls.enable_tiling).parameters
                       if p != "self"]
            unknown = sorted(set(self.tiling_args) - set(allowed))
            if unknown:
                raise InvalidInputError(f"vae_tiling: {vae_cls.__name__}.enable_tiling takes "
                                        f"{', '.join(allowed)}; not {', '.join(unknown)}")


class Components(dict):
    """A model's components by name; one that was released (:meth:`release`) is built again
    on first access (``components[name]``), and still counts as present (``name in``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._released: dict[str, Callable[[], Any]] = {}

    def release(self, name: str, rebuild: Callable[[], Any]) -> None:
        """Drop ``name`` (its memory is freed when nothing else holds it); ``rebuild()`` makes
        it again when it is next used."""
        if dict.__contains__(self, name):
            dict.__delitem__(self, name)
            self._released[name] = rebuild

    def is_released(self, name: str) -> bool:
        return name in self._released

    def __missing__(self, name: str) -> Any:
        if name not in self._released:
            raise KeyError(name)
        value = self._released.pop(name)()
        self[name] = value
        return value

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self._released


def offload_model(modules: list[Any], device: Any) -> list[Any]:
    """Chain accelerate's ``cpu_offload_with_hook`` over ``modules`` (in the order a request
    runs them), as diffusers' ``enable_model_cpu_offload`` does: each lives on the CPU and is
    moved to ``device`` for its forward; running one moves the previous back. Returns the hooks.
    """
    from accelerate import cpu_offload_with_hook

    hooks, previous = [], None
    for module in modules:
        module.to("cpu")
        _, previous = cpu_offload_with_hook(module, device, prev_module_hook=previous)
        hooks.append(previous)
    return hooks


def advice(kinds: tuple[str, ...], memory: MemoryOptions, dtypes: dict[str, str]) -> str:
    """Which of the memory options would lower the memory a component of ``kinds`` needs,
    given those already on (``memory``) and the dtype asked for each kind (``dtypes``)."""
    tips = []
    if "vae" in kinds:
        if not memory.vae_tiling:
            tips.append("--vae-tiling (vae_tiling=True) decodes in tiles")
        if not memory.vae_slicing:
            tips.append("--vae-slicing decodes one sample at a time")
    if not dtypes or any(dtypes.get(k, "float32") == "float32" for k in kinds):
        tips.append("--dtype bfloat16 halves the weights and activations")
    if memory.offload is None:
        tips.append("--offload text-encoder frees the text encoder once the prompt is encoded"
                    " (--offload model on an accelerator)")
    tips.append("fewer or smaller frames" if "vae" in kinds or "dit" in kinds else
                "a machine with more memory")
    return "what lowers it: " + "; ".join(tips)


def weight_bytes(folder: Any, dtype: str | None) -> int:
    """The bytes the floating-point tensors of the safetensors files in ``folder`` take in
    ``dtype`` (None: as stored), read from the files' headers."""
    import json
    from pathlib import Path

    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    stored = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U8": 1, "BOOL": 1}
    total = 0
    for path in Path(folder).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            floating = info["dtype"] in ("F64", "F32", "BF16", "F16")
            total += count * (size[dtype] if floating and dtype else stored.get(info["dtype"], 4))
    return total
