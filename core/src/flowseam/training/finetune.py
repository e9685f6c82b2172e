"""The ``finetune`` training method: the flow-matching loss on (prompt, image or video) pairs.

For data latents ``x0`` (the VAE mean, normalised as the DiT sees latents), noise ``ε`` and a
random ``σ`` per sample (logit-normal, SD3's default, or uniform): ``x_σ = (1 - σ) x0 + σ ε`` and
the DiT is trained to predict the velocity ``ε - x0`` at timestep ``σ·1000`` (Esser et al. 2024,
"Scaling Rectified Flow Transformers", eq. 1-3; Lipman et al. 2023). The prompt is dropped
(replaced by the empty string) with probability ``p_uncond`` so the model also learns the
unconditional velocity that CFG needs.

Config::

    model = "path/to/checkpoint"
    data = "path/to/data.jsonl"   # lines {"prompt": "...", "image": "a.png"} or {"prompt": "...", "video": "v.npy"|"v.gif"|"v.mp4"}
    steps = 100
    batch_size = 4
    seed = 0
    output_dir = "runs/ft"        # metrics.jsonl, checkpoints/, and model/ (the trained checkpoint)
    checkpoint_every = 0
    [sampling] height, width, num_frames, guidance_scale (the guidance value Flux's embedding sees)
    [train]    p_uncond = 0.1, sigma_sampling = "logit_normal" | "uniform", max_grad_norm = 1.0
    [optim]    lr, weight_decay, beta1, beta2, adam_eps
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import FlowseamError
from ..loading import load
from ..models.base import ModelInstance
from ..platform import Platform
from ..request import DiffusionParams, GenerationRequest, TaskType
from .common import LORA_DEFAULTS, OPTIM_DEFAULTS, RunFiles, Stage, Timer, derive_seed, run_training
from .config import section
from .flowgrpo import check_top

TOP_DEFAULTS = dict(model=None, backend=None, data=None, steps=100, batch_size=4, seed=0,
                    output_dir=None, checkpoint_every=0, sampling={}, train={}, optim={}, lora={})
TRAIN_DEFAULTS = dict(p_uncond=0.1, sigma_sampling="logit_normal", max_grad_norm=1.0)
SAMPLING_DEFAULTS = dict(height=None, width=None, num_frames=None, guidance_scale=None)


def read_dataset(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """A JSONL dataset → ``[(prompt, frames (F, H, W, 3) float32 in [0, 1])]``.

    :raises FlowseamError: naming the file and line of a bad record or a missing media file.
    """
    import imageio.v3 as iio

    path = Path(path)
    if not path.is_file():
        raise FlowseamError(f"dataset {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = rec["prompt"]
            media = path.parent / (rec.get("image") or rec["video"])
        except (ValueError, KeyError, TypeError) as exc:
            raise FlowseamError(f"{path}:{n}: need {{'prompt', 'image' or 'video'}}: {exc}") from exc
        if not media.is_file():
            raise FlowseamError(f"{path}:{n}: media file {media} does not exist")
        data = np.load(media) if media.suffix == ".npy" else iio.imread(media)
        data = np.asarray(data)
        if data.dtype == np.uint8:
            data = data.astype(np.float32) / 255.0
        if data.ndim == 3:
            data = data[None]
        out.append((prompt, data.astype(np.float32)[..., :3]))
    if not out:
        raise FlowseamError(f"dataset {path} is empty")
    return out


class Finetune:
    """Flow-matching fine-tuning of a model's DiT. ``Finetune(config, dataset=...).run()``.

    :param dataset: ``[(prompt, frames (F, H, W, 3) in [0, 1])]``; else ``config["data"]`` is read.
    """

    name = "finetune"

    def __init__(self, config: dict[str, Any], model: ModelInstance | None = None,
                 dataset: Sequence[tuple[str, np.ndarray]] | None = None) -> None:
        self.config = cfg = check_top(config, TOP_DEFAULTS)
        self.train_cfg = section(cfg, "train", TRAIN_DEFAULTS)
        if self.train_cfg["sigma_sampling"] not in ("logit_normal", "uniform"):
            raise FlowseamError(f"sigma_sampling={self.train_cfg['sigma_sampling']!r}; allowed: "
                                "'logit_normal', 'uniform'")
        self.sampling = section(cfg, "sampling", SAMPLING_DEFAULTS)
        if model is None:
            if not cfg["model"]:
                raise FlowseamError("config needs model = <checkpoint directory>")
            model = load(cfg["model"], platform=Platform(cfg["backend"]) if cfg["backend"] else None)
        self.model = model
        self.dataset = list(dataset) if dataset is not None else read_dataset(cfg["data"] or "")
        if cfg["batch_size"] < 1:
            raise FlowseamError(f"batch_size={cfg['batch_size']} must be >= 1")
        self.stage = Stage.create("dit", model, section(cfg, "optim", OPTIM_DEFAULTS),
                                  section(cfg, "lora", LORA_DEFAULTS), with_reference=False)
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"])
        self.step = 0
        self.progress = True

    def _params(self, frames: np.ndarray) -> DiffusionParams:
        F, H, W, _ = frames.shape
        s = self.sampling
        return DiffusionParams(num_steps=1, height=s["height"] or H, width=s["width"] or W,
                               num_frames=None if self.model.card.task is TaskType.T2I else (s["num_frames"] or F),
                               guidance_scale=s["guidance_scale"])

    def loss(self, prompt: str, frames: np.ndarray, seed: int) -> torch.Tensor:
        """The flow-matching loss of one example (scalar, differentiable in the policy)."""
        model, rng = self.model, random.Random(seed)
        if rng.random() < self.train_cfg["p_uncond"]:
            prompt = ""
        image = frames[0] if TaskType.I2V in model.card.tasks else None
        request = GenerationRequest(prompt, model.card.task, self._params(frames), image=image, seeds=[seed])
        params = model.check(request)
        cond = model.encode(request, params)
        noise = model.prepare_latents(request, params, [torch.Generator().manual_seed(seed)], cond)
        x0 = model.encode_latents(frames[None], params)
        g = torch.Generator().manual_seed(seed + 1)
        if self.train_cfg["sigma_sampling"] == "logit_normal":
            sigma = torch.sigmoid(torch.randn(1, generator=g))
        else:
            sigma = torch.rand(1, generator=g)
        s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.device)
        x_t = (1.0 - s) * x0 + s * noise.to(x0.dtype)
        v = model.velocity(x_t, (sigma * 1000.0).to(x0.device), cond, params.replace(guidance_scale=params.guidance_scale
                           if model.card.task is TaskType.T2I else 1.0), dit=self.stage.policy)
        return torch.nn.functional.mse_loss(v.float(), (noise.to(x0.dtype) - x0).float())

    def train_step(self) -> dict[str, Any]:
        timer = Timer()
        cfg = self.config
        order = random.Random(derive_seed(cfg["seed"], self.step)).sample(
            range(len(self.dataset)), k=min(cfg["batch_size"], len(self.dataset)))
        with timer("update"):
            self.stage.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for i, idx in enumerate(order):
                prompt, frames = self.dataset[idx]
                loss = self.loss(prompt, frames, derive_seed(cfg["seed"], self.step, i)) / len(order)
                loss.backward()
                total += float(loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.stage.policy.parameters() if p.requires_grad], self.train_cfg["max_grad_norm"])
            self.stage.optimizer.step()
        with timer("sync"):
            self.stage.sync.sync()
        self.step += 1
        record = {"step": self.step, "loss": total, "grad_norm": float(grad_norm),
                  "weights_version": self.stage.sync.version,
                  **{f"seconds_{k}": v for k, v in timer.seconds.items()}}
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, [self.stage], {})
        return record

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps; with an ``output_dir``, save the trained checkpoint to
        ``output_dir/model`` (diffusers format, atomically)."""
        self.progress = progress
        records = run_training(self, [self.stage], "finetune", "loss")
        saved = self.save(self.files.output_dir / "model") if self.files.output_dir else None
        return {"steps": self.step, "records": records, "model": str(saved) if saved else None}

    def save(self, path: str | Path) -> Path:
        """Write the model with the trained DiT as a diffusers-format checkpoint (atomically)."""
        if self.model.path is None:
            raise FlowseamError("cannot save: the model was not loaded from a checkpoint directory")
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.model.path, tmp)
        sub = tmp / self.model.DIT
        shutil.rmtree(sub)
        self.stage.policy.save_pretrained(sub)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        return path
