"""ComponentSpec (what to build) and the shared loader backends use to instantiate it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import CheckpointError, FlowseamError, InvalidInputError, UntrustedComponentError

#: Component kinds flowseam's cards use; a backend declares the ones it builds
#: (``flowseam_component_kinds``) and every other kind falls back to cpu:
#:
#: * ``dit``: the denoiser (velocity prediction; LTX-2's denoises video and audio together);
#: * ``vae``: the (video/image) autoencoder; ``text_encoder`` and ``tokenizer``;
#: * ``image_encoder``, ``image_processor``: Wan I2V's CLIP image conditioning;
#: * ``text_connectors``: LTX-2's ``LTX2TextConnectors`` (text encoder hidden states → one
#:   embedding per modality);
#: * ``audio_vae``: LTX-2's audio autoencoder (latents ↔ mel spectrogram);
#: * ``vocoder``: mel spectrogram → waveform (LTX-2's ``LTX2Vocoder``);
#: * ``latent_upsampler``: LTX-2's ``LTX2LatentUpsamplerModel`` (video latents x2 spatially);
#: * ``language_model``: the prompt refiner's causal LM (:mod:`flowseam.prompt_refiner`).
KINDS = ("dit", "vae", "text_encoder", "tokenizer", "image_encoder", "image_processor",
         "text_connectors", "audio_vae", "vocoder", "latent_upsampler", "language_model")

#: Kinds the loops run as ``torch.nn.Module`` (a builder must return a module for these).
MODULE_KINDS = ("dit", "vae", "text_encoder", "image_encoder")


@dataclass(frozen=True)
class ComponentSpec:
    """Where one component's weights are and which class loads them.

    :param name: the component's name in the pipeline (``"transformer"``, ``"vae"``, ...).
    :param cls: dotted path of the class, e.g. ``"diffusers.WanTransformer3DModel"`` or
        ``"transformers.UMT5EncoderModel"``.
    :param path: a diffusers-format checkpoint directory (weights under ``subfolder``), or None
        to build from ``config`` with random weights.
    :param subfolder: the component's folder inside ``path`` (``"transformer"``).
    :param config: constructor config when ``path`` is None.
    :param dtype: the dtype the card asks for (``"float32"``, ``"bfloat16"``), or None to let
        the backend choose.
    """

    name: str
    cls: str
    path: str | None = None
    subfolder: str | None = None
    config: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.path is None and self.config is None:
            raise InvalidInputError(
                f"ComponentSpec {self.name!r}: give a checkpoint path or a config")

    def describe(self) -> str:
        where = f"{self.path}/{self.subfolder}" if self.path and self.subfolder else (self.path or "config")
        return f"{self.name} ({self.cls} from {where})"


#: The libraries whose classes a checkpoint may name without any plugin declaring them.
TRUSTED_LIBRARIES = ("diffusers", "transformers")


def check_component_class(library: Any, cls: Any, declared: Iterable[str], source: str) -> str:
    """The dotted path ``"<library>.<cls>"`` of a component class a checkpoint names, if flowseam
    may import it: ``library`` is one of :data:`TRUSTED_LIBRARIES` (or a submodule of one), or the
    dotted path is one of ``declared`` (what installed plugins declare through
    ``flowseam_component_classes``). Nothing is imported here.

    A bare ``library`` that names a ``diffusers.pipelines`` subpackage (``"ltx2"``, as diffusers
    writes a pipeline's own modules) is that subpackage of diffusers, never a module of that name
    elsewhere.

    :param source: where the name was read (``".../model_index.json: 'vae'"``), for the message.
    :raises UntrustedComponentError: naming the module, for anything else; the module is not
        imported (no code from a checkpoint folder ever runs).
    """
    if not isinstance(library, str) or not isinstance(cls, str) or not cls.isidentifier() \
            or not all(part.isidentifier() for part in library.split(".")):
        raise UntrustedComponentError(
            f"{source} names component class {[library, cls]!r}; expected [library, ClassName] "
            "such as ['diffusers', 'AutoencoderKLWan']")
    dotted = f"{library}.{cls}"
    if library.split(".")[0] in TRUSTED_LIBRARIES or dotted in set(declared):
        return dotted
    if "." not in library and _is_diffusers_pipeline(library):
        # diffusers writes a pipeline's own modules by subpackage name (["ltx2", "LTX2TextConnectors"])
        return f"diffusers.pipelines.{library}.{cls}"
    raise UntrustedComponentError(
        f"{source} names component class {cls!r} from module {library!r}, which flowseam does not "
        f"import: component classes come only from {' and '.join(TRUSTED_LIBRARIES)}, or from a "
        "class an installed flowseam plugin declares (flowseam_component_classes). A checkpoint "
        f"folder never decides which code runs; {library!r} was not imported")


def _is_diffusers_pipeline(name: str) -> bool:
    """Whether ``diffusers.pipelines.<name>`` exists (found, not imported: only diffusers' own
    package is imported to look)."""
    import importlib.util

    try:
        return importlib.util.find_spec(f"diffusers.pipelines.{name}") is not None
    except (ImportError, ValueError):
        return False


def import_class(dotted: str) -> type:
    """Import ``"package.module.Class"`` or ``"package.Class"``.

    :raises FlowseamError: naming the path when it cannot be imported.
    """
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise FlowseamError(f"cannot import component class {dotted!r}: {exc}") from exc


def instantiate(spec: ComponentSpec, device: str = "cpu", dtype: Any = None) -> Any:
    """Build ``spec`` with its real class, on torch ``device`` in ``dtype``.

    Loads ``cls.from_pretrained(path, subfolder=...)`` for a checkpoint (diffusers models,
    transformers models, tokenizers and processors alike), or instantiates from ``config``.
    ``torch.nn.Module`` results are moved to ``device``/``dtype`` and put in eval mode.

    :param device: a torch device string (``"cpu"``, ``"cuda:0"``).
    :param dtype: a ``torch.dtype`` or None to keep the checkpoint's dtype.
    :raises FlowseamError: if the class cannot be imported or the checkpoint folder is missing.
    :raises CheckpointError: if the files cannot be read, or the component's ``config.json``
        disagrees with its weights (:func:`check_loading_info`).
    """
    import torch

    cls = import_class(spec.cls)
    cast = dtype is not None
    if spec.path is not None:
        folder = Path(spec.path) / (spec.subfolder or "")
        if not folder.is_dir():
            raise FlowseamError(f"component {spec.name!r}: checkpoint folder {folder} does not exist")
        kwargs: dict[str, Any] = {}
        if spec.subfolder:
            kwargs["subfolder"] = spec.subfolder
        is_module = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
        if is_module:
            kwargs["output_loading_info"] = True  # checked below: config vs weights
        if dtype is not None and is_module:
            # load in the target dtype, so a model's keep-in-float32 modules are honoured
            kwargs["dtype" if cls.__module__.startswith("transformers") else "torch_dtype"] = dtype
            cast = False
        try:
            # a diffusers model converted on load: one tensor at a time (flowseam.seam.weights)
            obj = _load_converted(cls, folder, dtype) if dtype is not None and is_module else None
            if obj is None:
                obj = cls.from_pretrained(spec.path, **kwargs)
        except Exception as exc:  # corrupt or incomplete files, shapes the config does not give
            files = sorted(p.name for p in folder.iterdir())
            raise CheckpointError(f"cannot load component {spec.name!r} ({spec.cls}) from {folder} "
                                  f"(files: {', '.join(files) or 'none'}): {type(exc).__name__}: "
                                  f"{exc}") from exc
        if is_module:
            obj, info = obj
            check_loading_info(spec, folder, info)
    elif hasattr(cls, "from_config") and not hasattr(cls, "config_class"):
        obj = cls.from_config(spec.config)  # diffusers
    elif getattr(cls, "config_class", None) is not None:
        obj = cls(cls.config_class(**spec.config))  # transformers
    else:
        obj = cls(**spec.config)
    if isinstance(obj, torch.nn.Module):
        if cast and any(p.dtype != dtype for p in obj.parameters()):
            obj = obj.to(dtype=dtype)
        obj = obj.to(device)
        obj.eval()
    return obj


def _load_converted(cls: type, folder: Path, dtype: Any) -> Any:
    """:func:`flowseam.seam.weights.load_converted` for a diffusers model class, else None."""
    try:
        from diffusers import ModelMixin
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    if not issubclass(cls, ModelMixin):
        return None
    from .weights import load_converted

    return load_converted(cls, folder, dtype)


def check_loading_info(spec: ComponentSpec, folder: Path, info: dict[str, Any]) -> None:
    """Refuse a component whose ``config.json`` disagrees with its weights.

    ``info`` is what diffusers' and transformers' ``from_pretrained(..., output_loading_info=True)``
    report: ``missing_keys`` (the config builds tensors the weights do not have: they would stay
    randomly initialised), ``unexpected_keys`` (the weights have tensors the config does not build:
    a smaller model than the checkpoint would run), ``mismatched_keys`` and ``error_msgs``. Both
    libraries only log these (a warning flowseam's console silences); flowseam makes them errors.

    :raises CheckpointError: naming the tensors (the first few of each list, and how many).
    """
    problems = []
    for key, what in (("missing_keys", "missing tensor(s), in the model but not in the weights "
                                        "(they would stay randomly initialised)"),
                      ("unexpected_keys", "unexpected tensor(s), in the weights but not in the "
                                          "model (the config builds a smaller model than the "
                                          "checkpoint)")):
        names = sorted(info.get(key) or ())
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            problems.append(f"{len(names)} {what}: {shown}")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        problems.append("shape mismatches: " + ", ".join(
            f"{m[0]} {tuple(m[1])} in the weights vs {tuple(m[2])} in the model" if len(m) == 3
            else str(m) for m in mismatched[:5]))
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"])))
    if problems:
        raise CheckpointError(f"component {spec.name!r} ({spec.cls}) in {folder}: config.json does "
                              "not match the weights: " + "; ".join(problems))


@dataclass(frozen=True)
class ComponentRecord:
    """Where a component was built and why there.

    :ivar fallback: True when it was built on a later device of the chain than the first.
    :ivar reason: why it is not on the first device (empty when it is).
    :ivar dtype: its parameters' dtype (:func:`module_dtype`: ``"bfloat16"``, or
        ``"bfloat16+float32"`` for a mixed-precision module); empty for a tokenizer or processor.
    """

    kind: str
    name: str
    device: str
    plugin: str
    fallback: bool
    reason: str = ""
    distribution: str = "?"
    version: str = "?"
    dtype: str = ""


def compute_dtype(obj: Any) -> Any:
    """The lowest-precision floating-point dtype of ``obj``'s parameters (``torch.bfloat16`` for
    a bf16 model with float32 norms), ``torch.float32`` when it has none (a tokenizer)."""
    import torch

    try:
        found = {p.dtype for p in obj.parameters() if p.is_floating_point()}
    except (AttributeError, TypeError):
        found = set()
    return min(found, key=lambda d: (d.itemsize, str(d))) if found else torch.float32


#: the inputs :func:`cast_inputs` casts by default: the activations diffusers' pipelines hand a
#: transformer (or a VAE) in its dtype — latents and embeddings. Timesteps, sigmas, RoPE
#: coordinates, position ids and masks stay as the caller gave them (float32), as in diffusers'
#: pipelines: in bfloat16 a timestep near 1000 or a video coordinate would lose its low bits
#: before the model's own float32 embedding of it.
ACTIVATIONS = ("hidden_states", "encoder_hidden_states", "audio_hidden_states",
               "audio_encoder_hidden_states", "encoder_hidden_states_image",
               "pooled_projections", "sample", "x", "z")


def cast_inputs(module: Any, dtype: Any = None, names: tuple[str, ...] = ACTIVATIONS) -> Any:
    """Make ``module`` cast its floating-point tensor inputs named in ``names`` (positional or
    keyword, nested in lists and tuples too) to ``dtype`` before ``forward`` runs: a forward
    pre-hook. For a component a backend builds in reduced precision, so that a caller holding
    float32 tensors (the conformance suite's replays, a workflow's other model, user code) can
    call it as it calls the float32 build. Other inputs (:data:`ACTIVATIONS`), integer and bool
    tensors are left alone.

    :param dtype: default :func:`compute_dtype` of ``module``.
    :param names: the ``forward`` parameters to cast.
    :returns: ``module`` (the hook is registered in place).
    """
    import inspect

    import torch

    dtype = compute_dtype(module) if dtype is None else dtype
    positional = list(inspect.signature(module.forward).parameters)

    def cast(value: Any) -> Any:
        if torch.is_tensor(value) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    def hook(_module: Any, args: tuple, kwargs: dict) -> tuple:
        args = tuple(cast(v) if i < len(positional) and positional[i] in names else v
                     for i, v in enumerate(args))
        return args, {k: cast(v) if k in names else v for k, v in kwargs.items()}

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return module


def module_dtype(obj: Any) -> str:
    """The floating-point dtypes of ``obj``'s parameters, lowest precision first, joined by
    ``+`` (``"float32"``; ``"bfloat16+float32"`` for a bf16 model that keeps its norms in
    float32); ``""`` for an object without floating-point parameters (a tokenizer)."""
    try:
        found = {p.dtype for p in obj.parameters() if p.is_floating_point()}
    except (AttributeError, TypeError):
        return ""
    return "+".join(str(d).removeprefix("torch.") for d in sorted(found, key=lambda d: (d.itemsize, str(d))))
