"""The HTTP routes of ``flowseam serve`` (FastAPI, run by uvicorn); docs/serving.md lists them.

Each route validates, hands the work to the :class:`~.engine.Engine` and answers; none waits on a
model except by awaiting a future, so the event loop never blocks on generation. Errors use
OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``. Security sits in front of
the routes: the API key (:class:`_Auth`: Bearer for the SDK, Basic for the web page), the body
limit (:class:`_BodyLimit`: 413 before a larger body is read), and ids in paths checked against
the server's own form (:func:`_check_id`); files are found through the job table, never through
a path built from the request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import BadRequest, Engine, JobConflict, JobRequest, NotFound, ServeError
from .jobs import PUBLIC_STATUSES, Job, valid_job_id
from .prometheus import CONTENT_TYPE
from .protocol import (
    ErrorBody,
    ErrorResponse,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    ModelList,
    ModelObject,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    form_to_dict,
    parse_size,
)
from .uploads import UploadError, decode_image, reference_bytes

log = logging.getLogger("flowseam.serve")

#: how often the SDK's ``videos.poll`` asks again (its ``openai-poll-after-ms`` header)
POLL_AFTER_MS = 250


def build_app(engine: Engine, *, api_key: str | None = None,
              max_upload_bytes: int = 16 * 2**20) -> FastAPI:
    """The ASGI app serving ``engine``; starts the engine on startup and stops it on shutdown.

    :param api_key: when set, every route but ``/health`` requires it (see the module doc).
    :param max_upload_bytes: the largest request body accepted (413 above it).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    from .. import __version__

    app = FastAPI(title="flowseam serve", version=__version__, lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_upload_bytes)
    if api_key:
        app.add_middleware(_Auth, key=api_key)
    _install_error_handlers(app)
    _image_routes(app, engine)
    _video_routes(app, engine, max_upload_bytes)
    _service_routes(app, engine)
    return app


def _image_routes(app: FastAPI, engine: Engine) -> None:
    """``POST /v1/images/generations`` (the OpenAI images API) and the images' content."""

    @app.post("/v1/images/generations", response_model=ImagesResponse)
    async def create_images(body: ImageGenerationRequest, request: Request) -> ImagesResponse:
        job = engine.submit(JobRequest(kind="image", n=body.n, **_common_fields(body)))
        done: Job = await asyncio.wrap_future(engine.future(job.id))
        if done.status != "completed":
            raise _JobFailed(done)
        seed = done.params["seed"]
        data = []
        for i, name in enumerate(done.outputs):
            if body.response_format == "url":
                url = str(request.url_for("image_content", image_id=f"{done.id}-{i}"))
                data.append(ImageData(url=url, seed=seed + i))
            else:
                raw = await asyncio.to_thread((engine.output_dir / name).read_bytes)
                data.append(ImageData(b64_json=base64.b64encode(raw).decode(), seed=seed + i))
        return ImagesResponse(id=done.id, created=int(done.created_at), data=data,
                              model=done.model, size=done.params["size"])

    @app.get("/v1/images/{image_id}/content", name="image_content")
    async def image_content(image_id: str) -> FileResponse:
        job_id, _, index = image_id.rpartition("-")
        if not (valid_job_id(job_id) and job_id.startswith("img_") and index.isdigit()):
            raise NotFound(f"no image {image_id!r}", param="image_id")
        job = engine.get(job_id)
        if job is None or job.status != "completed" or int(index) >= len(job.outputs):
            raise NotFound(f"no image {image_id!r}"
                           + (f" (the job is {job.status})" if job is not None else ""),
                           param="image_id")
        return FileResponse(engine.output_path(job, int(index)), media_type="image/png")


def _video_routes(app: FastAPI, engine: Engine, max_upload_bytes: int) -> None:
    """``/v1/videos`` (the OpenAI videos API: create, list, retrieve, content, delete)."""

    @app.post("/v1/videos", response_model=VideoObject)
    async def create_video(request: Request) -> JSONResponse:
        data, upload = await _read_video_body(request, max_upload_bytes)
        try:
            body = VideoCreateRequest.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc.errors(), VideoCreateRequest) from None
        image = await _reference_image(body, upload)
        if body.seconds is not None and body.frames is not None:
            raise BadRequest("give seconds or frames, not both", param="seconds")
        frames = body.frames if body.seconds is None else body.seconds * body.fps + 1
        job = engine.submit(JobRequest(kind="video", frames=frames, fps=body.fps, image=image,
                                       seconds=body.seconds, **_common_fields(body)))
        return _video_response(job)

    @app.get("/v1/videos", response_model=VideoList)
    async def list_videos(after: str | None = None, limit: int = Query(20, ge=1, le=100),
                          order: str = Query("desc", pattern="^(asc|desc)$")) -> VideoList:
        if after is not None and not valid_job_id(after):
            raise BadRequest(f"after={after!r} is not a video id", param="after")
        jobs, more = engine.store.list("video", statuses=PUBLIC_STATUSES, after=after,
                                       limit=limit, order=order)
        items = [video_object(engine.get(j.id) or j) for j in jobs]
        return VideoList(data=items, first_id=items[0].id if items else None,
                         last_id=items[-1].id if items else None, has_more=more)

    @app.get("/v1/videos/{video_id}", response_model=VideoObject)
    async def get_video(video_id: str) -> JSONResponse:
        return _video_response(_video(engine, video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> FileResponse:
        job = _video(engine, video_id)
        if variant != "video":
            raise BadRequest(f"variant={variant!r}: flowseam serves the video only "
                             "(no thumbnail or spritesheet)", param="variant")
        if job.status != "completed":
            raise JobConflict(f"video {video_id} is {job.status}"
                           + (f" ({job.progress}%)" if job.status == "in_progress" else "")
                           + "; its content exists once it is completed", code="not_ready")
        return FileResponse(engine.output_path(job), media_type="video/mp4",
                            filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str) -> VideoDeleted:
        _check_id(video_id, "video")
        job = engine.get(video_id)
        if job is None or job.kind != "video":
            raise NotFound(f"no video {video_id!r}", param="video_id")
        engine.delete(video_id)
        return VideoDeleted(id=video_id)


async def _reference_image(body: VideoCreateRequest, upload: bytes | None) -> Any:
    """The first frame a video request gives: an uploaded file, or ``input_reference`` (a data
    URL), decoded; None for none.

    :raises BadRequest: for one given twice, or one that does not decode.
    """
    try:
        if upload is not None:
            if body.input_reference is not None:
                raise UploadError("input_reference given twice (a file and a field)")
            return await asyncio.to_thread(decode_image, upload)
        if body.input_reference is not None:
            return await asyncio.to_thread(decode_image, reference_bytes(body.input_reference))
    except UploadError as exc:
        raise BadRequest(str(exc), param="input_reference") from None
    return None


def _service_routes(app: FastAPI, engine: Engine) -> None:
    """``/v1/models``, ``/health``, ``/metrics`` and the web page."""

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelObject(**vars(m)) for m in engine.served()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelObject)
    async def get_model(model_id: str) -> ModelObject:
        for m in engine.served():
            if m.id == model_id:
                return ModelObject(**vars(m))
        raise NotFound(f"model {model_id!r} is not served here; served: {engine.ids()}",
                       param="model")

    @app.get("/health")
    async def health() -> JSONResponse:
        models = engine.healthy()
        ok = all(v == "ok" for v in models.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "models": models},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(engine.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    page = resources.files("flowseam.serve").joinpath("static/index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)


# -- helpers -------------------------------------------------------------------------------------

def _common_fields(body: ImageGenerationRequest | VideoCreateRequest) -> dict[str, Any]:
    """The :class:`JobRequest` fields both endpoints take, from the parsed body."""
    width, height = parse_size(body.size) if body.size else (None, None)
    return dict(prompt=body.prompt, model=body.model, width=width, height=height,
                steps=body.steps, guidance_scale=body.guidance_scale, flow_shift=body.flow_shift,
                negative_prompt=body.negative_prompt, seed=body.seed,
                max_sequence_length=body.max_sequence_length,
                extra={"lora": body.lora, "cache": body.cache})


def video_object(job: Job) -> VideoObject:
    """The OpenAI ``Video`` object of a video job."""
    p = job.params
    error = VideoError(code=job.error_code or "failed", message=job.error_message or "") \
        if job.status == "failed" else None
    return VideoObject(
        id=job.id, status=job.status, progress=job.progress, model=job.model, prompt=job.prompt,
        created_at=int(job.created_at),
        completed_at=int(job.completed_at) if job.completed_at else None,
        expires_at=int(job.expires_at) if job.expires_at else None, seconds=p["seconds"],
        size=p["size"], error=error, seed=p["seed"], frames=p["frames"], fps=p["fps"],
        steps=p["steps"])


def _video_response(job: Job) -> JSONResponse:
    return JSONResponse(video_object(job).model_dump(),
                        headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})


def _check_id(job_id: str, kind: str) -> None:
    if not (valid_job_id(job_id) and job_id.startswith(f"{kind}_")):
        raise NotFound(f"no {kind} {job_id!r} (ids look like {kind}_ and 32 hex digits)",
                       param=f"{kind}_id")


def _video(engine: Engine, video_id: str) -> Job:
    _check_id(video_id, "video")
    job = engine.get(video_id)
    if job is None or job.kind != "video":
        raise NotFound(f"no video {video_id!r}", param="video_id")
    if job.status not in PUBLIC_STATUSES:
        raise NotFound(f"video {video_id!r} was {job.status}", param="video_id", code=job.status)
    return job


class _JobFailed(ServeError):
    """An image job that failed: 500 (503 if the server stopped) with the job's reason."""

    type = "server_error"

    def __init__(self, job: Job) -> None:
        super().__init__(job.error_message or f"the job ended {job.status}",
                         code=job.error_code or job.status)
        self.status = 503 if job.error_code in ("server_shutdown", "worker_stopped") else 500


async def _read_video_body(request: Request, limit: int) -> tuple[dict[str, Any], bytes | None]:
    """A video request's fields and uploaded ``input_reference`` bytes, JSON or multipart."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=1, max_fields=64, max_part_size=limit)
        except StarletteHTTPException:
            raise
        except Exception as exc:
            raise BadRequest(f"unreadable multipart body: {exc}") from None
        fields: list[tuple[str, Any]] = []
        upload = None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "input_reference":
                    raise BadRequest(f"{key}: only input_reference may be a file", param=key)
                upload = await value.read()
            else:
                fields.append((key, value))
        try:
            return form_to_dict(fields), upload
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    if ctype.startswith("application/json"):
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest("the body must be a JSON object")
        return data, None
    raise BadRequest(f"Content-Type {ctype or '(none)'!r}: send application/json or "
                     "multipart/form-data")


def _validation_error(errors: list[dict], model: type | None = None) -> BadRequest:
    """pydantic's errors → one 400 naming the first bad field and what is allowed."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = ".".join(loc) or "body"
    if first.get("type") == "extra_forbidden":
        allowed = sorted(model.model_fields) if model is not None else []
        message = (f"{field}: flowseam serve does not implement this field"
                   + (f"; accepted fields: {', '.join(allowed)}" if allowed else ""))
    elif first.get("type") == "missing":
        message = f"{field} is required"
    else:
        value = first.get("input")
        text = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        shown = (f" (got {value!r})" if value is not None and not isinstance(value, dict)
                 and f"{field}=" not in text else "")
        message = text if text.startswith(f"{field}=") else f"{field}: {text}{shown}"
    return BadRequest(message, param=loc[0] if loc else None, code="invalid_value")


def _error(status: int, message: str, *, type: str = "invalid_request_error",
           param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError) -> JSONResponse:
        return _error(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code,
                      headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        route = request.scope.get("route")
        model = None
        body_field = getattr(route, "body_field", None)
        if body_field is not None:
            model = getattr(body_field, "type_", None) or getattr(body_field.field_info,
                                                                   "annotation", None)
        err = _validation_error(list(exc.errors()), model if isinstance(model, type) else None)
        return _error(400, err.message, param=err.param, code=err.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
            exc.status_code)
        return _error(exc.status_code, str(exc.detail), code=code,
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error(500, f"internal error in flowseam serve: {type(exc).__name__}: {exc}",
                      type="server_error", code="internal_error")


# -- middleware (plain ASGI) ---------------------------------------------------------------------

async def _send_json(send: Any, status: int, body: dict,
                     headers: list[tuple[str, str]]) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


class _Auth:
    """Every route but ``/health`` needs ``Authorization: Bearer KEY`` or HTTP Basic with
    password KEY (any user name); otherwise 401 with both challenges, so that a browser asks for
    the key once and sends it with every request the page makes."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, value = header.partition(b" ")
        if scheme.lower() == b"bearer":
            return hmac.compare_digest(value.strip(), self.key)
        if scheme.lower() == b"basic":
            try:
                password = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
            return hmac.compare_digest(password, self.key)
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        if self._authorized(header):
            return await self.app(scope, receive, send)
        # both schemes, one header each: the SDK sends Bearer; a browser answers Basic
        challenges = [("WWW-Authenticate", 'Basic realm="flowseam", charset="UTF-8"'),
                      ("WWW-Authenticate", 'Bearer realm="flowseam"')]
        await _send_json(send, 401, ErrorResponse(error=ErrorBody(
            message="missing or wrong API key: send 'Authorization: Bearer KEY' (the key given "
                    "to flowseam serve --api-key)", type="invalid_request_error",
            code="invalid_api_key")).model_dump(), challenges)


class _BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` once a streamed body passes the limit (an HTTPException, so that
    FastAPI's body parsing passes it on unchanged)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-upload-mb)")


class _BodyLimit:
    """413 for a request body over ``limit`` bytes: at once from Content-Length, or as soon as
    a streamed body passes the limit."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        await _send_json(send, 413, ErrorResponse(error=ErrorBody(
            message=f"the request body is larger than {self.limit} bytes (--max-upload-mb)",
            code="body_too_large")).model_dump(), [])
