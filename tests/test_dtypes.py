"""Component dtypes and memory options: ``flowseam.load(dtype=..., offload=..., vae_tiling=...,
vae_slicing=...)``, ``--dtype`` and friends, and the trainer's memory (gradient checkpointing,
float32 master weights under autocast, LoRA copies sharing the frozen base).

The reference of a reduced-precision run is diffusers' own pipeline loaded with
``from_pretrained(torch_dtype=...)`` on the same checkpoint and seed, compared with the
conformance suite's bound for that dtype (``MODEL_RELATIVE_TOLERANCES``); the parameters'
dtypes, module by module, must be the ones diffusers' loading gives (its keep-in-float32 modules
included), which a float32 load cast afterwards would not give.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import run_main

import flowseam
from flowseam import DiffusionParams, InvalidInputError
from flowseam.testing.conformance._support import MODEL_RELATIVE_TOLERANCES
from flowseam.testing.tiny import write_tiny_checkpoint

CARDS = ("wan2.1-t2v", "flux.1-t2i")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    return {c: write_tiny_checkpoint(c, root / c) for c in (*CARDS, "wan2.1-causal-t2v")}


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _params(card: str, **over) -> DiffusionParams:
    if card.startswith("flux"):
        return DiffusionParams(num_steps=3, height=32, width=32, guidance_scale=3.5, seed=3, **over)
    return DiffusionParams(num_steps=3, height=32, width=32, num_frames=5, guidance_scale=4.0,
                           seed=3, negative_prompt="blurry", **over)


def _diffusers(path, card: str, dtype: torch.dtype):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    p = _params(card)
    kwargs = dict(prompt="a red ball", num_inference_steps=p.num_steps, height=p.height,
                  width=p.width, guidance_scale=p.guidance_scale,
                  generator=torch.Generator().manual_seed(p.seed), output_type="np")
    if card.startswith("flux"):
        return pipe(**kwargs).images[:, None], pipe
    return pipe(num_frames=p.num_frames, negative_prompt=p.negative_prompt, **kwargs).frames, pipe


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_is_loaded_as_diffusers_loads_it_and_generates_its_frames(
        ckpts, cpu, card, dtype):
    model = flowseam.load(ckpts[card], platform=cpu, quiet=True, dtype=dtype)
    ours = model.generate("a red ball", params=_params(card)).frames
    theirs, pipe = _diffusers(ckpts[card], card, getattr(torch, dtype))
    for name, module in model.components.items():
        if isinstance(module, torch.nn.Module):
            want = {n: p.dtype for n, p in getattr(pipe, name).named_parameters()}
            assert {n: p.dtype for n, p in module.named_parameters()} == want, name
    if getattr(model.dit, "_keep_in_fp32_modules", None):  # Wan's norms and time embedder
        kept = [n for n, p in model.dit.named_parameters() if p.dtype == torch.float32]
        assert kept and len(kept) < len(list(model.dit.parameters()))
    assert _rel(ours, theirs) <= MODEL_RELATIVE_TOLERANCES[dtype]
    full = flowseam.load(ckpts[card], platform=cpu, quiet=True).generate(
        "a red ball", params=_params(card)).frames
    assert np.abs(ours - full).max() > 1e-4  # the dtype took effect
    assert f"transformer=cpu/cpu {dtype}" in model.provenance(solver=False)


def test_a_dtype_per_kind_leaves_the_other_kinds_to_the_backend(ckpts, cpu):
    model = flowseam.load(ckpts["wan2.1-t2v"], platform=cpu, quiet=True,
                          dtype="dit=bf16,vae=float16")
    dtypes = {n: {p.dtype for p in m.parameters()} for n, m in model.components.items()
              if isinstance(m, torch.nn.Module)}
    assert dtypes == {"transformer": {torch.bfloat16, torch.float32}, "vae": {torch.float16},
                      "text_encoder": {torch.float32}}
    out = model.generate("a red ball", params=_params("wan2.1-t2v")).frames
    assert out.dtype == np.float32 and np.isfinite(out).all() and out.std() > 0.01


@pytest.mark.parametrize("card, options, message", [
    ("wan2.1-t2v", dict(dtype="int8"),
     "dtype='int8' is not a dtype flowseam loads components in; use one of float32, bfloat16, "
     "float16"),
    ("wan2.1-t2v", dict(dtype="dit=bfloat16,image_encoder=float16"),
     "dtype: wan2.1-t2v has no component of kind 'image_encoder'; its kinds are text_encoder, "
     "vae, dit"),
    ("wan2.1-t2v", dict(dtype="dit=bfloat16,dit=float16"), "dtype: 'dit' is given twice"),
    ("wan2.1-t2v", dict(dtype="dit=bf16,vae"), "'vae' is not KIND=DTYPE"),
    ("wan2.1-t2v", dict(offload="disk"), "offload='disk': use model or text_encoder"),
    ("wan2.1-t2v", dict(offload="model"),
     "offload=model: platform 'cpu' builds every component on the CPU, so there is no "
     "accelerator to offload from"),
    ("wan2.1-causal-t2v", dict(vae_tiling=True),
     "vae_tiling: wan2.1-causal-t2v decodes chunk by chunk through the VAE's causal cache"),
    ("wan2.1-t2v", dict(vae_tiling={"tile_size": 64}),
     "vae_tiling: AutoencoderKLWan.enable_tiling takes tile_sample_min_height"),
    ("wan2.1-t2v", dict(vae_slicing="yes"), "must be true or false"),
])
def test_bad_options_are_refused_before_any_weights_load(ckpts, cpu, no_weights, card, options,
                                                          message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flowseam.load(ckpts[card], platform=cpu, quiet=True, **options)


def test_a_backend_that_does_not_build_a_dtype_says_so_before_loading(ckpts, no_weights):
    flowseam.seam.discovery._CACHE = None
    accel = flowseam.seam.discovery.discover().records.get("accel")
    if accel is None or not accel.usable:
        pytest.skip("the accel backend is not usable here")
    with pytest.raises(InvalidInputError,
                       match=r"dtype bfloat16 for vae \(vae\): plugin 'accel' \(device accel\) "
                             r"builds vae in float32 only"):
        flowseam.load(ckpts["wan2.1-t2v"], platform=flowseam.Platform("accel"), quiet=True,
                      dtype="bfloat16")


@pytest.mark.parametrize("args, message", [
    (["--dtype", "int8"], "flowseam: error: dtype='int8' is not a dtype"),
    (["--offload", "model"], "flowseam: error: offload=model: platform 'cpu' builds every"),
    (["--dtype", "vae=bf16,vea=fp16"], "has no component of kind 'vea'"),
])
def test_generate_refuses_bad_memory_options_in_one_line(ckpts, tmp_path, args, message):
    r = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "x", "--backend",
                 "cpu", "--output", str(tmp_path / "x.mp4"), *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_generate_with_dtype_and_offload_reports_what_ran(ckpts, tmp_path):
    r = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a red ball",
                 "--backend", "cpu", "--steps", "2", "--height", "32", "--width", "32",
                 "--frames", "5", "--dtype", "bfloat16", "--offload", "text-encoder",
                 "--vae-slicing", "--output", str(tmp_path / "x.mp4"))
    assert r.returncode == 0, r.stderr
    assert "transformer=cpu/cpu bfloat16+float32" in r.stdout
    assert (tmp_path / "x.mp4").stat().st_size > 0


def test_offloading_the_text_encoder_frees_it_and_changes_nothing(ckpts, cpu):
    """offload="text_encoder": once a request's prompts are encoded the text encoder is gone
    (no reference left), the frames are those of a model that keeps it, and a prompt the cache
    misses builds it again through the platform."""
    keep = flowseam.load(ckpts["wan2.1-t2v"], platform=cpu, quiet=True)
    lean = flowseam.load(ckpts["wan2.1-t2v"], platform=cpu, quiet=True, offload="text_encoder")
    gone = weakref.ref(lean.components["text_encoder"])
    p = _params("wan2.1-t2v")
    first = lean.generate("a red ball", params=p).frames
    gc.collect()
    assert gone() is None and lean.components.is_released("text_encoder")
    assert "text_encoder" in lean.components
    np.testing.assert_array_equal(first, keep.generate("a red ball", params=p).frames)
    built = len(cpu.components)
    again = lean.generate("a blue cube", params=p).frames
    assert len(cpu.components) == built + 1 and cpu.components[-1].name == "text_encoder"
    np.testing.assert_array_equal(again, keep.generate("a blue cube", params=p).frames)


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
def test_vae_tiling_is_diffusers_own_tiled_decode(ckpts, cpu, card):
    """With small tiles (64 px frames: Wan's tile sizes passed through, FLUX's AutoencoderKL
    tiles at its config's sample_size, 32), flowseam's tiled frames equal diffusers' tiled
    pipeline's, and differ from the untiled frames by what diffusers' own tiled decode differs
    by (the tiling is on, and it is the same)."""
    tiles = ({"tile_sample_min_height": 32, "tile_sample_min_width": 32,
              "tile_sample_stride_height": 24, "tile_sample_stride_width": 24}
             if card.startswith("wan") else {})
    params = _params(card).replace(height=64, width=64)

    def ours(**kw):
        model = flowseam.load(ckpts[card], platform=cpu, quiet=True, **kw)
        return model.generate("a red ball", params=params).frames

    tiled = ours(vae_tiling=tiles or True)
    untiled = ours()

    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(ckpts[card])
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red ball", num_inference_steps=params.num_steps, height=64, width=64,
                  guidance_scale=params.guidance_scale, output_type="np")
    if not card.startswith("flux"):
        kwargs.update(num_frames=params.num_frames, negative_prompt=params.negative_prompt)

    def theirs():
        out = pipe(generator=torch.Generator().manual_seed(params.seed), **kwargs)
        return out.images[:, None] if card.startswith("flux") else out.frames

    plain = theirs()
    pipe.vae.enable_tiling(**tiles)
    their_tiled = theirs()
    assert np.abs(plain - untiled).max() <= 1e-5
    assert np.abs(their_tiled - tiled).max() <= 1e-5
    gap = np.abs(their_tiled - plain).max()
    assert gap > 1e-4 and np.abs(tiled - untiled).max() <= gap + 1e-5


# -- training at size ------------------------------------------------------------------------
def _grpo(ckpts, **over):
    from flowseam.training.flowgrpo import FlowGRPO

    cfg = dict(model=str(ckpts["flux.1-t2i"]), backend="cpu", prompts=["a red ball"],
               reward="brightness", group_size=4, steps=1, seed=3,
               sampling=dict(num_steps=3, height=32, width=32, max_sequence_length=16),
               grpo=dict(beta=0.04, clip_range=0.2), lora=dict(rank=4),
               optim=dict(lr=1e-3, adam_eps=1e-3))
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    torch.manual_seed(0)  # the LoRA adapters' initialisation
    method = FlowGRPO(cfg)
    record = method.train_step()
    return method, record, {n: p.detach().float().clone()
                            for n, p in method.stage.policy.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_gradient_checkpointing_trains_the_same_weights(ckpts):
    """One flowgrpo step with the DiT's blocks recomputed in the backward ends with the weights
    of the same step that kept their activations (the adapters' B start at zero: they moved)."""
    plain, r0, w0 = _grpo(ckpts)
    ckpt, r1, w1 = _grpo(ckpts, gradient_checkpointing=True)
    assert ckpt.stage.policy.is_gradient_checkpointing
    assert not plain.stage.policy.is_gradient_checkpointing
    assert r0["updated"] and r1["updated"] and r1["ratio_dev_first_epoch"] <= 1e-6
    assert w0.keys() == w1.keys()
    assert max(float((w0[n] - w1[n]).abs().max()) for n in w0) <= 1e-6
    assert max(float(w1[n].abs().max()) for n in w1 if "lora_B" in n) > 1e-4


@pytest.mark.slow
def test_lora_copies_share_the_frozen_base_and_master_weights_stay_float32(ckpts):
    """A LoRA run holds one copy of the DiT: the trainer's and the reference's copies share the
    rollout model's frozen tensors. With a bfloat16 model and mixed_precision = "bf16" the
    adapters are float32 master weights, the forward runs under autocast, C2 holds and the
    update moves them."""
    method, record, weights = _grpo(ckpts, dtype="bfloat16", optim={"mixed_precision": "bf16"})
    rollout = dict(method.model.dit.named_parameters())
    policy = dict(method.stage.policy.named_parameters())
    reference = dict(method.stage.reference.named_parameters())
    base = [n for n in rollout if "lora_" not in n]
    assert base and all(policy[n] is rollout[n] and reference[n] is rollout[n] for n in base)
    assert all(policy[n] is not rollout[n] for n in rollout if "lora_" in n)
    assert {rollout[n].dtype for n in base} >= {torch.bfloat16}
    assert {p.dtype for p in policy.values() if p.requires_grad} == {torch.float32}
    assert record["updated"] and record["ratio_dev_first_epoch"] <= 1e-6
    assert any(float(p.abs().max()) > 0 for n, p in weights.items() if "lora_B" in n)
    synced = dict(method.model.dit.named_parameters())
    assert all(torch.equal(synced[n].float(), policy[n].detach().to(synced[n].dtype).float())
               for n in policy if "lora_" in n)


def test_a_full_fine_tune_copies_every_weight(ckpts):
    from flowseam.training.common import Stage

    model = flowseam.load(ckpts["flux.1-t2i"], platform=flowseam.Platform("cpu"), quiet=True)
    from flowseam.training.config import LoraSection, OptimSection, validate_config

    stage = Stage.create("dit", model, validate_config(OptimSection, {}),
                         validate_config(LoraSection, {}), with_reference=True)
    rollout = dict(model.dit.named_parameters())
    assert not any(p is rollout[n] for n, p in stage.policy.named_parameters())


@pytest.mark.parametrize("over, message", [
    (dict(dtype="int8"), "dtype='int8' is not a dtype flowseam loads components in"),
    (dict(optim={"mixed_precision": "fp8"}), "mixed_precision='fp8'"),
    (dict(gradient_checkpointing="sometimes"), "gradient_checkpointing='sometimes'"),
])
def test_training_memory_options_are_refused_before_the_model_loads(ckpts, no_weights, over,
                                                                     message):
    from flowseam.training.flowgrpo import FlowGRPO

    cfg = dict(model=str(ckpts["flux.1-t2i"]), prompts=["a"], **over)
    with pytest.raises(flowseam.FlowseamError, match=message.replace("(", r"\(")):
        FlowGRPO(cfg)


@pytest.mark.slow
def test_running_out_of_memory_says_how_much_and_what_lowers_it(tmp_path):
    """A request too large for the memory the process may use (RLIMIT_DATA 3 GiB, as
    tests/test_serve.py's server runs): encoding the image condition of 1001 frames at 512x512
    fails in the VAE; the command exits 1 with the allocator's request size and the options that
    lower it, and writes nothing."""
    import os
    import resource
    import subprocess
    import sys

    from PIL import Image

    path = write_tiny_checkpoint("wan2.1-i2v", tmp_path / "i2v")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "first.png")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    r = subprocess.run([sys.executable, "-m", "flowseam", "generate", "--model", str(path),
                        "--image", str(tmp_path / "first.png"), "--prompt", "x", "--steps", "2",
                        "--height", "512", "--width", "512", "--frames", "1001", "--backend",
                        "cpu", "--output", str(tmp_path / "out.mp4")],
                       capture_output=True, text=True, env=env, preexec_fn=limit, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("flowseam: out of memory: ") and "you tried to allocate" in line, line
    assert "while preparing the latents; what lowers it: --vae-tiling" in line, line
    assert "--dtype bfloat16" in line and "Traceback" not in r.stderr
    assert not (tmp_path / "out.mp4").exists()
