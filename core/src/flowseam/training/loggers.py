"""``[logging]``: a run's metrics where users look — TensorBoard and Weights & Biases — next to
the ``metrics.jsonl`` every run with an ``output_dir`` writes.

Every numeric field of a step's record is logged as a scalar under its ``metrics.jsonl`` name and
step (:func:`scalars`); every ``samples_every`` steps, the first ``samples`` outputs the step's
reward scored are logged with their prompts and rewards, as images or GIFs (:class:`SampleTap`
catches them as the reward is called). Only rank 0 logs, and a resumed run continues the same
logs (:class:`RunLoggers`). The keys (:class:`~flowseam.training.config.LoggingSection`) and
what appears where: docs/training.md ("Logging").
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import FlowseamError

#: frames per second of the GIF a video sample is logged as
SAMPLE_FPS = 8


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a per-step record (all but ``step``) as floats: ints, floats (NaN
    stays NaN), bools (0/1) and one-element tensors; strings, lists and None are skipped."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float, np.integer, np.floating)):
            out[key] = float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
    return out


def gif_bytes(frames: np.ndarray, fps: float = SAMPLE_FPS) -> bytes:
    """``frames (F, H, W, 3)`` float in [0, 1] as an animated GIF (PIL; looping)."""
    from PIL import Image

    ims = [Image.fromarray(f) for f in _uint8(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, format="GIF", save_all=True, append_images=ims[1:],
                duration=int(round(1000 / fps)), loop=0)
    return buf.getvalue()


def _uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(np.asarray(x, dtype=np.float64) * 255), 0, 255).astype(np.uint8)


class RunLoggers:
    """The TensorBoard writer and W&B run of one run (rank 0), opened by
    :meth:`flowseam.training.common.RunFiles.open` after the run takes its ``output_dir``.

    On resume, TensorBoard hides the events past the checkpoint (``SummaryWriter(purge_step=
    ...)``), as ``metrics.jsonl`` drops those lines, and W&B continues the same run: its id is
    kept in ``output_dir/wandb/flowseam-run-id`` (W&B ignores the steps it has already seen, so
    the steps rerun after the checkpoint keep their first values there).

    :param settings: the validated ``[logging]`` section.
    :param output_dir: the run's directory (``tensorboard/`` and ``wandb/`` go under it).
    :param resumed_step: the checkpoint step the run resumed from (0: a fresh run).
    :param name: the run's name in W&B (the ``output_dir``'s name); ``config`` its config.
    :raises FlowseamError: when ``wandb.init`` fails (an online run without a W&B login).
    """

    def __init__(self, settings: dict[str, Any], output_dir: Path, resumed_step: int = 0,
                 name: str | None = None, config: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.tensorboard = self.wandb = None
        output_dir = Path(output_dir)
        if settings["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(
                log_dir=str(output_dir / "tensorboard"),
                purge_step=resumed_step + 1 if resumed_step else None)
        if settings["wandb"] != "off":
            import wandb

            wandb_dir = output_dir / "wandb"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            id_file = wandb_dir / "flowseam-run-id"
            if resumed_step and id_file.is_file():
                run_id = id_file.read_text().strip()
            else:
                run_id = uuid.uuid4().hex[:8]
                id_file.write_text(run_id + "\n")
            try:
                self.wandb = wandb.init(
                    project=settings["wandb_project"], name=name or output_dir.name, id=run_id,
                    resume="allow", mode=settings["wandb"], dir=str(output_dir),
                    config=config or {})
            except Exception as exc:
                self.close()
                raise FlowseamError(
                    f"[logging] wandb = {settings['wandb']!r}: wandb.init failed ({exc}); an "
                    "online run needs a W&B login first (wandb login, or WANDB_API_KEY), or "
                    "use wandb = \"offline\"") from exc

    @property
    def samples_every(self) -> int:
        return self.settings["samples_every"] if self.settings["samples"] else 0

    def samples_due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, the record's ``step``) logs samples."""
        every = self.samples_every
        return bool(every) and (step == 1 or step % every == 0)

    def log_scalars(self, record: dict[str, Any]) -> None:
        """Every numeric field of ``record`` (:func:`scalars`) at step ``record["step"]``."""
        step = int(record.get("step", 0))
        values = scalars(record)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_samples(self, step: int, prompts: list[str], outputs: np.ndarray,
                    rewards: list[float]) -> None:
        """``outputs (N, F, H, W, 3)`` float in [0, 1], each with its prompt and reward."""
        if not len(prompts):
            return
        captions = [f"{p} (reward {r:.4g})" for p, r in zip(prompts, rewards)]
        video = outputs.shape[1] > 1
        if self.tensorboard is not None:
            for i, sample in enumerate(outputs):
                if video:
                    self._tensorboard_gif(f"samples/{i}", sample, step)
                else:
                    self.tensorboard.add_image(f"samples/{i}", _uint8(sample[0]), step,
                                               dataformats="HWC")
            self.tensorboard.add_text("samples/captions", "\n\n".join(
                f"{i}: {c}" for i, c in enumerate(captions)), step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            if video:
                media = {"samples_video": [
                    wandb.Video(io.BytesIO(gif_bytes(s)), caption=c, format="gif")
                    for s, c in zip(outputs, captions)]}
            else:
                media = {"samples": [wandb.Image(_uint8(s[0]), caption=c)
                                     for s, c in zip(outputs, captions)]}
            self.wandb.log(media, step=step)

    def _tensorboard_gif(self, tag: str, frames: np.ndarray, step: int) -> None:
        """A video as TensorBoard's image summary holding an animated GIF (what
        ``SummaryWriter.add_video`` writes, without its moviepy dependency)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        _, h, w, c = frames.shape
        image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=gif_bytes(frames))
        self.tensorboard.file_writer.add_summary(
            Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_loggers(settings: dict[str, Any] | None, output_dir: Path | None, resumed_step: int,
                 name: str | None = None, config: dict[str, Any] | None = None) -> RunLoggers | None:
    """The run's :class:`RunLoggers`, or None when ``[logging]`` turns every logger off (or the
    run has no ``output_dir``: the config refuses loggers without one)."""
    if not settings or output_dir is None or \
            not (settings["tensorboard"] or settings["wandb"] != "off"):
        return None
    return RunLoggers(settings, output_dir, resumed_step, name, config)


class SampleTap:
    """Keeps what a method's reward scores on the steps that log samples, during
    :func:`~flowseam.training.common.run_training`'s loop: the first ``samples`` scored outputs
    ``(B, F, H, W, 3)`` of a due step, with their prompts and (total) rewards. Video or image
    outputs only (an audio reward's waveforms are not kept).

    It listens on ``method.reward``: a :class:`~flowseam.rewards.spec.Reward` (what the
    built-in methods build) gets the tap as one of its :attr:`~flowseam.rewards.spec.Reward.
    observers`; any other callable (a third-party method's) is stood in for by the tap (every
    attribute is the reward's). :meth:`detach` undoes either.
    """

    def __init__(self, method: Any, loggers: RunLoggers) -> None:
        from ..rewards.spec import Reward

        self.method, self.loggers = method, loggers
        self.reward = method.reward
        self.limit = loggers.settings["samples"]
        self.armed = False
        self.prompts: list[str] = []
        self.outputs: list[np.ndarray] = []
        self.rewards: list[float] = []
        if isinstance(self.reward, Reward):
            self.reward.observers.append(self.observe)
            self.patched = True
        else:
            method.reward = self
            self.patched = False

    @classmethod
    def attach(cls, method: Any) -> "SampleTap | None":
        """A tap on ``method.reward`` when ``method.files`` logs samples, else None (also when
        the method scores on remote reward workers: the trainer never sees those outputs)."""
        loggers = method.files.loggers
        if loggers is None or not loggers.samples_every or method.reward is None:
            return None
        if method.fleet is not None and method.fleet.reward_workers:
            return None
        return cls(method, loggers)

    def __call__(self, prompts, outputs):
        result = self.reward(prompts, outputs)
        self.keep(prompts, outputs, result)
        return result

    def observe(self, prompts, outputs, scores) -> None:
        """A :class:`~flowseam.rewards.spec.Reward` observer: keep the total's samples."""
        self.keep(prompts, outputs, scores.total)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["reward"], name)

    def keep(self, prompts, outputs, result) -> None:
        """Copy the first samples of a scored batch while armed and not yet full."""
        need = self.limit - len(self.prompts)
        if not self.armed or need <= 0:
            return
        x = np.asarray(outputs)
        if x.ndim == 4 and x.shape[-1] == 3:
            x = x[:, None]
        if x.ndim != 5 or x.shape[-1] != 3 or \
                (self.outputs and x.shape[1:] != self.outputs[0].shape[1:]):
            return
        values = torch.as_tensor(result, dtype=torch.float32).flatten().tolist()
        self.outputs.append(np.array(x[:need], dtype=np.float32))
        self.prompts += list(prompts)[:need]
        self.rewards += values[:need]

    def before_step(self, step: int) -> None:
        """Keep samples during step ``step`` (the record's step) if it logs them."""
        self.armed = self.loggers.samples_due(step)

    def after_step(self, step: int) -> None:
        """Log what step ``step`` kept, and forget it."""
        if self.armed and self.outputs:
            self.loggers.log_samples(step, self.prompts, np.concatenate(self.outputs),
                                     self.rewards)
        self.armed = False
        self.prompts, self.outputs, self.rewards = [], [], []

    def detach(self) -> None:
        """Give the method its reward back, as it was."""
        if self.patched:
            if self.observe in self.reward.observers:
                self.reward.observers.remove(self.observe)
        elif self.method.reward is self:
            self.method.reward = self.reward
