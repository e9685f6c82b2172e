"""Model cards and the instances that run them. A card is chosen from a checkpoint's
``model_index.json`` (its ``_class_name``)."""

from __future__ import annotations

from typing import Any

from .card import ComponentEntry, ModelCard
from .instance import Conditioning, ModelInstance, frames_to_pixels, postprocess
from .flux import FLUX_T2I, FluxT2I
from .ltx2 import LTX2_I2V, LTX2_T2V, LTX2I2V, LTX2T2V
from .wan import WAN22_I2V, WAN22_T2V, WAN_I2V, WAN_T2V, WanI2V, WanT2V
from .wan_causal import WAN_CAUSAL_T2V, WanCausalT2V
from ..errors import InvalidInputError

#: card name → card
CARDS: dict[str, ModelCard] = {c.name: c for c in (WAN_T2V, WAN_I2V, WAN22_T2V, WAN22_I2V,
                                                   FLUX_T2I, WAN_CAUSAL_T2V, LTX2_T2V, LTX2_I2V)}


def declared(index: dict[str, Any], name: str) -> bool:
    """Whether ``model_index.json`` declares component ``name`` (``[library, class]``, not
    ``[null, null]``)."""
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and None not in entry


def card_for_index(index: dict[str, Any], source: str = "model_index.json") -> ModelCard:
    """The card whose ``pipeline_class`` is the index's ``_class_name`` and whose number of
    DiT experts the index declares (a ``WanPipeline`` with ``transformer_2`` or a
    ``boundary_ratio`` is Wan2.2: two experts); a ``WanPipeline`` folder with a
    ``_flowseam_causal`` entry is a causal checkpoint (``wan2.1-causal-t2v``).

    :raises ValueError: naming the class and the classes flowseam knows.
    """
    cls = index.get("_class_name")
    if "_flowseam_causal" in index:
        if cls != WAN_CAUSAL_T2V.pipeline_class:
            raise InvalidInputError(
                f"{source}: _flowseam_causal is for WanPipeline checkpoints, not "
                f"_class_name={cls!r}")
        return WAN_CAUSAL_T2V
    matches = [c for c in CARDS.values() if c.pipeline_class == cls and c is not WAN_CAUSAL_T2V]
    if not matches:
        known = sorted({c.pipeline_class for c in CARDS.values()})
        raise InvalidInputError(
            f"{source}: _class_name={cls!r} has no flowseam model card; known "
            f"pipeline classes: {known} (and WanPipeline with _flowseam_causal: "
            f"{WAN_CAUSAL_T2V.name})")
    two = declared(index, "transformer_2") or index.get("boundary_ratio") is not None
    for card in matches:
        if (len(card.experts) > 1) == two:
            return card
    return matches[0]


__all__ = ["CARDS", "ComponentEntry", "Conditioning", "FLUX_T2I", "FluxT2I", "LTX2I2V", "LTX2T2V",
           "LTX2_I2V", "LTX2_T2V", "ModelCard", "ModelInstance", "WAN22_I2V", "WAN22_T2V",
           "WAN_CAUSAL_T2V", "WAN_I2V", "WAN_T2V", "WanCausalT2V", "WanI2V", "WanT2V",
           "card_for_index", "declared", "frames_to_pixels", "postprocess"]
