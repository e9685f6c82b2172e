"""The work behind ``flowseam serve``'s routes: one worker thread per loaded model, batching,
progress, cancellation, failures, persistence and expiry. Knows nothing about HTTP (the routes in
:mod:`.api_server` translate :class:`ServeError` into answers).

:meth:`Engine.submit` checks a request with the model's card (a bad value is a :class:`BadRequest`
before anything is queued) and queues it; the model's :class:`ModelWorker` runs it together with
every compatible queued job as one :func:`flowseam.loops.run_loop` run, the loop and parameters
``flowseam generate`` runs, and writes the frames with :func:`flowseam.media.write_output`. The
loop's step callback is the one place a run is steered: it sets progress and stops the run at a
step boundary once every job in it was cancelled or the server stops. No job stays
``in_progress`` once its worker stopped working on it. The life of a job as a client sees it:
docs/serving.md, "How jobs run".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import math
import secrets
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .. import media
from ..seam.faults import is_out_of_memory
from ..request import DiffusionParams, GenerationRequest, TaskType
from .jobs import Job, JobStore, new_job_id
from .prometheus import ServeMetrics

if TYPE_CHECKING:  # pragma: no cover
    from ..models.instance import ModelInstance
    from ..workflows import Workflow

log = logging.getLogger("flowseam.serve")



class ServeError(Exception):
    """An error the HTTP layer answers with ``status`` and OpenAI's error envelope."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.headers = message, param, code, headers or {}


class BadRequest(ServeError):
    status = 400

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = "invalid_value", **kw: Any) -> None:
        super().__init__(message, param=param, code=code, **kw)


class NotFound(ServeError):
    status = 404


class JobConflict(ServeError):
    """A request the job's state does not allow yet (its content before it is completed)."""

    status = 409


class QueueFull(ServeError):
    status = 429
    type = "rate_limit_error"


class Unavailable(ServeError):
    status = 503
    type = "server_error"


@dataclass
class JobRequest:
    """A generation request as the routes parsed it (API names, no HTTP left).

    :param kind: ``"image"`` (``n`` images, answered when done) or ``"video"`` (a job).
    :param model: a served model id, or None for the only one that fits.
    :param width, height: pixels, or None for the card's default.
    :param frames: video length in frames, or None for the card's default (videos only).
    :param image: the conditioning image for image-to-video (a PIL RGB image) or None.
    :param seed: None draws one (``secrets``); image ``i`` of ``n`` uses ``seed + i``.
    :param extra: further API fields (``lora``, ``cache``) checked against what flowseam has.
    """

    kind: str
    prompt: str
    model: str | None = None
    n: int = 1
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    fps: int = 8
    steps: int | None = None
    guidance_scale: float | None = None
    flow_shift: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    seed: int | None = None
    image: Any = None
    seconds: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def params(self, seed: int) -> DiffusionParams:
        """The :class:`DiffusionParams` ``flowseam generate`` builds from the same values.

        :raises BadRequest: for a ``lora`` or ``cache`` value that does not parse.
        """
        from ..models.adapters import normalize_lora
        from ..loops.step_cache import normalize_cache

        extra = {}
        for name, normalize in (("lora", normalize_lora), ("cache", normalize_cache)):
            try:
                extra[name] = normalize(self.extra.get(name))
            except ValueError as exc:
                raise BadRequest(str(exc), param=name) from None
        return DiffusionParams(num_steps=self.steps, guidance_scale=self.guidance_scale,
                               seed=seed, height=self.height, width=self.width,
                               num_frames=self.frames, negative_prompt=self.negative_prompt,
                               flow_shift=self.flow_shift,
                               max_sequence_length=self.max_sequence_length, **extra)


@dataclass
class _Item:
    """One unit of work for a worker: one job's stage."""

    job: Job
    request: GenerationRequest
    #: the batch key (model parameters without the seed), None: never batched (an image)
    key: tuple | None
    steps_before: int
    total_steps: int
    #: the next stage, given this stage's frames ``(n, F, H, W, 3)``; None: write the outputs
    then: Callable[[np.ndarray], None] | None = None
    fps: int = 8

    @property
    def rows(self) -> int:
        return len(self.request.prompts)


class _Stop(Exception):
    """Raised from the step callback to stop a loop run at a step boundary."""


class ModelWorker(threading.Thread):
    """The one thread that runs a model's jobs, in order, batching compatible ones.

    It takes the oldest item and every queued item with the same batch key (same model and
    parameters apart from the seed; never one with a conditioning image), at most ``max_batch``
    samples in all. An exception in a run (out of memory included) fails every job of that run
    with its reason (:func:`describe_failure`) and the worker goes on with the next jobs. If the
    thread itself dies (a bug in flowseam), every job it held is failed and
    :meth:`Engine.healthy` reports it (``/health`` answers 503).
    """

    def __init__(self, name: str, model: "ModelInstance", engine: "Engine") -> None:
        super().__init__(name=f"flowseam-worker-{name}", daemon=True)
        self.model_name, self.model, self.engine = name, model, engine
        self.queue: deque[_Item] = deque()
        self.cond = threading.Condition()
        self.running: list[_Item] = []
        self.error: str | None = None
        self.stopping = False
        #: running mean of a loop run's seconds (for Retry-After)
        self.mean_run_seconds = 1.0

    # -- used by the engine ----------------------------------------------------------------
    def queue_depth(self) -> int:
        with self.cond:
            return len(self.queue)

    def enqueue(self, item: _Item, *, limit: int | None, accept: Callable[[], None]) -> None:
        """Queue ``item``; call ``accept()`` (writes the job row) under the queue lock first.

        :raises QueueFull: when ``limit`` items are already waiting (with ``Retry-After``).
        :raises Unavailable: when the worker has stopped.
        """
        with self.cond:
            if not self.is_alive() or self.stopping:
                raise Unavailable(f"the worker of model {self.model_name!r} is not running"
                                  + (f" ({self.error})" if self.error else ""))
            if limit is not None and len(self.queue) >= limit:
                wait = self.mean_run_seconds * (len(self.queue) / self.engine.max_batch + 1)
                raise QueueFull(f"the queue of model {self.model_name!r} is full ({limit} jobs "
                                "waiting, --max-queue); retry later", code="queue_full",
                                headers={"Retry-After": str(max(1, math.ceil(wait)))})
            accept()
            self.queue.append(item)
            self.cond.notify()

    def remove(self, job_id: str) -> bool:
        """Drop the queued items of ``job_id``; True if there were any."""
        with self.cond:
            kept = [it for it in self.queue if it.job.id != job_id]
            removed = len(kept) != len(self.queue)
            self.queue = deque(kept)
        return removed

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    # -- the thread ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                self._run(batch)
        except BaseException as exc:  # a bug in flowseam: report it, fail what it held
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("the worker of %s stopped:\n%s", self.model_name, traceback.format_exc())
        finally:
            with self.cond:
                held = self.running + list(self.queue)
                self.running, self.queue = [], deque()
            reason = ("the server stopped before the job finished" if self.error is None
                      else f"the worker of model {self.model_name!r} stopped ({self.error})")
            for item in held:
                self.engine.fail(item.job, "server_shutdown" if self.error is None
                                 else "worker_stopped", reason)

    def _next_batch(self) -> list[_Item] | None:
        with self.cond:
            while not self.queue and not self.stopping:
                self.cond.wait()
            if self.stopping:
                return None
            first = self.queue.popleft()
            batch, rows = [first], first.rows
            if first.key is not None:
                kept: deque[_Item] = deque()
                for item in self.queue:
                    if item.key == first.key and rows + item.rows <= self.engine.max_batch:
                        batch.append(item)
                        rows += item.rows
                    else:
                        kept.append(item)
                self.queue = kept
            self.running = batch
            return batch

    def _run(self, batch: list[_Item]) -> None:
        """Run one batch of jobs through the model's loop and deliver each job's rows; a job
        cancelled or a server stopping ends the run at the next step boundary."""
        from ..loops import run_loop

        engine = self.engine
        for item in batch:
            if engine.cancel_requested(item.job.id):  # cancelled as the worker took it
                engine.acknowledge_cancel(item.job)
        live = [item for item in batch if not item.job.finished]
        if not live:
            with self.cond:
                self.running = []
            return
        for item in live:
            engine.started(item.job)
        request = self._request(batch)
        started = time.perf_counter()
        try:
            result = (engine.run or run_loop)(self.model, request,
                                              step_callback=self._on_step(live))
            self._deliver(batch, live, result.frames)
            del result
        except _Stop:
            for item in live:
                if engine.cancel_requested(item.job.id):
                    engine.acknowledge_cancel(item.job)
                else:
                    engine.fail(item.job, "server_shutdown",
                                "the server stopped before the job finished")
        except Exception as exc:
            code, message = describe_failure(exc)
            log.warning("model %s: run of %d job(s) failed: %s", self.model_name, len(batch),
                        message)
            for item in live:
                engine.fail(item.job, code, message)
        finally:
            with self.cond:
                self.running = []
            seconds = time.perf_counter() - started
            self.mean_run_seconds = 0.8 * self.mean_run_seconds + 0.2 * seconds
            del request, live
            free_memory()

    def _request(self, batch: list[_Item]) -> GenerationRequest:
        """One request for the batch: a lone job's own (exactly what ``flowseam generate``
        would run), else every job's prompts and seeds in order, with the first one's params."""
        if len(batch) == 1:
            request = batch[0].request
        else:
            first = batch[0].request
            request = GenerationRequest(
                prompt=[p for it in batch for p in it.request.prompts], task=first.task,
                params=first.params,
                seeds=[s for it in batch for s in it.request.sample_seeds(it.request.params)])
        self.engine.metrics.batch_size.labels(self.model_name).observe(len(request.prompts))
        return request

    def _on_step(self, live: list[_Item]) -> Callable[[int, int, Any], None]:
        """The loop's step callback: step times, each job's progress, and a stop at this step
        boundary when the server stops or every job of the batch was cancelled (a cancelled
        job leaves ``live``)."""
        engine, metrics = self.engine, self.engine.metrics
        last = [time.perf_counter()]

        def on_step(index: int, num_steps: int, latents: Any) -> None:
            now = time.perf_counter()
            if index > 0:  # step 0's interval includes encoding the prompt
                metrics.step_seconds.labels(self.model_name).observe(now - last[0])
            last[0] = now
            for it in live:
                done = it.steps_before + index + 1
                it.job.progress = min(99, 100 * done // it.total_steps)
            if self.stopping:
                raise _Stop("server stopping")
            for it in [it for it in live if engine.cancel_requested(it.job.id)]:
                live.remove(it)
                engine.acknowledge_cancel(it.job)
            if not live:
                raise _Stop("cancelled")

        return on_step

    def _deliver(self, batch: list[_Item], live: list[_Item], frames: Any) -> None:
        """Each live job's rows of ``frames``: written as its outputs, or handed to its next
        stage (``then``); a job cancelled during decoding is acknowledged instead."""
        engine, row = self.engine, 0
        for item in batch:
            rows = frames[row:row + item.rows]
            row += item.rows
            if item not in live:
                continue
            if engine.cancel_requested(item.job.id):  # cancelled during decoding
                engine.acknowledge_cancel(item.job)
                continue
            try:
                if item.then is not None:
                    item.then(rows)
                else:
                    engine.complete(item.job, engine.write_outputs(item.job, rows, item.fps))
            except ServeError as exc:
                engine.fail(item.job, exc.code or "stage_failed", exc.message)
            except Exception as exc:  # writing the output failed (disk full, ...)
                engine.fail(item.job, "output_failed", f"{type(exc).__name__}: {exc}")


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """(error code, message) for an exception raised while a job ran: ``out_of_memory`` for
    torch's ``OutOfMemoryError``, ``MemoryError`` and the CPU allocator's "can't allocate
    memory" RuntimeError; ``generation_failed`` otherwise. The message names the exception."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > 2000:
        text = text[:2000] + " ..."
    if is_out_of_memory(exc):
        return "out_of_memory", (f"out of memory: {text}; try a smaller size, fewer frames or "
                                 "fewer images per request")
    return "generation_failed", text


def free_memory() -> None:
    """Collect garbage and return torch's cached GPU memory (after a run, a failure, a cancel)."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class ServedModel:
    """One entry of ``GET /v1/models``."""

    id: str
    kind: str
    tasks: list[str]
    card: dict[str, Any]
    provenance: dict[str, Any]
    created: int


class Engine:
    """Everything ``flowseam serve`` runs, without HTTP.

    :param models: served model id → loaded model (each gets one :class:`ModelWorker`).
    :param output_dir: where the job table (``jobs.sqlite3``), ``videos/`` and ``images/`` go.
    :param workflow: ``(workflow id, Workflow, t2i model id, i2v model id)`` to serve a
        cross-model workflow as one more model id, or None.
    :param max_queue: jobs that may wait per model; one more is a :class:`QueueFull` (429).
    :param max_batch: samples one loop run may hold (1 turns batching off).
    :param expire_after: seconds a finished job's outputs and row are kept.
    :param run: what runs a loop (``run_loop``'s signature); default
        :func:`flowseam.loops.run_loop`. ``flowseam serve --nproc`` passes
        :meth:`flowseam.serve.ranks.RankRelay.run`, which runs it on every rank.
    """

    def __init__(self, models: dict[str, "ModelInstance"], output_dir: str | Path, *,
                 workflow: tuple[str, "Workflow", str, str] | None = None, max_queue: int = 64,
                 max_batch: int = 8, expire_after: float = 86400.0,
                 run: Callable[..., Any] | None = None) -> None:
        self.run = run
        self.output_dir = Path(output_dir)
        self.models = dict(models)
        self.workflow = workflow
        self.max_queue, self.max_batch, self.expire_after = max_queue, max_batch, expire_after
        self.store = JobStore(self.output_dir / "jobs.sqlite3")
        self.workers = {name: ModelWorker(name, model, self) for name, model in models.items()}
        self.metrics = ServeMetrics(self.workers, self.store.counts)
        self._lock = threading.RLock()
        self._active: dict[str, Job] = {}
        self._cancel: set[str] = set()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="flowseam-expiry", daemon=True)
        self.started_at = int(time.time())
        self.restarted_jobs: list[str] = []

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Mark jobs a previous server left unfinished as failed, start workers and expiry.

        Unfinished jobs are failed ("server restarted"), not re-queued: their clients have
        usually given up, and a re-run would need every request's uploads kept on disk."""
        self.restarted_jobs = self.store.fail_unfinished(
            "server restarted: the job was queued or running when the previous server stopped; "
            "submit it again")
        if self.restarted_jobs:
            log.warning("marked %d unfinished job(s) of a previous server failed",
                        len(self.restarted_jobs))
        self._expire(time.time())
        for worker in self.workers.values():
            worker.start()
        self._reaper.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop at the next step boundary: running and queued jobs fail ("server stopped")."""
        self._stopping.set()
        for worker in self.workers.values():
            worker.stop()
        for worker in self.workers.values():
            if worker.is_alive():
                worker.join(timeout)
        self._reaper.join(timeout)
        self.store.close()

    def healthy(self) -> dict[str, str]:
        """model id → ``"ok"`` or why its worker is not running."""
        return {name: "ok" if w.is_alive() else f"worker stopped: {w.error or 'not started'}"
                for name, w in self.workers.items()}

    # -- what /v1/models lists ---------------------------------------------------------------
    def served(self) -> list[ServedModel]:
        out = []
        for name, model in self.models.items():
            card = model.card
            components = {
                n: {"kind": r.kind, "device": r.device, "plugin": r.plugin,
                    "fallback": r.fallback, "reason": r.reason}
                for n, r in model.component_records.items()}
            kernels = {op: k.impl_id for op, k in model.platform.kernels.resolved().items()}
            out.append(ServedModel(
                id=name, kind="model", tasks=[t.value for t in card.tasks],
                card={"name": card.name, "pipeline_class": card.pipeline_class,
                      "loops": list(card.loops), "defaults": dict(card.defaults),
                      "rules": list(card.rules)},
                provenance={"checkpoint": str(model.path) if model.path else None,
                            "platform": model.platform.name,
                            "device_chain": list(model.platform.device_chain),
                            "components": components, "kernels": kernels,
                            "summary": model.provenance()},
                created=self.started_at))
        if self.workflow is not None:
            wf_id, wf, t2i, i2v = self.workflow
            out.append(ServedModel(
                id=wf_id, kind="workflow", tasks=["t2v"],
                card={"name": wf.name, "stages": [t2i, i2v]},
                provenance={"stages": {t2i: self.models[t2i].provenance(),
                                       i2v: self.models[i2v].provenance()}},
                created=self.started_at))
        return out

    # -- submitting --------------------------------------------------------------------------
    def submit(self, req: JobRequest) -> Job:
        """Check ``req``, write its job row and queue it.

        :raises BadRequest: for a value the card refuses, an unknown model or a model that does
            not serve the request's task (the message names the field).
        :raises QueueFull: when the model's queue is full.
        :raises Unavailable: when the server is stopping or the model's worker stopped.
        """
        if self._stopping.is_set():
            raise Unavailable("the server is shutting down")
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        try:  # DiffusionParams refuses non-finite and out-of-range values (naming the field)
            params = req.params(seed)
        except ValueError as exc:
            raise BadRequest(str(exc), param=_api_field(str(exc))) from None
        target = self._target(req)
        if params.lora:
            if self.workflow is not None and target == self.workflow[0]:
                raise BadRequest("lora: a workflow job runs two models; send LoRA requests to "
                                 "one model", param="lora")
            params = params.replace(lora=_loaded_loras(self.models[target], params.lora))
        job = Job(id=new_job_id(req.kind), kind=req.kind, model=target, prompt=req.prompt,
                  status="queued", params={})
        if self.workflow is not None and target == self.workflow[0]:
            return self._submit_workflow(req, job, params, seed)
        model = self.models[target]
        request = GenerationRequest(prompt=[req.prompt] * req.n, task=model.card.task,
                                    params=params, image=req.image,
                                    seeds=[seed + i for i in range(req.n)])
        filled = _check(model, request, req)
        request.params = filled
        job.params = self._describe(req, filled, seed)
        item = _Item(job=job, request=request, key=_batch_key(target, request), steps_before=0,
                     total_steps=filled.num_steps, fps=req.fps)
        self._enqueue(target, item)
        return job

    def _submit_workflow(self, req: JobRequest, job: Job, params: DiffusionParams,
                         seed: int) -> Job:
        """Queue a ``t2i-i2v`` job: an image stage on the text-to-image model's worker, whose
        frame becomes the first frame of a video stage queued on the image-to-video model's
        worker (``then``). Both stages are checked now; progress counts the steps of both."""
        wf_id, workflow, t2i_id, i2v_id = self.workflow
        if req.image is not None:
            raise BadRequest(f"input_reference: the {wf_id} workflow draws its own first frame; "
                             f"send the image to the image-to-video model {i2v_id!r} instead",
                             param="input_reference")
        if req.n != 1:
            raise BadRequest(f"n={req.n}: a {wf_id} job makes one video", param="n")
        image_params, video_params = workflow.stage_params(params)
        first, second = workflow.requests(req.prompt, image_params, video_params, seed=seed)
        first.params = _check(self.models[t2i_id], first, req)
        # the video stage is checked now with a stand-in first frame (check() reads no pixels);
        # the real one is stage 1's output
        second.image = np.zeros((8, 8, 3), np.float32)
        second.params = _check(self.models[i2v_id], second, req)
        second.image = None
        total = first.params.num_steps + second.params.num_steps
        job.params = self._describe(req, second.params, seed)

        def then(frames: np.ndarray) -> None:
            second.image = frames[0, 0]
            stage2 = _Item(job=job, request=second, key=None, steps_before=first.params.num_steps,
                           total_steps=total, fps=req.fps)
            self.workers[i2v_id].enqueue(stage2, limit=None, accept=lambda: None)

        item = _Item(job=job, request=first, key=_batch_key(t2i_id, first), steps_before=0,
                     total_steps=total, then=then, fps=req.fps)
        self._enqueue(t2i_id, item)
        return job

    def _enqueue(self, worker: str, item: _Item) -> None:
        job = item.job

        def accept() -> None:
            self.store.insert(job)
            with self._lock:
                self._active[job.id] = job
                self._futures[job.id] = concurrent.futures.Future()

        self.workers[worker].enqueue(item, limit=self.max_queue, accept=accept)

    def _target(self, req: JobRequest) -> str:
        """The served id that runs ``req``. :raises BadRequest: naming ``model``."""
        wf_id = self.workflow[0] if self.workflow is not None else None
        if req.kind == "image":
            wanted = [TaskType.T2I]
        elif req.image is not None:
            wanted = [TaskType.I2V]
        else:
            wanted = [TaskType.T2V]
        fits = [n for n, m in self.models.items() if m.card.task in wanted]
        if req.model is None:
            if req.kind == "video" and req.image is None and wf_id is not None:
                return wf_id
            if len(fits) == 1:
                return fits[0]
            what = {"image": "text-to-image", "video": "image-to-video" if req.image is not None
                    else "text-to-video"}[req.kind]
            raise BadRequest(f"model: give one; the {what} models served here are {fits}"
                             if fits else f"model: no {what} model is served here; served: "
                             f"{self.ids()}", param="model")
        if req.model == wf_id and wf_id is not None:
            if req.kind == "video":
                return wf_id
            raise BadRequest(f"model={req.model!r} is a workflow that makes videos; use "
                             "POST /v1/videos", param="model")
        if req.model not in self.models:
            raise BadRequest(f"model={req.model!r} is not served here; served: {self.ids()}",
                             param="model", code="model_not_found")
        task = self.models[req.model].card.task
        if task not in wanted:
            if req.kind == "image":
                why = f"it makes {task.value} output; images come from text-to-image models"
            elif task is TaskType.I2V:
                why = "it is image-to-video: send input_reference"
            elif task is TaskType.T2V:
                why = "it is text-to-video and takes no input_reference"
            else:
                why = "it makes images: use POST /v1/images/generations"
            raise BadRequest(f"model={req.model!r} cannot serve this request: {why}",
                             param="input_reference" if "input_reference" in why else "model")
        return req.model

    def _describe(self, req: JobRequest, filled: DiffusionParams, seed: int) -> dict[str, Any]:
        frames = filled.num_frames or 1
        return {"size": f"{filled.width}x{filled.height}", "frames": frames, "fps": req.fps,
                "seconds": str(req.seconds) if req.seconds is not None
                else f"{frames / req.fps:g}", "steps": filled.num_steps, "seed": seed, "n": req.n,
                "guidance_scale": filled.guidance_scale, "flow_shift": filled.flow_shift,
                "negative_prompt": filled.negative_prompt,
                "image_to_video": req.image is not None,
                "lora": [{"name": Path(s.path).name, "weight": s.weight, "expert": s.expert}
                         for s in filled.lora],
                "cache": None if filled.cache is None else str(filled.cache)}

    # -- reading ---------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return [m.id for m in self.served()] if self.workflow else list(self.models)

    def get(self, job_id: str) -> Job | None:
        """The job (live progress while it runs), or None if there is no such job."""
        with self._lock:
            job = self._active.get(job_id)
        return job if job is not None else self.store.get(job_id)

    def future(self, job_id: str) -> concurrent.futures.Future:
        """A future resolved with the finished :class:`Job` (done at once if it is finished)."""
        with self._lock:
            fut = self._futures.get(job_id)
        if fut is None:
            fut = concurrent.futures.Future()
            fut.set_result(self.get(job_id))
        return fut

    def output_path(self, job: Job, index: int = 0) -> Path:
        """The file of a completed job's output ``index`` (a name the server made)."""
        return self.output_dir / job.outputs[index]

    # -- cancelling and deleting ---------------------------------------------------------------
    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancel

    def delete(self, job_id: str) -> Job:
        """Cancel a queued or running job (it stops at the next step boundary) or delete a
        finished one's outputs. Either way the job is gone from the API.

        A cancelled job that shares a batched run drops out of its results at once while the
        other jobs' samples finish; its memory is freed when the run ends. A run whose every job
        was cancelled stops at the next step boundary and frees everything.

        :raises NotFound: if there is no such job (or it is already gone).
        """
        job = self.get(job_id)
        if job is None or job.status in ("cancelled", "deleted", "expired"):
            raise NotFound(f"no video {job_id!r}" if job is None else
                           f"video {job_id!r} was {job.status} already", param="video_id")
        if not job.finished:
            with self._lock:
                self._cancel.add(job_id)
            if any(w.remove(job_id) for w in self.workers.values()):
                self.acknowledge_cancel(job)  # it was waiting in a queue
            else:  # a worker holds it: it lets go at the next step boundary; the API hides it now
                job.status = "cancelled"
                self.store.update(job, "status")
            return job
        self._remove_outputs(job)
        job.status = "deleted"
        self.store.update(job, "status", "outputs")
        return job

    def acknowledge_cancel(self, job: Job) -> None:
        """The worker let go of a cancelled job (or it was still queued)."""
        with self._lock:
            if job.id not in self._active:  # acknowledged already
                return
        job.status, job.completed_at = "cancelled", time.time()
        job.expires_at = job.completed_at + self.expire_after
        self.store.update(job, "status", "completed_at", "expires_at")
        self._finished(job)

    # -- what workers report ------------------------------------------------------------------
    def started(self, job: Job) -> None:
        if job.status == "queued":
            job.status, job.started_at = "in_progress", time.time()
            self.store.update(job, "status", "started_at")

    def complete(self, job: Job, outputs: list[str]) -> None:
        if self.cancel_requested(job.id):  # cancelled while its outputs were written
            job.outputs = outputs
            self._remove_outputs(job)
            self.acknowledge_cancel(job)
            return
        job.status, job.progress, job.outputs = "completed", 100, outputs
        job.completed_at = time.time()
        job.expires_at = job.completed_at + self.expire_after
        self.store.update(job, "status", "progress", "outputs", "completed_at", "expires_at")
        self._finished(job)

    def fail(self, job: Job, code: str, message: str) -> None:
        if self.cancel_requested(job.id):  # it was cancelled; that is what it ends as
            self.acknowledge_cancel(job)
            return
        if job.finished:
            return
        job.status, job.error_code, job.error_message = "failed", code, message
        job.completed_at = time.time()
        job.expires_at = job.completed_at + self.expire_after
        self.store.update(job, "status", "error_code", "error_message", "completed_at",
                          "expires_at", "progress")
        self._finished(job)

    def _finished(self, job: Job) -> None:
        with self._lock:
            self._active.pop(job.id, None)
            self._cancel.discard(job.id)
            fut = self._futures.pop(job.id, None)
        self.metrics.finished.labels(job.model, job.status).inc()
        if fut is not None and not fut.done():
            fut.set_result(job)

    def write_outputs(self, job: Job, frames: np.ndarray, fps: int) -> list[str]:
        """Write a job's frames ``(n, F, H, W, 3)`` in [0, 1] with :func:`media.write_output`:
        ``images/<id>-<i>.png`` per image, or ``videos/<id>.mp4``; returns the relative names."""
        if job.kind == "image":
            names = [f"images/{job.id}-{i}.png" for i in range(frames.shape[0])]
            for name, image in zip(names, frames):
                media.write_output(self.output_dir / name, image)
            return names
        name = f"videos/{job.id}.mp4"
        media.write_output(self.output_dir / name, frames[0], fps=fps)
        return [name]

    # -- expiry ------------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        interval = min(60.0, max(0.5, self.expire_after / 4))
        while not self._stopping.wait(interval):
            try:
                self._expire(time.time())
            except Exception:  # never let expiry take the server down; say so
                log.exception("expiring finished jobs failed")

    def _expire(self, now: float) -> None:
        for job in self.store.expired(now):
            self._remove_outputs(job)
            job.status = "expired"
            self.store.update(job, "status", "outputs")

    def _remove_outputs(self, job: Job) -> None:
        for name in job.outputs:
            (self.output_dir / name).unlink(missing_ok=True)
        job.outputs = []


def _check(model: "ModelInstance", request: GenerationRequest, req: JobRequest) -> DiffusionParams:
    """``model.validate(request)`` (the card's rules and, for a model split over ranks, what the
    split divides) as a :class:`BadRequest` naming the API field (``seconds`` when the frame count
    came from it)."""
    try:
        return model.validate(request)
    except ValueError as exc:
        message, param = str(exc), _api_field(str(exc))
        if param == "frames" and req.seconds is not None:
            message = (f"seconds={req.seconds} at fps={req.fps} makes {req.frames} frames "
                       f"(seconds * fps + 1): {message}")
            param = "seconds"
        raise BadRequest(message, param=param) from None


#: DiffusionParams field → the API field it comes from
_API_FIELDS = {"num_steps": "steps", "num_frames": "frames", "height": "size", "width": "size",
               "image": "input_reference", "prompt": "prompt"}


def _api_field(message: str) -> str | None:
    name = message.split("=", 1)[0].split(" ", 1)[0] if "=" in message.split(" ", 1)[0] else None
    if name is None:
        return None
    return _API_FIELDS.get(name, name)


def _loaded_loras(model: "ModelInstance", specs: tuple) -> tuple:
    """A request's LoRA set with each file resolved to one the server loaded at start
    (``flowseam serve --lora``), named by its path or its file name; the server never reads a
    path a client sends.

    :raises BadRequest: for a file the model has not loaded.
    """
    loaded = [Path(a.path) for a in model.adapters.loaded.values()]
    out = []
    for spec in specs:
        match = [p for p in loaded if spec.path in (str(p), p.name)]
        if not match:
            raise BadRequest(f"lora {spec.path!r} is not loaded for {model.card.name} on this "
                             f"server; loaded: {[p.name for p in loaded] or 'none'} (start "
                             "flowseam serve with --lora PATH)", param="lora")
        out.append(dataclasses.replace(spec, path=str(match[0])))
    return tuple(out)


def _batch_key(model: str, request: GenerationRequest) -> tuple | None:
    """Requests with equal keys run as one batch: same model and parameters but the seed."""
    if request.image is not None:
        return None
    return (model, request.task, request.params.replace(seed=None))
