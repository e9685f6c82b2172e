"""The ``joint_multi_rl`` training method: Flow-GRPO over a model whose denoising steps are split
between several DiT experts (Wan2.2 A14B: ``transformer`` for the high-noise steps,
``transformer_2`` below ``boundary_ratio``), each expert trained on the steps it produced.

It rolls out and scores as ``flowgrpo`` does. Every :class:`~flowseam.loops.BehaviorRecord`
names the expert that ran its step, and before any update the step → expert map is checked
against the model's own (:func:`check_expert_map`), so a rollout is never credited to the wrong
expert. Each expert then runs its own PPO update on the picked SDE steps it produced, with its
own trainer copy, reference, optimizer, LoRA and WeightSyncPlan (``freeze`` keeps one as loaded):
the SDE window and ``timestep_fraction`` decide which experts learn. One process.

Config keys: ``flowseam train --method joint_multi_rl --show-config`` (``[experts.<name>]``
tables are named after the checkpoint's experts); what each means, and the metrics:
docs/training.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from ..errors import FlowseamError
from ..loading import load, read_json, resolve_checkpoint
from ..loops import LoopResult
from ..models import card_for_index
from ..models.instance import ModelInstance
from ..seam.platform import Platform
from ..request import TaskType
from .common import RunFiles, Stage, Timer, derive_seed, reward_summary, run_training, sync_updated
from .config import (
    LoraOverrides,
    LoraSection,
    Name,
    NonNegativeFloat,
    OptimOverrides,
    OptimSection,
    merge_overrides,
    schema_defaults,
    validate_config,
)
from .distributed import DataParallel
from .flowgrpo import FlowGRPO, SamplingSection, check_sampling, require_prompts, sampling_params
from .grpo import GroupRLConfig, GRPOConfig, UpdateStats, group_advantages, ppo_update, train_timesteps
from ..rewards.spec import RewardScores, as_reward, build_reward, check_scores


class JointSampling(SamplingSection):
    """``[sampling]``: flowgrpo's, plus ``guidance_scale_2`` (the low-noise expert's guidance)."""

    guidance_scale_2: NonNegativeFloat | None = None


class ExpertSection(OptimOverrides):
    """One ``[experts.<name>]`` table: any ``[optim]`` key for this expert alone, ``freeze``
    (keep it as loaded; it still rolls out its steps), and ``[experts.<name>.lora]`` over
    ``[lora]``."""

    freeze: bool = False
    lora: LoraOverrides = LoraOverrides()


class JointMultiRLConfig(GroupRLConfig):
    """The ``joint_multi_rl`` config (``--show-config``; docs/training.md says what each key
    means): one process, so no ``[distributed]`` or ``[ray]`` table. It is checked before any
    weights load; the ``[experts]`` names against the checkpoint's ``model_index.json``
    (:func:`expert_settings`)."""

    model: Name | None = None
    backend: Name | None = None
    sampling: JointSampling = JointSampling()
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimSection = OptimSection()
    lora: LoraSection = LoraSection()
    experts: dict[Name, ExpertSection] = {}


def expert_settings(config: dict[str, Any], experts: tuple[str, ...], optim: dict[str, Any],
                    lora: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each expert's ``{"optim", "lora", "freeze"}``: ``[optim]``/``[lora]`` overridden by its
    ``[experts.<name>]`` table (``config`` validated by :class:`JointMultiRLConfig`).

    :raises FlowseamError: for a name that is not one of ``experts``, or every expert frozen.
    """
    tables = config["experts"]
    unknown = sorted(set(tables) - set(experts))
    if unknown:
        raise FlowseamError(f"config [experts] names {unknown}, which the model does not have; its "
                            f"DiT experts are {list(experts)}")
    out = {}
    for name in experts:
        own = tables.get(name) or ExpertSection().model_dump()
        out[name] = {"optim": merge_overrides(optim, {k: own[k] for k in optim}),
                     "lora": merge_overrides(lora, own["lora"]), "freeze": own["freeze"]}
    if all(s["freeze"] for s in out.values()):
        raise FlowseamError(f"every expert is frozen ({list(experts)}): nothing would be trained; "
                            "drop freeze = true from at least one [experts.<name>] table")
    return out


def checkpoint_experts(path: str) -> tuple[str, ...]:
    """The DiT experts (component names, high-noise first) of the checkpoint at ``path``, read
    from its ``model_index.json`` without loading any weights."""
    root = resolve_checkpoint(path)
    index_file = root / "model_index.json"
    try:
        return tuple(card_for_index(read_json(index_file), str(index_file)).experts)
    except ValueError as e:
        raise FlowseamError(str(e)) from None


def check_expert_map(model: ModelInstance, result: LoopResult) -> None:
    """Assert at replay that every record names the expert that owns its timestep on ``model``
    (``model.experts.at``), as ``result.experts`` says.

    :raises FlowseamError: naming the first step whose expert disagrees.
    """
    if len(result.experts) != len(result.records):
        raise FlowseamError(f"the rollout names {len(result.experts)} experts for "
                            f"{len(result.records)} steps: it was not produced by this loop")
    for j, (rec, name) in enumerate(zip(result.records, result.experts)):
        owner = model.experts.at(rec.timestep)
        if not rec.expert == name == owner:
            raise FlowseamError(f"step {j} (timestep {float(rec.timestep.reshape(-1)[0]):.1f}) was recorded as "
                                f"produced by {rec.expert!r}, but {model.card.name} assigns it to "
                                f"{owner!r}: the rollout does not belong to this model's expert "
                                "boundary; refusing to credit the wrong expert")


class JointMultiRL(FlowGRPO):
    """Flow-GRPO over a model with N DiT experts, each trained on its own steps.
    ``JointMultiRL(config).run()``; see the module docstring. Rollout, reward and evaluation are
    ``flowgrpo``'s (one process, no fleet). Checkpoints hold every trained expert's weights and
    optimizer under its component name; a run with an ``output_dir`` ends by saving the trained
    model to ``<output_dir>/model`` (diffusers format, every expert, LoRA fused).

    :param model: an already loaded instance (else ``config["model"]`` is loaded).
    :param reward: a reward callable (else ``config["reward"]`` is built:
        :func:`~flowseam.rewards.spec.build_reward`).
    :raises FlowseamError: for an invalid config or reward spec, naming the key and what is
        allowed (before any weights load).
    """

    name = "joint_multi_rl"
    #: the config's tables (``flowseam train --method joint_multi_rl --show-config``)
    config_tables = ("sampling", "grpo", "optim", "lora")

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every config key with its default, tables as dicts (``experts`` is empty: its tables
        are named after the checkpoint's DiT experts)."""
        return schema_defaults(JointMultiRLConfig)

    def __init__(self, config: dict[str, Any], model: ModelInstance | None = None, reward=None) -> None:
        # everything that can be checked is checked before a model loads
        self.config = cfg = validate_config(JointMultiRLConfig, config)
        self.check_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        require_prompts(cfg)
        self.sampling = check_sampling(cfg["sampling"])
        sampling_params(self.sampling)  # DiffusionParams' own checks
        self.grpo = GRPOConfig(**cfg["grpo"])
        optim, lora = cfg["optim"], cfg["lora"]
        # the reward is built (and its factories' checks run) before the checkpoint is read
        self.reward = as_reward(reward, cfg["reward_timeout"]) if reward is not None else \
            build_reward(cfg["reward"], cfg["reward_args"], cfg["reward_timeout"])
        if model is None and not cfg["model"]:
            raise FlowseamError("config needs model = <checkpoint directory>")
        experts = tuple(model.experts) if model is not None else checkpoint_experts(cfg["model"])
        self.settings = expert_settings(cfg, experts, optim, lora)
        if model is None:
            model = load(cfg["model"], platform=Platform(cfg["backend"]) if cfg["backend"]
                         else Platform.detect(), dtype=cfg["dtype"])
        if TaskType.I2V in model.card.tasks:
            raise FlowseamError(f"joint_multi_rl trains text-conditioned models; {model.card.name} "
                                "needs an image per prompt")
        self.model = model
        self.dp = DataParallel.single()
        self.shard = self.dp.shard_groups(cfg["prompts_per_step"], cfg["group_size"])
        self.fleet = None
        self.stages = [Stage.create(name, model, s["optim"], s["lora"], with_reference=self.grpo.beta > 0,
                                    component=name,
                                    gradient_checkpointing=cfg["gradient_checkpointing"])
                       for name, s in self.settings.items() if not s["freeze"]]
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"], method=self.name, config=cfg)
        self.step = 0
        self.progress = True
        self.last_stats: dict[str, UpdateStats] = {}
        self.skipped_groups = 0
        self.warned_no_sde: set[str] = set()

    @classmethod
    def check_world_size(cls, config: dict[str, Any], world_size: int) -> None:
        """:raises FlowseamError: for more than one rank (``flowseam train --nproc`` calls it
        before any rank starts)."""
        if world_size > 1:
            raise FlowseamError(f"joint_multi_rl runs on one process; {world_size} ranks (--nproc / "
                                "torchrun) are not implemented for it: drop --nproc")

    # -- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One step: rollouts, rewards, advantages, one PPO update per trained expert on the
        picked SDE steps it produced, the syncs; returns its metrics (also in metrics.jsonl).

        The trained steps (``timestep_fraction`` of the SDE steps: every step, or those of
        ``[sampling] sde_window``) are picked once for the whole model; each expert's update
        (:func:`~flowseam.training.grpo.ppo_update` with ``expert=``) recomputes the log-probs of
        the picked steps it produced with the pinned kernels (C2: first-epoch ratio 1). An
        expert none of whose steps is picked is left untouched (no optimizer step, no weight
        decay); one that produced no SDE step at all is warned about once per run."""
        timer = Timer()
        cfg = self.config
        with timer("rollout"):
            trajectories, results, prompts, _ = self.rollout(self.step)
        for result in results:
            check_expert_map(self.model, result)
        with timer("reward"):
            shape = (len(self.shard.groups), len(self.shard.members))
            scores = RewardScores.cat([self.score(p, r) for p, r in zip(prompts, results)]).map(
                lambda t: t.view(shape))
            check_scores(self.reward, scores, f"step {self.step + 1}")
            rewards = scores.total
        adv, _, adv_stats = group_advantages(rewards, self.grpo)
        if adv_stats["groups_skipped_nan"]:
            self.skipped_groups += adv_stats["groups_skipped_nan"]
            warnings.warn(f"step {self.step}: reward returned NaN for {adv_stats['groups_skipped_nan']} "
                          "group(s); skipped them (no update from those samples)", stacklevel=2)
        trained = (adv != 0).any(dim=1)
        for g, traj in enumerate(trajectories):  # one batch per group (no fleet)
            traj.advantages, traj.trained = adv[g], bool(trained[g])
        # which expert got which SDE step, and which of them this step trains on
        records = results[0].records
        sde = [j for j, rec in enumerate(records) if rec.log_prob is not None]
        seed = derive_seed(cfg["seed"], self.step, 99)
        picked = [sde[k] for k in train_timesteps(len(sde), self.grpo.timestep_fraction, seed)] if sde else []
        counts = {name: {"sde_steps": sum(records[j].expert == name for j in sde),
                         "trained_steps": sum(records[j].expert == name for j in picked)}
                  for name in self.settings}
        self.warn_idle_experts(counts)
        stats: dict[str, UpdateStats] = {}
        with timer("update"):
            for stage in self.stages:
                stats[stage.name] = ppo_update(stage.trainer, stage.reference, trajectories, stage.optimizer,
                                               self.grpo, seed=seed, expert=stage.name)
        with timer("sync"):
            sync_updated(self.stages, stats)
        self.last_stats = stats
        self.step += 1
        record = {"step": self.step, **reward_summary(rewards, scores.parts), **adv_stats, "groups_skipped_nan_total": self.skipped_groups}
        for name, c in counts.items():
            record.update({f"{name}_{k}": v for k, v in c.items()})
        for stage in self.stages:
            s = stats[stage.name]
            record.update({**s.summary(f"{stage.name}_"), f"{stage.name}_updated": bool(s.grad_norms),
                           f"{stage.name}_weights_version": stage.sync.version})
        record.update({f"seconds_{k}": v for k, v in timer.seconds.items()})
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, self.stages, {"skipped_groups": self.skipped_groups})
        return record

    def warn_idle_experts(self, counts: dict[str, dict[str, int]]) -> None:
        """Warn (once per run and expert) about a trained expert that produced no SDE step."""
        for stage in self.stages:
            if counts[stage.name]["sde_steps"] == 0 and stage.name not in self.warned_no_sde:
                self.warned_no_sde.add(stage.name)
                window = self.sampling.get("sde_window")
                warnings.warn(
                    f"expert {stage.name!r} gets no SDE step (sde_window={window!r}, "
                    f"{self.sampling['num_steps']} steps, the experts switch at timestep "
                    f"{self.model.experts.boundary_timestep}): it cannot learn in this run; move the "
                    "window onto its steps or freeze it", UserWarning, stacklevel=3)

    # -- the run ----------------------------------------------------------------------------
    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps (resuming from ``output_dir``'s latest checkpoint); with an
        ``output_dir`` the run ends with its final checkpoint and the trained model in
        ``<output_dir>/model``: a diffusers-format checkpoint with every trained expert in place
        (LoRA fused; a frozen one as loaded), which ``flowseam.load`` and diffusers'
        ``WanPipeline`` read; a LoRA on ``transformer`` also as
        ``pytorch_lora_weights.safetensors`` (:mod:`flowseam.training.export`).

        :returns: ``{"steps", "records", "model", "weights_versions", "exported": {expert:
            {"model", "lora"}}}``
        """
        self.progress = progress
        records = run_training(self, self.stages, "joint_multi_rl", "reward_mean")
        exported = self.files.exported_paths()
        return {"steps": self.step, "records": records,
                "model": next((e["model"] for e in exported.values()), None),
                "weights_versions": {s.name: s.sync.version for s in self.stages},
                "exported": exported}

    def close(self) -> None:
        """Nothing to shut down (no rollout fleet)."""

