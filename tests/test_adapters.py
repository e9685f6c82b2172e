"""LoRA adapters at serve time (flowseam.adapters), checked against diffusers on the same weights.

Fixtures are diffusers' own dummy pipelines (``get_dummy_components()`` of its tests, rebuilt in
test_checkpoint_parity) and LoRA files written the way people get them: diffusers'
``save_lora_weights`` (peft keys) and ComfyUI's ``diffusion_model.`` layout with kohya
``lora_down``/``lora_up``/``alpha``. The reference is always diffusers' ``load_lora_weights`` +
``set_adapters`` on the same checkpoint and files, or a hand computation (the alpha/rank scale).
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import flowseam
from flowseam import DiffusionParams, FlowseamError
from flowseam.models.adapters import LoraSpec, normalize_lora
from conftest import run_main
from test_checkpoint_parity import CALLS, TOL, _diff, _image, ours
from test_checkpoint_parity import checkpoints, cpu  # noqa: F401  (the fixtures, shared)

LORA_EFFECT = 1e-2   # a LoRA set moves the frames by more than this (so parity proves something)
WAN_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_k", "ffn.net.0.proj")
FLUX_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "proj_mlp", "proj_out")


def lora_layers(dit: torch.nn.Module, rank: int, seed: int, targets=WAN_TARGETS) -> dict:
    """Random LoRA weights (peft keys, no prefix) for the linear layers of ``dit`` ending in
    ``targets``; lora_B is non-zero so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(targets):
            out[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.3
            out[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.3
    return out


class Loras:
    """LoRA files for a checkpoint, written once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def peft(self, checkpoint: Path, name: str, rank: int, seed: int, *, pipeline=diffusers.WanPipeline,
             targets=WAN_TARGETS, expert: str = "transformer", scale: float = 1.0) -> str:
        path = self.root / checkpoint.name / f"{name}.safetensors"
        if not path.exists():
            dit_class = getattr(diffusers, _config(checkpoint / expert)["_class_name"])
            layers = lora_layers(dit_class.from_pretrained(checkpoint / expert), rank, seed, targets)
            layers = {k: v * scale if "lora_B" in k else v for k, v in layers.items()}
            pipeline.save_lora_weights(path.parent, transformer_lora_layers=layers, weight_name=path.name)
        return str(path)


def _config(folder: Path) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> Loras:
    return Loras(tmp_path_factory.mktemp("loras"))


def params_for(name: str, **changes) -> DiffusionParams:
    call = CALLS[name]
    p = DiffusionParams(num_steps=call["steps"], height=call["height"], width=call["width"],
                        num_frames=call["num_frames"], guidance_scale=call["guidance"],
                        max_sequence_length=call["max_sequence_length"], seed=0,
                        negative_prompt="negative" if name.startswith("wan") else None)
    return p.replace(**changes)


def generate(model, name: str, **changes) -> np.ndarray:
    image = _image() if name.endswith("i2v") else None
    return model.generate(CALLS[name]["prompts"], image=image, params=params_for(name, **changes)).frames


def diffusers_with_loras(path: Path, name: str, loras: list[tuple[str, float, dict]]) -> np.ndarray:
    """diffusers' call with ``load_lora_weights(file, adapter_name, **kwargs)`` per adapter and
    ``set_adapters(names, weights)``."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (file, _, kwargs) in enumerate(loras):
        pipe.load_lora_weights(file, adapter_name=f"adapter{i}", **kwargs)
        names.append(f"adapter{i}")
    by_expert: dict[str, list[int]] = {}
    for i, (_, _, kwargs) in enumerate(loras):
        by_expert.setdefault("transformer_2" if kwargs.get("load_into_transformer_2") else "transformer", []).append(i)
    for expert, idx in by_expert.items():  # set_adapters per model (each expert has its own)
        getattr(pipe, expert).set_adapters([names[i] for i in idx], [loras[i][1] for i in idx])
    call = CALLS[name]
    generators = [torch.Generator().manual_seed(i) for i in range(len(call["prompts"]))]
    args = dict(prompt=call["prompts"], num_inference_steps=call["steps"], height=call["height"],
                width=call["width"], guidance_scale=call["guidance"], generator=generators,
                max_sequence_length=call["max_sequence_length"], output_type="np")
    if name == "flux":
        return pipe(**args).images[:, None]
    args.update(num_frames=call["num_frames"], negative_prompt="negative")
    if name.endswith("i2v"):
        args["image"] = _image()
    return pipe(**args).frames


# -- parity with diffusers ------------------------------------------------------------------------

def _sets(name: str, path: Path, loras: Loras) -> list[tuple[str, float, dict]]:
    """(file, weight, diffusers' load_lora_weights kwargs) of the set each case runs."""
    if name == "flux":
        kw = dict(pipeline=diffusers.FluxPipeline, targets=FLUX_TARGETS)
        return [(loras.peft(path, "style", 4, 1, **kw), 0.7, {}),
                (loras.peft(path, "detail", 2, 2, **kw), 0.4, {})]
    if name == "wan22-t2v":  # one adapter per expert, as Wan2.2 LoRAs ship (high/low noise)
        return [(loras.peft(path, "high", 4, 1), 0.8, {}),
                (loras.peft(path, "low", 2, 2, expert="transformer_2"), 0.6,
                 {"load_into_transformer_2": True})]
    return [(loras.peft(path, "style", 4, 1), 0.7, {}), (loras.peft(path, "detail", 2, 2), 0.4, {})]


def _specs(sets) -> tuple[LoraSpec, ...]:
    return tuple(LoraSpec(f, w, "transformer_2" if kw.get("load_into_transformer_2") else None)
                 for f, w, kw in sets)


@pytest.mark.parametrize("name", ["wan-t2v", "wan-i2v", "flux", "wan22-t2v"])
def test_lora_set_equals_diffusers_load_lora_weights_and_set_adapters(checkpoints, loras, cpu, name):
    """Two adapters with weights (Wan2.1 T2V, FLUX.1; a T2V LoRA on Wan2.1 I2V, which diffusers
    expands with zero image projections; one adapter per Wan2.2 expert) equal diffusers within
    1e-5, and the set moves the frames (parity is not trivial)."""
    path = checkpoints.base(name)
    sets = _sets(name, path, loras)
    model = flowseam.load(path, platform=cpu, quiet=True)
    result = generate(model, name, lora=_specs(sets))
    reference = diffusers_with_loras(path, name, sets)
    assert _diff(result, reference) < TOL, f"{name}: max |flowseam - diffusers| = {_diff(result, reference):.3g}"
    base = generate(model, name)  # the same model, back to no adapter
    assert _diff(result, base) > LORA_EFFECT
    assert _diff(base, ours(path, name, cpu).frames) == 0.0  # switching back is exact
    swapped = generate(model, name, lora=tuple(LoraSpec(s.path, w, s.expert) for s, w in
                                               zip(_specs(sets), (sets[1][1], sets[0][1]))))
    assert _diff(swapped, result) > LORA_EFFECT / 10  # the per-adapter weights matter


def _comfyui_file(dit_folder: Path, path: Path, rank: int, alpha: float, seed: int) -> dict:
    """A ComfyUI/kohya Wan LoRA (``diffusion_model.blocks.i.self_attn.q.lora_down.weight``, ``up``,
    ``alpha``) of the self-attention projections; returns the same LoRA in peft keys with the
    kohya scale ``alpha / rank`` folded into lora_B by hand."""
    dit = diffusers.WanTransformer3DModel.from_pretrained(dit_folder)
    layers = lora_layers(dit, rank, seed, targets=("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"))
    comfy, peft = {}, {}
    names = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    for key, value in layers.items():
        layer, which = key.rsplit(".lora_", 1)
        block, proj = layer.split(".attn1.")
        original = f"diffusion_model.{block}.self_attn.{names[proj]}"
        if which.startswith("A"):
            comfy[f"{original}.lora_down.weight"] = value
            comfy[f"{original}.alpha"] = torch.tensor(alpha)
            peft[key] = value
        else:
            comfy[f"{original}.lora_up.weight"] = value
            peft[key] = value * (alpha / rank)
    save_file(comfy, str(path))
    return peft


def test_comfyui_kohya_layout_loads_as_the_scaled_peft_lora(checkpoints, tmp_path, cpu):
    """A ComfyUI-layout Wan LoRA with kohya alpha (alpha 2, rank 4: scale 0.5) gives what the
    same weights in peft keys with lora_B scaled by 0.5 by hand give, and what diffusers gives."""
    path = checkpoints.base("wan-t2v")
    comfy = tmp_path / "comfy.safetensors"
    peft = _comfyui_file(path / "transformer", comfy, rank=4, alpha=2.0, seed=3)
    diffusers.WanPipeline.save_lora_weights(tmp_path, transformer_lora_layers=peft,
                                            weight_name="peft.safetensors")
    model = flowseam.load(path, platform=cpu, quiet=True)
    from_comfy = generate(model, "wan-t2v", lora=(f"{comfy}:0.9",))
    from_peft = generate(model, "wan-t2v", lora=(f"{tmp_path / 'peft.safetensors'}:0.9",))
    assert _diff(from_comfy, from_peft) < 1e-6
    assert _diff(from_comfy, diffusers_with_loras(path, "wan-t2v", [(str(comfy), 0.9, {})])) < TOL
    assert _diff(from_comfy, generate(model, "wan-t2v")) > LORA_EFFECT


# -- switching, hot-swap, fuse, delete -------------------------------------------------------------

def test_switching_per_request_reads_each_file_once(checkpoints, loras, cpu, tmp_path):
    """A, B, none, A again on one model: each file is read once (they are deleted after the first
    requests and the switch still works), A twice gives the same frames, none gives the base."""
    path = checkpoints.base("wan-t2v")
    a, b = (tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    a.write_bytes(Path(loras.peft(path, "style", 4, 1)).read_bytes())
    b.write_bytes(Path(loras.peft(path, "detail", 2, 2)).read_bytes())
    model = flowseam.load(path, platform=cpu, quiet=True)
    first = generate(model, "wan-t2v", lora=(str(a),))
    second = generate(model, "wan-t2v", lora=(f"{b}:0.5",))
    a.unlink(), b.unlink()
    none = generate(model, "wan-t2v")
    again = generate(model, "wan-t2v", lora=(str(a),))
    assert np.array_equal(first, again)
    assert _diff(first, second) > LORA_EFFECT
    assert np.array_equal(none, ours(path, "wan-t2v", cpu).frames)
    assert len(model.adapters.loaded) == 2


def test_hotswap_slot_gives_the_named_adapters_output(checkpoints, loras, cpu):
    """The compiled-DiT mode (one padded slot, sets written in place) forced on the cpu: the same
    frames as diffusers' set_adapters, the base model exactly for an empty set, one slot build
    for adapters loaded up front."""
    path = checkpoints.base("wan-t2v")
    sets = _sets("wan-t2v", path, loras)
    model = flowseam.load(path, platform=cpu, quiet=True)
    from flowseam.models.adapters import AdapterSet

    model._adapters = AdapterSet(model.card.name, model.card.pipeline_class, model.experts,
                                 hotswap=True)
    for file, _, _ in sets:
        model.adapters.load(file)
    result = generate(model, "wan-t2v", lora=_specs(sets))
    assert _diff(result, diffusers_with_loras(path, "wan-t2v", sets)) < TOL
    assert np.array_equal(generate(model, "wan-t2v"), ours(path, "wan-t2v", cpu).frames)
    only_a = generate(model, "wan-t2v", lora=_specs(sets)[:1])
    assert _diff(only_a, diffusers_with_loras(path, "wan-t2v", sets[:1])) < TOL
    assert model.adapters.slot_builds == 1


def test_fuse_then_unfuse_restores_the_base_weights_exactly(checkpoints, loras, cpu):
    path = checkpoints.base("wan-t2v")
    sets = _sets("wan-t2v", path, loras)
    model = flowseam.load(path, platform=cpu, quiet=True)
    unfused = generate(model, "wan-t2v", lora=_specs(sets))
    before = {k: v.clone() for k, v in model.dit.state_dict().items() if "lora_" not in k}
    model.adapters.fuse(_specs(sets))
    fused_weights = {k: v for k, v in model.dit.state_dict().items() if "lora_" not in k}
    assert any(not torch.equal(before[k], fused_weights[k]) for k in before)  # fusing changed them
    assert _diff(generate(model, "wan-t2v", lora=_specs(sets)), unfused) < TOL
    assert _diff(generate(model, "wan-t2v"), unfused) < TOL  # the fused model is the model now
    with pytest.raises(FlowseamError, match="fused"):
        generate(model, "wan-t2v", lora=_specs(sets)[:1])
    model.adapters.unfuse()
    after = {k: v for k, v in model.dit.state_dict().items() if "lora_" not in k}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert np.array_equal(generate(model, "wan-t2v"), ours(path, "wan-t2v", cpu).frames)


def test_disable_and_delete(checkpoints, loras, cpu):
    path = checkpoints.base("wan-t2v")
    (a, _, _), (b, _, _) = _sets("wan-t2v", path, loras)
    model = flowseam.load(path, platform=cpu, quiet=True)
    with_a = generate(model, "wan-t2v", lora=(a,))
    model.adapters.disable()
    assert np.array_equal(generate(model, "wan-t2v"), ours(path, "wan-t2v", cpu).frames)
    model.adapters.load(b)
    model.adapters.delete(a)
    assert [x.path for x in model.adapters.loaded.values()] == [str(Path(b).resolve())]
    assert len(model.dit.peft_config) == 1  # diffusers' delete_adapters removed it from the DiT
    with pytest.raises(FlowseamError, match="not loaded"):
        model.adapters.delete(a)
    assert np.array_equal(generate(model, "wan-t2v", lora=(a,)), with_a)  # read again on request


# -- bad input ---------------------------------------------------------------------------------

def test_a_lora_that_does_not_match_the_model_is_refused_naming_its_keys(checkpoints, loras, cpu, tmp_path):
    wan = checkpoints.base("wan-t2v")
    flux_lora = loras.peft(checkpoints.base("flux"), "style", 4, 1, pipeline=diffusers.FluxPipeline,
                           targets=FLUX_TARGETS)
    model = flowseam.load(wan, platform=cpu, quiet=True)
    with pytest.raises(FlowseamError, match=r"match no layer of wan2.1-t2v's transformer.*"
                                            r"transformer_blocks\.0\.attn\.to_q\.lora_A\.weight"):
        generate(model, "wan-t2v", lora=(flux_lora,))
    # the right layers, the wrong rank layout (lora_A's input size is not the layer's)
    dit = diffusers.WanTransformer3DModel.from_pretrained(wan / "transformer")
    layers = lora_layers(dit, 4, 0, targets=("attn1.to_q",))
    layers["blocks.0.attn1.to_q.lora_A.weight"] = torch.zeros(4, 7)
    diffusers.WanPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                            weight_name="wrong_rank.safetensors")
    with pytest.raises(FlowseamError, match=r"blocks\.0\.attn1\.to_q\.lora_A\.weight \(4, 7\)"):
        generate(model, "wan-t2v", lora=(str(tmp_path / "wrong_rank.safetensors"),))
    save_file({"text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.zeros(2, 32),
               "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.zeros(32, 2)},
              str(tmp_path / "te.safetensors"))
    with pytest.raises(FlowseamError, match="not for the DiT.*text_encoder.encoder.block.0"):
        generate(model, "wan-t2v", lora=(str(tmp_path / "te.safetensors"),))
    (tmp_path / "x.bin").write_bytes(b"\x80\x04")
    with pytest.raises(FlowseamError, match="only .safetensors"):
        generate(model, "wan-t2v", lora=(str(tmp_path / "x.bin"),))
    with pytest.raises(FlowseamError, match="does not exist"):
        generate(model, "wan-t2v", lora=(str(tmp_path / "missing.safetensors"),))
    assert not getattr(model.dit, "peft_config", {})  # nothing was injected by the refused files
    assert np.array_equal(generate(model, "wan-t2v"), ours(wan, "wan-t2v", cpu).frames)


def test_lora_specs_parse_and_stay_hashable():
    assert LoraSpec.parse("a.safetensors") == LoraSpec("a.safetensors", 1.0, None)
    assert LoraSpec.parse("/x/a.safetensors:0.25@transformer_2") == LoraSpec("/x/a.safetensors", 0.25, "transformer_2")
    assert LoraSpec.parse("a.safetensors:-1") == LoraSpec("a.safetensors", -1.0, None)
    with pytest.raises(ValueError, match="weight 'abc' is not a number"):
        LoraSpec.parse("a.safetensors:abc")
    params = DiffusionParams(lora=["a.safetensors:0.5", {"path": "b.safetensors", "weight": 2}])
    assert params.lora == (LoraSpec("a.safetensors", 0.5), LoraSpec("b.safetensors", 2.0))
    assert hash(params) == hash(DiffusionParams(lora=("a.safetensors:0.5", "b.safetensors:2")))
    with pytest.raises(ValueError, match="twice"):
        normalize_lora(["a.safetensors:0.5", "a.safetensors:0.7"])
    with pytest.raises(ValueError, match="weight='x' must be a number"):
        normalize_lora([{"path": "a.safetensors", "weight": "x"}])


# -- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_cli_lora_flag(checkpoints, loras, tmp_path):
    path = checkpoints.base("wan-t2v")
    (a, _, _), (b, _, _) = _sets("wan-t2v", path, loras)
    common = ["generate", "--model", str(path), "--prompt", "dance monkey", "--steps", "2",
              "--height", "16", "--width", "32", "--frames", "5", "--backend", "cpu"]
    out = tmp_path / "v.mp4"
    r = run_main(*common, "--lora", f"{a}:0.7", "--lora", f"{b}:0.4", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "lora: style.safetensors x0.7, detail.safetensors x0.4" in r.stdout
    r = run_main(*common, "--lora", f"{tmp_path / 'nope.safetensors'}:0.5", "--output",
                 str(tmp_path / "bad.mp4"))  # refused before the model loads (parsing: above)
    assert r.returncode == 2 and "nope.safetensors does not exist" in r.stderr, r.stderr
    assert not (tmp_path / "bad.mp4").exists()


# -- hot-swap on the accel backend (torch.compile) -----------------------------------------------

@pytest.mark.backends
@pytest.mark.slow
def test_switching_adapters_on_accel_never_recompiles(checkpoints, loras, cpu):
    """On accel (DiT compiled in place) the adapters loaded up front share one hot-swap slot:
    after the first request with an adapter (the DiT gains LoRA layers: it compiles once), the
    sets A, B, A+B with weights, none and A again build no new graph (dynamo's own counter and
    accel's compile report), and each gives the cpu's frames for the same set."""
    pytest.importorskip("flowseam_accel")
    from torch._dynamo.utils import counters

    from flowseam_accel.compiled import compile_report

    reg = flowseam.seam.discovery.discover(refresh=True)
    if not reg.records.get("accel") or not reg.records["accel"].usable:
        pytest.skip("the accel backend is not usable here")
    accel = flowseam.Platform("accel", registry=reg)
    path = checkpoints.base("wan-t2v")
    (a, _, _), (b, _, _) = _sets("wan-t2v", path, loras)
    model = flowseam.load(path, platform=accel, quiet=True)
    reference = flowseam.load(path, platform=cpu, quiet=True)
    for file in (a, b):
        model.adapters.load(file)

    def latents(m, lora):  # the DiT's work only: no VAE decode (it would compile too)
        request = flowseam.GenerationRequest(CALLS["wan-t2v"]["prompts"], flowseam.TaskType.T2V,
                                             params_for("wan-t2v", lora=lora))
        return flowseam.run_loop(m, request, decode=False).latents.numpy()

    latents(model, (a,))  # compiles the DiT with its slot
    graphs, compiles = counters["stats"]["unique_graphs"], compile_report()["compiles"]
    for lora in ((b,), (f"{a}:0.7", f"{b}:0.4"), (), (f"{a}:0.3",), (a,)):
        assert _diff(latents(model, lora), latents(reference, lora)) < 1e-4, lora
    assert counters["stats"]["unique_graphs"] == graphs
    assert compile_report()["compiles"] == compiles
    assert model.adapters.slot_builds == 1
    assert model.adapters._state("transformer").hotswap  # chosen because the DiT is compiled


# -- a LoRA trained by RL, served with --lora and by diffusers -------------------------------------

def test_a_flowgrpo_lora_file_loads_with_lora_and_in_diffusers_alike(cpu, tmp_path):
    """flowgrpo trains a rank-4 LoRA (alpha 8: scale 2, carried in the file's metadata) for two
    steps and its run ends by writing ``<output_dir>/pytorch_lora_weights.safetensors``; a fresh
    model with ``lora=(file,)`` and diffusers' ``load_lora_weights(file)`` both reproduce the
    trained model's frames."""
    from flowseam.testing.tiny import write_tiny_checkpoint
    from flowseam.training.flowgrpo import FlowGRPO

    path = write_tiny_checkpoint("flux.1-t2i", tmp_path / "flux")
    sampling = dict(num_steps=3, height=32, width=32, max_sequence_length=16, guidance_scale=3.5)
    cfg = dict(prompts=["a ball", "a box"], reward="brightness", group_size=2, steps=2, seed=0,
               sampling=sampling, grpo=dict(beta=0.0, clip_range=0.2), optim=dict(lr=3e-2),
               lora=dict(rank=4, alpha=8), output_dir=str(tmp_path / "run"))
    trainer = FlowGRPO(cfg, model=flowseam.load(path, platform=cpu, quiet=True))
    trainer.run(progress=False)
    params = DiffusionParams(**sampling, seed=5)
    trained = trainer.model.generate("a ball", params=params).frames
    file = tmp_path / "run" / "pytorch_lora_weights.safetensors"
    fresh = flowseam.load(path, platform=cpu, quiet=True)
    base = fresh.generate("a ball", params=params).frames
    served = fresh.generate("a ball", params=params.replace(lora=(str(file),))).frames
    assert _diff(trained, base) > 1e-4  # training moved the model
    assert _diff(served, trained) < TOL
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(file))
    theirs = pipe("a ball", num_inference_steps=3, height=32, width=32, guidance_scale=3.5,
                  max_sequence_length=16, generator=torch.Generator().manual_seed(5),
                  output_type="np").images[:, None]
    assert _diff(theirs, trained) < TOL
