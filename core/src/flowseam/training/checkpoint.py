"""Training checkpoints, written atomically.

A checkpoint is a directory ``step-<N>/`` holding ``weights-<name>.safetensors`` per trained
module, ``optimizer-<name>.pt``, ``rng.pt`` (torch, numpy and Python RNG states) and
``state.json`` (step, weights versions, anything the method adds). It is written into a
temporary sibling directory, fsynced, and renamed into place; then ``latest`` (a one-line file
naming it) is replaced atomically. A crash at any point leaves the previous checkpoint and
``latest`` intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..errors import FlowseamError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


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
        for name, module in modules.items():
            tensors = {k: v.detach().cpu().contiguous() for k, v in module.named_parameters()
                       if v.requires_grad}
            save_file(tensors, str(tmp / f"weights-{name}.safetensors"))
        for name, opt in optimizers.items():
            torch.save(opt.state_dict(), tmp / f"optimizer-{name}.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1, default=str))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names (None if there is none)."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: str | Path, modules: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """Restore modules, optimizers and RNG states from ``path``; returns ``state.json``.

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
            opt.load_state_dict(torch.load(path / f"optimizer-{name}.pt", weights_only=False))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return json.loads((path / "state.json").read_text())
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise FlowseamError(f"cannot resume from checkpoint {path}: {type(exc).__name__}: {exc}") from exc
