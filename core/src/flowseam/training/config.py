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
