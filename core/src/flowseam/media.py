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


class StreamingVideoWriter:
    """Writes a video progressively as chunks of frames arrive, as a fragmented MP4 (H.264,
    ``-movflags frag_every_frame+empty_moov``, ``-tune zerolatency``) through the ffmpeg binary
    that imageio-ffmpeg ships: every frame is its own fragment, flushed as soon as it is encoded,
    so a reader can play the frames written so far while later chunks are still being
    generated — all but the newest one, whose duration the MP4 muxer only learns from the frame
    after it (the next chunk's first frame, or :meth:`close`). The file grows under a temporary name next to ``path``; :meth:`close` renames it
    onto ``path``, and a failure (:meth:`abort`, or an exception inside ``with``) deletes it, so
    nothing is ever left at ``path`` but a complete video.

    :param fps: frames per second.
    :raises ValueError: for a suffix other than ``.mp4``.
    """

    def __init__(self, path: str | os.PathLike, fps: int = 8) -> None:
        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise ValueError(f"streamed output {self.path} must end in .mp4 (a fragmented MP4 "
                             "plays while it is written)")
        self.fps = int(fps)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".mp4", dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.process = None
        self.frames = 0

    def _start(self, height: int, width: int) -> None:
        import subprocess

        import imageio_ffmpeg

        even = height % 2 == 0 and width % 2 == 0
        cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}",
               "-r", str(self.fps), "-i", "-", "-an", "-c:v", "libx264",
               "-pix_fmt", "yuv420p" if even else "yuv444p", "-crf", "17",
               "-tune", "zerolatency", "-flush_packets", "1",
               "-movflags", "+frag_every_frame+empty_moov+default_base_moof",
               "-f", "mp4", str(self.tmp)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, bufsize=0)
        self.shape = (height, width)

    def write(self, frames: np.ndarray) -> None:
        """Append ``frames`` ``(f, H, W, 3)`` float in [0, 1] (every call the same H, W).

        :raises ValueError: for a wrongly shaped array.
        :raises OSError: if ffmpeg stopped (its error output in the message).
        """
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames have shape {frames.shape}; expected (F, H, W, 3)")
        if self.process is None:
            self._start(*frames.shape[1:3])
        elif frames.shape[1:3] != self.shape:
            raise ValueError(f"frames are {frames.shape[1:3]}, the video is {self.shape}")
        try:
            self.process.stdin.write(to_uint8(frames).tobytes())
        except OSError as exc:
            raise OSError(f"ffmpeg stopped while writing {self.path}: {self._stderr()}") from exc
        self.frames += len(frames)

    def _stderr(self) -> str:
        try:
            return self.process.stderr.read().decode(errors="replace").strip()
        except Exception:  # pragma: no cover
            return ""

    def close(self) -> Path:
        """Finish the video and rename it onto ``path``.

        :raises OSError: if ffmpeg failed (the temporary file is deleted).
        :raises ValueError: if no frame was written.
        """
        try:
            if self.process is None:
                raise ValueError(f"no frames were written to {self.path}")
            self.process.stdin.close()
            if self.process.wait() != 0:
                raise OSError(f"ffmpeg failed writing {self.path}: {self._stderr()}")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.tmp, 0o666 & ~umask)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Stop ffmpeg and delete the temporary file (nothing appears at ``path``)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def __enter__(self) -> "StreamingVideoWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


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
