"""``ocr``: Flow-GRPO's text-rendering reward, read by PaddleOCR's PP-OCRv4 recognizer.

The reward asks whether an image shows the text its prompt quotes, and follows Flow-GRPO's
``OcrScorer`` (``flow_grpo/ocr.py`` in github.com/yifan123/flow_grpo; Liu et al., "Flow-GRPO:
Training Flow Matching Models via Online RL", 2025) step by step: the target
(:func:`ocr_target`) and the recognized text are normalised alike (:func:`normalize_text`), and
the score is ``1 - d / len(target)`` with d their edit distance, 0 when the target occurs in
the recognized text (:func:`ocr_score`). Recognition runs through ``rapidocr-onnxruntime`` (the
``flowseam[ocr]`` extra), whose wheel ships the PP-OCRv4 ONNX models: nothing is downloaded.
Each departure from Flow-GRPO is deliberate and said where it is made: a prompt without quotes,
an empty target, an OCR failure (which raises rather than score a silent 0), the colour order.
For users: docs/rewards.md ("OCR").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InvalidInputError


def normalize_text(text: str) -> str:
    """``text`` with every whitespace character removed (``str.split``'s: spaces, tabs, U+3000,
    ...), lower-cased: Flow-GRPO's normalisation of both sides, which removes ``" "`` only.
    flowseam removes every whitespace character because the Chinese-English PP-OCRv4 recognizer
    that rapidocr ships reads a wide margin as the ideographic space U+3000, which Flow-GRPO's
    English PaddleOCR model never emits."""
    return "".join(text.split()).lower()


def ocr_target(prompt: str) -> str:
    """The text ``prompt`` asks to be rendered, normalised (:func:`normalize_text`).

    The text after the prompt's first double quote up to the next one (``prompt.split('"')[1]``,
    as Flow-GRPO reads it); the whole prompt when it has no double quote (where Flow-GRPO raises
    ``IndexError``). ``'a sign that says "Hello World"'`` → ``"helloworld"``; ``'a sign that says
    ""'`` → ``""``.
    """
    return normalize_text(prompt.split('"')[1] if '"' in prompt else prompt)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions
    that turn ``a`` into ``b`` (Wagner & Fischer, 1974: the row-by-row dynamic programme,
    O(len(a) * len(b)) time, O(len(b)) memory). ``edit_distance("kitten", "sitting") == 3``."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1,                 # delete ca
                           cur[j - 1] + 1,              # insert cb
                           prev[j - 1] + (ca != cb)))   # substitute (or keep)
        prev = cur
    return prev[-1]


def ocr_score(target: str, recognized: str) -> float:
    """Flow-GRPO's OCR reward of ``recognized`` text for ``target`` (both normalised already):
    1 - min(d, len(target)) / len(target), with d = 0 when ``target`` occurs in ``recognized``
    and the Levenshtein distance (:func:`edit_distance`) otherwise. NaN for an empty target
    (nothing to read, so the sample cannot be scored: the reward contract's NaN, which makes the
    method skip that sample's group and warn, where Flow-GRPO divides by zero)."""
    if not target:
        return float("nan")
    d = 0 if target in recognized else edit_distance(recognized, target)
    return 1.0 - min(d, len(target)) / len(target)


def _check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or \
            (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise InvalidInputError(
            f"ocr reward: {name}={value!r} is not allowed; expected {allowed}"
            + (" or None" if allow_none else ""))


class OcrReward:
    """Flow-GRPO's OCR reward (see the module docstring for the formula and its source).
    An OCR failure raises (Flow-GRPO prints it and scores 0), so the method names the reward
    instead of training on a silent zero.

    ``reward(prompts, outputs)``: ``prompts`` is ``list[str]`` of length B, ``outputs`` an array
    ``(B, F, H, W, 3)`` (or ``(B, H, W, 3)``, one frame) float in [0, 1], RGB; returns
    ``torch.Tensor (B,)`` float32 in [0, 1], NaN for a prompt whose quoted text is empty. Frames
    are quantised to uint8 as ``round(x * 255)`` clipped to [0, 255] (Flow-GRPO's conversion). A
    video scores the mean over ``frames`` frames sampled evenly from first to last
    (``np.linspace(0, F - 1, frames)`` rounded), every frame when it has ``frames`` or fewer.

    :param threads: onnxruntime intra-op threads per model, in [1, os.cpu_count()]; None lets
        onnxruntime choose (one per core).
    :param use_det: run PP-OCRv4's text detector first and read each detected line (one frame
        per call); False (the default) reads the whole frame as one line, batched.
    :param frames: how many frames of a video are read, >= 1.
    :param batch_size: frames per onnxruntime run of the recognizer (rapidocr's
        ``rec_batch_num``, whose default this is), >= 1.
    :raises InvalidInputError: for an argument outside those ranges (naming it), or when
        ``rapidocr-onnxruntime`` is not installed (``pip install 'flowseam[ocr]'``); raised before
        any model loads.
    """

    def __init__(self, threads: int | None = None, use_det: bool = False, frames: int = 4,
                 batch_size: int = 6) -> None:
        _check_int("threads", threads, 1, os.cpu_count() or 1, allow_none=True)
        if not isinstance(use_det, bool):
            raise InvalidInputError(f"ocr reward: use_det={use_det!r} is not allowed; expected "
                                    "true or false")
        _check_int("frames", frames, 1)
        _check_int("batch_size", batch_size, 1)
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise InvalidInputError(
                "the ocr reward needs rapidocr-onnxruntime, which is not installed: "
                "pip install 'flowseam[ocr]'") from e
        self.threads, self.use_det = threads, use_det
        self.frames, self.batch_size = int(frames), int(batch_size)
        kwargs = {"rec_batch_num": self.batch_size}
        if threads is not None:  # rapidocr applies one value to the detector and recognizer
            kwargs.update(intra_op_num_threads=int(threads), inter_op_num_threads=1)
        self.engine = RapidOCR(**kwargs)

    # -- recognition ----------------------------------------------------------------------------
    @staticmethod
    def _to_bgr_uint8(images) -> list[np.ndarray]:
        """``(N, H, W, 3)`` float RGB in [0, 1] (or a list of ``(H, W, 3)``) → uint8 BGR frames:
        the order PaddleOCR's models read (Flow-GRPO passes RGB arrays)."""
        out = []
        for i, img in enumerate(images):
            x = np.asarray(img)
            if x.ndim != 3 or x.shape[-1] != 3:
                raise InvalidInputError(
                    f"ocr reward: image {i} has shape {x.shape}; expected (H, W, 3) RGB")
            if x.dtype != np.uint8:
                x = np.clip(np.round(x.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
            out.append(np.ascontiguousarray(x[..., ::-1]))
        return out

    def _read(self, frames_bgr: list[np.ndarray]) -> list[str]:
        """Recognized text per frame, lines with confidence > 0 joined in reading order (not yet
        normalised). Without ``use_det`` the whole frame is read as one text line, batched over
        frames and samples, which suits small images with one word on them; with it, PP-OCRv4's
        detector finds the lines first (one frame at a time), for larger images whose text is
        somewhere in the scene."""
        if not frames_bgr:
            return []
        if self.use_det:
            texts = []
            for img in frames_bgr:
                res, _ = self.engine(img, use_det=True, use_cls=False, use_rec=True)
                texts.append("".join(line[1] for line in (res or []) if float(line[2]) > 0))
            return texts
        # rapidocr's own preprocessing (its min/max side limits), then one batched recognizer call
        # (RapidOCR.text_rec takes a list of line images; rec_batch_num per onnxruntime run).
        prepped = [self.engine.preprocess(img)[0] for img in frames_bgr]
        rec, _ = self.engine.text_rec(prepped)
        return [text if float(conf) > 0 else "" for text, conf in rec]

    def recognize(self, images) -> list[str]:
        """The text read in each image, normalised (spaces removed, lower-cased).

        :param images: ``(N, H, W, 3)`` float RGB in [0, 1] (uint8 is taken as is), or a list of
            ``(H, W, 3)`` arrays.
        :returns: N strings; ``""`` where nothing is read (a blank or noise image).
        :raises InvalidInputError: for an image that is not ``(H, W, 3)``.
        """
        return [normalize_text(t) for t in self._read(self._to_bgr_uint8(images))]

    def frame_indices(self, num_frames: int) -> np.ndarray:
        """Which of ``num_frames`` frames a video is scored on: ``frames`` of them, evenly spaced
        from first to last, or all of them."""
        if num_frames <= self.frames:
            return np.arange(num_frames)
        return np.round(np.linspace(0, num_frames - 1, self.frames)).astype(np.int64)

    # -- the reward -----------------------------------------------------------------------------
    def __call__(self, prompts: Sequence[str], outputs) -> torch.Tensor:
        x = np.asarray(outputs)
        if x.ndim == 4:
            x = x[:, None]
        if x.ndim != 5 or x.shape[-1] != 3:
            raise InvalidInputError(
                f"ocr reward: outputs have shape {x.shape}; expected (B, F, H, W, 3) RGB")
        if len(prompts) != x.shape[0]:
            raise InvalidInputError(
                f"ocr reward: {len(prompts)} prompts for {x.shape[0]} outputs; expected one each")
        idx = self.frame_indices(x.shape[1])
        texts = self.recognize(x[:, idx].reshape(-1, *x.shape[2:]))
        scores = np.empty(len(prompts), dtype=np.float64)
        for b, prompt in enumerate(prompts):
            target = ocr_target(prompt)
            per_frame = [ocr_score(target, t) for t in texts[b * len(idx):(b + 1) * len(idx)]]
            scores[b] = float(np.mean(per_frame))
        return torch.from_numpy(scores.astype(np.float32))

    def __repr__(self) -> str:
        return (f"OcrReward(threads={self.threads}, use_det={self.use_det}, "
                f"frames={self.frames}, batch_size={self.batch_size})")
