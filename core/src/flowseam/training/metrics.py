"""Per-step training metrics: JSON lines on disk and a progress bar on the console."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Append one JSON object per training step to ``path`` (flushed every line).

    Non-finite floats are written as null (JSON has no NaN).
    """

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean, default=float) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
