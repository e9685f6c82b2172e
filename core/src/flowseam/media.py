"""Reading input images and writing outputs (PNG images, MP4 (H.264) or GIF videos, WAV audio).

:func:`read_image` is the one place flowseam turns an image file into pixels: every PIL mode
becomes 8-bit RGB with its real values, EXIF orientation is applied, and bad files (decompression
bombs, truncated or unreadable ones) are refused, naming the file. Every writer renders into a
temporary file in the destination folder and renames it into place (:func:`atomic_path`), so a
failed or interrupted run leaves no partial output file. A video with sound (LTX-2) is an MP4
with an H.264 video track and an AAC audio track; a GIF cannot hold sound, so writing one drops
the audio with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import tempfile
import warnings
import wave
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import FlowseamError, InvalidInputError, InvalidParameterError

IMAGE_SUFFIXES = (".png",)
VIDEO_SUFFIXES = (".mp4", ".gif")
AUDIO_SUFFIXES = (".wav",)

#: The largest input image flowseam decodes, in pixels: PIL's own limit (``MAX_IMAGE_PIXELS``,
#: about 89 megapixels), at which PIL merely warns; flowseam refuses.
MAX_IMAGE_PIXELS = 89_478_485

#: errno values that mean "the disk (or quota) is full".
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def disk_error(exc: OSError, path: str | os.PathLike, doing: str = "writing") -> FlowseamError | None:
    """A :class:`FlowseamError` saying "no space left on device while writing PATH" for a
    full-disk ``OSError`` (``ENOSPC``, ``EDQUOT``, ``EFBIG``); None for any other error."""
    if getattr(exc, "errno", None) not in _FULL:
        return None
    return FlowseamError(f"no space left on device while {doing} {path} "
                         f"({os.strerror(exc.errno)}); free some space and run again")


def output_mode(path: str | os.PathLike) -> int:
    """The permission bits an output written onto ``path`` gets: those of the file it replaces,
    or ``0o666 & ~umask`` for a new one (``mkstemp`` makes its files 0600)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only on success.

    Every writer goes through it, so a failed or interrupted run (an exception, Ctrl-C, SIGTERM
    through the CLI's handler) leaves no partial output file. The new file gets the mode of the
    file it replaces (or ``0o666 & ~umask`` for a new one).

    :raises FlowseamError: "no space left on device", naming ``path``, when the disk is full.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with deferred_signals():  # a SIGTERM right after mkstemp still finds tmp to remove
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
            os.close(fd)
        yield Path(tmp)
        os.chmod(tmp, output_mode(path))
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        full = disk_error(exc, path) if isinstance(exc, OSError) else None
        if full is not None:
            raise full from exc
        raise


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are delivered when it ends (blocked with
    ``pthread_sigmask`` in the calling thread; a no-op where that does not exist): a step that
    creates something to clean up, and records it, cannot be interrupted in between."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def check_writable(path: str | os.PathLike) -> Path:
    """Make sure ``path`` can be written (atomically) before any work: its folder exists or can
    be created, a file can be created in it, and ``path`` is not a directory.

    :raises FlowseamError: naming the path and why not.
    """
    path = Path(path)
    if path.is_dir():
        raise FlowseamError(f"output {path} is a directory; give a file name (.png, .mp4, .gif)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".probe", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise (disk_error(exc, path) or FlowseamError(
            f"output {path} cannot be written: {exc.strerror or exc}")) from exc
    return path


# -- reading images -----------------------------------------------------------------------------

def read_image(image: Any) -> "Any":
    """An 8-bit RGB PIL image from a PIL image, a path, or an ``(H, W, 3)`` / ``(H, W)`` array
    (float in [0, 1], or uint8).

    Conversions: 16-bit greyscale (``I;16*``, and ``I`` with values up to 65535) is scaled by
    1/257; 1-bit, greyscale, palette (``P``, ``PA``) and alpha modes through PIL (alpha dropped,
    as diffusers' ``load_image`` does); CMYK through its embedded ICC profile to sRGB when it has
    one, else PIL's conversion; EXIF orientation applied.

    :raises ValueError: naming the file or array, for a missing file, a file PIL cannot
        identify, a truncated file, an image over :data:`MAX_IMAGE_PIXELS` (a decompression bomb:
        refused from its header, before decoding), 32-bit float images (no defined white), or an
        array that is not finite, not in [0, 1] or wrongly shaped.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(image, Image.Image):
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise InvalidInputError(
                f"image is {w}x{h} = {w * h:,} pixels, over flowseam's limit of "
                f"{MAX_IMAGE_PIXELS:,}")
        return _to_rgb(ImageOps.exif_transpose(image), "image")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise InvalidInputError(f"image {path} does not exist")
        try:
            with warnings.catch_warnings():  # PIL only warns below twice its limit; refuse
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im = Image.open(path)
            with im:
                w, h = im.size
                if w * h > MAX_IMAGE_PIXELS:
                    raise InvalidInputError(
                        f"image {path} is {w}x{h} = {w * h:,} pixels, over flowseam's limit of "
                        f"{MAX_IMAGE_PIXELS:,} (a decompression bomb?); it was not decoded")
                im.load()  # decode now: a truncated file fails here, not halfway through a run
                im = ImageOps.exif_transpose(im)
                return _to_rgb(im, str(path))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise InvalidInputError(
                f"image {path} is over the pixel limit (a decompression bomb?); it "
                f"was not decoded: {exc}") from exc
        except UnidentifiedImageError as exc:
            raise InvalidInputError(f"image {path} is not an image PIL can read ({exc})") from exc
        except (OSError, SyntaxError) as exc:
            raise InvalidInputError(
                f"image {path} cannot be decoded (truncated or corrupt?): {exc}") from exc
    if isinstance(image, np.ndarray):
        return _array_to_rgb(image)
    raise InvalidInputError(
        f"image={type(image).__name__} is not supported; pass a PIL image, a path, "
        "or an (H, W, 3) float array in [0, 1]")


def _to_rgb(im: Any, name: str) -> Any:
    from PIL import Image

    mode = im.mode
    if mode == "RGB":
        return im.copy() if im.readonly else im
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(im, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise InvalidInputError(f"image {name} has mode {mode} with values outside 0..65535; "
                                    "convert it to 8- or 16-bit first")
        grey = np.round(a / 257.0).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if mode == "F":
        raise InvalidInputError(
            f"image {name} is a 32-bit float image (mode F), which has no defined "
            "white level; convert it to 8- or 16-bit first")
    if mode == "CMYK" and im.info.get("icc_profile"):
        import io

        from PIL import ImageCms

        src = ImageCms.ImageCmsProfile(io.BytesIO(im.info["icc_profile"]))
        return ImageCms.profileToProfile(im, src, ImageCms.createProfile("sRGB"), outputMode="RGB")
    return im.convert("RGB")


def _array_to_rgb(a: np.ndarray) -> Any:
    from PIL import Image

    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=-1)
    if a.ndim != 3 or a.shape[-1] != 3:
        raise InvalidInputError(f"image array has shape {a.shape}; expected (H, W, 3) or (H, W)")
    if a.dtype == np.uint8:
        return Image.fromarray(a, mode="RGB")
    if not np.issubdtype(a.dtype, np.floating):
        raise InvalidInputError(
            f"image array has dtype {a.dtype}; expected float in [0, 1] or uint8")
    if not np.isfinite(a).all():
        raise InvalidInputError(
            f"image array has {int((~np.isfinite(a)).sum())} non-finite value(s)")
    lo, hi = float(a.min()), float(a.max())
    if lo < 0.0 or hi > 1.0:
        raise InvalidInputError(f"image array has values in [{lo:.4g}, {hi:.4g}]; expected [0, 1]")
    return Image.fromarray(to_uint8(a), mode="RGB")


def check_fps(fps: Any) -> float:
    """``fps`` as a positive finite number of frames per second.

    :raises InvalidParameterError: (a ``ValueError``) naming the value.
    """
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) \
            or fps <= 0:
        raise InvalidParameterError("fps", f"fps={fps!r} must be a finite number of frames per "
                                           "second > 0")
    return fps


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
        raise InvalidInputError(f"image output {path} must end in .png")
    if image.ndim != 3 or image.shape[-1] != 3:
        raise InvalidInputError(f"image has shape {image.shape}; expected (H, W, 3)")
    with atomic_path(path) as tmp:
        Image.fromarray(to_uint8(image)).save(tmp, format="PNG")
    return path


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float = 8,
                audio: np.ndarray | None = None, sample_rate: int | None = None) -> Path:
    """Write ``frames`` ``(F, H, W, 3)`` float in [0, 1] as MP4 (H.264) or GIF, by the suffix of
    ``path``; with ``audio`` an MP4 also gets an AAC track.

    Without audio the MP4 goes through imageio-ffmpeg (whose wheel ships ffmpeg); with audio
    through PyAV: libx264 (yuv420p, or yuv444p for odd sizes) at ``fps`` plus AAC at
    ``sample_rate``. A GIF has no sound: ``audio`` is dropped with a :class:`UserWarning`.

    :param fps: frames per second (> 0).
    :param audio: ``(channels, samples)`` float waveform in [-1, 1] (1 or 2 channels), or None.
    :param sample_rate: the waveform's samples per second (Hz); required with ``audio``.
    :raises ValueError: for an unsupported suffix, a wrongly shaped array, ``fps <= 0``, or audio
        without a sample rate.
    """
    import imageio.v2 as imageio

    check_fps(fps)

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise InvalidInputError(f"video output {path} must end in one of {VIDEO_SUFFIXES}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise InvalidInputError(f"video has shape {frames.shape}; expected (F, H, W, 3)")
    if audio is not None:
        audio = _check_audio(audio, sample_rate)
        if suffix == ".gif":
            warnings.warn(f"{path}: a GIF has no audio track; the audio is dropped (write .mp4 "
                          "for video with sound, or .wav for the sound alone)", stacklevel=2)
            audio = None
    data = to_uint8(frames)
    with atomic_path(path) as tmp:
        if suffix == ".gif":
            imageio.mimsave(tmp, list(data), format="GIF", duration=1000.0 / fps, loop=0)
        elif audio is not None:
            _write_mp4_with_audio(tmp, data, fps, audio, sample_rate)
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
    after it (the next chunk's first frame, or :meth:`close`). The file grows under a temporary
    name next to ``path``; :meth:`close` renames it onto ``path``, and a failure (:meth:`abort`,
    or an exception inside ``with``) deletes it, so nothing is ever left at ``path`` but a
    complete video.

    :param fps: frames per second (> 0).
    :raises ValueError: for a suffix other than ``.mp4``, or ``fps <= 0``.
    """

    def __init__(self, path: str | os.PathLike, fps: float = 8) -> None:
        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise InvalidInputError(
                f"streamed output {self.path} must end in .mp4 (a fragmented MP4 "
                "plays while it is written)")
        self.fps = check_fps(fps)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: the temporary file, created with the first frames (inside ``with``, so that any
        #: failure or signal from then on removes it)
        self.tmp: Path | None = None
        self.process = None
        self.frames = 0

    def _start(self, height: int, width: int) -> None:
        import subprocess

        import imageio_ffmpeg

        with deferred_signals():  # created and recorded together (abort() removes it)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".mp4",
                                       dir=self.path.parent)
            os.close(fd)
            self.tmp = Path(tmp)
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
            raise InvalidInputError(f"frames have shape {frames.shape}; expected (F, H, W, 3)")
        if self.process is None:
            self._start(*frames.shape[1:3])
        elif frames.shape[1:3] != self.shape:
            raise InvalidInputError(f"frames are {frames.shape[1:3]}, the video is {self.shape}")
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
                raise InvalidInputError(f"no frames were written to {self.path}")
            self.process.stdin.close()
            if self.process.wait() != 0:
                raise OSError(f"ffmpeg failed writing {self.path}: {self._stderr()}")
            os.chmod(self.tmp, output_mode(self.path))
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
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)

    def __enter__(self) -> "StreamingVideoWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _check_audio(audio: np.ndarray, sample_rate: int | None) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] == 0:
        raise InvalidInputError(
            f"audio has shape {audio.shape}; expected (channels, samples) with 1 or "
            "2 channels")
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise InvalidInputError(
            f"sample_rate={sample_rate!r} must be a positive number of samples per "
            "second")
    return np.ascontiguousarray(np.clip(audio, -1.0, 1.0))


def _write_mp4_with_audio(path: Path, data: np.ndarray, fps: float, audio: np.ndarray,
                          sample_rate: int) -> None:
    """H.264 video (uint8 ``(F, H, W, 3)``) and AAC audio (``(channels, samples)`` in [-1, 1])
    muxed into one MP4 with PyAV."""
    import av

    layout = "stereo" if audio.shape[0] == 2 else "mono"
    with av.open(str(path), mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        video.height, video.width = data.shape[1:3]
        video.pix_fmt = "yuv420p" if _even(data) else "yuv444p"
        video.options = {"crf": "18"}
        sound = container.add_stream("aac", rate=sample_rate, layout=layout)
        for frame in data:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        samples = av.AudioFrame.from_ndarray(audio, format="fltp", layout=layout)
        samples.sample_rate = sample_rate
        container.mux(sound.encode(samples))
        container.mux(sound.encode())


def write_audio(path: str | os.PathLike, audio: np.ndarray, sample_rate: int) -> Path:
    """Write a waveform ``(channels, samples)`` float in [-1, 1] as 16-bit PCM WAV (clipped,
    rounded).

    :raises ValueError: for a suffix other than .wav, a wrongly shaped array or a bad rate.
    """
    path = Path(path)
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise InvalidInputError(f"audio output {path} must end in .wav")
    audio = _check_audio(audio, sample_rate)
    pcm = np.round(audio.T * 32767.0).astype("<i2")  # interleaved (samples, channels)
    with atomic_path(path) as tmp:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(audio.shape[0])
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.tobytes())
    return path


def _even(frames: np.ndarray) -> bool:
    return frames.shape[1] % 2 == 0 and frames.shape[2] % 2 == 0


def write_output(path: str | os.PathLike, frames: np.ndarray | None, fps: float = 8,
                 audio: np.ndarray | None = None, sample_rate: int | None = None) -> Path:
    """Write an image (``.png``; frames ``(1, H, W, 3)`` or ``(H, W, 3)``), a video (``.mp4``,
    ``.gif``; with ``audio`` an MP4 gets a sound track) or the audio alone (``.wav``), by suffix.

    :raises ValueError: for an unsupported suffix, or ``.wav`` without audio.
    """
    suffix = Path(path).suffix.lower()
    if suffix in AUDIO_SUFFIXES:
        if audio is None:
            raise InvalidInputError(
                f"{path}: this output has no sound to write; use .png, .mp4 or .gif")
        return write_audio(path, audio, sample_rate)
    if suffix in IMAGE_SUFFIXES:
        if frames.ndim == 4:
            if frames.shape[0] != 1:
                raise InvalidInputError(f"{path}: a PNG holds one frame, got {frames.shape[0]}; "
                                        f"use .mp4 or .gif for video")
            frames = frames[0]
        return write_image(path, frames)
    if suffix in VIDEO_SUFFIXES:
        return write_video(path, frames if frames.ndim == 4 else frames[None], fps=fps,
                           audio=audio, sample_rate=sample_rate)
    raise InvalidInputError(
        f"output {path}: unsupported suffix {suffix!r}; use .png, .mp4, .gif or .wav")
