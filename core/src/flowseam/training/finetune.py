"""The ``finetune`` training method: the flow-matching loss on (prompt, image or video) pairs.

For data latents ``x0`` (the VAE mean, normalised as the DiT sees latents), noise ``ε`` and a
random ``σ`` per sample (logit-normal, SD3's default, or uniform): ``x_σ = (1 - σ) x0 + σ ε`` and
the DiT is trained to predict the velocity ``ε - x0`` at timestep ``σ·1000`` (Esser et al. 2024,
"Scaling Rectified Flow Transformers", eq. 1-3; Lipman et al. 2023). The prompt is dropped with
probability ``p_uncond`` so the model also learns the unconditional velocity that CFG needs.
Every example is encoded once, before the first step (:meth:`Finetune.prepare`); a step is one
batched forward and backward of the DiT, each row drawing its dropout, noise and ``σ`` from its
own seed, so its loss does not depend on its batch (or on the rank that computes it).

Config keys: ``flowseam train --method finetune --show-config``; what each means, and the data
file's format: docs/training.md ("Config keys").
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch

from ..errors import FlowseamError, InvalidInputError
from ..loading import load
from ..models.instance import Conditioning, ModelInstance
from ..seam.platform import Platform
from ..request import DiffusionParams, GenerationRequest, TaskType
from .common import RunFiles, Stage, SteppedMethod, Timer, derive_seed, run_training
from .config import (
    ConfigSection,
    LoraSection,
    Name,
    NonNegativeFloat,
    NonNegativeInt,
    OptimSection,
    PositiveFloat,
    PositiveInt,
    RunConfig,
    UnitFloat,
    schema_defaults,
    validate_config,
)
from .distributed import DataParallel, DistributedSection, data_parallel, full_state
from .export import export_model
from .guards import clip_gradients


class TrainSection(ConfigSection):
    """``[train]``: the flow-matching loss and its optimisation."""

    p_uncond: UnitFloat = 0.1
    sigma_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    max_grad_norm: PositiveFloat = 1.0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: NonNegativeInt = 0


class FinetuneSampling(ConfigSection):
    """``[sampling]``: the size data is encoded at (None: the data's own) and Flux's guidance."""

    height: PositiveInt | None = None
    width: PositiveInt | None = None
    num_frames: PositiveInt | None = None
    guidance_scale: NonNegativeFloat | None = None
    max_sequence_length: PositiveInt | None = None


class FinetuneConfig(RunConfig):
    """The ``finetune`` config: every key with its default is what ``--show-config`` prints;
    docs/training.md says what each means."""

    model: Name | None = None
    backend: Name | None = None
    data: Name | None = None
    steps: PositiveInt = 100
    batch_size: PositiveInt = 4
    sampling: FinetuneSampling = FinetuneSampling()
    train: TrainSection = TrainSection()
    optim: OptimSection = OptimSection()
    lora: LoraSection = LoraSection()
    distributed: DistributedSection = DistributedSection()


def read_dataset(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """A JSONL dataset → ``[(prompt, frames (F, H, W, 3) float32 in [0, 1])]``.

    :raises FlowseamError: naming the file and line of a bad record or a missing media file.
    """
    import imageio.v3 as iio

    from ..media import read_image

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
        if not isinstance(prompt, str):
            raise FlowseamError(f"{path}:{n}: prompt={prompt!r} must be a string")
        if not media.is_file():
            raise FlowseamError(f"{path}:{n}: media file {media} does not exist")
        try:
            if media.suffix.lower() == ".npy":
                data = np.load(media, allow_pickle=False)  # never unpickle a data file
            elif media.suffix.lower() in (".gif", ".mp4"):
                data = iio.imread(media)
            else:  # images: every mode converted correctly, bad files refused (flowseam.media)
                data = np.asarray(read_image(media))
        except (ValueError, OSError) as exc:
            raise FlowseamError(f"{path}:{n}: cannot read {media}: {exc}") from exc
        data = np.asarray(data)
        if data.dtype == np.uint8:
            data = data.astype(np.float32) / 255.0
        if data.ndim == 3:
            data = data[None]
        if data.ndim != 4 or data.shape[-1] < 3 or not np.issubdtype(data.dtype, np.floating):
            raise FlowseamError(f"{path}:{n}: {media} holds {data.dtype} data of shape {data.shape}; "
                                "expected (F, H, W, 3) or (H, W, 3), uint8 or float in [0, 1]")
        if not np.isfinite(data).all() or data.min() < 0 or data.max() > 1:
            raise FlowseamError(f"{path}:{n}: {media} has values outside [0, 1] or non-finite ones")
        out.append((prompt, data.astype(np.float32)[..., :3]))
    if not out:
        raise FlowseamError(f"dataset {path} is empty")
    return out


@dataclass
class Example:
    """One training example, encoded once: its data latents and its conditions.

    :ivar x0: ``(1, ...)`` float32, the VAE mean as the DiT sees latents (:meth:`encode_latents`).
    :ivar cond: the condition for its prompt (text embeddings; for I2V the first frame's).
    :ivar uncond: the same with the empty prompt (the image condition kept), or None when the
        prompt is never dropped (``p_uncond = 0``).
    :ivar params: the sampling parameters it was encoded with (rows of one forward share them).
    """

    x0: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    params: DiffusionParams


class Finetune(SteppedMethod):
    """Flow-matching fine-tuning of a model's DiT. ``Finetune(config, dataset=...).run()``.

    Every example is encoded once (VAE latents, prompt embeddings and, for image-to-video, the
    image condition and image embeddings) before the first step and kept in memory; each step is
    then one batched forward and backward of the DiT over ``batch_size`` examples.

    :param dataset: ``[(prompt, frames (F, H, W, 3) in [0, 1])]``; else ``config["data"]`` is read.
    """

    name = "finetune"
    #: the config's tables (``flowseam train --method finetune --show-config``)
    config_tables = ("sampling", "train", "optim", "lora", "distributed")

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every config key with its default, tables as dicts (None: required or chosen at run
        time)."""
        return schema_defaults(FinetuneConfig)

    def __init__(self, config: dict[str, Any], model: ModelInstance | None = None,
                 dataset: Sequence[tuple[str, np.ndarray]] | None = None) -> None:
        # the config, the data and the output_dir are checked before the model loads
        self.config = cfg = validate_config(FinetuneConfig, config)
        self.train_cfg, self.sampling, self.optim = cfg["train"], cfg["sampling"], cfg["optim"]
        self.dp = data_parallel(cfg)
        self.check_world_size(cfg, self.dp.world_size)
        if model is not None:
            self.check_loop(model)
        self.dataset = list(dataset) if dataset is not None else read_dataset(cfg["data"] or "")
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"], dp=self.dp, method=self.name,
                              config=cfg)
        if model is None:
            if not cfg["model"]:
                raise FlowseamError("config needs model = <checkpoint directory>")
            model = load(cfg["model"], platform=self.dp.platform(
                lambda: Platform(cfg["backend"]) if cfg["backend"] else Platform.detect()),
                dtype=cfg["dtype"])
            self.check_loop(model)
        self.model = model
        self.stage = Stage.create("dit", model, self.optim, cfg["lora"], with_reference=False,
                                  dp=self.dp, gradient_checkpointing=cfg["gradient_checkpointing"])
        self.step = 0
        self.progress = True
        self.examples: list[Example] | None = None  # filled by prepare()

    @staticmethod
    def check_loop(model: ModelInstance) -> None:
        """:raises FlowseamError: for a model whose card runs another loop than ``flow_match``
        (finetune's loss is the bidirectional flow-matching loss)."""
        if model.card.loops[0] != "flow_match":
            raise FlowseamError(f"finetune's loss is the bidirectional flow-matching loss; "
                                f"{model.card.name} runs the {model.card.loops[0]} loop, which it "
                                "does not implement (train causal checkpoints with flowgrpo)")

    @classmethod
    def check_world_size(cls, config: dict[str, Any], world_size: int) -> None:
        """:raises FlowseamError: for an invalid config, or if ``batch_size`` does not split
        evenly over ``world_size`` ranks (checked by ``flowseam train --nproc`` before the ranks
        start)."""
        cfg = validate_config(FinetuneConfig, config)
        DataParallel(world_size=world_size).shard_rows(cfg["batch_size"])

    # -- encoding, once per example --------------------------------------------------------------
    def _params(self, frames: np.ndarray) -> DiffusionParams:
        F, H, W, _ = frames.shape
        s, t2i = self.sampling, self.model.card.task is TaskType.T2I
        # Flux's guidance is an input embedding (kept); Wan trains the plain conditional velocity.
        return DiffusionParams(num_steps=1, height=s["height"] or H, width=s["width"] or W,
                               num_frames=None if t2i else (s["num_frames"] or F),
                               guidance_scale=s["guidance_scale"] if t2i else 1.0,
                               max_sequence_length=s["max_sequence_length"])

    def _request(self, prompt: str, frames: np.ndarray) -> GenerationRequest:
        image = frames[0] if TaskType.I2V in self.model.card.tasks else None
        return GenerationRequest(prompt, self.model.card.task, self._params(frames), image=image,
                                 seeds=[0])

    def _conditions(self, prompt: str, frames: np.ndarray, with_uncond: bool
                    ) -> tuple[Conditioning, Conditioning | None, DiffusionParams]:
        model = self.model
        request = self._request(prompt, frames)
        params = model.check(request)
        cond = model.condition(request, params)
        uncond = None
        if with_uncond:
            blank = self._request("", frames)
            uncond = model.condition(blank, model.check(blank))
        return cond, uncond, params

    def encode_example(self, prompt: str, frames: np.ndarray, with_uncond: bool = True) -> Example:
        """Encode one ``(prompt, frames (F, H, W, 3))`` example (uncached)."""
        cond, uncond, params = self._conditions(prompt, frames, with_uncond)
        return Example(self.model.encode_latents(frames[None], params), cond, uncond, params)

    def prepare(self, chunk: int = 64) -> list[Example]:
        """Encode every dataset example once (idempotent): conditions one example at a time
        (text embeddings are cached per prompt), VAE latents in batches of ``chunk`` examples
        of the same shape."""
        if self.examples is not None:
            return self.examples
        with_uncond = self.train_cfg["p_uncond"] > 0
        items = range(len(self.dataset))
        if self.progress:
            from tqdm.auto import tqdm
            items = tqdm(items, desc="finetune: encode data", unit="example", leave=False)
        encoded = [self._conditions(p, f, with_uncond) for p, f in (self.dataset[i] for i in items)]
        x0: list[torch.Tensor | None] = [None] * len(self.dataset)
        by_shape: dict[tuple, list[int]] = {}
        for i, (_, frames) in enumerate(self.dataset):
            by_shape.setdefault((frames.shape, encoded[i][2]), []).append(i)
        for (_, params), idx in by_shape.items():
            for start in range(0, len(idx), chunk):
                part = idx[start:start + chunk]
                latents = self.model.encode_latents(np.stack([self.dataset[i][1] for i in part]), params)
                for i, row in zip(part, latents.split(1)):
                    x0[i] = row
        self.examples = [Example(x0[i], *encoded[i][:2], encoded[i][2]) for i in range(len(self.dataset))]
        return self.examples

    # -- the loss --------------------------------------------------------------------------------
    def batch_loss(self, examples: Sequence[Example], seeds: Sequence[int]) -> torch.Tensor:
        """The flow-matching loss of a batch of examples sharing their params (scalar, mean over
        every latent element, differentiable in the policy), in one forward of the DiT.

        Row ``b`` takes its prompt dropout, noise ``ε`` (standard normal, in the latents' layout)
        and ``σ`` from ``seeds[b]`` alone, so a row's loss does not depend on its batch.

        :raises ValueError: if the examples do not share their params.
        """
        model = self.model
        params = examples[0].params
        if any(e.params != params for e in examples):
            raise InvalidInputError(
                "a batch's examples must share their sampling params (one forward)")
        conds, noise, sigmas = [], [], []
        for e, seed in zip(examples, seeds):
            drop = random.Random(seed).random() < self.train_cfg["p_uncond"]
            if drop and e.uncond is None:
                raise InvalidInputError(
                    "this example was encoded without its unconditional condition")
            conds.append(e.uncond if drop else e.cond)
            noise.append(torch.randn(e.x0.shape, generator=torch.Generator().manual_seed(seed)))
            g = torch.Generator().manual_seed(seed + 1)
            sigmas.append(torch.sigmoid(torch.randn(1, generator=g))
                          if self.train_cfg["sigma_sampling"] == "logit_normal" else torch.rand(1, generator=g))
        x0 = torch.cat([e.x0 for e in examples])
        eps = torch.cat(noise).to(x0.device, x0.dtype)
        sigma = torch.cat(sigmas).to(x0.device)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - s) * x0 + s * eps
        v = model.velocity(x_t, sigma * 1000.0, model.stack_conditions(conds), params,
                           dit=self.stage.trainer)
        return torch.nn.functional.mse_loss(v.float(), (eps - x0).float())

    def loss(self, prompt: str, frames: np.ndarray, seed: int) -> torch.Tensor:
        """The flow-matching loss of one example (scalar, differentiable in the policy); equal to
        its row of :meth:`batch_loss` with the same seed."""
        drop = random.Random(seed).random() < self.train_cfg["p_uncond"]
        example = self.encode_example(prompt, frames, with_uncond=drop)
        if drop:
            example.cond = example.uncond
        return self.batch_loss([example], [seed])

    # -- one step ----------------------------------------------------------------------------------
    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): constant, or a linear warm-up over
        ``warmup_steps`` then a cosine decay to 0 at ``steps`` (depends on the step alone, so a
        resumed run continues the same schedule)."""
        lr, t = self.optim["lr"], self.train_cfg
        if t["lr_schedule"] == "constant":
            return lr
        if step < t["warmup_steps"]:
            return lr * (step + 1) / t["warmup_steps"]
        span = max(1, self.config["steps"] - t["warmup_steps"])
        return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - t["warmup_steps"]) / span)))

    def train_step(self) -> dict[str, Any]:
        timer = Timer()
        cfg = self.config
        with timer("encode"):
            examples = self.prepare()
        order = random.Random(derive_seed(cfg["seed"], self.step)).sample(
            range(len(examples)), k=min(cfg["batch_size"], len(examples)))
        seeds = [derive_seed(cfg["seed"], self.step, i) for i in range(len(order))]
        groups: dict[DiffusionParams, list[int]] = {}
        for i in self.dp.shard_rows(len(order), "the batch (batch_size, or the dataset size)"):
            groups.setdefault(examples[order[i]].params, []).append(i)  # this rank's rows
        if self.dp.fsdp and len(groups) > 1:  # FSDP ranks must run the same number of forwards
            raise FlowseamError("fsdp = true needs every example of a batch to have the same size "
                                f"(one forward per step); this batch has {len(groups)} sizes")
        lr = self.learning_rate(self.step)
        for group in self.stage.optimizer.param_groups:
            group["lr"] = lr
        with timer("update"):
            self.stage.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for n, rows in enumerate(groups.values()):
                with self.dp.accumulate(self.stage.trainer, sync=n == len(groups) - 1):
                    loss = self.batch_loss([examples[order[i]] for i in rows], [seeds[i] for i in rows])
                    # the batch mean; × world size because DDP/FSDP average gradients over ranks
                    loss = loss * (len(rows) / len(order)) * self.dp.world_size
                    loss.backward()
                total += float(loss.detach()) / self.dp.world_size
            total = self.dp.sum(total)
            grad_norm = clip_gradients([p for p in self.stage.policy.parameters() if p.requires_grad],
                                       self.train_cfg["max_grad_norm"], f"finetune step {self.step + 1}")
            self.stage.optimizer.step()
        with timer("sync"):
            self.stage.sync.sync()
        self.step += 1
        record = {"step": self.step, "loss": total, "grad_norm": grad_norm, "lr": lr,
                  "weights_version": self.stage.sync.version,
                  **{f"seconds_{k}": v for k, v in timer.seconds.items()}}
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, [self.stage], {})
        return record

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps; with an ``output_dir``, the run ends with its final
        checkpoint and the trained model in ``output_dir/model`` (diffusers format, atomically;
        :mod:`flowseam.training.export`)."""
        self.progress = progress and self.dp.is_main
        self.prepare()
        records = run_training(self, [self.stage], "finetune", "loss")
        exported = self.files.exported_paths()
        return {"steps": self.step, "records": records, "exported": exported,
                "model": exported.get(self.stage.name, {}).get("model")}

    def save(self, path: str | Path) -> Path:
        """Write the model with the trained DiT (LoRA merged) as a diffusers-format checkpoint
        at ``path`` (atomically). Under FSDP2 every rank must call it (the policy is gathered).

        :raises FlowseamError: if the model was not loaded from a checkpoint directory.
        """
        return export_model(self.model, {self.model.DIT: full_state(self.stage.policy)}, path,
                            {"method": self.name, "step": self.step, "stage": self.stage.name})
