"""Rendered text as text-to-image data: the demo's second world, scored by a real OCR model.

Each example is one of the short strings of :data:`WORDS` drawn in DejaVu Sans Bold (the font
matplotlib ships; no download) dark on light on a ``64 x 32`` canvas, under the prompt ``a sign
that says "42"``; its size, position and gray levels vary a little (:func:`render`), so the
model learns a distribution of signs, not one image per prompt. The reward is the ``ocr`` reward
plugin (PP-OCRv4's recogniser through rapidocr-onnxruntime), which reads the text between the
prompt's double quotes as the target. The held-out evaluation uses the same prompts (the world
has no other) with seeds the training never sampled. The world, for users: docs/demo.md.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from ..errors import InvalidInputError

#: the world's strings: numbers and words of 1 to 4 characters (24; 3 + 6 + 9 + 6 by length),
#: every one read correctly by the recogniser in every augmentation the renderer draws (the tests
#: check it). Single characters it confuses with symbols (``"0"`` reads as ``"。"``, ``"X"`` as
#: ``"×"``) are left out.
WORDS = ("7", "5", "A",
         "42", "13", "99", "HI", "GO", "OK",
         "100", "365", "CAT", "DOG", "SUN", "BUS", "FOX", "MAP", "RED",
         "2026", "TAXI", "STOP", "OPEN", "EXIT", "CAFE")
PROMPT_TEMPLATE = 'a sign that says "{}"'
WIDTH, HEIGHT = 64, 32
#: font size in pixels (the largest that fits is used when a string is wider)
FONT_PX = (19, 22)
#: the text's offset from the centre, at most this many pixels (x, y)
JITTER_PX = (2, 1)
#: gray levels in [0, 255]: text within ``INK``, background within ``PAPER``
INK = (0, 60)
PAPER = (200, 255)
#: the training renders are numbered from here (a render's seed fixes its augmentation); the
#: demo's held-out seeds (from :data:`flowseam.demo.run.EVAL_SEED_BASE`) name noise, never a render
TRAIN_SEED_BASE = 0


def text_prompt(word: str) -> str:
    """``'a sign that says "42"'``."""
    return PROMPT_TEMPLATE.format(word)


def prompt_text(prompt: str) -> str | None:
    """The text between a prompt's first pair of double quotes (None without them)."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def font_path() -> str:
    """DejaVu Sans Bold as matplotlib ships it.

    :raises InvalidInputError: if matplotlib is missing (``pip install 'flowseam[demo]'``).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise InvalidInputError("the text world renders with matplotlib's DejaVu Sans Bold: "
                                "pip install 'flowseam[demo]'") from exc
    return os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf",
                        "DejaVuSans-Bold.ttf")


@lru_cache(maxsize=32)
def _font(px: int):
    from PIL import ImageFont

    return ImageFont.truetype(font_path(), px)


def render(word: str, width: int = WIDTH, height: int = HEIGHT, font_px: int = 20,
           offset: tuple[int, int] = (0, 0), ink: int = 30, paper: int = 235) -> np.ndarray:
    """``(height, width, 3)`` float32 in [0, 1]: ``word`` in DejaVu Sans Bold, ``font_px`` tall
    (smaller if it would not fit within 2 px of each side), centred then moved by ``offset``
    ``(dx, dy)`` pixels, gray ``ink`` on gray ``paper`` (0–255).

    :raises InvalidInputError: for an empty word or gray levels outside [0, 255].
    """
    from PIL import Image, ImageDraw

    if not word:
        raise InvalidInputError("word='' : the text world renders 1 to 4 characters")
    if not (0 <= ink <= 255 and 0 <= paper <= 255):
        raise InvalidInputError(f"ink={ink}, paper={paper}: gray levels must be in [0, 255]")
    im = Image.new("L", (width, height), int(paper))
    draw = ImageDraw.Draw(im)
    px = int(font_px)
    while True:
        left, top, right, bottom = draw.textbbox((0, 0), word, font=_font(px))
        if (right - left <= width - 4 and bottom - top <= height - 4) or px <= 6:
            break
        px -= 1
    x = (width - (right - left)) / 2 - left + offset[0]
    y = (height - (bottom - top)) / 2 - top + offset[1]
    draw.text((x, y), word, fill=int(ink), font=_font(px))
    gray = np.asarray(im, np.float32) / 255.0
    return np.repeat(gray[..., None], 3, axis=-1)


def augmented(word: str, seed: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """:func:`render` with the augmentation drawn from ``seed``: font size in :data:`FONT_PX`,
    offset within :data:`JITTER_PX`, ink in :data:`INK`, paper in :data:`PAPER`."""
    rng = np.random.RandomState(seed)
    return render(word, width, height, font_px=int(rng.randint(FONT_PX[0], FONT_PX[1] + 1)),
                  offset=(int(rng.randint(-JITTER_PX[0], JITTER_PX[0] + 1)),
                          int(rng.randint(-JITTER_PX[1], JITTER_PX[1] + 1))),
                  ink=int(rng.randint(INK[0], INK[1] + 1)),
                  paper=int(rng.randint(PAPER[0], PAPER[1] + 1)))


def text_dataset(per_word: int = 100, width: int = WIDTH, height: int = HEIGHT,
                 words: tuple[str, ...] | list[str] = WORDS,
                 limit: int | None = None) -> list[tuple[str, np.ndarray]]:
    """``(prompt, image (1, height, width, 3) float32 in [0, 1])`` pairs: ``per_word``
    augmentations of every word (render seeds ``TRAIN_SEED_BASE + k``, in word-major order
    interleaved so that any prefix covers every word), the first ``limit`` of them.

    :raises InvalidInputError: for a word of more than 4 characters or ``per_word < 1``.
    """
    if per_word < 1:
        raise InvalidInputError(f"per_word={per_word} must be >= 1")
    for w in words:
        if not 1 <= len(w) <= 4 or '"' in w:
            raise InvalidInputError(f"word {w!r}: the text world draws 1 to 4 characters, no '\"'")
    out = []
    n = len(words) * per_word if limit is None else min(limit, len(words) * per_word)
    for i in range(n):
        k, word = divmod(i, len(words))
        seed = TRAIN_SEED_BASE + k * len(words) + word
        out.append((text_prompt(words[word]), augmented(words[word], seed, width, height)[None]))
    return out
