"""Model cards and the instances that run them. A card is chosen from a checkpoint's
``model_index.json`` (its ``_class_name``)."""

from __future__ import annotations

from typing import Any

from .base import ComponentEntry, Conditioning, ModelCard, ModelInstance
from .flux import FLUX_T2I, FluxT2I
from .wan import WAN_I2V, WAN_T2V, WanI2V, WanT2V
from .wan_causal import WAN_CAUSAL_T2V, WanCausalT2V

#: card name → card
CARDS: dict[str, ModelCard] = {c.name: c for c in (WAN_T2V, WAN_I2V, FLUX_T2I, WAN_CAUSAL_T2V)}


def card_for_index(index: dict[str, Any], source: str = "model_index.json") -> ModelCard:
    """The card whose ``pipeline_class`` is the index's ``_class_name``; a ``WanPipeline`` folder
    with a ``_flowseam_causal`` entry is a causal checkpoint (``wan2.1-causal-t2v``).

    :raises ValueError: naming the class and the classes flowseam knows.
    """
    cls = index.get("_class_name")
    if "_flowseam_causal" in index:
        if cls != WAN_CAUSAL_T2V.pipeline_class:
            raise ValueError(f"{source}: _flowseam_causal is for WanPipeline checkpoints, not "
                             f"_class_name={cls!r}")
        return WAN_CAUSAL_T2V
    for card in CARDS.values():
        if card is WAN_CAUSAL_T2V:
            continue
        if card.pipeline_class == cls:
            return card
    known = {c.pipeline_class: c.name for c in CARDS.values() if c is not WAN_CAUSAL_T2V}
    raise ValueError(f"{source}: _class_name={cls!r} has no flowseam model card; known: {known} "
                     f"(and WanPipeline with _flowseam_causal: {WAN_CAUSAL_T2V.name})")


__all__ = ["CARDS", "ComponentEntry", "Conditioning", "FLUX_T2I", "FluxT2I", "ModelCard",
           "ModelInstance", "WAN_CAUSAL_T2V", "WAN_I2V", "WAN_T2V", "WanCausalT2V", "WanI2V",
           "WanT2V", "card_for_index"]
