"""Pieces every RL method shares: seeds, the policy/reference/optimizer set-up of one stage,
checkpoint and metrics plumbing."""

from __future__ import annotations

import abc
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import FlowseamError, RewardServerError
from ..models.instance import ModelInstance
from ..seam.method_contract import TrainingMethod
from .distributed import DataParallel, state_checksum
from .checkpoint import (clean_temporaries, latest_checkpoint, load_checkpoint, rng_state,
                         save_checkpoint, set_rng_state)
from .guards import check_finite_weights
from .loggers import SampleTap, open_loggers
from .metrics import MetricsWriter, read_metrics, rewrite_metrics
from .rundir import RunLock, check_config, record_config
from .weight_sync import WeightRole, WeightSyncPlan



def derive_seed(base: int, *keys: int) -> int:
    """A 31-bit seed that depends only on ``(base, *keys)`` (numpy's SeedSequence), so a resumed
    run draws exactly what an uninterrupted one would."""
    return int(np.random.SeedSequence([int(base), *map(int, keys)]).generate_state(1)[0] >> 1)


@dataclass
class Stage:
    """The trainable side of one model: the trainer's policy copy of the DiT, a frozen
    reference copy (KL), an AdamW optimizer, and the WeightSyncPlan that hands the policy to the
    instance that rolls out.

    The copies are ``copy.deepcopy`` of the instance's DiT: on the accel backend, whose DiT is
    compiled in place, the copy runs eager (deepcopy drops the compiled wrapper), so updates are
    eager while rollouts are compiled; the log-probs agree to float rounding (C2 holds within
    1e-6; the conformance suite checks the rollout/recompute identity per backend)."""

    name: str
    model: ModelInstance
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    sync: WeightSyncPlan
    #: what updates run forward and backward through: the policy itself on one process, its DDP
    #: wrapper or the FSDP2-sharded policy under data parallelism (``DataParallel.wrap``)
    trainer: torch.nn.Module | None = None

    @classmethod
    def create(cls, name: str, model: ModelInstance, optim: dict[str, Any], lora: dict[str, Any],
               with_reference: bool, dp: DataParallel | None = None,
               component: str | None = None, gradient_checkpointing: bool = False) -> "Stage":
        """The stage that trains ``model.components[component]``: by default the model's one DiT
        (``model.DIT``); ``component`` names another one — one DiT expert of a multi-expert model
        (``joint_multi_rl``), or the LM of a :class:`~flowseam.prompt_refiner.PromptRefiner` (anything
        with ``components``, ``versions`` and ``bump_version``).

        :param gradient_checkpointing: the trainer's copy recomputes each block's activations
            in the backward (diffusers' ``enable_gradient_checkpointing``).

        Memory: with LoRA (``lora["rank"] > 0``, not FSDP) the trainer's and the reference's
        copies share the frozen base weights with the rollout model (only the adapters are
        copied; the base never changes), so a LoRA run holds one copy of the DiT, not three.
        With ``optim["mixed_precision"]`` (``"bf16"``, ``"fp16"``) the trained weights are
        float32 master weights and the trainer's forward runs under ``torch.autocast``.

        :raises FlowseamError: with no ``component``, for a model with several DiT experts
            (Wan2.2): a stage trains one DiT, and training only the first expert while the other
            one rolls out half of every trajectory would credit it for steps it did not produce;
            ``gradient_checkpointing`` for a module without it.
        """
        dp = dp or DataParallel.single()
        if component is None:
            if len(model.experts) > 1:
                raise FlowseamError(
                    f"{model.card.name} has {len(model.experts)} DiT experts "
                    f"({', '.join(model.experts)}); this method trains one DiT. A multi-expert "
                    "model needs a method that credits each expert for the steps it produced "
                    "(BehaviorRecord.expert): joint_multi_rl")
            component = model.DIT
        module = model.components[component]
        if lora["rank"]:
            _add_lora(module, lora)  # the rollout copy gets the same adapters (zero-initialised)
        # a model split over ranks (flowseam.parallel) copies its DiT without the split
        split = model.parallel if isinstance(model, ModelInstance) else None
        copy_of = split.unsplit_copy if split is not None else copy.deepcopy
        shared = {} if not lora["rank"] or dp.fsdp else {
            id(t): t for n, t in [*module.named_parameters(), *module.named_buffers()]
            if "lora_" not in n}  # the frozen base: the same tensors in every copy

        def clone(m: torch.nn.Module) -> torch.nn.Module:
            return copy_of(m, memo=dict(shared))

        policy = clone(module)
        reference = clone(module).requires_grad_(False) if with_reference else None
        if lora["rank"]:
            for n, p in policy.named_parameters():
                p.requires_grad_("lora_" in n)
        else:
            policy.requires_grad_(True)
        precision = optim.get("mixed_precision", "no")
        if precision != "no":  # float32 master weights, the forward under autocast
            for p in policy.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
            policy.forward = _autocast(policy.forward, precision)
        if gradient_checkpointing:
            if not hasattr(policy, "enable_gradient_checkpointing"):
                raise FlowseamError(f"gradient_checkpointing: {type(policy).__name__} has no "
                                    "enable_gradient_checkpointing()")
            policy.enable_gradient_checkpointing()
        trainer = dp.wrap(policy)  # before the optimizer: FSDP2 replaces the parameters
        if reference is not None and dp.fsdp:
            reference = dp.wrap(reference)
        trainable = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=optim["lr"], weight_decay=optim["weight_decay"],
                                      betas=(optim["beta1"], optim["beta2"]), eps=optim["adam_eps"])
        plan = WeightSyncPlan(policy, model, component, WeightRole.STUDENT)
        return cls(name, model, policy, reference, optimizer, plan, trainer)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}


def _autocast(forward: Any, precision: str) -> Any:
    """``forward`` run under ``torch.autocast`` in ``precision`` (``"bf16"``, ``"fp16"``) on
    its module's device type."""
    import functools

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        device = next(forward.__self__.parameters()).device.type
        with torch.autocast(device, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def _add_lora(module: torch.nn.Module, lora: dict[str, Any]) -> None:
    from peft import LoraConfig

    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"] or lora["rank"],
                        target_modules=list(lora["target_modules"]), init_lora_weights=True)
    module.add_adapter(config)


@dataclass
class RunFiles:
    """Where a run writes, under ``output_dir``: ``metrics.jsonl``, ``checkpoints/`` (every
    ``checkpoint_every`` steps and always at the last step), ``run.json`` and the trained model
    (:mod:`flowseam.training.export`: ``model/``, and for LoRA runs
    ``pytorch_lora_weights.safetensors``; under ``<stage>/`` for each stage of a multi-model
    method), and what ``[logging]`` asks for (``tensorboard/``, ``wandb/``:
    :mod:`.loggers`). One run at a time holds ``output_dir`` (:mod:`.rundir`).

    Constructed before any model loads: it refuses now an ``output_dir`` that another run holds,
    or that was started with another config (differing keys listed; only ``steps`` may change).

    :param dp: the run's ranks: rank 0 alone writes (and holds the lock); every rank reads the
        checkpoint it resumes from (under FSDP2 each rank then keeps its shard of it).
    :param method: the training method's name, and ``config`` its validated config (recorded in
        ``run.json``; a resume must match it).
    :ivar resumed_from: the checkpoint the run resumed from, if any.
    :ivar exported: stage name → ``{"model": dir, "lora": file}`` once the run has exported.
    :ivar loggers: the run's TensorBoard / W&B loggers while it is open (None when off).
    """

    output_dir: Path | None
    checkpoint_every: int = 0
    metrics: MetricsWriter | None = None
    timings: dict[str, float] = field(default_factory=dict)
    dp: DataParallel = field(default_factory=DataParallel.single)
    method: str = ""
    config: dict[str, Any] | None = None
    lock: RunLock | None = None
    resumed_from: Path | None = None
    exported: dict[str, dict[str, Path]] = field(default_factory=dict)
    loggers: Any = None

    @property
    def _recorded_config(self) -> dict[str, Any] | None:
        """The config ``run.json`` records and a resume must match: all but ``[logging]``
        (where a run logs does not change what it trains, so a resume may turn loggers on)."""
        if self.config is None:
            return None
        return {k: v for k, v in self.config.items() if k != "logging"}

    def __post_init__(self) -> None:
        if self.output_dir is None or not self.dp.is_main:
            return
        self.output_dir = Path(self.output_dir)
        RunLock(self.output_dir).check_free()
        if self.config is not None:
            check_config(self.output_dir, self.method, self._recorded_config)

    def begin(self) -> None:
        """Take the lock (held until :meth:`close`), record the config, and remove what an
        interrupted checkpoint save left behind."""
        if self.output_dir is None or not self.dp.is_main:
            return
        self.lock = RunLock(self.output_dir).acquire()
        if self.config is not None:
            check_config(self.output_dir, self.method, self._recorded_config)
            record_config(self.output_dir, self.method, self._recorded_config)
        if self.checkpoint_dir is not None and self.checkpoint_dir.is_dir():
            clean_temporaries(self.checkpoint_dir)

    def open(self, resumed_step: int) -> None:
        if self.output_dir is None or not self.dp.is_main:
            return
        path = self.output_dir / "metrics.jsonl"
        if resumed_step and path.is_file():  # drop lines past the checkpoint we resume from
            rewrite_metrics(path, [r for r in read_metrics(path) if r.get("step", 0) <= resumed_step])
        self.metrics = MetricsWriter(path, append=bool(resumed_step))
        self.loggers = open_loggers((self.config or {}).get("logging"), self.output_dir,
                                    resumed_step, config=self.config)

    @property
    def checkpoint_dir(self) -> Path | None:
        return None if self.output_dir is None else self.output_dir / "checkpoints"

    def resume(self, stages: list[Stage]) -> dict[str, Any] | None:
        """Load the latest checkpoint into the stages (and their rollout instances)."""
        if self.checkpoint_dir is None:
            return None
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        modules, optimizers = self.dp.checkpoint_views(stages, gather=False)
        state = load_checkpoint(path, modules, optimizers)
        self.dp.restore(stages, modules, optimizers)
        self.resumed_from = path
        for s in stages:
            # the rollout copy (and every receiver of the plan) gets the restored weights under
            # the version they had
            s.sync.version = state["sync_versions"][s.name] - 1
            s.sync.sync()
            s.model.versions[s.sync.component] = state["weights_versions"][s.name]
        return state

    def maybe_checkpoint(self, step: int, stages: list[Stage], extra: dict[str, Any],
                         final: bool = False) -> Path | None:
        """Save checkpoint ``step`` if it is due (every ``checkpoint_every`` steps), or, with
        ``final``, unless this run already saved it or resumed from it; never with non-finite
        weights. Every rank calls it (and every rank decides alike: under FSDP2 the weights are
        gathered from all of them); rank 0 writes.

        :raises NonFiniteTrainingError: if a trainable weight is NaN or infinite (nothing written).
        """
        if self.checkpoint_dir is None:
            return None
        due = bool(self.checkpoint_every) and step % self.checkpoint_every == 0
        if final:
            if due or (self.resumed_from is not None
                       and self.resumed_from.name == f"step-{step:06d}"):
                return None
        elif not due:
            return None
        modules, optimizers = self.dp.checkpoint_views(stages, gather=True)  # every rank
        if not self.dp.is_main:
            return None
        check_finite_weights(modules, f"checkpoint at step {step}")
        return save_checkpoint(
            self.checkpoint_dir, step, modules, optimizers,
            {"sync_versions": {s.name: s.sync.version for s in stages},
             "weights_versions": {s.name: s.model.versions[s.sync.component] for s in stages},
             **extra})

    def export(self, method: str, step: int, stages: list[Stage]) -> None:
        """Write each trained diffusion model (and LoRA file) under its root (see the class
        docstring): one ``model/`` per model instance, with every component its stages trained
        (both experts of a Wan2.2 model in ``joint_multi_rl``); the root is ``output_dir`` when
        the run trains one model, else ``output_dir/<stage>``. A stage that trains something
        else (the LM of ``unified_rl``) is saved by its method. Every rank must call it: a
        sharded policy is gathered first.
        """
        from .distributed import full_state
        from .export import MODEL_DIR, export_lora, export_model, exportable_stages, has_lora

        groups: dict[int, list[Stage]] = {}
        for s in exportable_stages(stages):
            groups.setdefault(id(s.model), []).append(s)
        for group in groups.values():
            # an all-gather under FSDP2, so on every rank
            states = {s.sync.component: full_state(s.policy) for s in group}
            if self.output_dir is None or not self.dp.is_main:
                continue
            model = group[0].model
            root = self.output_dir if len(groups) == 1 else self.output_dir / group[0].name
            trained = {"method": method, "step": step,
                       "stage": ", ".join(s.name for s in group)}
            path = export_model(model, states, root / MODEL_DIR, trained)
            for s in group:
                self.exported[s.name] = {"model": path}
                if has_lora(s.policy) and s.sync.component == model.DIT:  # see export_lora
                    self.exported[s.name]["lora"] = export_lora(model, states[model.DIT], root)

    def exported_paths(self) -> dict[str, dict[str, str]]:
        """:attr:`exported` with the paths as strings (what a method's summary returns)."""
        return {stage: {k: str(v) for k, v in paths.items()} for stage, paths in self.exported.items()}

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if self.loggers is not None:
            self.loggers.log_scalars(record)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.loggers is not None:
            self.loggers.close()
            self.loggers = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class Timer:
    """Accumulates wall seconds per phase: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.t0

        return _Ctx()


class SteppedMethod(TrainingMethod):
    """A training method that runs :func:`run_training`'s outer loop (flowseam's own): it keeps
    its run's files and step count and implements :meth:`train_step`.

    :ivar files: the run directory's files (:class:`RunFiles`).
    :ivar step: the steps done (a resumed run starts at its checkpoint's).
    :ivar config: the checked config (``steps`` is the run's length).
    :ivar progress: whether :func:`run_training` shows a progress bar.
    :ivar dp: the data-parallel ranks (None: one process).
    :ivar reward: the reward the method scores with (None for a method without one).
    :ivar fleet: its Ray rollout fleet, when it rolls out on one.
    :ivar skipped_groups: groups skipped because every sample's reward was NaN, kept in its
        checkpoints (None for a method without groups).
    """

    files: "RunFiles"
    config: dict[str, Any]
    step: int = 0
    progress: bool = True
    dp: DataParallel | None = None
    reward: Any = None
    fleet: Any = None
    skipped_groups: int | None = None

    @abc.abstractmethod
    def train_step(self) -> dict[str, Any]:
        """One step; its metrics record (``step`` 1-based, written to ``metrics.jsonl``)."""


def run_training(method: SteppedMethod, stages: list[Stage], desc: str,
                 postfix: str) -> list[dict[str, Any]]:
    """The outer loop every built-in method shares: take the ``output_dir``'s lock, resume from
    ``method.files``' latest checkpoint (and say so), then call ``method.train_step()`` until
    ``method.config["steps"]`` (stopping at non-finite weights), with a progress bar showing
    ``postfix`` from each record when ``method.progress`` is set; then, with an ``output_dir``,
    save the final checkpoint and export every stage as a model (:meth:`RunFiles.export`) and
    release the lock. With ``[logging]`` samples on, ``method.reward`` is wrapped during the loop
    (:class:`~flowseam.training.loggers.SampleTap`) so that the samples a due step scores are
    logged after it.

    :raises FlowseamError: before the first step, if the run has an ``output_dir`` but a stage's
        model cannot be exported (it was not loaded from a checkpoint directory).
    :raises NonFiniteTrainingError: after a step that left a trainable weight NaN or infinite
        (before any checkpoint or export holds it).
    :raises RewardServerError: when a reward server stays down through every retry: the run
        stops with the steps done so far in a checkpoint (:func:`reward_server_stopped`).
    """
    from .export import check_exportable, exportable_stages

    if method.files.output_dir is not None:
        for s in exportable_stages(stages):
            check_exportable(s.model)
    dp = method.dp or DataParallel.single()
    records: list[dict[str, Any]] = []
    bar = tap = None
    try:
        method.files.begin()  # the output_dir's lock, held until files.close()
        state = method.files.resume(stages)
        if state is not None:
            method.step = state["step"]
            if method.skipped_groups is not None:
                method.skipped_groups = state.get("skipped_groups", 0)
            if method.progress and dp.is_main:
                print(f"{desc}: resuming from {method.files.resumed_from.name} in "
                      f"{method.files.output_dir} (step {method.step} of {method.config['steps']})")
        method.files.open(method.step)
        if method.progress and dp.is_main:
            from tqdm.auto import tqdm
            bar = tqdm(total=method.config["steps"], initial=method.step, desc=desc, unit="step")
        tap = SampleTap.attach(method)
        while method.step < method.config["steps"]:
            if tap is not None:
                tap.before_step(method.step + 1)
            rng = rng_state()  # as the step found them: a checkpoint after a failed step keeps them
            try:
                records.append(method.train_step())
            except RewardServerError as exc:
                raise reward_server_stopped(method, stages, desc, dp, rng, exc) from exc
            if tap is not None:
                tap.after_step(method.step)
            check_finite_weights({s.name: s.policy for s in stages}, f"{desc} step {method.step}")
            if bar is not None:
                bar.update(1)
                bar.set_postfix({postfix: f"{records[-1][postfix]:.4f}"})
        if bar is not None:
            bar.close()
            bar = None
        check_replicas(dp, stages)
        if method.files.output_dir is not None:  # still under the lock
            extra = {} if method.skipped_groups is None else \
                {"skipped_groups": method.skipped_groups}
            method.files.maybe_checkpoint(method.step, stages, extra, final=True)
            method.files.export(method.name, method.step, stages)
    finally:
        if tap is not None:
            tap.detach()
        if bar is not None:
            bar.close()
        method.files.close()
    return records


def reward_server_stopped(method: SteppedMethod, stages: list[Stage], desc: str, dp: DataParallel,
                          rng: tuple, exc: RewardServerError) -> RewardServerError:
    """The error that stops a run whose reward server stayed down during step
    ``method.step + 1``: ``exc``'s message, then the last complete checkpoint and how to resume.

    On one process with an ``output_dir`` the steps done so far are saved first, unless a
    checkpoint already holds them (the weights are those of step ``method.step``: rewards are
    scored before any update; the RNG states are put back to ``rng``, what that step found), so
    rerunning the same command resumes there and loses no step; nothing of the failed step is
    written. Under data parallelism only the latest checkpoint on disk is named (a save is
    collective, and the other ranks may not have failed).
    """
    files = method.files
    if files.output_dir is None:
        where = "the run has no output_dir, so no checkpoint holds its steps"
    else:
        if dp.world_size == 1 and dp.is_main and method.step > 0:
            set_rng_state(*rng)
            extra = {} if method.skipped_groups is None else \
                {"skipped_groups": method.skipped_groups}
            files.maybe_checkpoint(method.step, stages, extra, final=True)
        latest = latest_checkpoint(files.checkpoint_dir) if files.checkpoint_dir.is_dir() else None
        if latest is None:
            where = "no checkpoint was written yet; rerunning the same command starts afresh"
        else:
            step = json.loads((latest / "state.json").read_text())["step"]
            where = (f"the last complete checkpoint is {latest} (step {step}); rerun the same "
                     f"command once the server is up: it resumes from {files.output_dir}'s latest "
                     "checkpoint")
    return RewardServerError(f"{exc}; {desc} stopped before step {method.step + 1} of "
                             f"{method.config['steps']}: {where}")


def check_replicas(dp: DataParallel, stages: list[Stage]) -> None:
    """Under DDP, every rank must end with the same weights (one checksum per rank, compared).

    :raises FlowseamError: naming the ranks whose weights differ from rank 0's.
    """
    if dp.world_size == 1 or dp.fsdp:  # FSDP shards differ by design
        return
    mine = [state_checksum(s.trainable_state()) for s in stages]
    ranks = dp.gather_objects(mine)
    bad = [r for r, sums in enumerate(ranks) if sums != ranks[0]]
    if bad:
        raise FlowseamError(f"data-parallel replicas diverged: rank(s) {bad} hold different weights "
                            "from rank 0 after training")


def reward_summary(rewards: torch.Tensor,
                   parts: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """``reward_mean`` and ``reward_std`` (population) of the finite entries of ``rewards``
    (NaN when none is finite); for a weighted-sum reward also each component's
    ``reward_<label>_mean`` and ``reward_<label>_std`` over its own finite scores (``parts``:
    label → scores, :attr:`flowseam.rewards.spec.RewardScores.parts`)."""
    def stats(values: torch.Tensor) -> tuple[float, float]:
        finite = values[torch.isfinite(values)]
        if not finite.numel():
            return float("nan"), float("nan")
        return float(finite.mean()), float(finite.std(unbiased=False))

    out: dict[str, float] = {}
    for label, values in {"": rewards, **(parts or {})}.items():
        key = f"reward_{label}_" if label else "reward_"
        out[f"{key}mean"], out[f"{key}std"] = stats(values)
    return out


def sync_updated(stages: list[Stage], stats: dict[str, Any]) -> None:
    """Sync each stage whose update ran an optimizer step (``stats[name].grad_norms``)."""
    for stage in stages:
        if stats[stage.name].grad_norms:
            stage.sync.sync()
