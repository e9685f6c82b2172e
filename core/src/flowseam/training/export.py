"""A finished training run as a model that ``flowseam generate`` and diffusers load.

For each trained stage, under the run's ``output_dir`` (``output_dir/<stage>`` for each stage of
a multi-model method such as ``workflow_rl``), :func:`export_model` writes ``model/``: a
diffusers-format checkpoint, every component of the one the stage was loaded from with the
trained transformer in its place (LoRA adapters merged, as diffusers' ``fuse_lora`` +
``unload_lora`` do) and a ``flowseam.json`` that records the training. For a LoRA run,
:func:`export_lora` also writes the adapters alone, as diffusers' LoRA training scripts do
(``pytorch_lora_weights.safetensors``). Both are written into a temporary sibling and renamed,
so an interrupted export leaves the previous one (or none), never half of one. What a user
does with them: docs/training.md ("What a run writes").
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..checkpoint_defaults import read_checkpoint_defaults, write_checkpoint_defaults
from ..errors import FlowseamError
from ..models.instance import ModelInstance

MODEL_DIR = "model"
LORA_FILE = "pytorch_lora_weights.safetensors"
#: files of a source checkpoint that describe its original weights, not the trained ones
#: (the demo's recipe copy)
_NOT_COPIED = ("flowseam_recipe.toml",)


def has_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries peft adapters (added by the ``[lora]`` config)."""
    return bool(getattr(module, "peft_config", None))


def exportable_stages(stages: list[Any]) -> list[Any]:
    """The stages that train a component of a diffusion model (a :class:`ModelInstance`): the
    ones a run exports as a model. Others (the LM of ``unified_rl``) are saved by their method."""
    return [s for s in stages if isinstance(s.model, ModelInstance)]


def check_exportable(model: ModelInstance) -> None:
    """:raises FlowseamError: if ``model`` was not loaded from a checkpoint directory (there is
    nothing to copy the other components from). Called before training starts."""
    if model.path is None or not (Path(model.path) / "model_index.json").is_file():
        raise FlowseamError(f"{model.card.name}: the run cannot export its result as a model: "
                            "the model was not loaded from a checkpoint directory "
                            "(flowseam.load(path)); leave output_dir unset to train in memory")


def merged_copy(model: ModelInstance, state: dict[str, torch.Tensor],
                component: str | None = None) -> torch.nn.Module:
    """A plain (uncompiled, unsharded) copy of ``model``'s transformer (or its DiT expert
    ``component``) holding ``state`` (the trained weights by name), with any LoRA adapters merged
    into its base weights and removed."""
    module = _holding(model, state, component)
    if has_lora(module):
        module.fuse_lora()     # W += scale * B @ A, per adapted layer (peft's merge)
        module.unload_lora()   # the adapted layers become their base layers again
    return module.requires_grad_(False)


def _holding(model: ModelInstance, state: dict[str, torch.Tensor],
             component: str | None = None) -> torch.nn.Module:
    """A copy of ``model``'s component ``component`` (default its DiT) with every parameter taken
    from ``state`` (buffers, which training does not change, keep their values).

    :raises FlowseamError: naming parameters ``state`` lacks.
    """
    module = copy.deepcopy(model.components[component or model.DIT])
    params = dict(module.named_parameters())
    absent = sorted(set(params) - set(state))
    if absent:
        raise FlowseamError(f"the trained weights lack {len(absent)} parameter(s) of "
                            f"{type(module).__name__}: {absent[:4]}")
    module.load_state_dict({k: v for k, v in state.items() if k in params}, strict=False)
    return module


def export_model(model: ModelInstance, states: dict[str, dict[str, torch.Tensor]],
                 target: str | Path, trained: dict[str, Any]) -> Path:
    """Write the directory ``target``: ``model``'s checkpoint with each trained component
    replaced, atomically. ``states`` maps a component name (``transformer``; a Wan2.2 model's
    ``transformer_2`` too) to its trained weights by parameter name (LoRA adapters are merged).
    ``flowseam.json`` holds the base checkpoint's serving defaults plus a ``trained`` table:
    ``trained`` (method, step, ...) and ``base_model``, the base checkpoint's path. Load the
    result with ``flowseam.load`` / ``flowseam generate --model`` or
    ``DiffusionPipeline.from_pretrained``.

    :returns: ``target``.
    """
    check_exportable(model)
    source, final = Path(model.path), Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*states, *_NOT_COPIED))
        for component, state in states.items():
            merged_copy(model, state, component).save_pretrained(tmp / component,
                                                                 safe_serialization=True)
        write_checkpoint_defaults(tmp, read_checkpoint_defaults(source),
                                  {**trained, "base_model": str(source)})
        os.chmod(tmp, 0o755)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def export_lora(model: ModelInstance, state: dict[str, torch.Tensor], root: str | Path) -> Path:
    """Write ``root/pytorch_lora_weights.safetensors`` with the pipeline class's
    ``save_lora_weights`` (the adapters of ``state``, the DiT's: the file's ``transformer.``
    keys name the pipeline's ``transformer``; peft's state dict, the adapter config as metadata),
    atomically: ``pipe.load_lora_weights(root)`` applies it to the base checkpoint. A second DiT
    expert's adapters are exported merged into its ``model/`` only.

    :raises FlowseamError: if the transformer has no LoRA adapters.
    """
    import diffusers
    from peft.utils import get_peft_model_state_dict

    module = _holding(model, state)
    if not has_lora(module):
        raise FlowseamError("export_lora: the transformer has no LoRA adapters")
    pipeline = getattr(diffusers, model.card.pipeline_class)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lora.", dir=root))
    try:
        pipeline.save_lora_weights(
            tmp, transformer_lora_layers=get_peft_model_state_dict(module),
            transformer_lora_adapter_metadata=module.peft_config["default"].to_dict(),
            weight_name=LORA_FILE)
        os.replace(tmp / LORA_FILE, root / LORA_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root / LORA_FILE
