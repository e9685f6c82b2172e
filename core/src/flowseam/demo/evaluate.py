"""Checks of the demo models with the held-out classifier: does the text-to-image model draw the
prompted digit, does the image-to-video model move it the prompted way.

Samples are drawn with the card's own loop (``model.generate``: deterministic ODE steps) and the
model's recipe ``[serve]`` parameters. Only the classifier has seen the held-out split; the
image-to-video model is given generator-split first frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..request import DiffusionParams
from .classifier import digit_probabilities, displacement
from .data import DIRECTIONS, NUMBER_WORDS, i2v_prompt, moving_clip, splits, t2i_prompt


def serve_params(recipe_config: dict[str, Any], **changes: Any) -> DiffusionParams:
    """The recipe's ``[serve]`` table as :class:`DiffusionParams` (``changes`` override)."""
    return DiffusionParams(**{**recipe_config.get("serve", {}), **changes})


def t2i_accuracy(model, params: DiffusionParams, samples_per_digit: int = 10, seed: int = 0,
                 batch: int = 50, digit_px: int | None = None) -> dict[str, Any]:
    """Generate ``samples_per_digit`` images per digit (seeds ``seed, seed+1, ...``) and classify
    them (``digit_px``: how tall the model draws digits; default the image height).

    :returns: ``accuracy`` (argmax = prompted digit), ``mean_prob`` (of the prompted digit),
        ``per_digit`` accuracies, ``samples``.
    """
    prompts = [t2i_prompt(d) for d in range(10) for _ in range(samples_per_digit)]
    labels = np.repeat(np.arange(10), samples_per_digit)
    seeds = [seed + k for _ in range(10) for k in range(samples_per_digit)]
    frames = np.concatenate([
        model.generate(prompts[i:i + batch], params=params, seeds=seeds[i:i + batch]).frames
        for i in range(0, len(prompts), batch)])
    probs = digit_probabilities(frames[:, 0], digit_px=digit_px or frames.shape[2])
    hit = probs.argmax(1) == labels
    return {"accuracy": float(hit.mean()),
            "mean_prob": float(probs[np.arange(len(labels)), labels].mean()),
            "per_digit": {NUMBER_WORDS[d]: float(hit[labels == d].mean()) for d in range(10)},
            "samples": int(len(labels))}


def moves_as_prompted(video: np.ndarray, direction: str, min_px: float = 2.0) -> bool:
    """The centroid moved at least ``min_px`` in the prompted direction, more than across it."""
    along, across = displacement(video, direction)
    return along >= min_px and along > across


def i2v_direction(model, params: DiffusionParams, digits: int = 10, seed: int = 0,
                  digit_size: int = 16) -> dict[str, Any]:
    """Animate one generator-split scan of each of ``digits`` digits in all four directions.

    :returns: ``direction_accuracy`` (fraction of videos that :func:`moves_as_prompted`),
        ``mean_along_px`` (mean displacement in the prompted direction), ``mean_digit_prob`` (the
        classifier's mean probability of the digit over the frames), ``videos``.
    """
    gen, _ = splits()
    firsts = [int(np.flatnonzero(gen.labels == d)[0]) for d in range(min(digits, 10))]
    hits, along, probs = [], [], []
    for n, i in enumerate(firsts):
        image = moving_clip(gen.images[i], "left", frames=1, size=params.height,
                            digit_size=digit_size)[0]
        for direction in sorted(DIRECTIONS):
            video = model.generate(i2v_prompt(int(gen.labels[i]), direction), image=image,
                                   params=params, seeds=[seed + n]).frames[0]
            hits.append(moves_as_prompted(video, direction))
            along.append(displacement(video, direction)[0])
            probs.append(float(digit_probabilities(video, digit_size)[:, gen.labels[i]].mean()))
    return {"direction_accuracy": float(np.mean(hits)), "mean_along_px": float(np.mean(along)),
            "mean_digit_prob": float(np.mean(probs)), "videos": len(hits)}


def digit_px(recipe_config: dict[str, Any]) -> int:
    """How tall the recipe's data draws digits: ``[data] digit_size``, else the image size."""
    data = recipe_config.get("data", {})
    return int(data.get("digit_size") or data.get("size", 32))


def text_ocr(model, params: DiffusionParams, seeds: list[int], words=None, reward=None,
             batch: int = 48) -> dict[str, Any]:
    """Generate every word's prompt (:func:`flowseam.demo.text.text_prompt`) once per seed and
    read the images with the ``ocr`` reward plugin (PP-OCRv4's recogniser).

    :param words: the strings (default :data:`flowseam.demo.text.WORDS`).
    :param reward: an ``ocr`` reward instance (default ``get_reward("ocr")``); its ``recognize``
        gives the text read, for the exact match.
    :returns: ``ocr_reward`` (the mean reward over every sample), ``exact_match`` (fraction of
        samples whose recognised text, spaces removed and lower-cased, is the target exactly),
        ``per_seed_reward`` (``len(seeds)`` means over the words, for seed-set spreads),
        ``per_word`` exact-match fractions, ``samples``, ``examples`` (up to 4 of what was read).
    """
    from ..rewards.ocr import ocr_target
    from ..training import get_reward
    from .text import WORDS, text_prompt

    words = list(WORDS if words is None else words)
    reward = reward if reward is not None else get_reward("ocr")
    prompts = [text_prompt(w) for w in words for _ in seeds]
    all_seeds = [s for _ in words for s in seeds]
    frames = np.concatenate([
        model.generate(prompts[i:i + batch], params=params, seeds=all_seeds[i:i + batch]).frames
        for i in range(0, len(prompts), batch)])
    scores = np.asarray(reward(prompts, frames), np.float64).reshape(len(words), len(seeds))
    read = reward.recognize(frames[:, 0])
    hit = np.array([r == ocr_target(p) for r, p in zip(read, prompts)]).reshape(scores.shape)
    return {"ocr_reward": float(scores.mean()), "exact_match": float(hit.mean()),
            "per_seed_reward": [float(v) for v in scores.mean(0)],
            "per_word": {w: float(hit[i].mean()) for i, w in enumerate(words)},
            "samples": int(scores.size),
            "examples": [{"prompt": p, "read": r}
                         for p, r in list(zip(prompts, read))[::len(seeds)][:4]]}


def evaluate_model(recipe, model, samples: int | None = None) -> dict[str, Any]:
    """The check that matches the model's card and data (recorded in the build manifest), plus
    a one-line ``summary``. ``samples`` shrinks it (per digit, digits for I2V, seeds per word
    for text)."""
    params = serve_params(recipe.config)
    ev = dict(recipe.config.get("eval", {}))
    if recipe.config.get("data", {}).get("kind") == "text":
        seeds = list(range(int(samples or ev.get("seeds_per_word", 4))))
        out = text_ocr(model, params, seeds)
        del out["per_seed_reward"]
        out["summary"] = (f"OCR reads the prompted text exactly in {out['exact_match']:.0%} of "
                          f"{out['samples']} samples (mean OCR reward {out['ocr_reward']:.2f})")
        return out
    if model.card.name == "flux.1-t2i":
        per_digit = samples or ev.get("samples_per_digit", 10)
        out = t2i_accuracy(model, params, samples_per_digit=per_digit,
                           digit_px=digit_px(recipe.config))
        out["summary"] = (f"classifier recognises the prompted digit in {out['accuracy']:.0%} of "
                          f"{out['samples']} samples (mean probability {out['mean_prob']:.2f})")
        return out
    out = i2v_direction(model, params, digits=samples or ev.get("digits", 10),
                        digit_size=digit_px(recipe.config))
    out["summary"] = (f"{out['direction_accuracy']:.0%} of {out['videos']} videos move the digit "
                      f"the prompted way (mean {out['mean_along_px']:.1f} px; digit probability "
                      f"{out['mean_digit_prob']:.2f})")
    return out
