"""Reading an uploaded conditioning image (``input_reference``) safely.

The server fetches nothing: an image arrives as an uploaded file or a ``data:`` URL, is opened
with Pillow only if it is a PNG, JPEG or WebP no larger than :data:`MAX_PIXELS`, and is decoded
fully before the job is queued, so a broken upload is a 400 and never a failed job.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from ..media import read_image

#: the largest image accepted, in pixels (Pillow's own bomb check starts at 89 MP)
MAX_PIXELS = 4096 * 4096
FORMATS = ("PNG", "JPEG", "WEBP")


class UploadError(ValueError):
    """An ``input_reference`` the server refuses; the message says what is accepted."""


def reference_bytes(value: Any) -> bytes:
    """The image bytes of a JSON ``input_reference``: ``"data:image/...;base64,..."`` or
    ``{"image_url": "data:..."}``.

    :raises UploadError: for a remote URL, a ``file_id`` or anything else.
    """
    if isinstance(value, dict):
        if "file_id" in value:
            raise UploadError("input_reference.file_id: flowseam serve has no Files API; upload "
                              "the image (multipart) or send it as a data: URL")
        unknown = sorted(set(value) - {"image_url"})
        if unknown or "image_url" not in value:
            raise UploadError(f"input_reference must be {{'image_url': 'data:...'}}; got keys "
                              f"{sorted(value)}")
        value = value["image_url"]
    if not isinstance(value, str):
        raise UploadError(f"input_reference must be an uploaded file or a data: URL, not "
                          f"{type(value).__name__}")
    if value.startswith(("http://", "https://")):
        raise UploadError("input_reference: remote URLs are not fetched (the server makes no "
                          "outbound requests); upload the file or send a data: URL")
    header, sep, payload = value.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64") and sep):
        raise UploadError("input_reference must be a data:image/...;base64,... URL")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UploadError(f"input_reference: the data: URL is not valid base64 ({exc})") from None


def decode_image(data: bytes) -> Any:
    """Uploaded bytes → a PIL RGB image, fully decoded.

    :raises UploadError: if the bytes are not a PNG/JPEG/WebP image, are truncated or corrupt,
        or have more than :data:`MAX_PIXELS` pixels (checked before decoding).
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise UploadError("input_reference is empty")
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise UploadError(f"input_reference is {width}x{height} pixels; at most "
                                  f"{MAX_PIXELS} pixels are accepted")
            image.load()
            return read_image(image)  # every mode converted with its real values (flowseam.media)
    except UploadError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UploadError(f"input_reference is not a readable {'/'.join(FORMATS)} image "
                          f"({type(exc).__name__}: {exc})") from None
