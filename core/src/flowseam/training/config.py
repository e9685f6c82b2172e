"""Training configs: TOML (stdlib ``tomllib``) or YAML (PyYAML) files, or plain dicts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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
