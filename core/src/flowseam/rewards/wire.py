"""The reward server's wire format: JSON bodies, the samples inside them as base64 — never pickle.

A score request (``POST http://HOST:PORT/NAME``) is ``{"prompts": [...], "outputs": {"format":
..., ...}}``, its samples in one of three formats: ``"safetensors"`` carries the float array
itself, so the server's scores are the in-process scores, number for number; ``"png"`` and
``"mp4"`` carry 8-bit media, for clients that hold encoded images or videos. The answer is
``{"scores": [...]}``, ``null`` for a sample the reward cannot score (NaN in process); an error
is ``{"error": {"type", "message", "field"}}`` with its HTTP status. Every field and status:
docs/rewards.md ("Reward server"). Shared by the server (:mod:`flowseam.rewards.reward_server`)
and the client (:mod:`flowseam.rewards.remote`); it imports numpy only (safetensors, Pillow and
PyAV where a format needs them).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import numpy as np

from ..errors import InvalidInputError

#: the content type of every request and answer body
CONTENT_TYPE = "application/json"
#: the formats of ``outputs``, the default first
FORMATS = ("safetensors", "png", "mp4")
#: the name of the one tensor in a ``safetensors`` blob
TENSOR = "outputs"
#: the dtypes a ``safetensors`` blob may hold (sent unchanged; any other is sent as float32)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class WireError(InvalidInputError):
    """A request or answer body that does not follow the wire format. ``field`` names the JSON
    field at fault (``"outputs.data"``, ``"prompts"``, ...); the message says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    def __reduce__(self):
        return (type(self), (self.field, str(self).partition(": ")[2]))


class WireTooLarge(WireError):
    """PNG or MP4 samples that decode to more values than the receiver takes (a small file can
    hold a huge blank image): the server answers 413."""


class _Budget:
    """Counts decoded values against ``limit`` (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.used = limit, 0

    def take(self, values: int, field: str) -> None:
        self.used += values
        if self.limit is not None and self.used > self.limit:
            raise WireTooLarge(field, f"the samples decode to more than {self.limit} values, "
                                      "more than this server takes: send fewer or smaller frames")


# -- the samples ---------------------------------------------------------------------------------
def encode_outputs(outputs: np.ndarray, format: str = "safetensors", fps: float = 8.0) -> dict:
    """``outputs`` (frames ``(B, F, H, W, 3)`` float in [0, 1], or waveforms ``(B, C, S)`` for
    ``safetensors``) as the request's ``outputs`` field: ``{"format": "safetensors", "data":
    <base64 of a safetensors file holding one tensor, "outputs">}``, ``{"format": "png",
    "frames": <B lists of F base64 PNGs>}`` or ``{"format": "mp4", "videos": <B base64
    videos>}`` (H.264, lossy; the decoder takes anything PyAV decodes, every video of a request
    with the same frame count and size).

    :param format: one of :data:`FORMATS`. ``png`` and ``mp4`` round the frames to 8 bits
        (``round(clip(x, 0, 1) * 255)``) and need ``(B, F, H, W, 3)``.
    :param fps: the frame rate written into an ``mp4`` (the reward sees only the frames).
    :raises InvalidInputError: for an unknown format, or frames of another shape for png/mp4.
    """
    if format not in FORMATS:
        raise InvalidInputError(f"format={format!r} is not a wire format; use one of {FORMATS}")
    x = np.asarray(outputs)
    if format == "safetensors":
        from safetensors.numpy import save

        if x.dtype not in FLOAT_DTYPES:
            x = x.astype(np.float32)
        return {"format": format, "data": _b64(save({TENSOR: np.ascontiguousarray(x)}))}
    if x.ndim != 5 or x.shape[-1] != 3:
        raise InvalidInputError(f"format={format!r} sends RGB frames (B, F, H, W, 3); these "
                                f"outputs have shape {x.shape} (send them as 'safetensors')")
    data = (np.clip(x, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if format == "png":
        return {"format": format, "frames": [[_b64(_png(f)) for f in sample] for sample in data]}
    return {"format": format, "videos": [_b64(_mp4(sample, fps)) for sample in data]}


def decode_outputs(field: Any, batch: int, modality: str = "video",
                   max_values: int | None = None) -> np.ndarray:
    """The array a request's ``outputs`` field holds: ``(batch, F, H, W, 3)`` (``(batch, C, S)``
    for an audio reward), float32 (or the float64 a ``safetensors`` blob holds).

    :param max_values: the most values PNG or MP4 samples may decode to (the server's body
        limit over 4: what a safetensors body of that size could hold); None: no limit.
    :raises WireError: naming the field that does not decode, or the shape that does not fit
        ``batch`` samples of the reward's ``modality``.
    :raises WireTooLarge: (a :class:`WireError`) for PNG or MP4 samples over ``max_values``.
    """
    if not isinstance(field, dict):
        raise WireError("outputs", f"must be an object with a 'format' ({', '.join(FORMATS)}), "
                                   f"not {type(field).__name__}")
    format = field.get("format")
    if format not in FORMATS:
        raise WireError("outputs.format", f"{format!r} is not a wire format; use one of {FORMATS}")
    if format != "safetensors" and modality == "audio":
        raise WireError("outputs.format", f"{format!r} carries frames; this reward scores audio "
                                          "waveforms (B, C, S): send 'safetensors'")
    budget = _Budget(max_values)
    if format == "safetensors":
        x = _tensor(_unb64(field.get("data"), "outputs.data"))
    elif format == "png":
        x = _stack(_png_samples(field.get("frames"), budget), "outputs.frames")
    else:
        x = _stack([_decode_mp4(_unb64(v, f"outputs.videos[{i}]"), f"outputs.videos[{i}]",
                                budget)
                    for i, v in enumerate(_list(field.get("videos"), "outputs.videos"))],
                   "outputs.videos")
    want = "(B, C, S)" if modality == "audio" else "(B, F, H, W, 3)"
    good = x.ndim == 3 if modality == "audio" else (x.ndim == 5 and x.shape[-1] == 3)
    if not good or x.shape[0] != batch:
        raise WireError("outputs", f"holds shape {x.shape}; this {modality} reward scores {want} "
                                   f"with B = {batch} (the number of prompts)")
    return x


# -- requests and answers ------------------------------------------------------------------------
def encode_request(prompts: list[str], outputs: np.ndarray, format: str = "safetensors") -> dict:
    """The JSON body of a score request: ``{"prompts": [B strings], "outputs":
    encode_outputs(outputs, format)}``."""
    return {"prompts": [str(p) for p in prompts], "outputs": encode_outputs(outputs, format)}


def decode_prompts(body: Any) -> list[str]:
    """The ``prompts`` of a request body: a non-empty list of strings.

    :raises WireError: naming ``body`` or ``prompts``.
    """
    if not isinstance(body, dict):
        raise WireError("body", f"must be a JSON object with 'prompts' and 'outputs', not "
                                f"{type(body).__name__}")
    unknown = sorted(set(body) - {"prompts", "outputs"})
    if unknown:
        raise WireError(unknown[0], "is not a field of a score request; allowed: prompts, outputs")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or \
            not all(isinstance(p, str) for p in prompts):
        raise WireError("prompts", "must be a non-empty list of strings (one per sample)")
    return prompts


def encode_scores(scores: np.ndarray) -> dict:
    """``{"scores": [...]}``: one float per sample, ``None`` (JSON ``null``) for NaN.

    :raises ValueError: for an infinite score (no reward may return one; NaN means "cannot
        score").
    """
    out = []
    for s in np.asarray(scores, dtype=np.float64).reshape(-1):
        if math.isinf(s):
            raise ValueError(f"score {s} is infinite (a reward returns a finite score, or NaN "
                             "for a sample it cannot score)")
        out.append(None if math.isnan(s) else float(s))
    return {"scores": out}


def decode_scores(body: Any, batch: int) -> np.ndarray:
    """The scores of an answer body as float32 ``(batch,)``, NaN for ``null``.

    :raises WireError: for a body that is not ``{"scores": [...]}`` with ``batch`` numbers.
    """
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != batch or not all(
            s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)) for s in scores):
        raise WireError("scores", f"the answer must hold {batch} numbers (or null), got "
                                  f"{_short(body)}")
    return np.array([math.nan if s is None else s for s in scores], dtype=np.float32)


# -- helpers -------------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise WireError(field, f"must be a base64 string, not {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(field, f"is not valid base64 ({exc})") from None


def _list(value: Any, field: str) -> list:
    if not isinstance(value, list) or not value:
        raise WireError(field, f"must be a non-empty list, not {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor(blob: bytes) -> np.ndarray:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(blob)
    except (SafetensorError, ValueError, OSError) as exc:
        raise WireError("outputs.data", f"is not a safetensors file ({exc})") from None
    if set(tensors) != {TENSOR}:
        raise WireError("outputs.data", f"must hold one tensor named {TENSOR!r}, not "
                                        f"{sorted(tensors)}")
    x = tensors[TENSOR]
    if x.dtype not in FLOAT_DTYPES:
        raise WireError("outputs.data", f"holds dtype {x.dtype}; allowed: float32, float64")
    return x


def _png(frame: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def _png_samples(frames: Any, budget: _Budget) -> list[np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    samples = []
    for i, sample in enumerate(_list(frames, "outputs.frames")):
        images = []
        for j, value in enumerate(_list(sample, f"outputs.frames[{i}]")):
            field = f"outputs.frames[{i}][{j}]"
            try:
                with Image.open(io.BytesIO(_unb64(value, field))) as im:
                    if im.format != "PNG":
                        raise WireError(field, f"is a {im.format} image; allowed: PNG")
                    budget.take(im.width * im.height * 3, field)  # before it is decoded
                    images.append(np.asarray(im.convert("RGB")))
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
                raise WireError(field, f"is not a PNG image ({exc})") from None
        samples.append(_stack(images, f"outputs.frames[{i}]", scale=False))
    return samples


def _mp4(frames: np.ndarray, fps: float) -> bytes:
    """``frames`` (F, H, W, 3) uint8 as an H.264 MP4 (yuv420p; yuv444p for odd sizes)."""
    import av
    from fractions import Fraction

    buf = io.BytesIO()
    height, width = frames.shape[1:3]
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if height % 2 == 0 and width % 2 == 0 else "yuv444p"
        stream.options = {"crf": "18"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _decode_mp4(blob: bytes, field: str, budget: _Budget) -> np.ndarray:
    import av

    frames = []
    try:
        with av.open(io.BytesIO(blob), mode="r") as container:
            for frame in container.decode(video=0):
                budget.take(frame.width * frame.height * 3, field)
                frames.append(frame.to_ndarray(format="rgb24"))
    except (av.FFmpegError, IndexError, ValueError) as exc:
        raise WireError(field, f"is not a video PyAV can decode ({exc})") from None
    if not frames:
        raise WireError(field, "holds no video frame")
    return _stack(frames, field)


def _stack(arrays: list[np.ndarray], field: str, scale: bool = True) -> np.ndarray:
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) != 1:
        raise WireError(field, f"its items differ in shape {shapes}; one request holds samples "
                               "of one size and frame count")
    x = np.stack(arrays)
    if scale and x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    return x
