"""Model cards and the instances that run them. A card is chosen from a checkpoint's
``model_index.json`` (its ``_class_name``)."""

from __future__ import annotations

from typing import Any

from .base import ComponentEntry, Conditioning, ModelCard, ModelInstance
from .flux import FLUX_T2I, FluxT2I
from .wan import WAN_I2V, WAN_T2V, WanI2V, WanT2V

#: card name → card
CARDS: dict[str, ModelCard] = {c.name: c for c in (WAN_T2V, WAN_I2V, FLUX_T2I)}


def card_for_index(index: dict[str, Any], source: str = "model_index.json") -> ModelCard:
    """The card whose ``pipeline_class`` is the index's ``_class_name``.

    :raises ValueError: naming the class and the classes flowseam knows.
    """
    cls = index.get("_class_name")
    for card in CARDS.values():
        if card.pipeline_class == cls:
            return card
    known = {c.pipeline_class: c.name for c in CARDS.values()}
    raise ValueError(f"{source}: _class_name={cls!r} has no flowseam model card; known: {known}")


__all__ = ["CARDS", "ComponentEntry", "Conditioning", "FLUX_T2I", "FluxT2I", "ModelCard",
           "ModelInstance", "WAN_I2V", "WAN_T2V", "WanI2V", "WanT2V", "card_for_index"]
