"""The demo world: real digits as data, the held-out classifier and its rewards (registered as
plugins), batched finetune, the recipe-keyed model cache, and a ``flowseam demo`` smoke run."""

from __future__ import annotations

import json
from importlib import metadata

import flowseam
import numpy as np
import pytest
import torch
from flowseam.demo import classifier as clf_mod
from flowseam.demo.classifier import DigitImageReward, DigitVideoReward, features
from flowseam.demo.data import (
    DIRECTIONS,
    HELD_OUT_FRACTION,
    SPLIT_SEED,
    i2v_dataset,
    i2v_prompt,
    moving_clip,
    parse_prompt,
    splits,
    t2i_dataset,
    t2i_example,
    t2i_prompt,
)


def test_data_shapes_and_prompts():
    t2i = t2i_dataset(limit=5)
    assert len(t2i) == 5
    for prompt, image in t2i:
        digit, direction = parse_prompt(prompt)
        assert prompt.startswith("a handwritten digit ") and digit is not None and direction is None
        assert image.shape == (1, 32, 32, 3) and image.dtype == np.float32
        assert 0.0 <= image.min() and image.max() <= 1.0 and image.max() > 0.5
    # workflow prompts: every scan again under "... moving <direction>", the very same image
    both = t2i_dataset(limit=5, workflow_prompts=True)
    assert len(both) == 10
    for (plain, image), (moving, same) in zip(both[::2], both[1::2]):
        assert parse_prompt(moving)[0] == parse_prompt(plain)[0]
        assert parse_prompt(moving)[1] in DIRECTIONS and parse_prompt(plain)[1] is None
        assert np.array_equal(image, same)
    i2v = i2v_dataset(limit=8)
    for prompt, clip in i2v:
        digit, direction = parse_prompt(prompt)
        assert direction in DIRECTIONS and prompt.endswith(f"moving {direction}")
        assert clip.shape == (9, 32, 32, 3)
    assert parse_prompt("a handwritten digit seven moving left") == (7, "left")
    with pytest.raises(ValueError, match="leaves a 32px canvas"):
        moving_clip(splits()[0].images[0], "left", frames=9, digit_size=24)


def test_classifier_is_fitted_on_the_held_out_split_only(monkeypatch):
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    gen_idx, held_idx = train_test_split(np.arange(len(digits.target)), test_size=HELD_OUT_FRACTION,
                                         random_state=SPLIT_SEED, stratify=digits.target)
    gen, held = splits()
    assert not set(gen_idx) & set(held_idx)
    assert np.array_equal(gen.images, (digits.images[gen_idx] / 16.0).astype(np.float32))
    assert np.array_equal(held.images, (digits.images[held_idx] / 16.0).astype(np.float32))

    fitted = []
    real_fit = LogisticRegression.fit
    def recording_fit(self, x, y, *args, **kwargs):
        fitted.append((x, y))
        return real_fit(self, x, y, *args, **kwargs)

    monkeypatch.setattr(LogisticRegression, "fit", recording_fit)
    clf_mod.classifier.cache_clear()
    try:
        clf_mod.classifier()
    finally:
        clf_mod.classifier.cache_clear()
    (x, y), = fitted
    assert np.array_equal(y, held.labels)
    expected = np.stack([features(moving_clip(im, "left", frames=1)[0], 16) for im in held.images])
    assert np.array_equal(x, expected)
    # the generators' data never reaches it: the generator split is data, not training rows
    assert len(x) == len(held_idx) and len(x) + len(gen.labels) == len(digits.target)


def test_video_reward_prefers_the_prompted_direction():
    gen, _ = splits()
    reward = DigitVideoReward()
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    prompts, right_way, wrong_way = [], [], []
    for i in range(8):
        direction = sorted(DIRECTIONS)[i % 4]
        prompts.append(i2v_prompt(int(gen.labels[i]), direction))
        right_way.append(moving_clip(gen.images[i], direction))
        wrong_way.append(moving_clip(gen.images[i], opposite[direction]))
    good = reward(prompts, np.stack(right_way))
    bad = reward(prompts, np.stack(wrong_way))
    reversed_time = reward(prompts, np.stack(right_way)[:, ::-1])
    assert (good > bad).all() and (good > reversed_time).all(), (good, bad)
    assert good.mean() > 0.5 and bad.max() == 0.0
    assert torch.isnan(reward([t2i_prompt(int(gen.labels[0]))], np.stack(right_way[:1]))).all()
    image = DigitImageReward()([t2i_prompt(int(gen.labels[0]))],
                               t2i_example(gen.images[0], digit_size=16)[None])
    filling = DigitImageReward(digit_px=32)([t2i_prompt(int(gen.labels[0]))],
                                            t2i_example(gen.images[0])[None])
    assert float(filling[0]) > 0.5
    assert image.shape == (1,) and float(image[0]) > 0.5


def test_rewards_are_registered_as_a_plugin():
    from flowseam.training import get_reward, registered_rewards

    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["demo"].value == "flowseam.demo.plugin"
    rewards = registered_rewards()
    assert rewards["digit_image"] is DigitImageReward and rewards["digit_video"] is DigitVideoReward
    assert isinstance(get_reward("digit_video", target_px=4.0), DigitVideoReward)


@pytest.fixture(scope="module")
def flux_ckpt(tmp_path_factory):
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("demo") / "flux")


def test_finetune_batches_rows_independently_and_encodes_once(flux_ckpt, monkeypatch):
    from flowseam.training.finetune import Finetune

    flowseam.seam.discovery._CACHE = None
    model = flowseam.load(flux_ckpt, platform=flowseam.Platform("cpu"))
    data = t2i_dataset(limit=6)
    ft = Finetune(dict(steps=2, batch_size=4, seed=0, train=dict(p_uncond=0.5),
                       sampling=dict(max_sequence_length=32)), model=model, dataset=data)
    ft.progress = False
    calls = []
    real = model.encode_latents
    monkeypatch.setattr(model, "encode_latents", lambda *a, **k: calls.append(1) or real(*a, **k))
    examples = ft.prepare()
    assert len(examples) == 6 and all(e.uncond is not None for e in examples) and len(calls) == 1
    seeds = [11, 12, 13, 14, 15, 16]
    with torch.no_grad():
        batched = float(ft.batch_loss(examples, seeds))
        rows = [float(ft.loss(p, f, s)) for (p, f), s in zip(data, seeds)]
    assert batched == pytest.approx(np.mean(rows), rel=1e-4)
    encoded = len(calls)
    ft.run(progress=False)
    assert len(calls) == encoded  # training reuses the encoded latents


def test_manifest_lookup_is_keyed_on_the_recipe_settings(tmp_path):
    from flowseam.demo.build import Recipe, lookup, write_manifest

    path = tmp_path / "digits-t2i.toml"
    path.write_text('card = "flux.1-t2i"\n[serve]\nnum_steps = 20\n')
    recipe = Recipe.read(path)
    (tmp_path / "cache" / "digits-t2i").mkdir(parents=True)
    (tmp_path / "cache" / "digits-t2i" / "model_index.json").write_text("{}")
    write_manifest(tmp_path / "cache", {"digits-t2i": {"recipe_sha256": recipe.key()}})
    assert lookup(tmp_path / "cache", recipe) == tmp_path / "cache" / "digits-t2i"
    assert lookup(tmp_path / "cache", recipe, quick=True) is None  # a quick build is another key
    # comments and sampling settings do not change the weights; anything else does
    path.write_text('# a comment\ncard = "flux.1-t2i"\n[serve]\nnum_steps = 8\n')
    assert lookup(tmp_path / "cache", Recipe.read(path)) == tmp_path / "cache" / "digits-t2i"
    path.write_text('card = "flux.1-t2i"\nseed = 1\n')
    assert lookup(tmp_path / "cache", Recipe.read(path)) is None


def test_demo_smoke_builds_once_then_reuses_the_cache(tmp_path, capsys):
    from flowseam.cli import main

    threads = torch.get_num_threads()
    common = ["demo", "--quick", "--backend", "cpu", "--cache", str(tmp_path / "models"),
              "--output", str(tmp_path / "out")]
    try:
        assert main(common + ["--steps", "1", "--prompts", "1", "--eval-seeds", "1",
                              "--group-size", "2"]) == 0
        first = capsys.readouterr().out
        manifest = (tmp_path / "models" / "manifest.json").read_text()
        # without --backend: the table of the platform the demo runs on (cpu), and why not the
        # highest-priority backend
        assert main([a for a in common if a not in ("--backend", "cpu")] + ["--build-only"]) == 0
        second = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert "building" in first and "building" not in second and "using" in second
    assert "Platform: backend 'cpu'" in second
    detected = flowseam.Platform.detect().name
    if detected != "cpu":
        assert f"demo backend: cpu — the demo's default, so that no model waits for a compiler; " \
               f"the highest-priority backend here is {detected!r}" in second
    assert (tmp_path / "models" / "manifest.json").read_text() == manifest  # never retrained
    assert "backend" in first.splitlines()[0] or "name" in first.splitlines()[0]  # the table
    out = tmp_path / "out"
    for name in ("workflow_grid.png", "workflow_grid_after_rl.png", "reward.png", "summary.json",
                 "rl/metrics.jsonl", "videos/00-three-moving-right.gif",
                 "videos/00-three-moving-right.mp4", "videos/00-three-moving-right.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 1 and summary["backend"] == "cpu"
    # the post-trained stages are models generate takes
    assert summary["trained_models"] == {s: str(out / "rl" / s / "model") for s in ("t2i", "i2v")}
    assert f"trained t2i model: {out / 'rl' / 't2i' / 'model'}" in first
    assert {"reward_before", "reward_after", "generated_digit_accuracy_before"} <= set(summary)
    from flowseam.checkpoint_defaults import read_checkpoint_defaults
    from flowseam.demo.build import read_recipes

    recipes = read_recipes()
    for stage in ("digits-t2i", "digits-i2v"):
        loaded = flowseam.load(tmp_path / "models" / stage, platform=flowseam.Platform("cpu"))
        assert loaded.card.name == ("flux.1-t2i" if stage == "digits-t2i" else "wan2.1-i2v")
        # the recipe's [serve] settings are the built model's own serving defaults (its
        # flow_shift is a solver setting: the solver takes it at load and says where it came from)
        serve = recipes[stage].config["serve"]
        assert read_checkpoint_defaults(tmp_path / "models" / stage) == serve
        assert loaded.serve_defaults == {k: v for k, v in serve.items() if k != "flow_shift"}
        if "flow_shift" in serve:
            assert f"shift={float(serve['flow_shift'])} (flowseam.json)" in loaded.solver_line()


def test_the_shipped_weights_match_the_recipes_so_a_first_run_never_builds():
    from flowseam.demo.build import lookup, read_recipes, shipped_dir

    recipes = read_recipes()
    assert set(recipes) == {"digits-t2i", "digits-i2v"}
    for name, recipe in recipes.items():
        assert lookup(shipped_dir(), recipe) == shipped_dir() / name, name
        # the copy of the recipe kept with the weights is the recipe they were built from
        kept = (shipped_dir() / name / "flowseam_recipe.toml").read_text()
        assert kept == recipe.text, f"{name}: rebuild with flowseam demo --build-only --rebuild"


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps=-1 must be >= 0"),
    (["--prompts", "0"], "--prompts=0 must be in [1, 10]"),
    (["--prompts", "11"], "--prompts=11 must be in [1, 10]"),
    (["--group-size", "1"], "--group-size=1 must be >= 2"),
    (["--fps", "0"], "--fps=0 must be >= 1"),
    (["--threads", "0"], "--threads=0 must be >= 1"),
])
def test_demo_rejects_bad_input_before_any_work(tmp_path, capsys, argv, message):
    from flowseam.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--output", str(out)] + argv) == 2
    err = capsys.readouterr()
    assert message in err.err and "name" not in err.out  # no backend table: nothing ran
    assert not out.exists()


def test_demo_rejects_an_unwritable_output(tmp_path, capsys):
    from flowseam.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo", "--output", str(blocker / "out")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err
