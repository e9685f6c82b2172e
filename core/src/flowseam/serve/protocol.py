"""Request and response schemas of ``flowseam serve``, in the OpenAI API's shapes.

The official ``openai`` SDK works unchanged: ``client.images.generate`` posts an
:class:`ImageGenerationRequest`, ``client.videos.create`` a :class:`VideoCreateRequest` (as
``multipart/form-data``; nested objects arrive as ``key[sub]`` form fields, see
:func:`form_to_dict`), and the answers parse as the SDK's ``ImagesResponse`` and ``Video``.
flowseam's own parameters are extra fields (``extra_body=`` in the SDK); a field flowseam does not
implement is refused with 400 naming it, never ignored. Pure pydantic: no torch, no HTTP.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import InvalidInputError

SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
#: the largest width or height a request may ask for, in pixels
MAX_SIDE = 4096
#: the longest video a request may ask for, in frames
MAX_FRAMES = 1025


def parse_size(size: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` → ``(width, height)`` in pixels.

    :raises ValueError: naming the value and the allowed form.
    """
    match = SIZE_PATTERN.match(size)
    if not match:
        raise InvalidInputError(
            f"size={size!r} must look like WIDTHxHEIGHT in pixels, e.g. '512x512'")
    width, height = int(match.group(1)), int(match.group(2))
    if width > MAX_SIDE or height > MAX_SIDE:
        raise InvalidInputError(f"size={size!r}: width and height must be <= {MAX_SIDE} pixels")
    return width, height


class Extras(BaseModel):
    """flowseam's parameters, accepted as extra fields by both generation endpoints.

    ``None`` means "the model card's default" (the checkpoint's scheduler and the card decide),
    except ``seed``: None draws a random seed, which the answer reports.
    """

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="seeds the initial noise")
    steps: int | None = Field(None, ge=1, le=1000, description="denoising steps")
    guidance_scale: float | None = Field(None, ge=0, le=100)
    negative_prompt: str | None = Field(None, max_length=10_000)
    flow_shift: float | None = Field(None, gt=0, le=100)
    max_sequence_length: int | None = Field(None, ge=1, le=512, description="text tokens kept")
    #: the request's LoRA set: ``"NAME[:WEIGHT][@EXPERT]"``, ``{"path", "weight", "expert"}`` or a
    #: list of those, naming files the server loaded at start (``flowseam serve --lora``)
    lora: Any = None
    #: the step-cache policy: ``"NAME:THRESHOLD"`` or ``{"name", "threshold", ...}``
    cache: Any = None
    user: str | None = Field(None, max_length=256,
                             description="the OpenAI field; accepted, recorded nowhere")


class _Generation(Extras):
    """What both endpoints take: the prompt, the model and the size."""

    prompt: str = Field(min_length=1, max_length=10_000)
    model: str | None = Field(None, description="a served model id; default: the only one that "
                                                "fits the request")
    size: str | None = Field(None, description="WIDTHxHEIGHT in pixels; default: the card's")

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value


class ImageGenerationRequest(_Generation):
    """``POST /v1/images/generations`` (OpenAI's ``images.generate``)."""

    n: int = Field(1, ge=1, le=10, description="images, seeds seed, seed+1, ...")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png"] = "png"
    quality: Literal["auto"] = "auto"


class VideoCreateRequest(_Generation):
    """``POST /v1/videos`` (OpenAI's ``videos.create``); JSON or multipart/form-data.

    ``input_reference`` (image-to-video): an uploaded file (multipart), or
    ``{"image_url": "data:image/png;base64,..."}`` / the data URL itself (JSON). Remote URLs and
    ``file_id`` are refused: the server fetches nothing.
    """

    seconds: int | None = Field(None, ge=1, le=120,
                                description="length; frames = seconds * fps + 1")
    frames: int | None = Field(None, ge=1, le=MAX_FRAMES,
                               description="length in frames (instead of seconds)")
    fps: int = Field(8, ge=1, le=120, description="frames per second of the MP4")
    input_reference: Any = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        return int(value) if isinstance(value, str) and value.isdigit() else value


# -- answers ---------------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope; the SDK raises it as ``openai.APIStatusError`` subclasses."""

    error: ErrorBody


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int = Field(description="the seed this image was drawn with")


class ImagesResponse(BaseModel):
    """OpenAI's ``ImagesResponse`` plus ``id`` (the job, for the job table and ``url``s)."""

    id: str
    created: int
    data: list[ImageData]
    model: str
    output_format: str = "png"
    size: str


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """OpenAI's ``Video`` job object, plus flowseam's ``seed``, ``frames``, ``fps``, ``steps``."""

    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(ge=0, le=100, description="from the denoising steps done")
    model: str
    prompt: str
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    seed: int
    frames: int
    fps: int
    steps: int


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class ModelObject(BaseModel):
    """OpenAI's ``Model`` plus what a flowseam model is: its card and provenance."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flowseam"
    kind: Literal["model", "workflow"]
    tasks: list[str]
    card: dict[str, Any]
    provenance: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


# -- multipart ---------------------------------------------------------------------------------

_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")


def form_to_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Form fields as the SDK encodes them (``a[b]=v`` for nested objects, ``a[]=v`` for lists;
    every value a string) → a nested dict for the pydantic models, which coerce ``"5"`` to 5.

    :raises ValueError: for a field name that is not of that form.
    """
    out: dict[str, Any] = {}
    for key, value in items:
        match = _KEY.match(key)
        if not match:
            raise InvalidInputError(f"form field {key!r} is not a valid field name")
        parts = [match.group(1)] + re.findall(r"\[([^\[\]]*)\]", match.group(2))
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if part == "":  # a[]: append
                if not isinstance(node, list):
                    raise InvalidInputError(f"form field {key!r} mixes list and object forms")
                if last:
                    node.append(value)
                    break
                node.append({})
                node = node[-1]
                continue
            if not isinstance(node, dict):
                raise InvalidInputError(f"form field {key!r} mixes list and object forms")
            if last:
                if part in node:
                    raise InvalidInputError(f"form field {key!r} given twice")
                node[part] = value
            else:
                nxt = parts[i + 1]
                node = node.setdefault(part, [] if nxt == "" else {})
    return out
