"""Training checkpoints, written atomically, read without running code.

A checkpoint is a directory ``step-<N>/`` holding ``weights-<name>.safetensors`` per trained
module, ``optimizer-<name>.pt`` (the optimizer's ``state_dict``: tensors and plain values),
``rng.safetensors`` + ``rng.json`` (torch, numpy and Python RNG states) and ``state.json``
(step, weights versions, anything the method adds). It is written into a temporary sibling
directory (``.step-<N>.*``), fsynced, and renamed into place; then ``latest`` (a one-line file
naming it) is replaced atomically. A crash at any point leaves the previous checkpoint and
``latest`` intact; a leftover temporary directory is removed by :func:`clean_temporaries`.

Reading never unpickles code: ``optimizer-*.pt`` is loaded with ``torch.load(...,
weights_only=True)`` (tensors, numbers, strings, lists, tuples and dicts only), everything else
is safetensors or JSON. A file that needs more (a planted pickle that would call ``os.system``)
is refused with :class:`~flowseam.errors.UnsafeCheckpointError`, naming the file and the globals
it asks for; it is never loaded.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from ..errors import FlowseamError, UnsafeCheckpointError
from ..media import disk_error

#: What ``latest`` may name: a checkpoint directory of this root, nothing else.
_STEP_DIR = re.compile(r"^step-\d{6,}$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The torch, numpy and Python RNG states as (tensors for safetensors, values for JSON)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    values = {"numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)},
              "python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    return tensors, values


def set_rng_state(tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(tensors["torch"])
    n = values["numpy"]
    np.random.set_state((n["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = values["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def load_tensors_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code.

    :raises UnsafeCheckpointError: if the file needs anything else, naming it and the globals it
        asks for (the file is not loaded).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # noqa: BLE001 - not even a torch zip: say so below
            wanted = []
        raise UnsafeCheckpointError(
            f"checkpoint file {path} needs more than tensors and plain values to load"
            + (f" (it asks for {', '.join(wanted)})" if wanted else "")
            + "; flowseam refuses to unpickle it (torch.load weights_only=True). Delete the "
            "checkpoint, or resume from one flowseam wrote") from exc


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (an OSError on a full disk)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def clean_temporaries(root: str | Path) -> list[Path]:
    """Remove what an interrupted save left in ``root``: ``.step-*`` directories and
    ``.latest.tmp``. Call it only while holding the run's lock (:mod:`.rundir`).

    :returns: the removed paths.
    """
    root = Path(root)
    removed = []
    for p in sorted(root.glob(".step-*")) + sorted(root.glob(".latest.tmp")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def save_checkpoint(root: str | Path, step: int, modules: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; keep the newest ``keep``.

    Only trainable parameters are saved for each module (a LoRA run saves its adapters).
    :returns: the checkpoint directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:06d}.", dir=root))
    try:
        # every file is serialised in memory and written by Python, so that a full disk is an
        # OSError (ENOSPC) naming the file, not a library's own error without the errno
        for name, module in modules.items():
            tensors = {k: v.detach().cpu().contiguous() for k, v in module.named_parameters()
                       if v.requires_grad}
            _write(tmp / f"weights-{name}.safetensors", safetensors_bytes(tensors))
        for name, opt in optimizers.items():
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            _write(tmp / f"optimizer-{name}.pt", buffer.getvalue())
        rng_tensors, rng_values = rng_state()
        _write(tmp / "rng.safetensors", safetensors_bytes(rng_tensors))
        _write(tmp / "rng.json", json.dumps(rng_values).encode())
        _write(tmp / "state.json", json.dumps({"step": step, **state}, indent=1, default=str).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_error(exc, tmp, "writing checkpoint") if isinstance(exc, OSError) else None
        if full is not None:
            raise full from exc
        raise
    pointer = root / ".latest.tmp"
    try:
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / "latest")
    except OSError as exc:
        pointer.unlink(missing_ok=True)
        raise (disk_error(exc, pointer, "writing checkpoint pointer") or exc) from exc
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names (None if there is none)."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not _STEP_DIR.match(name):
        raise FlowseamError(f"{pointer} names {name!r}, which is not a checkpoint directory of "
                            f"{root} (step-NNNNNN); delete or fix it")
    path = root / name
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: str | Path, modules: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """Restore modules, optimizers and RNG states from ``path``; returns ``state.json``.

    :raises UnsafeCheckpointError: for a file that needs more than tensors and plain values.
    :raises FlowseamError: naming the missing or unreadable file.
    """
    path = Path(path)
    try:
        for name, module in modules.items():
            tensors = load_file(str(path / f"weights-{name}.safetensors"))
            params = dict(module.named_parameters())
            with torch.no_grad():
                for key, value in tensors.items():
                    params[key].copy_(value)
        for name, opt in optimizers.items():
            opt.load_state_dict(load_tensors_file(path / f"optimizer-{name}.pt"))
        if not (path / "rng.safetensors").is_file() and (path / "rng.pt").is_file():
            raise UnsafeCheckpointError(
                f"checkpoint {path} keeps its RNG states in rng.pt, a pickle (written by an older "
                "flowseam); flowseam no longer unpickles it. Start a new output_dir")
        set_rng_state(load_file(str(path / "rng.safetensors")),
                      json.loads((path / "rng.json").read_text()))
        return json.loads((path / "state.json").read_text())
    except UnsafeCheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise FlowseamError(f"cannot resume from checkpoint {path}: {type(exc).__name__}: {exc}") from exc
