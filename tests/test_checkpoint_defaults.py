"""A checkpoint's own serving defaults (``flowseam.json`` next to ``model_index.json``): what a
request leaves unset takes them before the card's defaults, the CLI flags beat them, a bad file
is refused before anything loads, and the shipped demo models carry their recipes' ``[serve]``
settings, so ``flowseam generate`` draws the prompted digit with no size or text-length flag."""

from __future__ import annotations

import json
import shutil

import imageio.v3 as iio
import numpy as np
import pytest

import flowseam
from flowseam import DiffusionParams, FlowseamError
from flowseam.cli import main
from flowseam.checkpoint_defaults import FILENAME, read_checkpoint_defaults
from flowseam.testing.tiny import write_tiny_checkpoint

SERVE = {"num_steps": 2, "height": 32, "width": 48, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    path = write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("defaults") / "flux")
    (path / FILENAME).write_text(json.dumps({"serve": SERVE}))
    return path


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def test_unset_parameters_take_the_checkpoints_defaults_before_the_cards(flux, cpu):
    model = flowseam.load(flux, platform=cpu)
    assert model.serve_defaults == SERVE
    out = model.generate("a cat")
    assert out.frames.shape == (1, 1, 32, 48, 3)  # the card's default is 1024x1024
    assert (out.params.num_steps, out.params.max_sequence_length) == (2, 16)  # card: 28, 512
    assert out.cond.prompt_embeds.shape[1] == 16  # T5 tokens kept: the text length took effect
    assert out.params.guidance_scale == model.card.defaults["guidance_scale"]  # not in the file
    # the request beats the checkpoint
    own = model.generate("a cat", params=DiffusionParams(height=32, width=32, max_sequence_length=8))
    assert own.frames.shape == (1, 1, 32, 32, 3) and own.cond.prompt_embeds.shape[1] == 8
    # and the text length changes the picture (it is not ignored)
    longer = model.generate("a cat", params=DiffusionParams(max_sequence_length=32))
    assert not np.array_equal(longer.frames, out.frames)


@pytest.mark.parametrize("content, match", [
    ({"serve": {"num_step": 2}}, r"serve has unknown key\(s\) \['num_step'\]; allowed: .*'num_steps'"),
    ({"serve": {"height": "32"}}, r"serve.height='32' must be a positive integer"),
    ({"serve": {"guidance_scale": True}}, r"serve.guidance_scale=True must be a number"),
    ({"sample": {}}, r"unknown key\(s\) \['sample'\]; allowed: \['serve', 'trained'\]"),
    ("{not json", "corrupt checkpoint file"),
])
def test_a_bad_file_is_refused_naming_it_before_any_component_loads(flux, tmp_path, cpu,
                                                                     monkeypatch, content, match):
    bad = tmp_path / "bad"
    shutil.copytree(flux, bad)
    (bad / FILENAME).write_text(content if isinstance(content, str) else json.dumps(content))
    built = []
    monkeypatch.setattr(cpu, "build_component", lambda *a, **k: built.append(a))
    with pytest.raises(FlowseamError, match=match) as info:
        flowseam.load(bad, platform=cpu)
    assert str(bad / FILENAME) in str(info.value) and built == []


def test_generate_cli_uses_them_and_its_flags_beat_them(flux, tmp_path, capsys):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    common = ["generate", "--model", str(flux), "--prompt", "a cat", "--backend", "cpu"]
    assert main(common + ["--output", str(a)]) == 0
    assert main(common + ["--max-sequence-length", "8", "--height", "16", "--output", str(b)]) == 0
    assert iio.imread(a).shape == (32, 48, 3) and iio.imread(b).shape == (16, 48, 3)
    out = capsys.readouterr().out
    assert "1 frame(s) of 32x48" in out and "1 frame(s) of 16x48" in out


def test_the_shipped_demo_models_carry_their_recipes_serve_settings():
    from flowseam.demo.build import read_recipes, shipped_dir

    for name, recipe in read_recipes().items():
        assert read_checkpoint_defaults(shipped_dir() / name) == recipe.config["serve"], name


def test_generate_with_the_shipped_text_to_image_model_draws_the_prompted_digit(tmp_path, capsys):
    """The newcomer's first command, without a size, step or text-length flag."""
    from flowseam.demo.build import shipped_dir
    from flowseam.demo.classifier import digit_probabilities

    out = tmp_path / "seven.png"
    assert main(["generate", "--model", str(shipped_dir() / "digits-t2i"), "--prompt",
                 "a handwritten digit seven", "--backend", "cpu", "--output", str(out)]) == 0
    image = iio.imread(out).astype(np.float32) / 255.0
    assert image.shape == (32, 32, 3)
    # the held-out classifier (fitted on scans the generator never saw) reads a seven
    probs = digit_probabilities(image[None], 16)[0]
    assert probs.argmax() == 7 and probs[7] > 0.5, probs


def test_models_lists_where_the_demo_models_are(tmp_path, capsys):
    from flowseam.demo.build import shipped_dir

    assert main(["models", "--cache", str(tmp_path / "empty-cache")]) == 0
    text = capsys.readouterr().out
    for name in ("digits-t2i", "digits-i2v", "text-t2i"):
        assert str(shipped_dir() / name) in text
    assert "20 steps, 32x32, 32 text tokens" in text  # digits-t2i's serving defaults
    assert f"flowseam generate --model {shipped_dir() / 'digits-t2i'}" in text
    assert main(["models", "--json", "--cache", str(tmp_path / "empty-cache")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["name"], r["source"], r["matches_recipe"]) for r in rows} == \
        {("digits-t2i", "shipped", True), ("digits-i2v", "shipped", True),
         ("text-t2i", "shipped", True)}
