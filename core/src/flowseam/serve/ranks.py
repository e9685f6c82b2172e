"""``flowseam serve --nproc N``: one HTTP server whose every generation is split over N ranks.

Every rank loads the same models with the same :class:`~flowseam.Parallel` layout. Rank 0 runs
the server as with one process; before it runs a loop, its :class:`RankRelay` sends the request
to the other ranks, which :func:`follow` it and run the same loop, so the split DiT's collectives
meet. What travels is JSON and the conditioning images' raw pixels, broadcast as bytes
(:func:`send`): no pickle, so a rank never unpickles what a client sent. A stop every rank agrees
on (a cancellation, the server stopping, bad input) leaves the ranks in step for the next run; a
failure on one rank alone stops the server. Each case, as a user sees it: docs/serving.md,
"Serving over several processes".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from ..errors import FlowseamError
from ..parallel import agreed_stop
from ..request import DiffusionParams, GenerationRequest, TaskType

if TYPE_CHECKING:  # pragma: no cover
    from ..models.instance import ModelInstance

log = logging.getLogger("flowseam.serve")

#: seconds between keep-alive messages while no run is sent: a follower waits in a collective,
#: which fails after the process group's timeout (30 minutes for gloo)
KEEPALIVE_S = 60.0


class RankRelay:
    """Rank 0's side: :meth:`run` is :func:`flowseam.loops.run_loop` run on every rank.

    One run at a time: a lock is held from sending a request to the end of its loop, so the runs
    of several served models (each with its own worker thread on rank 0) reach the other ranks in
    one order. While no run is sent, a keep-alive goes out every :data:`KEEPALIVE_S` seconds.

    :param models: served model id → model (the same ids, loaded in the same order, on every
        rank).
    """

    def __init__(self, models: dict[str, "ModelInstance"]) -> None:
        self._ids = {id(model): name for name, model in models.items()}
        #: why the ranks cannot run another request (a run failed on this rank alone), or None
        self.broken: str | None = None
        #: called once when :attr:`broken` is set (``flowseam serve``: stop uvicorn)
        self.on_broken: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="flowseam-ranks",
                                           daemon=True)
        self._keepalive.start()

    def run(self, model: "ModelInstance", request: GenerationRequest, **kwargs: Any) -> Any:
        """Send ``request`` to the other ranks, then run it here: ``run_loop(model, request,
        **kwargs)``'s result.

        A stop every rank agreed on (:func:`flowseam.parallel.agreed_stop`: a cancellation or
        the server stopping, through the agreed step callback; bad input refused before any rank
        communicated) ends this run only: the ranks stay in step for the next. Any other failure
        (a plugin fault, out of memory) may have struck this rank alone, mid-collective, where the
        others wait for it: the relay is then :attr:`broken`, :attr:`on_broken` shuts the server
        down (exit status non-zero), and torchrun stops the other ranks."""
        from ..loops import run_loop

        with self._lock:
            if self.broken or self._closed.is_set():
                raise FlowseamError("the ranks of this server have stopped"
                                    + (f" ({self.broken})" if self.broken else ""))
            message, blobs = encode_request(request)
            send({"op": "run", "model": self._ids[id(model)], "request": message}, blobs)
            try:
                return run_loop(model, request, **kwargs)
            except BaseException as exc:
                if not agreed_stop(exc):  # the other ranks may be waiting mid-run: stop
                    self.broken = f"a run failed on rank 0 only: {type(exc).__name__}: {exc}"
                    log.error("%s; the other ranks cannot go on: stopping the server",
                              self.broken)
                    self._closed.set()
                    self.on_broken()  # the server shuts down, and exits 1
                raise

    def close(self) -> None:
        """Tell the other ranks to exit (after the run in progress, if any). Ranks that have
        already gone (a Ctrl-C reaches every rank at once) are not waited for."""
        with self._lock:
            if not self._closed.is_set() and not self.broken:
                self._closed.set()
                try:
                    send({"op": "stop"})
                except RuntimeError as exc:  # the others stopped first: nothing to tell
                    log.info("the other ranks had stopped: %s", exc)

    def _keep_alive(self) -> None:
        while not self._closed.wait(KEEPALIVE_S):
            if self._lock.acquire(blocking=False):  # a run in progress is traffic enough
                try:
                    if not self._closed.is_set():
                        send({"op": "ping"})
                finally:
                    self._lock.release()


def follow(models: dict[str, "ModelInstance"],
           run: Callable[..., Any] | None = None) -> int:
    """A rank above 0: run every request rank 0's :class:`RankRelay` sends, until it says stop.

    A run every rank stopped together (a :class:`~flowseam.parallel.ParallelStopError` from the
    agreed step callback, or bad input, which arises on every rank alike before any rank
    communicates) is logged, and the follower waits for the next run; rank 0 answers the job.

    :returns: 0 after rank 0's stop.
    :raises Exception: what a run raised on this rank alone (not bad input, not a stop every
        rank agreed on): this rank then exits, and torchrun stops the others.
    """
    if run is None:
        from ..loops import run_loop as run
    while True:
        message, blobs = receive()
        if message["op"] == "stop":
            return 0
        if message["op"] != "run":
            continue
        request = decode_request(message["request"], blobs)
        try:
            run(models[message["model"]], request, decode=False)
        except Exception as exc:
            if not agreed_stop(exc):  # this rank alone: the others may wait for it mid-run
                raise
            log.info("run on this rank ended: %s", exc)  # rank 0 met it too, and answers


# -- the wire: JSON and raw arrays over torch.distributed.broadcast ---------------------------
def encode_request(request: GenerationRequest) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``request`` as a JSON-able dict and its conditioning images as arrays (exactly the
    pixels rank 0 runs with: a PIL image's uint8 array, a float array as it is)."""
    from PIL import Image

    images = request.image if isinstance(request.image, (list, tuple)) else \
        [] if request.image is None else [request.image]
    blobs, kinds = [], []
    for image in images:
        if isinstance(image, Image.Image):
            blobs.append(np.asarray(image.convert("RGB")))
            kinds.append("pil")
        else:
            blobs.append(np.ascontiguousarray(np.asarray(image)))
            kinds.append("array")
    params = dataclasses.asdict(request.params)
    params["lora"] = [dataclasses.asdict(spec) for spec in request.params.lora]
    params["cache"] = None if request.params.cache is None else \
        dataclasses.asdict(request.params.cache)
    return {"prompt": request.prompt, "task": request.task.value, "params": params,
            "seeds": request.seeds, "images": kinds,
            "image_list": isinstance(request.image, (list, tuple))}, blobs


def decode_request(message: dict[str, Any], blobs: list[np.ndarray]) -> GenerationRequest:
    """The inverse of :func:`encode_request`."""
    from PIL import Image

    images = [Image.fromarray(b) if kind == "pil" else b
              for kind, b in zip(message["images"], blobs)]
    image = images if message["image_list"] else (images[0] if images else None)
    return GenerationRequest(prompt=message["prompt"], task=TaskType(message["task"]),
                             params=DiffusionParams(**message["params"]), image=image,
                             seeds=message["seeds"])


def send(message: dict[str, Any], blobs: list[np.ndarray] = ()) -> None:
    """Rank 0: broadcast ``message`` (JSON) and ``blobs`` to every rank of the default group."""
    header = dict(message, blobs=[[str(b.dtype), list(b.shape)] for b in blobs])
    _broadcast_bytes(json.dumps(header).encode())
    for blob in blobs:
        _broadcast_bytes(np.ascontiguousarray(blob).tobytes())


def receive() -> tuple[dict[str, Any], list[np.ndarray]]:
    """A rank above 0: the next :func:`send` of rank 0."""
    message = json.loads(_broadcast_bytes(None).decode())
    blobs = [np.frombuffer(_broadcast_bytes(None), dtype=np.dtype(dtype)).reshape(shape).copy()
             for dtype, shape in message.pop("blobs")]
    return message, blobs


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (its length first, then the bytes), as CPU tensors."""
    import torch.distributed as dist

    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
              else torch.empty(int(size.item()), dtype=torch.uint8))
    if buffer.numel():
        dist.broadcast(buffer, src=0)
    return bytes(buffer.numpy())
