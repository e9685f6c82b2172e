"""``GET /metrics``: the server's state in Prometheus' text format (through ``prometheus_client``).

One registry per engine, never the library's global one, so two servers in one process do not
mix. The workers update the counter and histograms (:class:`ServeMetrics`: jobs finished, step
seconds, batch size); the gauges (queue depth, jobs per status, worker up, host and CUDA memory)
are read at each scrape, and the standard ``process_*`` family comes along. docs/serving.md
lists every family. The metrics see the server only through what the engine hands them (its
workers, :class:`WorkerState`, and its job counts), never the engine itself:
:mod:`flowseam.serve.engine` imports this module, and this module imports no other part of the
server.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class WorkerState(Protocol):
    """What the gauges read of one model's worker (``flowseam.serve.engine.ModelWorker``)."""

    def queue_depth(self) -> int: ...  # jobs waiting for it

    def is_alive(self) -> bool: ...  # whether its thread runs


class ServeMetrics:
    """The counters and histograms the workers update, and a collector for the rest.

    :param workers: model id → its worker, read at every scrape (the engine's own mapping, so
        the gauges follow it).
    :param job_counts: returns the job table's ``{status: number of jobs}`` (``JobStore.counts``).
    """

    def __init__(self, workers: Mapping[str, WorkerState],
                 job_counts: Callable[[], Mapping[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_seconds = Histogram("flowseam_step_seconds", "Wall time of one denoising step",
                                      ["model"], buckets=_STEP_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("flowseam_batch_size", "Samples per loop run", ["model"],
                                    buckets=_BATCH_BUCKETS, registry=self.registry)
        self.finished = Counter("flowseam_jobs_finished", "Jobs finished since the server started",
                                ["model", "status"], registry=self.registry)
        ProcessCollector(registry=self.registry)
        self.registry.register(_StateCollector(workers, job_counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges read from the server's workers and job table at scrape time."""

    def __init__(self, workers: Mapping[str, WorkerState],
                 job_counts: Callable[[], Mapping[str, int]]) -> None:
        self.workers = workers
        self.job_counts = job_counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import psutil

        depth = GaugeMetricFamily("flowseam_queue_depth", "Jobs waiting for a model's worker",
                                  labels=["model"])
        up = GaugeMetricFamily("flowseam_worker_up", "1 while the model's worker runs",
                               labels=["model"])
        for name, worker in self.workers.items():
            depth.add_metric([name], worker.queue_depth())
            up.add_metric([name], 1.0 if worker.is_alive() else 0.0)
        yield depth
        yield up
        jobs = GaugeMetricFamily("flowseam_jobs", "Jobs in the job table by status",
                                 labels=["status"])
        for status, count in self.job_counts().items():
            jobs.add_metric([status], count)
        yield jobs
        yield GaugeMetricFamily("flowseam_host_memory_rss_bytes", "Resident memory of the server",
                                value=psutil.Process().memory_info().rss)
        yield GaugeMetricFamily("flowseam_host_memory_available_bytes",
                                "Memory available on the machine",
                                value=psutil.virtual_memory().available)
        allocated = GaugeMetricFamily("flowseam_gpu_memory_allocated_bytes",
                                      "CUDA memory held by tensors", labels=["device"])
        reserved = GaugeMetricFamily("flowseam_gpu_memory_reserved_bytes",
                                     "CUDA memory reserved by torch's caching allocator",
                                     labels=["device"])
        for index, (used, held) in enumerate(_cuda_memory()):
            allocated.add_metric([f"cuda:{index}"], used)
            reserved.add_metric([f"cuda:{index}"], held)
        yield allocated
        yield reserved


def _cuda_memory() -> list[tuple[int, int]]:
    """(allocated, reserved) bytes per CUDA device; empty without CUDA (never initialises it)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [(torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
            for i in range(torch.cuda.device_count())]
