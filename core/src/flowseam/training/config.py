"""Training configs: TOML (stdlib ``tomllib``) or YAML (PyYAML) files, or plain dicts, typed and
range-checked by one schema mechanism that every training method uses (third-party ones too).

A method declares its config as a :class:`ConfigSection` (a pydantic model: strict types, unknown
keys refused) of bounded numbers, strings, lists and nested sections::

    class MyConfig(ConfigSection):
        steps: PositiveInt = 10
        optim: OptimSection = OptimSection()

    config = validate_config(MyConfig, {"steps": 5, "optim": {"lr": 3e-4}})  # a plain dict

Strict means what the file says is what runs: ``steps = 1.5`` is not rounded, ``lr = "1e-4"`` (a
string in YAML 1.1) is not a number, ``lr = inf`` is not finite; every error names the section
and key, the value and what is allowed, before any model loads.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Mapping

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field

from ..errors import FlowseamError


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``.toml``, ``.yaml`` or ``.yml`` config.

    :raises FlowseamError: for a missing file, another suffix, or a parse error (naming the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FlowseamError(f"config file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover
                import tomli as tomllib
            data = tomllib.loads(path.read_text())
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text()) or {}
        else:
            raise FlowseamError(f"config {path}: unsupported suffix {suffix!r}; use .toml or .yaml")
    except FlowseamError:
        raise
    except Exception as exc:
        raise FlowseamError(f"cannot parse config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise FlowseamError(f"config {path} must be a table/mapping at the top level")
    base = path.parent
    for key in ("model", "output_dir", "data"):
        if isinstance(data.get(key), str) and not Path(data[key]).is_absolute() and (base / data[key]).exists():
            data[key] = str(base / data[key])
    return data


def section(config: dict[str, Any], name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """``config[name]`` merged over ``defaults``; unknown keys raise (typos are errors).

    :raises FlowseamError: naming the unknown keys and the allowed ones.
    """
    given = config.get(name) or {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise FlowseamError(f"config [{name}] has unknown key(s) {unknown}; allowed: {sorted(defaults)}")
    return {**defaults, **given}


# -- the schema mechanism -------------------------------------------------------------------------

class ConfigSection(pydantic.BaseModel):
    """A typed config section: strict types (no str → number, float → int or str → list
    coercion), unknown keys refused, defaults validated. Subclass it for a method's config and
    its sections; nest sections as fields."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


def tuple_to_list(value: Any) -> Any:
    """A ``BeforeValidator`` for list fields: a tuple (Python callers) is taken as a list."""
    return list(value) if isinstance(value, tuple) else value


#: A finite float > 0 (an int is accepted).
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: A finite float >= 0.
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: A finite float in [0, 1].
UnitFloat = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
#: A finite float in [0, 1) (Adam's betas).
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
#: An int >= 1 (a bool is not an int here).
PositiveInt = Annotated[int, Field(ge=1)]
#: An int >= 0.
NonNegativeInt = Annotated[int, Field(ge=0)]
#: A non-empty string.
Name = Annotated[str, Field(min_length=1)]
#: A non-empty list of non-empty strings (a tuple is accepted; a bare string is not).
Names = Annotated[list[Name], Field(min_length=1), BeforeValidator(tuple_to_list)]
#: The ``reward`` key of a config: a name, a reward server URL, or a table of weights (checked
#: by :func:`flowseam.rewards.spec.build_reward`, which names the bad value).
RewardSpec = Name | dict[Name, Any]
#: The ``reward_timeout`` key: finite seconds > 0.
RewardTimeout = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: ``[start, end)`` step indices with ``0 <= start < end``.
StepWindow = Annotated[list[NonNegativeInt], Field(min_length=2, max_length=2),
                       BeforeValidator(tuple_to_list)]


#: ``[optim] mixed_precision``: ``"no"``, or the autocast dtype of the trainer's forward and
#: backward over float32 master weights (accelerate's ``mixed_precision``)
MixedPrecision = typing.Literal["no", "bf16", "fp16"]


def _dtype_request(value: Any) -> Any:
    """A config's ``dtype`` (a name, ``"KIND=DTYPE,..."`` or a table), checked as
    :func:`flowseam.seam.dtypes.parse_dtypes` checks it; kept as given."""
    from ..seam.dtypes import parse_dtypes

    parse_dtypes(value)
    return value


class OptimSection(ConfigSection):
    """``[optim]``: AdamW's hyper-parameters (``torch.optim.AdamW``), and ``mixed_precision``:
    ``"bf16"`` (or ``"fp16"``) keeps the trainer's copy of the trained weights in float32 (the
    master weights AdamW updates) and runs its forward and backward under ``torch.autocast`` in
    that dtype; ``"no"``: the trainer's copy is in the rollout model's dtype."""

    lr: PositiveFloat = 1e-4
    weight_decay: NonNegativeFloat = 1e-4
    beta1: Beta = 0.9
    beta2: Beta = 0.999
    adam_eps: PositiveFloat = 1e-8
    mixed_precision: MixedPrecision = "no"


class OptimOverrides(ConfigSection):
    """A per-stage ``[<stage>_optim]`` over ``[optim]``: only the keys given replace it."""

    lr: PositiveFloat | None = None
    weight_decay: NonNegativeFloat | None = None
    beta1: Beta | None = None
    beta2: Beta | None = None
    adam_eps: PositiveFloat | None = None
    mixed_precision: MixedPrecision | None = None


class LoraSection(ConfigSection):
    """``[lora]``: peft LoRA adapters on the DiT; ``rank = 0`` trains every weight instead."""

    rank: NonNegativeInt = 0
    alpha: PositiveFloat | None = None
    target_modules: Names = ["to_q", "to_k", "to_v", "to_out.0"]


class LoraOverrides(ConfigSection):
    """A per-part ``[...lora]`` table over ``[lora]`` (``joint_multi_rl``'s
    ``[experts.<name>.lora]``): only the keys given replace it."""

    rank: NonNegativeInt | None = None
    alpha: PositiveFloat | None = None
    target_modules: Names | None = None


def _wandb_logged_in() -> bool:
    """Whether W&B has an API key to log in with: ``WANDB_API_KEY``, or the ``api.wandb.ai``
    (or ``$WANDB_BASE_URL``'s host) entry that ``wandb login`` writes to the netrc file
    (``$NETRC``, else ``~/.netrc``)."""
    import netrc
    import os
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _refused(message: str) -> Exception:
    """A validation error whose message is ``message`` as is (no "Value error, " prefix)."""
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("flowseam_refused", message)


class LoggingSection(ConfigSection):
    """``[logging]``: TensorBoard event files and a Weights & Biases run next to
    ``metrics.jsonl`` (:mod:`flowseam.training.loggers`): every numeric field of each step's
    record as a scalar, and every ``samples_every`` steps (and at step 1) the first ``samples``
    samples the step's reward scored, as images (or GIFs for videos). Each logger is an
    optional extra, refused here when it is not installed; either needs ``output_dir``."""

    tensorboard: bool = False
    wandb: typing.Literal["off", "offline", "online"] = "off"
    wandb_project: Name = "flowseam"
    samples_every: NonNegativeInt = 10
    samples: NonNegativeInt = 4

    @pydantic.field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool) -> bool:
        if value and not _installed("tensorboard"):
            raise _refused("tensorboard = true needs the tensorboard package, which is not "
                           "installed: pip install 'flowseam[tensorboard]'")
        return value

    @pydantic.field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: str) -> str:
        if value != "off" and not _installed("wandb"):
            raise _refused(f"wandb = {value!r} needs the wandb package, which is not "
                           "installed: pip install 'flowseam[wandb]' (or wandb = \"off\")")
        if value == "online" and not _wandb_logged_in():
            raise _refused("wandb = \"online\" needs a W&B login, and there is none (no "
                           "WANDB_API_KEY, no api.wandb.ai entry in ~/.netrc): run `wandb login`, "
                           "or use wandb = \"offline\" and `wandb sync` the run later")
        return value


class RunConfig(ConfigSection):
    """The keys every training method's config has: how long, from which seed, where to write
    (``metrics.jsonl``, ``checkpoints/``, ``run.json``), how often to checkpoint (always at the
    last step; 0: only then), and what else logs the run (``[logging]``: :class:`LoggingSection`).
    docs/training.md ("Config keys") says what each key means."""

    steps: PositiveInt = 10
    seed: NonNegativeInt = 0
    output_dir: Name | None = None
    checkpoint_every: NonNegativeInt = 0
    #: the loaded models' component dtypes (flowseam.load's ``dtype``; ``flowseam train
    #: --dtype``): ``"bfloat16"``, ``"dit=bfloat16,vae=float32"`` or a table; None: the backend's
    dtype: Annotated[str | dict[str, str] | None, pydantic.AfterValidator(_dtype_request)] = None
    #: recompute each DiT block's activations in the backward instead of keeping them
    #: (diffusers' ``enable_gradient_checkpointing`` on the trainer's copy)
    gradient_checkpointing: bool = False
    logging: LoggingSection = LoggingSection()

    @pydantic.field_validator("logging")
    @classmethod
    def _logging_needs_output_dir(cls, value: LoggingSection, info) -> LoggingSection:
        if (value.tensorboard or value.wandb != "off") and info.data.get("output_dir") is None \
                and "output_dir" in info.data:
            raise _refused("[logging] writes under output_dir (tensorboard/, wandb/): set "
                           "output_dir, or tensorboard = false and wandb = \"off\"")
        return value


def merge_overrides(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with every non-None value of ``overrides`` (a validated :class:`OptimOverrides`)."""
    return {**base, **{k: v for k, v in overrides.items() if v is not None}}


def validate_config(schema: type[ConfigSection], config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` checked against ``schema``, with every default filled in, as plain dicts.

    :raises FlowseamError: one message listing every problem, each naming the section and key,
        the value given and what is allowed; unknown keys are listed with the allowed ones.
    """
    if config is not None and not isinstance(config, Mapping):
        raise FlowseamError(f"config must be a table/mapping, got {type(config).__name__}")
    try:
        return schema.model_validate(dict(config or {})).model_dump()
    except pydantic.ValidationError as exc:
        raise FlowseamError(describe_errors(schema, exc)) from None


def schema_defaults(schema: type[ConfigSection]) -> dict[str, Any]:
    """Every key of ``schema`` with its default, sections as dicts (None: required, or chosen at
    run time): what a method's ``default_config()`` returns for ``--show-config``."""
    return schema.model_construct().model_dump()


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None`` (``Optional[X]``), else ``annotation``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _section_model(schema: type[pydantic.BaseModel], path: tuple) -> Any:
    """The section (a pydantic model) at ``path`` under ``schema``, or None: each part names a
    field; a key of a ``dict[str, Section]`` field (``[experts.transformer]``) is one more part."""
    model: Any = schema
    parts = list(path)
    while parts:
        part = parts.pop(0)
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = _without_none(field.annotation)
        if typing.get_origin(ann) is dict:
            if not parts:
                return None  # the table of tables itself
            parts.pop(0)
            ann = _without_none(typing.get_args(ann)[1])
        if not (isinstance(ann, type) and issubclass(ann, pydantic.BaseModel)):
            return None
        model = ann
    return model


def _section_fields(schema: type[pydantic.BaseModel], path: tuple) -> list[str]:
    model = _section_model(schema, path)
    return sorted(model.model_fields) if model is not None else []


def describe_errors(schema: type[ConfigSection], exc: pydantic.ValidationError) -> str:
    """pydantic's errors as one line each: ``config [grpo] max_grad_norm=-1: Input should be
    greater than 0``; unknown keys as ``config [grpo] has unknown key(s) ['clip']; allowed:
    [...]``."""
    unknown: dict[tuple, list[str]] = {}
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
            continue
        depth = max(k for k in range(len(loc)) if _section_model(schema, loc[:k]) is not None)
        where = f"[{'.'.join(map(str, loc[:depth]))}] " if depth else ""
        key = ".".join(str(p) for p in loc[depth:])
        given = f"={err['input']!r}" if err["type"] != "missing" else ""
        lines.append(f"config {where}{key}{given}: {err['msg']}")
    for sec, keys in unknown.items():
        where = f"[{'.'.join(map(str, sec))}] " if sec else ""
        lines.insert(0, f"config {where}has unknown key(s) {sorted(keys)}; allowed: "
                        f"{_section_fields(schema, sec)}")
    return "; ".join(lines)


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }" \
            if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # numbers and strings (a JSON string is a TOML basic string)


def as_toml(config: dict[str, Any], tables: tuple[str, ...] = (), comment: str = "") -> str:
    """A config as TOML text: top-level keys, then one ``[table]`` per name in ``tables``. A key
    whose value is None (no default: required, or chosen at run time) is written commented out.
    ``comment`` opens the text as ``#`` lines."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()] if comment else []

    def entry(key: str, value: Any) -> str:
        return f"# {key} =" if value is None else f"{key} = {_toml_value(value)}"

    lines += [entry(k, v) for k, v in config.items() if k not in tables]
    for name in tables:
        lines += ["", f"[{name}]"] + [entry(k, v) for k, v in (config.get(name) or {}).items()]
    return "\n".join(lines) + "\n"
