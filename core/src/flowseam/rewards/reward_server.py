"""``flowseam reward-serve``: any installed reward over HTTP (FastAPI, run by uvicorn), so that a
reward model with its own dependencies (or its own GPU) runs in its own process, and a training
config names it as ``reward = "http://127.0.0.1:PORT/NAME"``.

Three routes (:func:`build_app`): ``POST /NAME`` scores a batch in the wire format of
:mod:`flowseam.rewards.wire`, ``GET /NAME`` describes the reward, ``GET /health`` counts what was
scored. Safe by default: loopback unless ``--host`` says otherwise (with a warning when there is
no ``--api-key``), JSON bodies only, and a body or batch over its limit refused before it is
decoded. The reward is called by one request at a time (a reward model need not be thread-safe);
decoding runs outside the event loop, so ``/health`` answers while a batch is scored. For users:
docs/rewards.md ("Reward server").
"""

# no ``from __future__ import annotations``: FastAPI reads the routes' ``Request`` annotations,
# which name a class imported inside build_app (fastapi loads only when a server is built)
import hmac
import json
import logging
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import FlowseamError, InvalidInputError
from ..seam.discovery import claims
from ..seam.reward_contract import modality as reward_modality
from . import wire

log = logging.getLogger("flowseam.rewards.reward_server")

#: the log levels ``--log-level`` takes (uvicorn's)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class RewardServeOptions:
    """The options of ``flowseam reward-serve`` (see ``flowseam reward-serve --help``)."""

    reward: str
    reward_args: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None
    max_batch: int = 64
    max_body_mb: float = 512.0
    log_level: str = "warning"
    threads: int | None = None


def check_options(opts: RewardServeOptions) -> None:
    """Validate ``opts`` before the reward loads.

    :raises InvalidInputError: naming the bad option and what is allowed.
    """
    if not isinstance(opts.reward_args, dict):
        raise InvalidInputError(f"--reward-args {opts.reward_args!r} must be a JSON object of "
                                "keyword arguments, e.g. '{\"channel\": 1}'")
    if not 0 <= opts.port <= 65535:
        raise InvalidInputError(f"--port={opts.port} must be in [0, 65535] (0: any free port)")
    if opts.max_batch < 1:
        raise InvalidInputError(f"--max-batch={opts.max_batch} must be >= 1")
    if not (math.isfinite(opts.max_body_mb) and opts.max_body_mb > 0):
        raise InvalidInputError(f"--max-body-mb={opts.max_body_mb} must be a finite number > 0")
    if opts.api_key is not None and not opts.api_key.strip():
        raise InvalidInputError("--api-key (or FLOWSEAM_REWARD_API_KEY) is empty")
    if opts.api_key is not None and not all(33 <= ord(ch) <= 126 for ch in opts.api_key):
        raise InvalidInputError("--api-key (or FLOWSEAM_REWARD_API_KEY) holds a space, a newline "
                                "or a character that is not printable ASCII, which no client can "
                                "send in an Authorization header (the key is not shown here)")
    if opts.log_level not in LOG_LEVELS:
        raise InvalidInputError(f"--log-level={opts.log_level!r}: use one of "
                                f"{', '.join(LOG_LEVELS)}")
    if opts.threads is not None and opts.threads < 1:
        raise InvalidInputError(f"--threads={opts.threads} must be >= 1")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What ``reward-serve`` prints on stderr when it listens beyond this machine without a key
    (None on a loopback address, or with a key)."""
    from ..serve.server import is_loopback

    if is_loopback(host) or api_key is not None:
        return None
    return (f"flowseam reward-serve: warning: listening on {host} without --api-key: anyone who "
            "can reach this port can use the reward")


def provenance(name: str) -> dict[str, str]:
    """The plugin that registers reward ``name`` (``"<plugin>:<name>"`` too): ``{"plugin",
    "distribution", "version"}`` (``"?"`` each when no plugin registers it: a callable given to
    :func:`build_app` directly)."""
    plugin, sep, short = name.rpartition(":")
    for rec, _ in claims("rewards").get(short if sep else name, []):
        if not sep or rec.name == plugin:
            return {"plugin": rec.name, "distribution": rec.distribution,
                    "version": str(rec.version)}
    return {"plugin": "?", "distribution": "?", "version": "?"}


def build_app(reward: Callable, name: str, *, max_batch: int = 64, api_key: str | None = None,
              max_body_bytes: int = 512 * 2**20, origin: dict[str, str] | None = None):
    """The FastAPI app that serves ``reward`` (a built reward: ``reward(prompts, outputs) ->
    (B,)``) as ``name``, on three routes:

    * ``POST /NAME``: score a batch: JSON ``{"prompts", "outputs"}`` → ``{"scores": [...]}``;
    * ``GET /NAME``: what is served: ``{"name", "modality", "plugin", "distribution",
      "version", "max_batch", "formats"}``; the client reads the reward's ``modality``
      (``"video"``, or ``"audio"`` for a reward that scores waveforms) and ``max_batch`` from it;
    * ``GET /health``: ``{"status": "ok", "reward", "requests", "samples"}`` (the score requests
      and samples answered so far); the only route that needs no API key.

    With ``api_key`` every other route needs ``Authorization: Bearer KEY`` (401 otherwise).
    Bodies are JSON only (415 for anything else, such as a pickle) and at most
    ``max_body_bytes`` (413, refused before the body is read past the limit); a request of more
    samples than ``max_batch`` gets 413 before any sample is decoded, and PNG or MP4 samples that
    would decode to more float32 values than the body limit holds get 413 as they are decoded.

    :param origin: the reward's ``{"plugin", "distribution", "version"}`` (what
        :func:`provenance` returns), named in descriptions and in reward-fault errors.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    origin = origin or {"plugin": "?", "distribution": "?", "version": "?"}
    kind = reward_modality(reward)
    path = "/" + name
    lock = threading.Lock()  # one batch at a time through the reward
    counts = {"requests": 0, "samples": 0}
    app = FastAPI(title=f"flowseam reward server: {name}", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.counts = counts

    def error(status: int, type_: str, message: str, field: str | None = None,
              headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"type": type_, "message": message, "field": field,
                                       "reward": name, **origin}},
                            status_code=status, headers=headers)

    def authorized(request: Request) -> bool:
        if not api_key:
            return True
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                                  api_key.encode())

    def refused(served: str, request: Request) -> JSONResponse | None:
        """The answer to a request without the key (401) or for another path (404), else
        None: what both reward routes check first."""
        if not authorized(request):
            return error(401, "unauthorized", "this reward server needs 'Authorization: Bearer "
                         "KEY' (the api_key of RemoteReward, or FLOWSEAM_REWARD_API_KEY)",
                         headers={"WWW-Authenticate": "Bearer"})
        if "/" + served != path:
            return error(404, "not_found", f"this server serves reward {name!r} at {path}, not "
                         f"/{served}")
        return None

    def description() -> dict[str, Any]:
        return {"name": name, "modality": kind, **origin, "max_batch": max_batch,
                "formats": list(wire.FORMATS) if kind != "audio" else ["safetensors"]}

    def scored(prompts: list[str], outputs_field: Any) -> dict | JSONResponse:
        """Decode the samples and score them (in a worker thread)."""
        outputs = wire.decode_outputs(outputs_field, len(prompts), kind,
                                      max_values=max_body_bytes // 4)
        with lock:
            try:
                result = reward(prompts, outputs)
            except InvalidInputError as exc:  # the reward refuses these samples: the client's
                return error(400, "invalid_request", f"reward {name!r} refused the samples: {exc}",
                             "outputs")
            except Exception as exc:  # noqa: BLE001 - any other failure is the reward's fault
                log.exception("reward %s raised", name)
                return error(500, "reward_fault", f"reward {name!r} (plugin {origin['plugin']}) "
                             f"raised {type(exc).__name__}: {exc}")
        try:
            scores = np.asarray(_numpy(result), dtype=np.float64)
            if scores.shape != (len(prompts),):
                raise ValueError(f"shape {scores.shape} for {len(prompts)} samples; expected "
                                 f"({len(prompts)},)")
            answer = wire.encode_scores(scores)
        except (TypeError, ValueError) as exc:
            return error(500, "reward_fault", f"reward {name!r} (plugin {origin['plugin']}) "
                         f"returned {_short(result)}: {exc}")
        with lock:
            counts["requests"] += 1
            counts["samples"] += len(prompts)
        return answer

    @app.get("/health")
    async def health():
        return {"status": "ok", "reward": name, **counts}

    @app.get("/{served:path}")
    async def describe(served: str, request: Request):
        if (refusal := refused(served, request)) is not None:
            return refusal
        return description()

    @app.post("/{served:path}")
    async def score(served: str, request: Request):
        if (refusal := refused(served, request)) is not None:
            return refusal
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != wire.CONTENT_TYPE:
            return error(415, "unsupported_media_type", f"the body must be {wire.CONTENT_TYPE} "
                         f"(see flowseam.rewards.wire), not {ctype or 'untyped'}", "body")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return _too_large(error, declared, max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return _too_large(error, len(body), max_body_bytes)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            return error(400, "invalid_request", f"the body is not JSON ({exc})", "body")
        except RecursionError:  # "[[[[..." nested past Python's recursion limit
            return error(400, "invalid_request", "the body is JSON nested too deeply to read; a "
                         "score request is {\"prompts\": [...], \"outputs\": {...}}", "body")
        try:
            prompts = wire.decode_prompts(data)
            if len(prompts) > max_batch:
                return error(413, "too_large", f"{len(prompts)} samples in one request; this "
                             f"server scores at most {max_batch} (--max-batch): send smaller "
                             "batches (RemoteReward's batch_size)", "prompts")
            if "outputs" not in data:
                raise wire.WireError("outputs", "is missing")
            return await run_in_threadpool(scored, prompts, data["outputs"])
        except wire.WireTooLarge as exc:
            return error(413, "too_large", str(exc), exc.field)
        except wire.WireError as exc:
            return error(400, "invalid_request", str(exc), exc.field)

    return app


def _too_large(error, size, limit: int):
    return error(413, "too_large", f"the body is {size} bytes; this server takes at most {limit} "
                 "(--max-body-mb): send smaller batches", "body")


def _numpy(result: Any) -> Any:
    """A reward's result as something numpy reads (a torch tensor detached, on the CPU)."""
    if hasattr(result, "detach") and hasattr(result, "cpu"):
        return result.detach().cpu().float().numpy()
    return result


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def run(opts: RewardServeOptions) -> int:
    """Serve until interrupted: check the options, bind the socket, build the reward (its model
    loads now), then run uvicorn.

    :raises InvalidInputError: for a bad option; ``FlowseamError`` for an unknown reward (listing
        the registered ones) or an address that cannot be bound — all before the reward loads.
    """
    import uvicorn

    from ..quiet import quiet_libraries
    from ..serve.server import bind
    from ..seam.reward_contract import get_reward

    check_options(opts)
    origin = provenance(opts.reward)
    if origin["plugin"] == "?":  # unknown: get_reward names the registered rewards
        get_reward(opts.reward, **opts.reward_args)
    sock = bind(opts.host, opts.port)
    try:
        host, port = sock.getsockname()[:2]
        warning = exposure_warning(opts.host, opts.api_key)
        if warning:
            print(warning, file=sys.stderr)
        quiet_libraries()
        if opts.threads is not None:
            import torch

            torch.set_num_threads(opts.threads)
        try:
            reward = get_reward(opts.reward, **opts.reward_args)
        except FlowseamError:
            raise
        except Exception as exc:  # the plugin's factory failed: its fault, named as in training
            from ..seam.faults import describe, is_out_of_memory
            from .spec import RewardComponent

            if is_out_of_memory(exc):
                raise
            raise RewardComponent(opts.reward, None, **origin).fault(
                f"{describe(exc)} while being built with reward_args {opts.reward_args}") from exc
        app = build_app(reward, opts.reward, max_batch=opts.max_batch, api_key=opts.api_key,
                        max_body_bytes=int(opts.max_body_mb * 2**20), origin=origin)
        logging.getLogger("flowseam.rewards.reward_server").setLevel(opts.log_level.upper())
        server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level,
                                               timeout_graceful_shutdown=10))
        shown = f"[{host}]" if ":" in host else host
        print(f"flowseam reward-serve: listening on http://{shown}:{port}/{opts.reward} | reward "
              f"{opts.reward} ({reward_modality(reward)}; plugin {origin['plugin']}, "
              f"{origin['distribution']} {origin['version']})", flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
