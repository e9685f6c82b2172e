"""``flowseam serve``: check the options, bind the socket, load the models, run uvicorn.

Everything a user can get wrong (a bad option, a port in use, an unwritable output directory, a
missing checkpoint) is reported before any model is loaded where it can be, as a
:class:`~flowseam.errors.FlowseamError` or ``ValueError`` the command line turns into one line on
stderr and exit status 2.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FlowseamError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from ..parallel import Parallel


@dataclass
class ServeOptions:
    """The options of ``flowseam serve`` (see ``flowseam serve --help``)."""

    models: list[str]
    workflow: str | None = None
    backends: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    max_batch: int = 8
    output_dir: str = "outputs/serve"
    expire_after: float = 86400.0
    max_upload_mb: float = 16.0
    log_level: str = "info"
    threads: int | None = None
    #: LoRA files loaded at start; requests may name only these (``lora`` field)
    loras: list[str] = field(default_factory=list)
    #: ``--nproc``, ``--sp``, ``--cfg-parallel``: every generation split over ranks
    #: (:func:`flowseam.parallel.parallel_from_options`; :mod:`.ranks`)
    nproc: int | None = None
    sp: int | None = None
    cfg_parallel: bool = False
    #: ``--dtype``, ``--offload``, ``--vae-tiling``, ``--vae-slicing``: :func:`flowseam.load`'s
    #: ``dtype``, ``offload``, ``vae_tiling``, ``vae_slicing`` for every model
    load_options: dict = field(default_factory=dict)


def model_id(path: str) -> str:
    """The id a ``--model`` is served under: a local directory's name, else the hub id."""
    local = Path(path).expanduser()
    return local.resolve().name if local.is_dir() else path


def check_options(opts: ServeOptions) -> list[str]:
    """Validate ``opts`` before anything loads; returns the served model ids.

    :raises ValueError: naming the bad option and what is allowed.
    :raises FlowseamError: for an output directory that cannot be written.
    """
    _check_numbers(opts)
    ids = _check_models(opts)
    out = Path(opts.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".flowseam-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FlowseamError(f"--output-dir={opts.output_dir!r} is not a writable directory: "
                            f"{exc}") from exc
    return ids


def _check_numbers(opts: ServeOptions) -> None:
    """The port, queue, batch, expiry, upload size, threads, API key and log level."""
    if not 0 <= opts.port <= 65535:
        raise InvalidInputError(f"--port={opts.port} must be in [0, 65535] (0: any free port)")
    for name, value, low in (("max-queue", opts.max_queue, 1), ("max-batch", opts.max_batch, 1)):
        if value < low:
            raise InvalidInputError(f"--{name}={value} must be >= {low}")
    if not opts.expire_after > 0:
        raise InvalidInputError(f"--expire-after={opts.expire_after} must be > 0 seconds")
    if not opts.max_upload_mb > 0:
        raise InvalidInputError(f"--max-upload-mb={opts.max_upload_mb} must be > 0")
    if opts.threads is not None and opts.threads < 1:
        raise InvalidInputError(f"--threads={opts.threads} must be >= 1")
    if opts.api_key is not None and not opts.api_key.strip():
        raise InvalidInputError("--api-key is empty")
    if opts.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise InvalidInputError(
            f"--log-level={opts.log_level!r}: use critical, error, warning, info or "
            "debug")


def _check_models(opts: ServeOptions) -> list[str]:
    """The ``--model`` checkpoints (one id each, a ``model_index.json`` where local), the
    ``--workflow`` over them and ``--backend`` once or once per model; returns the served ids."""
    from ..workflows import WORKFLOWS

    if opts.workflow is not None and opts.workflow not in WORKFLOWS:
        raise InvalidInputError(f"--workflow {opts.workflow!r} is unknown; available: "
                                f"{sorted(WORKFLOWS)}")
    if len(opts.backends) > 1 and len(opts.backends) != len(opts.models):
        raise InvalidInputError(
            f"--backend given {len(opts.backends)} times; give it once, or once per "
            f"--model ({len(opts.models)})")
    ids = [model_id(m) for m in opts.models] + ([opts.workflow] if opts.workflow else [])
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise InvalidInputError(f"two --model checkpoints would be served as {dupes[0]!r}: each is "
                                "served under its directory's name; rename one directory")
    for path in opts.models:
        local = Path(path).expanduser()
        looks_local = path.startswith((".", "/", "~")) or local.exists() or path.count("/") != 1
        if looks_local and not (local / "model_index.json").is_file():
            raise FlowseamError(f"--model {path}: no model_index.json there (expected a "
                                "diffusers-format checkpoint directory, or a hub id org/name)")
    if opts.workflow is not None:
        tasks = [_local_task(m) for m in opts.models]
        if None not in tasks and not {"t2i", "i2v"} <= set(tasks):
            raise InvalidInputError(
                f"--workflow {opts.workflow} needs a text-to-image and an image-to-"
                f"video --model; the checkpoints given make {tasks}")
    return ids


def _local_task(path: str) -> str | None:
    """The task of a local checkpoint's card (from its model_index.json), None for a hub id."""
    from ..loading import read_json
    from ..models import card_for_index

    index = Path(path).expanduser() / "model_index.json"
    if not index.is_file():
        return None
    return card_for_index(read_json(index), str(index)).task.value


def workflow_stages(models: dict) -> tuple[str, str]:
    """The served ids of a t2i-i2v workflow's stages: the first text-to-image and the first
    image-to-video model, in --model order.

    :raises ValueError: if either is missing.
    """
    from ..request import TaskType

    t2i = [n for n, m in models.items() if m.card.task is TaskType.T2I]
    i2v = [n for n, m in models.items() if m.card.task is TaskType.I2V]
    if not t2i or not i2v:
        raise InvalidInputError(
            "--workflow t2i-i2v needs a text-to-image and an image-to-video --model; "
            f"got {[m.card.name for m in models.values()]}")
    return t2i[0], i2v[0]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    :raises FlowseamError: if the address cannot be bound (in use, not local, ...).
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FlowseamError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose "
                            "another --port (0 picks a free one)") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def preload_loras(models: dict, paths: list[str]) -> None:
    """Load each ``--lora`` file into every served model whose DiT it matches (requests may
    name only loaded files: the server never reads a path a client sends).

    :raises FlowseamError: for a file that matches none of the models (each one's reason).
    """
    from ..errors import FlowseamError

    for path in paths:
        reasons = []
        for name, model in models.items():
            try:
                model.adapters.load(path)
            except FlowseamError as exc:
                reasons.append(f"{name}: {exc}")
        if len(reasons) == len(models):
            raise FlowseamError(f"--lora {path} fits none of the served models: " + "; ".join(reasons))


def check_parallel_options(opts: ServeOptions) -> "Parallel | None":
    """The layout ``--nproc``/``--sp``/``--cfg-parallel`` ask for (None: one process), checked
    against this machine and every ``--model``'s checkpoint before any model loads; the
    request-dependent checks (tokens that ``--sp`` divides) answer each request with a 400.

    :raises InvalidInputError: naming the numbers.
    """
    from ..loading import check_parallel_checkpoint
    from ..parallel import check_ranks, parallel_from_options
    from ..request import DiffusionParams

    parallel = parallel_from_options(opts.nproc, opts.sp, opts.cfg_parallel)
    if parallel is None:
        return None
    platforms = _platforms(opts)
    check_ranks(parallel, platforms[0])
    for path, platform in zip(opts.models, platforms):  # the defaults must split
        try:
            check_parallel_checkpoint(path, parallel, DiffusionParams(), platform)
        except InvalidInputError as exc:
            raise InvalidInputError(f"--model {path}: {exc}") from None
    return parallel


def run(opts: ServeOptions, argv: list[str] | None = None) -> int:
    """Serve until interrupted (SIGINT/SIGTERM stop the workers at the next step boundary).

    With ``--nproc`` (``argv``: the command's arguments, to start the ranks with) this process
    starts the ranks and waits for them; rank 0 serves, the others follow it (:mod:`.ranks`).
    """
    import os

    from ..launch import launch
    from ..parallel import is_rank_of

    ids = check_options(opts)
    parallel = check_parallel_options(opts)
    _check_load_options(opts)
    if parallel is not None and not is_rank_of(parallel.world_size):  # not yet a rank
        if opts.port:
            bind(opts.host, opts.port).close()  # a port in use fails here, before the ranks
        return launch(list(argv or ()), parallel.world_size)
    if parallel is not None and int(os.environ.get("RANK", "0")) != 0:
        return _follow(opts, ids, parallel)
    sock = bind(opts.host, opts.port)
    relay = None
    try:
        if not is_loopback(opts.host) and opts.api_key is None:
            print(f"flowseam serve: warning: listening on {opts.host} without --api-key: anyone "
                  "who can reach this port can generate", file=sys.stderr)
        models = _load_models(opts, ids, parallel)
        if parallel is not None:
            from .ranks import RankRelay

            relay = RankRelay(models)
        return _serve(opts, sock, models, relay)
    finally:
        sock.close()
        if relay is not None:
            relay.close()


def _serve(opts: ServeOptions, sock: socket.socket, models: dict, relay) -> int:
    """Run uvicorn on ``sock`` with an engine over ``models`` (and the ranks' ``relay``) until
    it stops: 0, 130 after Ctrl-C, 1 when a run failed on rank 0 alone."""
    import uvicorn

    from ..workflows import WORKFLOWS
    from .api_server import build_app
    from .engine import Engine

    workflow = None
    if opts.workflow is not None:
        t2i, i2v = workflow_stages(models)
        workflow = (opts.workflow, WORKFLOWS[opts.workflow](models[t2i], models[i2v]), t2i, i2v)
    engine = Engine(models, opts.output_dir, workflow=workflow, max_queue=opts.max_queue,
                    max_batch=opts.max_batch, expire_after=opts.expire_after,
                    run=relay.run if relay is not None else None)
    app = build_app(engine, api_key=opts.api_key, max_upload_bytes=int(opts.max_upload_mb * 2**20))
    logging.getLogger("flowseam.serve").setLevel(opts.log_level.upper())
    server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level,
                                           timeout_graceful_shutdown=10))
    if relay is not None:  # a run that failed on rank 0 alone stops the server
        relay.on_broken = lambda: setattr(server, "should_exit", True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"flowseam serve: listening on http://{shown}:{port} | models: "
          + ", ".join(m.id for m in engine.served()), flush=True)
    for name, model in models.items():
        print(f"  {name}: {model.provenance()}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        return 130
    if relay is not None and relay.broken:
        print(f"flowseam serve: stopped: {relay.broken}", file=sys.stderr)
        return 1
    return 0


def _platforms(opts: ServeOptions) -> list:
    """The platform of each ``--model``, in order (its ``--backend``, else the detected one)."""
    from ..seam.platform import Platform

    backends = opts.backends or [None]
    return [Platform(b) if b else Platform.detect()
            for b in (backends[min(i, len(backends) - 1)] for i in range(len(opts.models)))]


def _check_load_options(opts: ServeOptions) -> None:
    """``--dtype`` and the memory options against every model and its backend, before any
    weights load (:func:`flowseam.loading.check_load_options`)."""
    from ..loading import check_load_options

    for path, platform in zip(opts.models, _platforms(opts)):
        try:
            check_load_options(path, platform, **opts.load_options)
        except InvalidInputError as exc:
            raise InvalidInputError(f"--model {path}: {exc}") from None


def _load_models(opts: ServeOptions, ids: list[str], parallel: "Parallel | None") -> dict:
    """Every ``--model``, in order, on its ``--backend`` (split per ``parallel``; every rank
    loads the same models in the same order, and only rank 0 prints the load lines), with the
    ``--lora`` files read; the libraries quiet and ``--threads`` set first."""
    import os

    from ..loading import load
    from ..quiet import quiet_libraries

    quiet_libraries()
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    quiet = int(os.environ.get("RANK", "0")) != 0
    models = {name: load(path, platform=platform, parallel=parallel, quiet=quiet,
                         **opts.load_options)
              for name, path, platform in zip(ids, opts.models, _platforms(opts))}
    preload_loras(models, opts.loras)
    return models


def _follow(opts: ServeOptions, ids: list[str], parallel: "Parallel") -> int:
    """A rank above 0 of ``flowseam serve --nproc``: load what rank 0 loads, then run what it
    sends (:func:`flowseam.serve.ranks.follow`)."""
    from .ranks import follow

    models = _load_models(opts, ids, parallel)
    try:
        return follow(models)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: rank 0 says it stopped
        return 130


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
