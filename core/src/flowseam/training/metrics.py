"""Per-step training metrics: JSON lines on disk and a progress bar on the console.

Each record is written as one whole line by one ``write`` system call on a file opened with
``O_APPEND``; a short write (a full disk) stops the run with "no space left on device" naming the
file. What a crash or a full disk can leave is an incomplete last line without its newline:
:func:`read_metrics` drops it (with a warning naming the file and line) so that a resume is never
blocked by it, and refuses a damaged line anywhere else, naming the file and line number.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..errors import FlowseamError
from ..media import disk_error


class MetricsWriter:
    """Append one JSON object per training step to ``path``, one whole line per write.

    Non-finite floats are written as null (JSON has no NaN).

    :raises FlowseamError: from :meth:`write`, "no space left on device" naming the file.
    """

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        data = (json.dumps(clean, default=float) + "\n").encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a short write: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            raise (disk_error(exc, self.path) or exc) from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``.

    An incomplete last line (no newline at the end of the file: a run killed or out of disk
    mid-write) is dropped with a warning naming the file and line.

    :raises FlowseamError: for a damaged line anywhere else, naming the file and line number.
    """
    path = Path(path)
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    torn = lines.pop() if lines else ""  # what follows the last newline ("" when it ends in one)
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise FlowseamError(f"{path}:{n}: damaged metrics line ({exc}): {line[:80]!r}; fix or "
                                "delete that line") from None
        if not isinstance(record, dict):
            raise FlowseamError(f"{path}:{n}: a metrics line must be a JSON object, got {line[:80]!r}")
        records.append(record)
    if torn.strip():
        warnings.warn(f"{path}:{len(lines) + 1}: incomplete last line (the run stopped while "
                      f"writing it) dropped: {torn[:80]!r}", stacklevel=2)
    return records


def rewrite_metrics(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` atomically (temporary file, then rename).

    :raises FlowseamError: "no space left on device" naming the file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".metrics.", suffix=".jsonl", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise (disk_error(exc, path) or exc) from exc
