"""``flowseam.load``: a diffusers-format checkpoint → a model instance built through the seam."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .components import ComponentSpec
from .errors import FlowseamError
from .models import card_for_index
from .models.base import ModelInstance
from .platform import Platform


def resolve_checkpoint(path_or_hub_id: str | os.PathLike) -> Path:
    """A local directory, or a hub id (``org/name``) fetched with huggingface_hub.

    :raises FlowseamError: if the directory does not exist, or the hub cannot be reached (the
        message says how to pass a local directory instead).
    """
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_hub_id)
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists()
    if not looks_like_hub_id:
        raise FlowseamError(f"checkpoint {text!r} is not a directory (expected a diffusers-format "
                            "folder with model_index.json, or a hub id like 'org/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text))
    except Exception as exc:  # offline, unknown repo, auth...
        raise FlowseamError(
            f"cannot fetch {text!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "If this machine is offline, download the checkpoint elsewhere and pass its local "
            "directory instead (flowseam.load('/path/to/checkpoint'), --model /path/to/checkpoint)"
        ) from exc


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file. :raises FlowseamError: naming the missing or corrupt file."""
    if not path.is_file():
        raise FlowseamError(f"missing checkpoint file {path}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FlowseamError(f"corrupt checkpoint file {path}: {exc}") from exc


def load(path_or_hub_id: str | os.PathLike, platform: Platform | None = None) -> ModelInstance:
    """Load a diffusers-format checkpoint (WanPipeline, WanImageToVideoPipeline or FluxPipeline
    layout, or flowseam's causal Wan layout) into a flowseam model instance.

    The card is chosen from ``model_index.json``; every component is built with
    ``platform.build_component(kind, spec)`` (so a backend may override it and anything it leaves
    out falls back to cpu); the DiT's attention is routed through ``platform.kernels``'
    ``attention`` op (and ``cached_attention`` for a causal checkpoint).

    :param platform: default ``Platform.detect()``.
    :raises FlowseamError: for a missing directory, an unreachable hub, or a missing or corrupt
        checkpoint file (named in the message).
    :raises ValueError: if no card matches the checkpoint's pipeline class.
    """
    root = resolve_checkpoint(path_or_hub_id)
    index = read_json(root / "model_index.json")
    card = card_for_index(index, str(root / "model_index.json"))
    card.instance.check_index(index, str(root / "model_index.json"))
    platform = platform if platform is not None else Platform.detect()
    components: dict[str, Any] = {}
    records = {}
    for entry in card.components:
        declared = index.get(entry.name)
        if not declared or declared[0] is None or declared[1] is None:
            if entry.required:
                raise FlowseamError(f"{root / 'model_index.json'} declares no {entry.name!r}, which "
                                    f"{card.name} needs")
            continue
        library, cls = declared
        spec = ComponentSpec(name=entry.name, cls=f"{library}.{cls}", path=str(root),
                             subfolder=entry.name)
        components[entry.name] = _build(platform, entry.kind, spec, root)
        records[entry.name] = platform.components[-1]
    scheduler_config = read_json(root / "scheduler" / "scheduler_config.json") \
        if (root / "scheduler").is_dir() else {}
    instance = card.instance(card, platform, components, root, scheduler_config)
    instance.read_index(index, str(root / "model_index.json"))
    instance.component_records = records
    instance.route_attention()
    return instance


def _build(platform: Platform, kind: str, spec: ComponentSpec, root: Path) -> Any:
    folder = root / spec.subfolder
    try:
        return platform.build_component(kind, spec)
    except FlowseamError:
        raise
    except Exception as exc:
        files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        weights = [f for f in files if f.endswith((".safetensors", ".bin"))]
        raise FlowseamError(
            f"cannot load {spec.name!r} ({spec.cls}) from {folder}"
            + (f" (weights: {', '.join(weights)})" if weights else "")
            + f": {type(exc).__name__}: {exc}") from exc
