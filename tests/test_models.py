"""Model cards, loading through the seam, validation, and parity with diffusers' pipelines.

Parity: on the same tiny checkpoint, seed and parameters, flowseam's output equals diffusers'
own pipeline output (WanPipeline, WanImageToVideoPipeline, FluxPipeline, all with the
FlowMatchEulerDiscreteScheduler the checkpoint ships) within max-abs 1e-5 on cpu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import plugin_env
from PIL import Image

import flowseam
from flowseam import DiffusionParams, FlowseamError
from flowseam.attention import RoutedAttnProcessor
from flowseam.testing.tiny import write_tiny_checkpoint

CARDS = ("wan2.1-t2v", "wan2.1-i2v", "flux.1-t2i")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {card: write_tiny_checkpoint(card, root / card) for card in CARDS}


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


@pytest.fixture(scope="module")
def models(checkpoints, cpu):
    return {card: flowseam.load(path, platform=cpu) for card, path in checkpoints.items()}


def _image(h=40, w=48, seed=0):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))


def _diffusers_output(path, card, prompt, *, steps, height, width, frames, guidance, seed, image=None,
                      negative_prompt=None):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=prompt, num_inference_steps=steps, height=height, width=width,
                  guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                  output_type="np")
    if card == "flux.1-t2i":
        return pipe(**kwargs).images[:, None]
    kwargs.update(num_frames=frames, negative_prompt=negative_prompt)
    if image is not None:
        kwargs["image"] = image
    return pipe(**kwargs).frames


@pytest.mark.parametrize("card,height,width,frames,guidance", [
    ("wan2.1-t2v", 32, 48, 5, 5.0),      # CFG on
    ("wan2.1-t2v", 32, 32, 9, 1.0),      # CFG off
    ("flux.1-t2i", 32, 48, None, 3.5),
])  # wan2.1-i2v: test_i2v_matches_diffusers_with_one_image_and_with_one_image_per_prompt
def test_parity_with_diffusers(checkpoints, models, card, height, width, frames, guidance):
    image = _image() if card == "wan2.1-i2v" else None
    negative = "blurry" if card.startswith("wan") and guidance > 1 else None
    params = DiffusionParams(num_steps=4, height=height, width=width, num_frames=frames,
                             guidance_scale=guidance, seed=3, negative_prompt=negative)
    ours = models[card].generate("a red ball rolling", image=image, params=params).frames
    theirs = _diffusers_output(checkpoints[card], card, "a red ball rolling", steps=4, height=height,
                               width=width, frames=frames, guidance=guidance, seed=3, image=image,
                               negative_prompt=negative)
    assert ours.shape == theirs.shape
    assert ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-5
    assert ours.std() > 0.01  # not a constant image


def test_i2v_matches_diffusers_with_one_image_and_with_one_image_per_prompt(checkpoints, models):
    """Parity with WanImageToVideoPipeline (CFG on, images resized from 40x48 and 36x36): one
    prompt with one image; and a batch of two prompts with a list of two images, where row k
    equals diffusers' pipeline on prompt k, image k and seed k alone (diffusers has no
    per-sample images; the RL rollouts batch a group this way)."""
    model = models["wan2.1-i2v"]
    images, prompts, seeds = [_image(seed=1), _image(36, 36, seed=2)], ["a red ball", "a cube"], [3, 4]
    params = DiffusionParams(num_steps=3, height=32, width=32, num_frames=5, guidance_scale=5.0,
                             negative_prompt="blurry")
    theirs = [_diffusers_output(checkpoints["wan2.1-i2v"], "wan2.1-i2v", p, steps=3, height=32,
                                width=32, frames=5, guidance=5.0, seed=s, image=im,
                                negative_prompt="blurry")[0]
              for p, im, s in zip(prompts, images, seeds)]
    one = model.generate(prompts[0], image=images[0], params=params.replace(seed=seeds[0])).frames
    assert one.shape == (1, 5, 32, 32, 3) and one.dtype == np.float32 and one.std() > 0.01
    assert np.abs(one[0] - theirs[0]).max() <= 1e-5
    ours = model.generate(prompts, image=images, params=params, seeds=seeds).frames
    assert ours.shape == (2, 5, 32, 32, 3)
    assert np.abs(ours - np.stack(theirs)).max() <= 1e-5
    # the image varied per row is what each row follows: the same seeds, the images swapped
    swapped = model.generate(prompts, image=images[::-1], params=params, seeds=seeds).frames
    assert np.abs(swapped - ours).max() > 1e-3
    with pytest.raises(ValueError, match="list of 2 images for 3 prompt"):
        model.generate(prompts + ["x"], image=images, params=params)
    with pytest.raises(ValueError, match=r"image\[1\]"):
        model.generate(prompts, image=[images[0], np.full((8, 8, 3), 2.0)], params=params)


@pytest.mark.parametrize("card", CARDS)
def test_same_seed_is_bitwise_identical_and_seeds_differ(models, card):
    image = _image() if card == "wan2.1-i2v" else None
    p = DiffusionParams(num_steps=2, height=32, width=32, num_frames=5 if card != "flux.1-t2i" else None)
    a = models[card].generate("a cat", image=image, params=p.replace(seed=11)).frames
    b = models[card].generate("a cat", image=image, params=p.replace(seed=11)).frames
    c = models[card].generate("a cat", image=image, params=p.replace(seed=12)).frames
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_components_are_built_through_the_seam_and_attention_is_routed(models, cpu):
    model = models["wan2.1-t2v"]
    recs = model.component_records
    assert {r.kind for r in recs.values()} >= {"dit", "vae", "text_encoder", "tokenizer"}
    assert all(r.plugin == "cpu" and not r.fallback for r in recs.values())
    procs = model.dit.attn_processors
    assert procs and all(isinstance(p, RoutedAttnProcessor) for p in procs.values())
    before = sum(p._mode.calls for p in procs.values())
    params = DiffusionParams(num_steps=1, height=32, width=32, num_frames=5, guidance_scale=1.0)
    result = model.generate("x", params=params)
    # 1 step, 2 blocks x (self + cross) attention, no CFG
    assert sum(p._mode.calls for p in procs.values()) - before == 4
    # the cpu backend's Wan VAE convolves with oneDNN, never torch's slow im2col kernels
    # (flowseam_cpu.wan_vae; equal to diffusers' VAE: test_parity_with_diffusers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model.decode(result.latents, result.params)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::mkldnn_convolution" in ops
    assert not {"aten::slow_conv3d_forward", "aten::_slow_conv2d_forward"} & ops


def test_attention_kernel_of_the_platform_is_what_runs(checkpoints, fixture_plugins_dir):
    """A backend overriding the vae gets it; attention calls go to the platform's kernel."""
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a") as reg:
        platform = flowseam.Platform("testdev_a", registry=reg)
        model = flowseam.load(checkpoints["wan2.1-t2v"], platform=platform)
        assert model.component_records["vae"].plugin == "testdev_a"
        assert model.component_records["transformer"].fallback
        seen = []
        kernel = platform.kernels.get(flowseam.ops.ATTENTION)
        for proc in model.dit.attn_processors.values():
            proc._mode.attn = lambda q, k, v, attn_mask=None, scale=None: seen.append(q.shape) or kernel(q, k, v, attn_mask, scale)
        model.generate("x", params=DiffusionParams(num_steps=1, height=32, width=32, num_frames=5,
                                                   guidance_scale=1.0))
        assert len(seen) == 4 and all(len(s) == 4 for s in seen)


@pytest.mark.parametrize("card,kwargs,match", [
    ("wan2.1-t2v", dict(num_frames=6), r"num_frames=6 is not of the form 4k\+1.*try 5 or 9"),
    ("wan2.1-t2v", dict(height=40), r"height=40 is not divisible by 16.*try 32 or 48"),
    ("wan2.1-t2v", dict(num_steps=0), "num_steps=0 must be an integer >= 1"),
    ("wan2.1-t2v", dict(guidance_scale=-1.0), "guidance_scale=-1.0 must be a finite number >= 0"),
    ("flux.1-t2i", dict(width=40), r"width=40 is not divisible by 16"),
    ("flux.1-t2i", dict(negative_prompt="ugly"), "negative_prompt is not supported"),
    ("flux.1-t2i", dict(num_frames=5), "num_frames=5"),
])
def test_bad_parameters_name_the_value(models, card, kwargs, match):
    base = dict(num_steps=1, height=32, width=32)
    if card != "flux.1-t2i":
        base["num_frames"] = 5
    with pytest.raises(ValueError, match=match):
        models[card].generate("x", params=DiffusionParams(**{**base, **kwargs}))


def test_image_rules(models, tmp_path):
    p = DiffusionParams(num_steps=1, height=32, width=32, num_frames=5)
    with pytest.raises(ValueError, match="image-to-video: pass image="):
        models["wan2.1-i2v"].generate("x", params=p)
    with pytest.raises(ValueError, match="takes no image"):
        models["wan2.1-t2v"].generate("x", image=_image(), params=p)
    with pytest.raises(ValueError, match="does not exist"):
        models["wan2.1-i2v"].generate("x", image=tmp_path / "nope.png", params=p)
    # a path and an array in [0, 1] are accepted; a wrongly sized image is resized (Lanczos)
    img = _image(20, 60)
    img.save(tmp_path / "in.png")
    from_path = models["wan2.1-i2v"].generate("x", image=tmp_path / "in.png", params=p).frames
    from_pil = models["wan2.1-i2v"].generate("x", image=img, params=p).frames
    assert from_path.shape == (1, 5, 32, 32, 3) and np.array_equal(from_path, from_pil)


def test_text_embeddings_are_cached_per_weights_version(models):
    model = models["wan2.1-t2v"]
    calls = []
    handle = model.components["text_encoder"].register_forward_hook(lambda *a: calls.append(1))
    try:
        p = DiffusionParams(num_steps=1, height=32, width=32, num_frames=5, guidance_scale=1.0)
        model.generate("an uncached prompt", params=p)
        model.generate("an uncached prompt", params=p)
        assert len(calls) == 1
        model.bump_version("text_encoder")
        model.generate("an uncached prompt", params=p)
        assert len(calls) == 2
    finally:
        handle.remove()
    # what is cached is the prompt's own tokens (the tokenizer's count), not max_length rows
    tokens = int(model.components["tokenizer"]("an uncached prompt", return_tensors="pt")
                 .attention_mask.sum())
    (states, keep), = [v for k, v in model._text_cache.items()
                       if k[1:3] == (model.versions["text_encoder"], "an uncached prompt")]
    assert states.shape[:2] == (1, tokens) and int(keep.sum()) == tokens < len(keep) == 512


@pytest.mark.parametrize("card,text_only", [
    ("wan2.1-t2v", ("text_embedder", "attn2.to_k", "attn2.to_v", "attn2.norm_k")),
    ("wan2.1-i2v", ("text_embedder", "image_embedder", "attn2.to_k", "attn2.to_v", "attn2.norm_k",
                    "attn2.add_k_proj", "attn2.add_v_proj", "attn2.norm_added_k")),
])
def test_text_only_dit_values_are_computed_once_per_loop_run(models, monkeypatch, card, text_only):
    """Wan's text (and image) embedders and cross-attention keys/values run at the first step
    only — the output equals diffusers', which recomputes them every step
    (test_parity_with_diffusers); a trainer's recompute with gradients runs them again."""
    model = models[card]
    watched = {id(m) for name, m in model.dit.named_modules() if name.endswith(text_only)}
    embedders = sum(name.endswith("embedder") for name in text_only)  # once; the rest per block
    assert len(watched) == embedders + (len(text_only) - embedders) * len(model.dit.blocks)
    runs = []
    for cls in {type(model.dit.get_submodule(n)) for n, m in model.dit.named_modules()
                if id(m) in watched}:
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, x, _f=forward: runs.append(id(self))
                            or _f(self, x))
    p = DiffusionParams(num_steps=3, height=32, width=32, num_frames=5, guidance_scale=5.0,
                        negative_prompt="blurry")
    image = _image() if card.endswith("i2v") else None
    result = model.generate("a red ball", image=image, params=p)
    assert sorted(r for r in runs if r in watched) == sorted(watched)  # once each, not 3 times
    runs.clear()
    with torch.enable_grad():
        model.velocity(result.latents, torch.full((1,), 500.0), result.cond, result.params)
    assert sorted(r for r in runs if r in watched) == sorted(watched)


def test_load_errors_name_the_file(checkpoints, tmp_path, cpu, monkeypatch):
    import shutil

    with pytest.raises(FlowseamError, match="directory .*missing' does not exist"):
        flowseam.load(tmp_path / "missing", platform=cpu)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowseamError, match=r"missing checkpoint file .*model_index.json"):
        flowseam.load(tmp_path / "empty", platform=cpu)
    bad = tmp_path / "corrupt"
    shutil.copytree(checkpoints["wan2.1-t2v"], bad)
    weights = next((bad / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(FlowseamError, match=rf"'transformer'.*{weights.name}"):
        flowseam.load(bad, platform=cpu)
    (bad / "model_index.json").write_text("{not json")
    with pytest.raises(FlowseamError, match="corrupt checkpoint file .*model_index.json"):
        flowseam.load(bad, platform=cpu)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FlowseamError, match="pass its local directory"):
        flowseam.load("some-org/some-model", platform=cpu)


def test_a_refused_layout_comes_before_the_model_libraries_import(checkpoints, tmp_path):
    """The layout, dtype and memory checks import neither diffusers nor transformers (seconds
    of imports): a fresh process is refused at once."""
    import shutil
    import subprocess
    import sys

    bad = tmp_path / "no-vae"
    shutil.copytree(checkpoints["wan2.1-t2v"], bad)
    shutil.rmtree(bad / "vae")
    code = ("import sys, flowseam\n"
            "try:\n"
            f"    flowseam.load({str(bad)!r}, platform=flowseam.Platform('cpu'))\n"
            "except flowseam.FlowseamError as exc:\n"
            "    print(type(exc).__name__, exc)\n"
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and "vae" in lines[0], proc.stdout + proc.stderr
    assert lines[-1] == "[]"


def test_workflow_feeds_the_generated_image_to_image_to_video(models, fixture_plugins_dir):
    from flowseam.workflows import Workflow

    wf = Workflow(models["flux.1-t2i"], models["wan2.1-i2v"])
    t2i = DiffusionParams(num_steps=2, height=32, width=32)
    i2v = DiffusionParams(num_steps=2, height=32, width=32, num_frames=5)
    result = wf.run("a dog", t2i_params=t2i, i2v_params=i2v, seed=5)
    image, video = result.stages[0].frames, result.frames
    assert image.shape == (1, 1, 32, 32, 3) and video.shape == (1, 5, 32, 32, 3)
    direct = models["wan2.1-i2v"].generate("a dog", image=image[0, 0], params=i2v.replace(seed=5))
    assert np.array_equal(direct.frames, video)
    # a list of prompts runs as one batch per stage: row k has seed 5 + k and its own image
    # (per-sample images equal diffusers image by image: test_i2v_matches_diffusers_with_...)
    batch = wf.run(["a dog", "a cat"], t2i_params=t2i, i2v_params=i2v, seed=5)
    assert np.abs(batch.frames[:1] - video).max() <= 1e-5
    assert np.abs(batch.frames[1] - batch.frames[0]).max() > 1e-3
    # each stage keeps its own platform: stage 2 on a backend whose vae is its own
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a") as reg:
        i2v_platform = flowseam.Platform("testdev_a", registry=reg)
        i2v_other = flowseam.load(models["wan2.1-i2v"].path, platform=i2v_platform)
        mixed = Workflow(models["flux.1-t2i"], i2v_other).run("a dog", t2i_params=t2i, i2v_params=i2v, seed=5)
        assert models["flux.1-t2i"].platform.name == "cpu" and i2v_other.platform.name == "testdev_a"
        assert i2v_other.component_records["vae"].plugin == "testdev_a"
        assert np.abs(mixed.frames - video).max() <= 1e-5
    with pytest.raises(ValueError, match="stage 1 of t2i-i2v must be text-to-image"):
        Workflow(models["wan2.1-i2v"], models["wan2.1-i2v"])
