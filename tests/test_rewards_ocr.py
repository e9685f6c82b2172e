"""The ``ocr`` reward: Flow-GRPO's text-rendering reward, read by the real PP-OCRv4 recognizer
that rapidocr-onnxruntime's wheel ships, on strings rendered in DejaVu Sans Bold. Expected values
are hand computations of 1 - min(d, len(target)) / len(target)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("rapidocr_onnxruntime")

from flowseam.errors import InvalidInputError  # noqa: E402
from flowseam.rewards.ocr import (  # noqa: E402
    OcrReward,
    edit_distance,
    normalize_text,
    ocr_score,
    ocr_target,
)


def render(text: str, width: int = 64, height: int = 32, size: int = 22) -> np.ndarray:
    """``text`` in black DejaVu Sans Bold, centred on white: (H, W, 3) float in [0, 1]."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(os.path.join(os.path.dirname(matplotlib.__file__),
                                           "mpl-data/fonts/ttf/DejaVuSans-Bold.ttf"), size)
    im = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(im)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((width - (right - left)) / 2 - left, (height - (bottom - top)) / 2 - top), text,
              fill="black", font=font)
    return np.asarray(im, dtype=np.float32) / 255.0


@pytest.fixture(scope="module")
def reward():
    return OcrReward(threads=1)


@pytest.fixture(scope="module")
def words():
    """96x32 renderings (one shape, so they stack into a batch)."""
    return {w: render(w, 96) for w in ("42", "CAT", "CAR", "HELLO")}


def test_reads_rendered_words_and_nothing_in_noise(reward, words):
    assert reward.recognize(np.stack([render("42"), render("CAT")])) == ["42", "cat"]  # 64x32
    # 96x32; the wide margin of "42" reads as U+3000 (an ideographic space), which is removed
    assert reward.recognize([words["HELLO"], words["CAR"], words["42"]]) == ["hello", "car", "42"]
    noise = np.random.default_rng(0).random((2, 32, 64, 3))
    assert reward.recognize(noise) == ["", ""]


def test_reward_matches_hand_computed_values(reward, words):
    outputs = np.stack([words["42"], words["CAT"], words["CAT"], words["HELLO"]])[:, None]
    prompts = ['a sign that says "42"', 'a sign that says "CAT"',
               'a sign that says "CAR"',       # cat vs car: one substitution, 1 - 1/3
               'a poster reading "Hello"']     # case is ignored
    r = reward(prompts, outputs)
    assert r.dtype == torch.float32 and r.shape == (4,)
    assert torch.allclose(r, torch.tensor([1.0, 1.0, 1 - 1 / 3, 1.0]), atol=1e-6)


def test_target_inside_recognized_text_scores_one_and_distance_is_capped(reward, words):
    # Flow-GRPO's special case: "hell" occurs in "hello", so d = 0 despite the extra "o"
    # "cat" read for "42": d = 3 capped at len("42") = 2, so 0 (never negative)
    r = reward(['"hell"', '"42"'], np.stack([words["HELLO"], words["CAT"]])[:, None])
    assert r.tolist() == [1.0, 0.0]


def test_noise_scores_zero(reward):
    noise = np.random.default_rng(1).random((1, 1, 32, 64, 3))
    assert reward(['a sign that says "CAT"'], noise).tolist() == [0.0]


def test_prompt_without_quotes_is_the_target_and_spaces_are_removed(reward, words):
    assert ocr_target("Cat") == "cat" and ocr_target('say "Hello World" twice') == "helloworld"
    assert normalize_text("\u3000Ab c\t") == "abc"
    assert ocr_target('say "hi') == "hi"    # split('"')[1], as Flow-GRPO reads it
    r = reward(["CAT", "C A T", "CAR"], np.stack([words["CAT"]] * 3)[:, None])
    assert torch.allclose(r, torch.tensor([1.0, 1.0, 1 - 1 / 3]), atol=1e-6)


def test_video_is_the_mean_over_evenly_sampled_frames(words):
    blank = np.ones_like(words["CAT"])
    video = np.stack([words["CAT"], blank, words["CAR"], blank, words["42"]])[None]  # F = 5
    # frames=3 reads frames 0, 2, 4 (CAT, CAR, 42) for target "cat": 1, 1 - 1/3, 0
    three = OcrReward(threads=1, frames=3)
    assert three.frame_indices(5).tolist() == [0, 2, 4]
    assert three(['"CAT"'], video).item() == pytest.approx((1 + (1 - 1 / 3) + 0) / 3, abs=1e-6)
    # frames >= F reads every frame; a blank reads "" (d = 3, so 0)
    every = OcrReward(threads=1, frames=8, batch_size=2)
    assert every.frame_indices(5).tolist() == [0, 1, 2, 3, 4]
    assert every(['"CAT"'], video).item() == pytest.approx((1 + 0 + 2 / 3 + 0 + 0) / 5, abs=1e-6)


def test_empty_target_is_nan(reward, words):
    r = reward(['a sign that says ""', '"CAT"'], np.stack([words["CAT"]] * 2)[:, None])
    assert np.isnan(r[0].item()) and r[1].item() == 1.0


def test_edit_distance_against_hand_counts():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3
    assert edit_distance("flaw", "lawn") == 2 and edit_distance("same", "same") == 0
    assert ocr_score("car", "cat") == pytest.approx(2 / 3)
    assert ocr_score("ab", "xyzxyz") == 0.0 and np.isnan(ocr_score("", "abc"))


def test_registered_as_ocr_and_built_with_reward_args():
    from flowseam.training import get_reward

    r = get_reward("ocr", threads=1, frames=2)
    assert isinstance(r, OcrReward) and r.frames == 2 and r.threads == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(threads=0), "threads=0"), (dict(threads=10 ** 6), "threads=1000000"),
    (dict(threads=1.5), "threads=1.5"), (dict(use_det="yes"), "use_det='yes'"),
    (dict(frames=0), "frames=0"), (dict(frames=True), "frames=True"),
    (dict(batch_size=-1), "batch_size=-1"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        OcrReward(**kwargs)


def test_bad_outputs_are_refused(reward, words):
    with pytest.raises(InvalidInputError, match="expected one each"):
        reward(["a", "b"], words["CAT"][None, None])
    with pytest.raises(InvalidInputError, match=r"\(B, F, H, W, 3\)"):
        reward(["a"], np.zeros((1, 1, 32, 64)))


def test_missing_rapidocr_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import now fails
    with pytest.raises(InvalidInputError, match=r"pip install 'flowseam\[ocr\]'"):
        OcrReward()


def test_detector_finds_the_word_in_a_larger_scene():
    scene = np.ones((96, 160, 3), np.float32)
    scene[50:82, 70:160] = render("CAT", 90)        # off-centre, in the lower right
    det = OcrReward(threads=1, use_det=True)
    assert det.recognize([scene]) == ["cat"]
    assert det(['a sign that says "CAR"'], scene[None, None]).item() == pytest.approx(2 / 3)
