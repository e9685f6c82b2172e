"""Writing outputs: PNG images, MP4 (H.264) or GIF videos, always atomically.

Every writer renders into a temporary file in the destination folder and renames it into place,
so a failed or interrupted run leaves no partial output file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

IMAGE_SUFFIXES = (".png",)
VIDEO_SUFFIXES = (".mp4", ".gif")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """float frames in [0, 1] → uint8 (rounded, clipped)."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def write_image(path: str | os.PathLike, image: np.ndarray) -> Path:
    """Write one image ``(H, W, 3)`` float in [0, 1] as PNG.

    :raises ValueError: for a suffix other than .png or a wrongly shaped array.
    """
    from PIL import Image

    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"image output {path} must end in .png")
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"image has shape {image.shape}; expected (H, W, 3)")
    with atomic_path(path) as tmp:
        Image.fromarray(to_uint8(image)).save(tmp, format="PNG")
    return path


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: int = 8) -> Path:
    """Write ``frames`` ``(F, H, W, 3)`` float in [0, 1] as MP4 (H.264, through imageio-ffmpeg,
    whose wheel ships ffmpeg) or GIF, by the suffix of ``path``.

    :param fps: frames per second.
    :raises ValueError: for an unsupported suffix or a wrongly shaped array.
    """
    import imageio.v2 as imageio

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(f"video output {path} must end in one of {VIDEO_SUFFIXES}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video has shape {frames.shape}; expected (F, H, W, 3)")
    data = to_uint8(frames)
    with atomic_path(path) as tmp:
        if suffix == ".gif":
            imageio.mimsave(tmp, list(data), format="GIF", duration=1000.0 / fps, loop=0)
        else:
            # yuv420p (what players expect) needs even sizes; odd sizes use yuv444p.
            # macro_block_size=1 keeps tiny frames as they are instead of padding them to 16.
            with imageio.get_writer(tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264",
                                    quality=8, macro_block_size=1,
                                    pixelformat="yuv420p" if _even(data) else "yuv444p") as w:
                for frame in data:
                    w.append_data(frame)
    return path


def _even(frames: np.ndarray) -> bool:
    return frames.shape[1] % 2 == 0 and frames.shape[2] % 2 == 0


def write_output(path: str | os.PathLike, frames: np.ndarray, fps: int = 8) -> Path:
    """Write an image (``.png``; frames ``(1, H, W, 3)`` or ``(H, W, 3)``) or a video by suffix."""
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        if frames.ndim == 4:
            if frames.shape[0] != 1:
                raise ValueError(f"{path}: a PNG holds one frame, got {frames.shape[0]}; "
                                 f"use .mp4 or .gif for video")
            frames = frames[0]
        return write_image(path, frames)
    if suffix in VIDEO_SUFFIXES:
        return write_video(path, frames if frames.ndim == 4 else frames[None], fps=fps)
    raise ValueError(f"output {path}: unsupported suffix {suffix!r}; use .png, .mp4 or .gif")
