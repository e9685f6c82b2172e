"""LoRA adapters at serve time, on diffusers' own LoRA machinery, switched per request.

A request names its adapter set in ``DiffusionParams.lora`` (a tuple of :class:`LoraSpec`;
``flowseam generate --lora PATH[:WEIGHT][@EXPERT]``). Every model has one :class:`AdapterSet`
(``model.adapters``): it reads each LoRA file once, the way the card's diffusers pipeline reads
it (:meth:`AdapterSet.load`), and switches the DiT experts to a request's set before its first
denoising step (:meth:`AdapterSet.activate`); nothing is re-read between requests. Key decision,
per expert: an eager DiT holds one peft adapter per file and a request selects them by name, as
diffusers' ``set_adapters`` does; a DiT compiled with ``torch.compile`` holds one fixed-rank
adapter slot that each request's set is written into (hot-swap), since switching named adapters
would recompile it. docs/lora.md has the user's view.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..errors import FlowseamError
from ..request_fields import LoraSpec, normalize_lora  # noqa: F401  (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the adapter slot's name in a DiT switched by hot-swapping
SLOT = "flowseam_slot"


@dataclass
class Adapter:
    """One LoRA file read for one expert.

    :ivar state_dict: diffusers/peft keys without the ``transformer.`` prefix
        (``blocks.0.attn1.to_q.lora_A.weight``), CPU tensors.
    :ivar network_alphas: kohya-style alphas as diffusers' reader returned them (keys with the
        ``transformer.`` prefix), or None.
    :ivar metadata: the LoRA config saved in the file (``lora_adapter_metadata``, without the
        ``transformer.`` prefix), or None.
    :ivar scales: layer → ``alpha / rank`` as peft applies it (``alpha / sqrt(rank)`` for rsLoRA).
    :ivar ranks: layer → rank.
    """

    name: str
    path: str
    expert: str
    state_dict: dict[str, "torch.Tensor"]
    network_alphas: dict[str, Any] | None
    metadata: dict[str, Any] | None
    scales: dict[str, float]
    ranks: dict[str, int]

    @property
    def layers(self) -> set[str]:
        return set(self.ranks)


@dataclass
class _Expert:
    """What one DiT expert holds: its mode, the slot's shape (hotswap), what is active."""

    hotswap: bool
    slot_layers: frozenset[str] = frozenset()
    slot_rank: int = 0
    active: tuple | None = None
    fused: tuple | None = None
    base_weights: dict[str, Any] = field(default_factory=dict)


class AdapterSet:
    """The LoRA adapters of one model (``model.adapters``): read once, switched per request.

    :param model: the model's name (in error messages).
    :param pipeline_class: the card's diffusers pipeline class, whose ``lora_state_dict`` reads
        the files (``"WanPipeline"``).
    :param experts: the model's DiT experts (component name → module, high-noise first; a live
        mapping: :class:`~flowseam.models.experts.Experts`).
    :param hotswap: ``True``/``False`` to force a switching mode for every expert; None (the
        default): hot-swap exactly the experts that are compiled (``torch.compile``).
    :param min_slot_rank: the smallest rank of a hot-swap slot (room for adapters loaded later
        without rebuilding it).
    """

    def __init__(self, model: str, pipeline_class: str, experts: Mapping[str, "torch.nn.Module"],
                 hotswap: bool | None = None, min_slot_rank: int = 16) -> None:
        self.model, self.pipeline_class, self.experts = model, pipeline_class, experts
        self.force_hotswap = hotswap
        self.min_slot_rank = min_slot_rank
        #: (absolute path, expert) → Adapter, in load order
        self.loaded: dict[tuple[str, str], Adapter] = {}
        self._experts: dict[str, _Expert] = {}
        #: how many times a hot-swap slot was (re)built (each one compiles the DiT anew)
        self.slot_builds = 0
        self._count = 0

    # -- reading files --------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, expert: str | None = None) -> Adapter:
        """Read the LoRA file ``path`` for ``expert`` (default the first: Wan2.2's high-noise
        ``transformer``; ``"transformer_2"`` is diffusers' ``load_into_transformer_2=True``) once,
        check that every key matches the DiT, and make it available to requests.

        Only ``.safetensors`` files are read (never a pickle). ``<Pipeline>.lora_state_dict`` of
        the card's pipeline class converts the layouts people download (diffusers/peft, kohya
        ``lora_down``/``lora_up`` with ``alpha``, ComfyUI's ``diffusion_model.`` keys, musubi's
        ``lora_unet_``; for Flux also XLabs and BFL control LoRAs) to diffusers' keys, and a
        Wan2.1 T2V LoRA on an I2V model gets the zero image-projection layers diffusers adds
        (``_maybe_expand_t2v_lora_for_i2v``). Every key must then name a linear layer of the DiT
        with matching shapes (``lora_A: (rank, in_features)``, ``lora_B: (out_features,
        rank)``); a file with keys that match nothing (another base model, another rank layout,
        text-encoder LoRAs) is refused with those keys named, before anything is injected.

        :raises FlowseamError: for a missing or non-safetensors file, an unknown expert, or keys
            that match no layer of the DiT (named).
        """
        spec = LoraSpec(str(path), 1.0, expert)
        name = self._expert_name(spec)
        key = (spec.key[0], name)
        if key in self.loaded:
            return self.loaded[key]
        self._count += 1
        adapter = self._read(Path(spec.key[0]), name, f"lora{self._count}")
        state = self._state(name)
        if not state.hotswap:
            with warnings.catch_warnings():  # peft's notice that a model holds several adapters
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.experts[name].load_lora_adapter(
                    {f"transformer.{k}": v for k, v in adapter.state_dict.items()},
                    prefix="transformer", adapter_name=adapter.name,
                    network_alphas=adapter.network_alphas,
                    metadata=None if adapter.metadata is None else
                    {f"transformer.{k}": v for k, v in adapter.metadata.items()})
            state.active = None  # peft activates a freshly loaded adapter
        self.loaded[key] = adapter
        return adapter

    def _expert_name(self, spec: LoraSpec) -> str:
        name = spec.expert or next(iter(self.experts))
        if name not in self.experts:
            raise FlowseamError(f"lora {spec.path}@{spec.expert}: {self.model} has DiT "
                                f"experts {list(self.experts)}")
        return name

    def _read(self, path: Path, expert: str, name: str) -> Adapter:
        import diffusers
        import torch

        if not path.is_file():
            raise FlowseamError(f"lora {path} does not exist")
        if path.suffix != ".safetensors":
            raise FlowseamError(f"lora {path}: only .safetensors LoRA files are read (a pickled "
                                "checkpoint could run code); convert it to safetensors first")
        loader = getattr(diffusers, self.pipeline_class)
        # Flux's reader returns (state_dict, alphas, metadata), Wan's (state_dict, metadata)
        out = loader.lora_state_dict(str(path.parent), weight_name=path.name, use_safetensors=True,
                                     return_lora_metadata=True, return_alphas=True)
        state_dict, alphas, metadata = out if len(out) == 3 else (out[0], None, out[1])
        dit = self.experts[expert]
        expand = getattr(loader, "_maybe_expand_t2v_lora_for_i2v", None)
        if expand is not None:  # a T2V LoRA on an I2V DiT: zero image projections, as diffusers
            given = set(state_dict)  # (kept only where the DiT has them: zeros change nothing)
            modules = dict(dit.named_modules())
            expanded = expand(transformer=dit, state_dict=dict(state_dict))
            state_dict = {k: v for k, v in expanded.items() if k in given
                          or k.removeprefix("transformer.").rsplit(".lora_", 1)[0] in modules}
        other = sorted(k for k in state_dict if not k.startswith("transformer."))
        if other:
            raise FlowseamError(self._unmatched(path, other, "are not for the DiT (flowseam "
                                                "applies LoRAs to the transformer only)"))
        state_dict = {k.removeprefix("transformer."): v.to("cpu", torch.float32)
                      for k, v in state_dict.items()}
        ranks, bad = self._check_layers(dit, state_dict)
        if bad:
            raise FlowseamError(self._unmatched(path, bad, f"match no layer of "
                                                f"{self.model}'s {expert} (another base "
                                                "model, or another rank layout?)"))
        strip = lambda d: {k.removeprefix("transformer."): v for k, v in d.items()  # noqa: E731
                           if k.startswith("transformer.")} if d else None
        meta = strip(metadata)
        config = _lora_config(state_dict, strip(alphas), meta, ranks, dit)
        scales = {layer: _scale(config, layer, r) for layer, r in ranks.items()}
        return Adapter(name, str(path), expert, state_dict, alphas or None, meta, scales, ranks)

    @staticmethod
    def _check_layers(dit: "torch.nn.Module", state_dict: dict) -> tuple[dict[str, int], list[str]]:
        """layer → rank for the LoRA keys that match a linear layer of ``dit`` in shape; the
        keys that do not."""
        import torch

        modules = dict(dit.named_modules())
        ranks: dict[str, int] = {}
        bad: list[str] = []
        for key, value in state_dict.items():
            match = re.fullmatch(r"(.+)\.lora_([AB])\.(weight|bias)", key)
            module = modules.get(match.group(1)) if match else None
            base = getattr(module, "base_layer", module)
            if not isinstance(base, torch.nn.Linear):
                bad.append(key)
                continue
            layer, which, kind = match.groups()
            ok = (value.shape == (base.out_features,) if kind == "bias" else
                  value.ndim == 2 and (value.shape[1] == base.in_features if which == "A"
                                       else value.shape[0] == base.out_features))
            if not ok:
                bad.append(f"{key} {tuple(value.shape)} (layer is {base.in_features} -> "
                           f"{base.out_features})")
            elif which == "A":
                ranks[layer] = int(value.shape[0])
        unpaired = sorted(k for k in ranks if f"{k}.lora_B.weight" not in state_dict)
        return ranks, bad + [f"{k}.lora_A.weight (no lora_B)" for k in unpaired]

    @staticmethod
    def _unmatched(path: Path, keys: list[str], why: str) -> str:
        shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
        return f"lora {path}: {len(keys)} key(s) {why}: {shown}"

    # -- per request ----------------------------------------------------------------------------
    def activate(self, specs: Iterable[LoraSpec]) -> None:
        """Switch every DiT expert to ``specs`` (loading files not read yet), before the first
        denoising step of a request. An empty set runs the base model (or, while a set is fused,
        the fused model).

        An eager expert (cpu, cuda) holds each file as one peft adapter, injected once with
        ``load_lora_adapter``; a request runs ``set_adapters(names, weights)`` (``disable_lora()``
        for an empty set), exactly what ``pipe.load_lora_weights(...); pipe.set_adapters(...)``
        does. A compiled expert (accel) would recompile on that: peft's forward loops over the
        active adapter names and multiplies by a Python float scale, and dynamo guards on both.
        It holds instead one adapter slot of fixed rank over the union of the layers its loaded
        files target (diffusers' ``enable_lora_hotswap(target_rank)``), into which a request's
        set is written in place (``load_lora_adapter(..., hotswap=True)``) as one low-rank
        product (:func:`_combine`); the empty set writes zeros (the base model, exactly). Loading
        a file whose layers or rank do not fit the slot rebuilds it (one recompile); switching
        between loaded adapters never recompiles, so load the adapters you serve first.

        :raises FlowseamError: for files :meth:`load` refuses, or a set other than the fused one
            while one is fused.
        """
        specs = tuple(specs)
        if not specs and not self.loaded:
            return  # a model that never saw an adapter: nothing to switch
        wanted: dict[str, list[tuple[Adapter, float]]] = {name: [] for name in self.experts}
        for spec in specs:
            adapter = self.load(spec.path, spec.expert)
            wanted[adapter.expert].append((adapter, float(spec.weight)))
        for name, chosen in wanted.items():
            state = self._state(name)
            key = tuple((a.name, w) for a, w in chosen)
            if state.fused is not None:
                if key and key != state.fused:
                    raise FlowseamError(
                        f"{name} has LoRA set {_describe(state.fused)} fused into its weights; "
                        f"this request asks for {_describe(key)}: unfuse first "
                        "(model.adapters.unfuse())")
                continue
            if key == state.active:
                continue
            self._switch(name, state, chosen)
            state.active = key

    def _switch(self, name: str, state: _Expert, chosen: list[tuple[Adapter, float]]) -> None:
        dit = self.experts[name]
        if not state.hotswap:
            if not chosen:
                if getattr(dit, "peft_config", None):
                    dit.disable_lora()
                return
            dit.enable_lora()
            dit.set_adapters([a.name for a, _ in chosen], [w for _, w in chosen])
            return
        # hot-swap: the slot spans every loaded adapter of this expert (rebuilt when one is new)
        mine = [a for a in self.loaded.values() if a.expert == name]
        layers = frozenset().union(*(a.layers for a in mine)) if mine else frozenset()
        need = max([self.min_slot_rank, sum(max(a.ranks.values()) for a in mine)])
        rebuild = not (layers <= state.slot_layers and need <= state.slot_rank)
        if rebuild and chosen == [] and not state.slot_layers:
            return  # nothing loaded for this expert and nothing asked: keep the base model
        if rebuild:
            if SLOT in getattr(dit, "peft_config", {}):
                dit.delete_adapters(SLOT)
            state.slot_layers, state.slot_rank = layers, need
            dit.enable_lora_hotswap(target_rank=need, check_compiled="ignore")
            self.slot_builds += 1
        weights = _combine(chosen, state.slot_layers, state.slot_rank, dit)
        config = {"r": state.slot_rank, "lora_alpha": state.slot_rank,
                  "target_modules": sorted(state.slot_layers)}
        dit.load_lora_adapter(weights, prefix=None, adapter_name=SLOT, metadata=config,
                              hotswap=not rebuild)

    def _state(self, name: str) -> _Expert:
        if name not in self._experts:
            module = self.experts[name]
            # compiled whole or, as accel does, block by block (regional compilation)
            compiled = any(getattr(m, "_compiled_call_impl", None) is not None
                           for m in module.modules())
            foreign = sorted(set(getattr(module, "peft_config", {})))
            if foreign:
                raise FlowseamError(f"{self.model}'s {name} already has peft adapters "
                                    f"{foreign} (a LoRA training run?); serve-time LoRA sets need "
                                    "a DiT without them")
            hotswap = compiled if self.force_hotswap is None else self.force_hotswap
            self._experts[name] = _Expert(hotswap)
        return self._experts[name]

    # -- fuse, unfuse, disable, delete ------------------------------------------------------------
    def fuse(self, specs: Iterable[LoraSpec]) -> None:
        """Bake ``specs`` into the base weights of their experts (diffusers' ``fuse_lora``): no
        LoRA work per step until :meth:`unfuse`. :raises FlowseamError: if a set is fused."""
        specs = tuple(specs)
        if any(s.fused is not None for s in self._experts.values()):
            raise FlowseamError("a LoRA set is already fused; unfuse it first")
        self.activate(specs)
        for name, state in self._experts.items():
            if not state.active:
                continue
            dit = self.experts[name]
            layers = ({state_layer for a in self.loaded.values() if a.expert == name
                       for state_layer in a.layers} if not state.hotswap else state.slot_layers)
            state.base_weights = {layer: _base(dit, layer).weight.detach().clone()
                                  for layer in layers}
            dit.fuse_lora(lora_scale=1.0, adapter_names=[SLOT] if state.hotswap else
                          [a for a, _ in state.active])
            state.fused = state.active

    def unfuse(self) -> None:
        """Undo :meth:`fuse`: diffusers' ``unfuse_lora``, then the base weights saved at fuse time
        are written back, so they are bit-identical to before (``W + d - d`` is not ``W`` in
        floating point)."""
        for name, state in self._experts.items():
            if state.fused is None:
                continue
            dit = self.experts[name]
            dit.unfuse_lora()
            for layer, weight in state.base_weights.items():
                _base(dit, layer).weight.data.copy_(weight)
            state.base_weights, state.fused = {}, None

    def disable(self) -> None:
        """Run the base model until the next request names adapters (an empty set)."""
        self.activate(())

    def delete(self, path: str | os.PathLike, expert: str | None = None) -> None:
        """Forget the LoRA file ``path`` (diffusers' ``delete_adapters``); a later request that
        names it reads it again. :raises FlowseamError: if it is not loaded, or is fused."""
        spec = LoraSpec(str(path), 1.0, expert)
        key = (spec.key[0], self._expert_name(spec))
        adapter = self.loaded.get(key)
        if adapter is None:
            raise FlowseamError(f"lora {path} is not loaded; loaded: "
                                f"{[a.path for a in self.loaded.values()] or 'none'}")
        state = self._state(adapter.expert)
        if state.fused is not None and any(n == adapter.name for n, _ in state.fused):
            raise FlowseamError(f"lora {path} is fused; unfuse first")
        del self.loaded[key]
        if not state.hotswap:
            self.experts[adapter.expert].delete_adapters(adapter.name)
        if state.active and any(n == adapter.name for n, _ in state.active):
            self._switch(adapter.expert, state, [])
            state.active = ()

    def describe(self, specs: Iterable[LoraSpec]) -> str:
        """One line for the CLI summary: ``lora: a.safetensors x0.8, b.safetensors x0.5``."""
        specs = tuple(specs)
        return "lora: " + ", ".join(f"{Path(s.path).name} x{s.weight:g}"
                                    + (f"@{s.expert}" if s.expert else "") for s in specs)


def _describe(key: tuple) -> str:
    return "[" + ", ".join(f"{n} x{w:g}" for n, w in key) + "]"


def _base(dit: "torch.nn.Module", layer: str) -> "torch.nn.Linear":
    module = dit.get_submodule(layer)
    return getattr(module, "base_layer", module)


def _lora_config(state_dict: dict, alphas: dict | None, metadata: dict | None,
                 ranks: dict[str, int], dit: "torch.nn.Module"):
    """The ``LoraConfig`` diffusers' ``load_lora_adapter`` builds for this state dict (its own
    ``_create_lora_config``), so the scales below are the ones peft applies."""
    from diffusers.utils.peft_utils import _create_lora_config

    rank_pattern = {f"^{layer}.lora_B.weight": r for layer, r in ranks.items()}
    return _create_lora_config(state_dict, alphas, metadata, rank_pattern,
                               model_state_dict=dit.state_dict())


def _scale(config, layer: str, rank: int) -> float:
    """peft's ``scaling`` of ``layer``: ``alpha / rank`` (``alpha / sqrt(rank)`` for rsLoRA),
    with the config's per-layer alpha pattern (peft's ``get_pattern_key``)."""
    from peft.utils.other import get_pattern_key

    alpha = config.lora_alpha
    if config.alpha_pattern:
        key = get_pattern_key(config.alpha_pattern.keys(), layer)
        alpha = config.alpha_pattern.get(key, alpha)
    return alpha / (math.sqrt(rank) if config.use_rslora else rank)


def _combine(chosen: list[tuple[Adapter, float]], layers: frozenset[str], rank: int,
             dit: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """The slot's state dict for a weighted set: per layer ``A = [A_1; A_2; ...]`` and ``B = [w_1
    s_1 B_1 | w_2 s_2 B_2 | ...]``, zero-padded to ``rank`` (so ``B @ A = sum_i w_i s_i B_i
    A_i``, ``s_i`` the adapter's ``alpha / rank`` of that layer; the slot's scale is 1); layers
    no chosen adapter targets are zero."""
    import torch

    out = {}
    biased = sorted(a.path for a, _ in chosen if any(k.endswith(".bias") for k in a.state_dict))
    if biased:
        raise FlowseamError(f"lora {', '.join(biased)}: LoRAs with a lora_B bias cannot be "
                            "hot-swapped (a compiled DiT); serve them on an eager backend")
    for layer in sorted(layers):
        base = _base(dit, layer)
        A = torch.zeros(rank, base.in_features)
        B = torch.zeros(base.out_features, rank)
        row = 0
        for adapter, weight in chosen:
            if layer not in adapter.ranks:
                continue
            r = adapter.ranks[layer]
            A[row:row + r] = adapter.state_dict[f"{layer}.lora_A.weight"]
            scale = weight * adapter.scales[layer]
            B[:, row:row + r] = adapter.state_dict[f"{layer}.lora_B.weight"] * scale
            row += r
        dtype, device = base.weight.dtype, base.weight.device
        out[f"{layer}.lora_A.weight"] = A.to(device, dtype)
        out[f"{layer}.lora_B.weight"] = B.to(device, dtype)
    return out

