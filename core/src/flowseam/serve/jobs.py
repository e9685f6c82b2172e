"""The job table of ``flowseam serve``: one SQLite file under ``--output-dir``.

Every request (an image batch or a video) is a job row: its status, progress, error, times, the
parameters it was asked with and the files it wrote (names made by the server, relative to the
output directory, never built from user input). The table outlives the process: a restarted
server still serves completed jobs, and :meth:`JobStore.fail_unfinished` marks the jobs that were
queued or running when it stopped as failed. Thread-safe (one connection behind a lock; the HTTP
thread and every model worker write to it). Standard library only.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

#: what the API shows; ``cancelled``, ``deleted`` and ``expired`` jobs answer 404 (with the reason)
PUBLIC_STATUSES = ("queued", "in_progress", "completed", "failed")
STATUSES = PUBLIC_STATUSES + ("cancelled", "deleted", "expired")
UNFINISHED = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    error_code TEXT,
    error_message TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    expires_at REAL,
    params TEXT NOT NULL,
    outputs TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS jobs_kind_created ON jobs (kind, created_at);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
"""


def new_job_id(kind: str) -> str:
    """An opaque id: ``video_`` or ``img_`` and 32 random hex digits (``secrets``)."""
    return f"{'video' if kind == 'video' else 'img'}_{secrets.token_hex(16)}"


def valid_job_id(job_id: str) -> bool:
    """True for ids of the form :func:`new_job_id` makes (checked before any lookup)."""
    prefix, _, digits = job_id.partition("_")
    return prefix in ("video", "img") and len(digits) == 32 and all(
        c in "0123456789abcdef" for c in digits)


@dataclass
class Job:
    """One row of the table.

    :ivar kind: ``"video"`` or ``"image"``.
    :ivar params: what the request asked for and what was filled in (size, frames, fps, steps,
        seed, n, ...), JSON-serialisable.
    :ivar outputs: file names relative to the output directory (one per image; one MP4).
    :ivar progress: 0-100, from the denoising steps done (100 only when completed).
    """

    id: str
    kind: str
    model: str
    prompt: str
    status: str
    params: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    progress: int = 0
    error_code: str | None = None
    error_message: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    outputs: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED


class JobStore:
    """The SQLite job table at ``path`` (created with its folder if missing; WAL journal).

    :raises sqlite3.DatabaseError: if ``path`` exists and is not a SQLite database.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ----------------------------------------------------------------------------
    def insert(self, job: Job) -> None:
        row = asdict(job)
        row["params"], row["outputs"] = json.dumps(job.params), json.dumps(job.outputs)
        names = ", ".join(row)
        with self._lock:
            self._db.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(row))})",
                             tuple(row.values()))

    def update(self, job: Job, *names: str) -> None:
        """Write the fields ``names`` of ``job`` to its row."""
        values = [json.dumps(getattr(job, n)) if n in ("params", "outputs") else getattr(job, n)
                  for n in names]
        assignments = ", ".join(f"{n} = ?" for n in names)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job.id))

    def fail_unfinished(self, message: str, code: str = "server_restarted") -> list[str]:
        """Mark every queued or in-progress job failed with ``message``; returns their ids."""
        now = time.time()
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM jobs WHERE status IN ('queued', 'in_progress')")]
            self._db.execute(
                "UPDATE jobs SET status = 'failed', error_code = ?, error_message = ?, "
                "completed_at = ? WHERE status IN ('queued', 'in_progress')", (code, message, now))
        return ids

    # -- reads -----------------------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row is not None else None

    def list(self, kind: str, *, statuses: Iterable[str] = PUBLIC_STATUSES,
             after: str | None = None, limit: int = 20,
             order: str = "desc") -> tuple[list[Job], bool]:
        """Jobs of ``kind`` by creation time (``order`` asc|desc), starting after the job
        ``after``; returns (at most ``limit`` jobs, whether there are more)."""
        statuses = tuple(statuses)
        marks = ", ".join("?" * len(statuses))
        direction = "ASC" if order == "asc" else "DESC"
        query = f"SELECT * FROM jobs WHERE kind = ? AND status IN ({marks})"
        args: list[Any] = [kind, *statuses]
        if after is not None:
            cmp = ">" if order == "asc" else "<"
            query += (f" AND (created_at, id) {cmp} (SELECT created_at, id FROM jobs WHERE id = ?)")
            args.append(after)
        query += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def expired(self, now: float) -> list[Job]:
        """Finished jobs whose ``expires_at`` has passed (not yet marked expired)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? "
                "AND status IN ('completed', 'failed', 'cancelled')", (now,)).fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[str, int]:
        """Number of jobs per status (every status, zeros included)."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({r[0]: r[1] for r in rows})
        return counts


def _job(row: sqlite3.Row) -> Job:
    data = dict(row)
    data["params"], data["outputs"] = json.loads(data["params"]), json.loads(data["outputs"])
    return Job(**data)
