"""Real handwritten digits as T2I and I2V data.

scikit-learn's ``load_digits`` (1,797 real 8x8 scans, 16 gray levels) is split once, with a fixed
seed, into a *generator* split (the T2I and I2V models train on it) and a *held-out* split (only
the reward's classifier sees it). T2I examples: ``"a handwritten digit seven"`` → the scan
upscaled to ``size x size`` (bilinear), white on black, RGB, or drawn ``digit_size`` px tall at the
centre of the canvas (the demo's choice: then a T2I image is exactly an I2V first frame). I2V
examples: ``"a handwritten digit seven moving left"`` → ``frames`` frames (4k+1) of the digit,
drawn at ``digit_size`` on a black canvas, sliding ``step`` pixels per frame in the named
direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import InvalidInputError

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (dy, dx)
HELD_OUT_FRACTION = 0.3
SPLIT_SEED = 0


def t2i_prompt(digit: int) -> str:
    return f"a handwritten digit {NUMBER_WORDS[digit]}"


def i2v_prompt(digit: int, direction: str) -> str:
    if direction not in DIRECTIONS:
        raise InvalidInputError(f"direction={direction!r}; allowed: {sorted(DIRECTIONS)}")
    return f"{t2i_prompt(digit)} moving {direction}"


def parse_prompt(prompt: str) -> tuple[int | None, str | None]:
    """(digit, direction) named in a prompt (None where absent): the first number word or
    single-digit numeral (``"seven"``, ``"7"``) and the first direction word — so a user's loose
    request (``"draw me a 7 sliding to the left"``) parses like a generator prompt."""
    words = prompt.lower().replace(",", " ").split()
    digit = next((NUMBER_WORDS.index(w) if w in NUMBER_WORDS else int(w) for w in words
                  if w in NUMBER_WORDS or (len(w) == 1 and w.isdigit())), None)
    direction = next((w for w in words if w in DIRECTIONS), None)
    return digit, direction


@dataclass(frozen=True)
class DigitSplit:
    """Images ``(N, 8, 8)`` float32 in [0, 1] and labels ``(N,)``."""

    images: np.ndarray
    labels: np.ndarray


@lru_cache(maxsize=1)
def splits() -> tuple[DigitSplit, DigitSplit]:
    """``(generator, held_out)``: a stratified split of scikit-learn's digits (fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    gi, hi, gl, hl = train_test_split(images, digits.target, test_size=HELD_OUT_FRACTION,
                                      random_state=SPLIT_SEED, stratify=digits.target)
    return DigitSplit(gi, gl.astype(np.int64)), DigitSplit(hi, hl.astype(np.int64))


def upscale(image8: np.ndarray, size: int) -> np.ndarray:
    """An 8x8 scan → ``(size, size)`` float32 in [0, 1] (PIL bilinear)."""
    from PIL import Image

    im = Image.fromarray((np.clip(image8, 0, 1) * 255).astype(np.uint8))
    return np.asarray(im.resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0


def to_rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=-1)


def t2i_example(image8: np.ndarray, size: int = 32, digit_size: int | None = None) -> np.ndarray:
    """``(1, size, size, 3)`` float32: the digit filling the frame, or drawn ``digit_size`` px
    tall at the centre of a black canvas (exactly the first frame of :func:`moving_clip`)."""
    if digit_size is not None:
        return moving_clip(image8, "left", frames=1, size=size, digit_size=digit_size)
    return to_rgb(upscale(image8, size))[None]


def moving_clip(image8: np.ndarray, direction: str, frames: int = 9, size: int = 32,
                digit_size: int = 16, step: int = 1) -> np.ndarray:
    """``(frames, size, size, 3)`` float32: the digit sliding ``step`` px/frame towards
    ``direction``, starting centred. Raises ValueError for an unknown direction or a digit that
    leaves the canvas."""
    if direction not in DIRECTIONS:
        raise InvalidInputError(f"direction={direction!r}; allowed: {sorted(DIRECTIONS)}")
    dy, dx = DIRECTIONS[direction]
    travel = step * (frames - 1)
    if (size - digit_size) // 2 < travel:
        raise InvalidInputError(
            f"a {digit_size}px digit moving {travel}px leaves a {size}px canvas")
    digit = upscale(image8, digit_size)
    out = np.zeros((frames, size, size), np.float32)
    y0 = x0 = (size - digit_size) // 2
    for f in range(frames):
        y, x = y0 + dy * step * f, x0 + dx * step * f
        out[f, y:y + digit_size, x:x + digit_size] = digit
    return to_rgb(out)


def t2i_dataset(size: int = 32, limit: int | None = None, digit_size: int | None = None,
                workflow_prompts: bool = False, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """(prompt, image (1, size, size, 3)) pairs from the generator split (see
    :func:`t2i_example` for ``digit_size``).

    :param workflow_prompts: also pair every scan with a workflow prompt naming a motion
        (``"a handwritten digit seven moving left"``, a random direction each, fixed ``seed``), so
        that the first stage of the ``t2i-i2v`` workflow, which is given the video's prompt, draws
        the same digit (the image does not depend on the direction). Doubles the examples.
    """
    gen, _ = splits()
    rng = np.random.RandomState(seed)
    names = sorted(DIRECTIONS)
    n = len(gen.labels) if limit is None else min(limit, len(gen.labels))
    out = []
    for i in range(n):
        digit, image = int(gen.labels[i]), t2i_example(gen.images[i], size, digit_size)
        out.append((t2i_prompt(digit), image))
        if workflow_prompts:
            out.append((i2v_prompt(digit, names[rng.randint(len(names))]), image))
    return out


def i2v_dataset(frames: int = 9, size: int = 32, digit_size: int = 16, limit: int | None = None,
                seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """(prompt, clip (frames, size, size, 3)) pairs from the generator split, a random direction
    each (fixed seed)."""
    gen, _ = splits()
    rng = np.random.RandomState(seed)
    names = sorted(DIRECTIONS)
    n = len(gen.labels) if limit is None else min(limit, len(gen.labels))
    out = []
    for i in range(n):
        direction = names[rng.randint(len(names))]
        out.append((i2v_prompt(int(gen.labels[i]), direction),
                    moving_clip(gen.images[i], direction, frames, size, digit_size)))
    return out
