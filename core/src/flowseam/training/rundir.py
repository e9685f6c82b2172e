"""A training run's ``output_dir``: one run at a time, one config per directory.

* **Lock.** A run holds an exclusive ``flock`` on ``output_dir/.lock`` (which records its pid,
  host and start time) from its first step to its end. A second run on the same directory is
  refused, naming the first's pid; the lock dies with its process (``kill -9`` included), so a
  crashed run never blocks its resume.
* **Config.** The first run writes ``output_dir/run.json`` (the method and its validated config).
  A later run on the same directory (a resume) must have the same config in everything but
  ``steps``: otherwise it is refused, listing the differing keys with both values, so that
  metrics and checkpoints of two configs never mix. Start a new ``output_dir`` to change one.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from ..errors import FlowseamError

LOCK_FILE = ".lock"
RUN_FILE = "run.json"

#: Config keys a resumed run may change: how far to train, where the directory is, how long a
#: reward call may take (a run stopped by a reward timeout resumes with a larger one), and where
#: its metrics are logged; none of them changes what a step computes.
RESUMABLE_KEYS = ("steps", "output_dir", "reward_timeout", "logging")


class RunLock:
    """An exclusive lock on ``output_dir`` (``flock`` on ``output_dir/.lock``).

    :raises FlowseamError: from :meth:`acquire`, naming the holder's pid, when another process
        holds it.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    def _refuse(self, fd: int) -> None:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FlowseamError(
            f"output_dir {self.path.parent} is in use by another run ({holder}); wait for it "
            "to finish, or give this run another output_dir") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def check_free(self) -> None:
        """Fail now (before any model loads) if another run holds the lock; creates nothing
        (a run refused later, by a bad config, leaves no ``output_dir`` behind) and holds
        nothing."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(fd)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _normalise(config: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON round trip (tuples become lists, objects their ``str``), so that a config compares
    equal to what :func:`record_config` wrote."""
    return json.loads(json.dumps(dict(config), default=str, sort_keys=True))


def config_changes(output_dir: str | os.PathLike, method: str, config: Mapping[str, Any]) -> list[str]:
    """How ``config`` differs from the one ``output_dir/run.json`` records, ignoring
    :data:`RESUMABLE_KEYS`: ``["optim.lr: 0.0001 -> 0.0002", ...]`` (empty when the file does not
    exist yet or everything matches).

    :raises FlowseamError: if ``run.json`` is unreadable.
    """
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return []
    try:
        recorded = json.loads(path.read_text())
        old_method, old = recorded["method"], recorded["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlowseamError(f"{path} is unreadable ({exc}); it records which config this "
                            "output_dir belongs to. Fix or remove it, or use another output_dir") from exc
    changes = [f"method: {old_method!r} -> {method!r}"] if old_method != method else []
    before, after = _flatten(old), _flatten(_normalise(config))
    for key in sorted(set(before) | set(after)):
        if key.split(".")[0] in RESUMABLE_KEYS:
            continue
        a, b = before.get(key, "<unset>"), after.get(key, "<unset>")
        if a != b:
            changes.append(f"{key}: {a!r} -> {b!r}")
    return changes


def check_config(output_dir: str | os.PathLike, method: str, config: Mapping[str, Any]) -> None:
    """Refuse a run whose config differs from the one ``output_dir`` was started with.

    :raises FlowseamError: listing every differing key (recorded value -> this run's).
    """
    changes = config_changes(output_dir, method, config)
    if changes:
        raise FlowseamError(
            f"output_dir {output_dir} belongs to a run with another config ({RUN_FILE}); a run "
            f"resumes only with the same config except {', '.join(RESUMABLE_KEYS)}. Differences: "
            + "; ".join(changes) + ". Use a new output_dir for a new config")


def record_config(output_dir: str | os.PathLike, method: str, config: Mapping[str, Any]) -> None:
    """Write ``output_dir/run.json`` (atomically) unless it exists."""
    path = Path(output_dir) / RUN_FILE
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run.", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump({"method": method, "config": _normalise(config)}, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
