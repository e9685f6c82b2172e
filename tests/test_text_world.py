"""The demo's text world: strings rendered in a real font, read by the real OCR model (PP-OCRv4
through rapidocr-onnxruntime), the text-t2i recipe and its shipped weights, and a
``flowseam demo --world text --quick`` smoke run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flowseam.demo.text import WORDS, augmented, prompt_text, render, text_dataset, text_prompt

pytest.importorskip("rapidocr_onnxruntime")


@pytest.fixture(scope="module")
def ocr():
    from flowseam.training import get_reward

    return get_reward("ocr", threads=1)


def test_every_word_renders_legibly_to_the_real_ocr_model(ocr):
    # the plain render and two jittered ones (smallest/largest font, offsets, gray levels) of
    # every word: the recogniser must read each exactly, so the data is ~100% OCR-correct
    images, targets = [], []
    for i, word in enumerate(WORDS):
        for image in (render(word), augmented(word, seed=i), augmented(word, seed=1000 + i)):
            assert image.shape == (32, 64, 3) and image.dtype == np.float32
            images.append(image)
            targets.append(word.lower())
    read = ocr.recognize(np.stack(images))
    wrong = [(t, r) for t, r in zip(targets, read) if t != r]
    assert not wrong, wrong
    # the reward of a correct render is 1 and a blank sign reads nothing
    scores = ocr([text_prompt(w) for w in WORDS[:4]], np.stack(images[:12:3])[:, None])
    assert torch.equal(scores, torch.ones(4))
    assert ocr.recognize(np.full((1, 32, 64, 3), 0.9, np.float32)) == [""]


def test_dataset_prompts_and_augmentation():
    data = text_dataset(per_word=2)
    assert len(data) == 2 * len(WORDS)
    assert [prompt_text(p) for p, _ in data[:len(WORDS)]] == list(WORDS)  # any prefix: every word
    (p0, a), (p1, b) = data[0], data[len(WORDS)]
    assert p0 == p1 == 'a sign that says "7"' and a.shape == (1, 32, 64, 3)
    assert not np.array_equal(a, b)  # two augmentations of one word differ
    assert np.array_equal(text_dataset(per_word=2)[5][1], data[5][1])  # and are reproducible
    image = a[0, ..., 0]
    assert image.min() < 0.3 and np.median(image) > 0.7  # dark text on a light sign
    with pytest.raises(ValueError, match="1 to 4 characters"):
        text_dataset(words=["HELLO"])
    with pytest.raises(ValueError, match="per_word=0"):
        text_dataset(per_word=0)


def test_the_shipped_text_model_matches_its_recipe():
    from flowseam.demo.build import default_recipe_dir, lookup, read_recipes, shipped_dir

    recipes = read_recipes(world="text")
    assert set(recipes) == {"text-t2i"} and (default_recipe_dir("text") / "text-t2i.toml").is_file()
    recipe = recipes["text-t2i"]
    assert recipe.config["card"] == "flux.1-t2i"
    assert lookup(shipped_dir(), recipe) == shipped_dir() / "text-t2i", \
        "rebuild with flowseam demo --world text --build-only --rebuild and ship it"
    assert (shipped_dir() / "text-t2i" / "flowseam_recipe.toml").read_text() == recipe.text


def test_ship_copies_a_full_build_and_refuses_a_quick_one(tmp_path):
    from flowseam.demo.build import read_manifest, ship, write_manifest
    from flowseam.errors import FlowseamError

    cache, target = tmp_path / "cache", tmp_path / "weights"
    (cache / "text-t2i").mkdir(parents=True)
    (cache / "text-t2i" / "model_index.json").write_text("{}")
    target.mkdir()
    write_manifest(target, {"digits-t2i": {"recipe_sha256": "d"}})
    write_manifest(cache, {"text-t2i": {"recipe_sha256": "abc+quick", "quick": True}})
    with pytest.raises(FlowseamError, match="no full build of 'text-t2i'"):
        ship("text-t2i", cache, target)
    write_manifest(cache, {"text-t2i": {"recipe_sha256": "abc", "quick": False}})
    assert ship("text-t2i", cache, target) == target / "text-t2i"
    assert (target / "text-t2i" / "model_index.json").read_text() == "{}"
    assert read_manifest(target) == {"digits-t2i": {"recipe_sha256": "d"},
                                     "text-t2i": {"recipe_sha256": "abc", "quick": False}}


def test_text_demo_smoke(tmp_path, capsys):
    from flowseam.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "out"
    try:
        assert main(["demo", "--world", "text", "--quick", "--backend", "cpu", "--cache",
                     str(tmp_path / "models"), "--output", str(out), "--steps", "1",
                     "--prompts", "2", "--eval-seeds", "1", "--seed-sets", "2",
                     "--group-size", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "text-t2i: building" in printed and "held-out OCR reward" in printed
    for name in ("samples_before.png", "samples_after.png", "reward.png", "summary.json",
                 "rl/metrics.jsonl", "rl/model/model_index.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == "text" and summary["rl_steps"] == 1
    assert summary["prompts"] == ['a sign that says "7"', 'a sign that says "5"']
    assert summary["eval_seed_sets"] == [[10_000], [10_001]]
    for key in ("ocr_reward_before", "ocr_reward_after", "exact_match_before",
                "exact_match_after"):
        assert 0.0 <= summary[key] <= 1.0, key
    control = summary["control"]
    assert control["reward"] == "constant" and control["weights_moved"] is False
    assert control["spread"] == pytest.approx(np.std(control["per_set_reward"]))
    assert summary["gain"] == pytest.approx(summary["ocr_reward_after"]
                                            - summary["ocr_reward_before"])
    assert summary["trained_model"] == str(out / "rl" / "model")
    assert summary["config"]["reward"] == "ocr"


def test_demo_refuses_an_unknown_world_before_any_work(tmp_path, capsys):
    from flowseam.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--world", "letters", "--output", str(out)]) == 2
    err = capsys.readouterr()
    assert "world='letters' is not a demo world; allowed: digits, text" in err.err
    assert "name" not in err.out and not out.exists()  # no backend table, nothing written
    assert main(["demo", "--world", "text", "--prompts", "25", "--output", str(out)]) == 2
    assert "--prompts=25 must be in [1, 24]" in capsys.readouterr().err
    assert main(["demo", "--seed-sets", "3", "--output", str(out)]) == 2
    assert "--seed-sets=3 is for --world text" in capsys.readouterr().err
    assert main(["demo", "--world", "text", "--fps", "4", "--output", str(out)]) == 2
    assert "--fps=4 is for --world digits" in capsys.readouterr().err
    assert not out.exists()
