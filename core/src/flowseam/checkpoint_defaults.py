"""A checkpoint's own serving defaults: ``flowseam.json`` next to ``model_index.json``.

diffusers' format has no place for how a model is meant to be sampled (its size, step count,
text length, guidance), so a card's defaults — FLUX.1-dev's 1024×1024 and 512 text tokens — would
apply to every checkpoint of that architecture, including a 32×32 one trained on 32-token
prompts. A checkpoint states its own in the file's ``serve`` table
(:class:`~flowseam.DiffusionParams` fields, :data:`SERVE_KEYS`; the schema:
:func:`check_checkpoint_defaults`); diffusers ignores the file, :func:`flowseam.load` reads it.
A parameter a request leaves unset takes, in this order: the request itself, the checkpoint's
``serve`` table, what the checkpoint's ``scheduler/scheduler_config.json`` says about the
solver, the card's defaults (``ModelCard.defaults``). docs/models.md shows it from the user's
side.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from .errors import FlowseamError

#: the file, next to ``model_index.json``
FILENAME = "flowseam.json"

#: the ``serve`` keys and the type each must have
SERVE_KEYS: dict[str, type] = {
    "num_steps": int, "height": int, "width": int, "num_frames": int,
    "max_sequence_length": int, "guidance_scale": float, "flow_shift": float,
    "negative_prompt": str,
}
TOP_KEYS = ("serve", "trained")


def _check_value(path: Path, key: str, value: Any) -> Any:
    kind = SERVE_KEYS[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        what = "a positive integer"
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
        what = "a number >= 0"
    else:
        ok = isinstance(value, str)
        what = "a string"
    if not ok:
        raise FlowseamError(f"{path}: serve.{key}={value!r} must be {what}")
    return float(value) if kind is float else value


def check_checkpoint_defaults(data: Any, path: str | Path = FILENAME) -> dict[str, Any]:
    """Validate the parsed contents of a ``flowseam.json``::

        {
          "serve": {"num_steps": 20, "height": 32, "width": 32, "max_sequence_length": 32},
          "trained": {"method": "flowgrpo", "steps": 10, "base_model": "/path/to/base"}
        }

    ``serve`` holds :class:`~flowseam.DiffusionParams` fields (:data:`SERVE_KEYS`); ``trained``
    (optional, informational) is written by a training run that exported the checkpoint.

    :returns: ``data`` with the ``serve`` numbers normalised (guidance and shift as floats).
    :raises FlowseamError: naming the file and the bad key or value, and what is allowed.
    """
    path = Path(path)
    if not isinstance(data, dict):
        raise FlowseamError(f"{path} must hold a JSON object with a 'serve' table")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise FlowseamError(f"{path}: unknown key(s) {unknown}; allowed: {list(TOP_KEYS)}")
    serve = data.get("serve", {})
    if not isinstance(serve, dict):
        raise FlowseamError(f"{path}: 'serve' must be a table of sampling defaults")
    unknown = sorted(set(serve) - set(SERVE_KEYS))
    if unknown:
        raise FlowseamError(f"{path}: serve has unknown key(s) {unknown}; allowed: "
                            f"{sorted(SERVE_KEYS)}")
    return {**data, "serve": {k: _check_value(path, k, v) for k, v in serve.items()}}


def read_checkpoint_defaults(root: str | Path) -> dict[str, Any]:
    """The ``serve`` table of ``root/flowseam.json`` (``{}`` when the checkpoint has none).

    :raises FlowseamError: for a file that is not JSON or breaks the schema (naming it).
    """
    path = Path(root) / FILENAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FlowseamError(f"corrupt checkpoint file {path}: {exc}") from exc
    return check_checkpoint_defaults(data, path)["serve"]


def write_checkpoint_defaults(root: str | Path, serve: dict[str, Any],
                              trained: dict[str, Any] | None = None) -> Path:
    """Write ``root/flowseam.json`` atomically (validated first).

    :raises FlowseamError: for a ``serve`` key or value outside the schema.
    """
    from .media import atomic_path

    data: dict[str, Any] = {"serve": dict(serve)}
    if trained:
        data["trained"] = dict(trained)
    data = check_checkpoint_defaults(data, Path(root) / FILENAME)
    with atomic_path(Path(root) / FILENAME) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return Path(root) / FILENAME
