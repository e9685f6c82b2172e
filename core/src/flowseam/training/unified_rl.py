"""The ``unified_rl`` training method: a language model rewrites the user's prompt, a generator
renders the rewrite, and one reward on the output trains both.

The rollout is a tree (Tencent UniRL's layout): P prompts, N rewrites of each (the first
``unrefined_rewrites`` keep the unrefined prompt as a baseline: PromptRL's prompt retention) and
M SDE samples of every rewrite. The reward scores every output against the *user's* prompt, never
the rewrite (the rewrite is the LM's action; scoring it would let the LM rewrite the task).
Advantages are group-relative per level (:meth:`UnifiedRL.advantages`): samples within their
rewrite drive a Flow-GRPO update of the generator's DiT (as ``flowgrpo``'s), rewrites within
their prompt a GRPO update of the LM's tokens (:mod:`.lm_grpo`); both recompute the rollout's
log-probs exactly (C2). Registered through its own entry point, as a third party's would be.

Config keys: ``flowseam train --method unified_rl --show-config``; what each means, the metrics
and the method in detail: docs/training.md.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field

from ..errors import FlowseamError
from ..loading import load
from ..loops import ExecutionProfile, run_loop
from ..models.instance import ModelInstance
from ..seam.platform import Platform
from ..prompt_refiner import PromptRefiner, RefinerSampling, check_template
from ..request import GenerationRequest, TaskType
from .common import (
    RunFiles, Stage, SteppedMethod, Timer, derive_seed, reward_summary, run_training, sync_updated,
)
from .config import (
    ConfigSection,
    LoraSection,
    Name,
    Names,
    NonNegativeInt,
    OptimOverrides,
    OptimSection,
    PositiveInt,
    RewardSpec,
    RewardTimeout,
    RunConfig,
    merge_overrides,
    schema_defaults,
    validate_config,
)
from .flowgrpo import SamplingSection, check_sampling, require_prompts, sampling_params
from .grpo import GRPOConfig, Trajectory, UpdateStats, group_advantages, ppo_update
from .lm_grpo import LMGRPOConfig, lm_grpo_update
from ..rewards.spec import (
    DEFAULT_REWARD_TIMEOUT, RewardScores, as_reward, build_reward, check_scores,
)
from .workflow_rl import workflow_rollout

#: where a run's trained LM is saved, under ``output_dir``
LM_DIR = "lm"


class LMSamplingOverrides(ConfigSection):
    """``[lm_sampling]``: what replaces the LM directory's :class:`~flowseam.prompt_refiner.RefinerSampling`
    (typed here; its ranges are checked by ``RefinerSampling`` itself)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None


class UnifiedRLConfig(RunConfig):
    """The ``unified_rl`` config: every key with its default is what ``--show-config`` prints;
    docs/training.md says what each means."""

    lm_model: Name | None = None
    lm_template: str | None = None
    model: Name | None = None
    t2i_model: Name | None = None
    i2v_model: Name | None = None
    backend: Name | None = None
    prompts: Names | None = None
    reward: RewardSpec = "brightness"
    reward_args: dict[str, Any] = {}
    reward_timeout: RewardTimeout = DEFAULT_REWARD_TIMEOUT
    prompts_per_step: PositiveInt = 1
    #: N >= 2: the LM's advantage is relative to the other rewrites of the same prompt
    rewrites: Annotated[int, Field(ge=2)] = 4
    #: of the N, how many keep the unrefined prompt (< N: at least one must be the LM's)
    unrefined_rewrites: NonNegativeInt = 0
    #: M >= 2: the generator's advantage is relative to the other samples of the same rewrite
    samples_per_rewrite: Annotated[int, Field(ge=2)] = 2
    #: true: the generator renders every rollout but is not updated (the LM alone learns)
    freeze_generator: bool = False
    sampling: SamplingSection = SamplingSection()
    t2i_sampling: SamplingSection = SamplingSection()
    i2v_sampling: SamplingSection = SamplingSection()
    lm_sampling: LMSamplingOverrides = LMSamplingOverrides()
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimSection = OptimSection()
    lora: LoraSection = LoraSection()
    t2i_optim: OptimOverrides = OptimOverrides()
    i2v_optim: OptimOverrides = OptimOverrides()
    lm_grpo: LMGRPOConfig = LMGRPOConfig()
    lm_optim: OptimSection = OptimSection()


class Generator:
    """The generator side of ``unified_rl``: one text-conditioned model (stage ``dit``) or the
    t2i → i2v workflow (stages ``t2i`` and ``i2v``), with one :class:`Stage` per DiT."""

    def __init__(self, models: dict[str, ModelInstance], sampling: dict[str, dict[str, Any]],
                 optims: dict[str, dict[str, Any]], lora: dict[str, Any], grpo: GRPOConfig,
                 gradient_checkpointing: bool = False) -> None:
        self.models, self.sampling = models, sampling
        self.stages = [Stage.create(name, model, optims[name], lora, with_reference=grpo.beta > 0,
                                    gradient_checkpointing=gradient_checkpointing)
                       for name, model in models.items()]

    @property
    def workflow(self) -> bool:
        return "i2v" in self.models

    def rollout(self, prompts: list[str], seeds: list[int], sde: bool = True):
        """Render ``B`` samples (row ``k``: ``prompts[k]``, ``seeds[k]``).

        :returns: ``(pieces, frames)``: ``pieces`` lists ``(stage name, LoopResult, rows)``
            with ``rows`` the slice of the B samples the result holds; ``frames``
            ``(B, F, H, W, 3)`` float32 in [0, 1], the final outputs.
        """
        if self.workflow:
            images, videos, frames = workflow_rollout(self.models["t2i"], self.models["i2v"], prompts,
                                                      seeds, self.sampling["t2i"], self.sampling["i2v"], sde)
            rows = slice(0, len(prompts))
            return [("t2i", images, rows), ("i2v", videos, rows)], frames
        model = self.models["dit"]
        params = sampling_params(self.sampling["dit"]).replace(sde_rollout=sde)
        result = run_loop(model, GenerationRequest(list(prompts), model.card.task, params, seeds=seeds),
                          profile=ExecutionProfile.ROLLOUT if sde else ExecutionProfile.SERVE)
        return [("dit", result, slice(0, len(prompts)))], result.frames


class UnifiedRL(SteppedMethod):
    """A prompt-refining LM and the generator trained from one reward.
    ``UnifiedRL(config).run()``; see the module docstring.

    :param refiner: an already loaded :class:`PromptRefiner` (else ``config["lm_model"]``).
    :param model: an already loaded generator (else ``config["model"]``), or
    :param t2i, i2v: the two models of the t2i → i2v workflow (else ``t2i_model``/``i2v_model``).
    :param reward: a reward callable (else ``config["reward"]`` is built:
        :func:`~flowseam.rewards.spec.build_reward`, before any model loads).
    :raises FlowseamError: for an invalid config, naming the key and what is allowed (before any
        model loads).
    """

    name = "unified_rl"
    #: the config's tables (``flowseam train --method unified_rl --show-config``)
    config_tables = ("sampling", "grpo", "optim", "lora", "lm_sampling", "lm_grpo", "lm_optim")

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every config key with its default, tables as dicts, for the one-model generator
        (``model``); the workflow takes ``t2i_model``/``i2v_model`` and the per-stage tables
        instead. ``[lm_sampling]`` is empty: its defaults are the LM directory's."""
        # the workflow's per-stage tables take the same keys as [sampling] and [optim]
        return {**schema_defaults(UnifiedRLConfig), "t2i_sampling": {}, "i2v_sampling": {},
                "t2i_optim": {}, "i2v_optim": {}}

    def __init__(self, config: dict[str, Any], refiner: PromptRefiner | None = None,
                 model: ModelInstance | None = None, t2i: ModelInstance | None = None,
                 i2v: ModelInstance | None = None, reward=None) -> None:
        # everything that can be checked is checked before a model loads
        self.config = cfg = validate_config(UnifiedRLConfig, config)
        self.check_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        require_prompts(cfg)
        self.P, self.N, self.M = cfg["prompts_per_step"], cfg["rewrites"], cfg["samples_per_rewrite"]
        self.U = cfg["unrefined_rewrites"]
        if self.U > self.N - 1:
            raise FlowseamError(f"config unrefined_rewrites={self.U} must be an integer in [0, "
                                f"{self.N - 1}]: how many of the rewrites keep the unrefined "
                                "prompt; at least one must be the LM's")
        self.freeze_generator = cfg["freeze_generator"]
        workflow = bool(cfg["t2i_model"] or cfg["i2v_model"] or t2i is not None or i2v is not None)
        single = bool(cfg["model"] or model is not None)
        if workflow == single:
            raise FlowseamError("the generator is either model = <checkpoint> (a text-to-image or "
                                "text-to-video model) or t2i_model + i2v_model (the t2i-i2v "
                                "workflow); the config gives " + ("both" if single else "neither"))
        unused = ("t2i_sampling", "i2v_sampling", "t2i_optim", "i2v_optim") if single else ("sampling",)
        given = [k for k in unused if (config or {}).get(k)]
        if given:
            raise FlowseamError(f"config table(s) {given} do not apply to this generator: "
                                + ("the per-stage tables are for the t2i-i2v workflow (t2i_model + "
                                   "i2v_model); use [sampling] and [optim]" if single else
                                   "the workflow takes [t2i_sampling] and [i2v_sampling]"))
        self.grpo = GRPOConfig(**cfg["grpo"])
        self.lm_grpo = LMGRPOConfig(**cfg["lm_grpo"])
        optim, lora, lm_optim = cfg["optim"], cfg["lora"], cfg["lm_optim"]
        if single:
            sampling = {"dit": check_sampling(cfg["sampling"])}
            optims = {"dit": optim}
        else:
            sampling = {s: check_sampling(cfg[f"{s}_sampling"], f"{s}_sampling") for s in ("t2i", "i2v")}
            optims = {s: merge_overrides(optim, cfg[f"{s}_optim"]) for s in ("t2i", "i2v")}
        for table in sampling.values():
            sampling_params(table)  # DiffusionParams' own checks
        if cfg["lm_template"] is not None:
            check_template(cfg["lm_template"])
        RefinerSampling(**merge_overrides(asdict(RefinerSampling()), cfg["lm_sampling"]))  # now
        if refiner is None and not cfg["lm_model"]:
            raise FlowseamError("config needs lm_model = <directory of a transformers causal LM "
                                "and its tokenizer, written with save_pretrained>")
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"], method=self.name, config=cfg)
        # the reward is built (and its factories' checks run) before any model loads
        self.reward = as_reward(reward, cfg["reward_timeout"]) if reward is not None else \
            build_reward(cfg["reward"], cfg["reward_args"], cfg["reward_timeout"])

        # The models (after every check above).
        platform = None
        if refiner is None or (single and model is None) or (workflow and (t2i is None or i2v is None)):
            platform = Platform(cfg["backend"]) if cfg["backend"] else Platform.detect()
        if single:
            model = model or _load(cfg["model"], "model", platform, cfg["dtype"])
            if TaskType.I2V in model.card.tasks:
                raise FlowseamError(f"model: {model.card.name} needs an image per prompt; for "
                                    "image-to-video give the t2i-i2v workflow (t2i_model + i2v_model)")
            models = {"dit": model}
        else:
            t2i = t2i or _load(cfg["t2i_model"], "t2i_model", platform, cfg["dtype"])
            i2v = i2v or _load(cfg["i2v_model"], "i2v_model", platform, cfg["dtype"])
            if TaskType.T2I not in t2i.card.tasks or TaskType.I2V not in i2v.card.tasks:
                raise FlowseamError(f"the t2i-i2v workflow needs a text-to-image then an "
                                    f"image-to-video model; got {t2i.card.name} and {i2v.card.name}")
            models = {"t2i": t2i, "i2v": i2v}
        self.refiner = refiner or PromptRefiner.load(cfg["lm_model"], platform=platform)
        if cfg["lm_template"] is not None:
            self.refiner.template = cfg["lm_template"]
        self.lm_sampling = RefinerSampling(**merge_overrides(asdict(self.refiner.sampling),
                                                             cfg["lm_sampling"]))
        self.refiner.sampling = self.lm_sampling  # what the saved LM samples with

        self.generator = Generator(models, sampling, optims, lora, self.grpo,
                                   cfg["gradient_checkpointing"])
        self.lm_stage = Stage.create("lm", self.refiner, lm_optim, validate_config(LoraSection, {}),
                                     with_reference=self.lm_grpo.beta > 0,
                                     component=PromptRefiner.COMPONENT)
        self.stages = [self.lm_stage, *self.generator.stages]
        self.step = 0
        self.progress = True
        self.skipped_groups = 0
        self.last_stats: dict[str, UpdateStats] = {}
        self.last_rollout = None

    @classmethod
    def check_world_size(cls, config: dict[str, Any], world_size: int) -> None:
        """:raises FlowseamError: for more than one rank (``flowseam train --nproc`` calls it
        before any rank starts)."""
        if world_size > 1:
            raise FlowseamError(f"unified_rl runs on one process; {world_size} ranks (--nproc / "
                                "torchrun) are not implemented for it: drop --nproc")

    # -- one step ---------------------------------------------------------------------------
    def step_prompts(self, step: int) -> list[str]:
        prompts = self.config["prompts"]
        return [prompts[(step * self.P + i) % len(prompts)] for i in range(self.P)]

    def rollout(self, step: int) -> dict[str, Any]:
        """The rollout tree of step ``step``: the LM's rewrites of the refined branches (one
        batch), then per prompt the generator's N × M samples (one batch), scored against the
        prompt. Returns the prompts, the branch texts ``(P, N)``, the LM rollout, the generator
        pieces per prompt, the rewards ``(P, N, M)`` and, for a weighted-sum reward, each
        component's ``(P, N, M)`` (``reward_parts``: label → scores).

        :raises RewardFaultError: for a reward that fails, or is NaN for every sample of the step.
        """
        seed, P, N, U, M = self.config["seed"], self.P, self.N, self.U, self.M
        prompts = self.step_prompts(step)
        lm_rows = [(i, n) for i in range(P) for n in range(U, N)]
        lm = self.refiner.sample([prompts[i] for i, _ in lm_rows],
                                 [derive_seed(seed, step, i, n, 0) for i, n in lm_rows], self.lm_sampling)
        texts = [[prompts[i]] * N for i in range(P)]
        for (i, n), rewrite in zip(lm_rows, lm.rewrites):
            texts[i][n] = rewrite
        pieces, scored = [], []
        reward = as_reward(self.reward, self.config["reward_timeout"])
        for i in range(P):
            rows = [(n, k) for n in range(N) for k in range(M)]
            parts, frames = self.generator.rollout([texts[i][n] for n, _ in rows],
                                                   [derive_seed(seed, step, i, n, 1 + k) for n, k in rows])
            pieces.append(parts)
            scored.append(reward.score([prompts[i]] * len(rows), frames).map(lambda t: t.view(N, M)))
        scores = RewardScores.stack(scored)
        check_scores(reward, scores, f"step {step + 1}")
        return {"prompts": prompts, "texts": texts, "lm": lm, "lm_rows": lm_rows, "pieces": pieces,
                "rewards": scores.total, "reward_parts": scores.parts}

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Group-relative advantages of both levels from ``rewards`` ``(P, N, M)``.

        Samples are grouped by branch (rewrite): ``A_dit = (r - mean_branch) / (std_branch +
        eps)`` with ``[grpo]``'s ``eps`` and ``adv_clip_max``. Branches are scored by the mean
        reward of their M samples and grouped by prompt: ``A_lm = (s - mean_prompt) /
        (std_prompt + eps)`` over all N branches with ``[lm_grpo]``'s, the unrefined ones
        included, so a rewrite is judged against the unrefined prompt too.

        :returns: ``(sample_adv (P, N, M), rewrite_adv (P, N), stats)``; a prompt with any
            non-finite reward gets 0 everywhere (skipped at both levels).
        """
        P, N, M = rewards.shape
        finite = torch.isfinite(rewards).flatten(1).all(dim=1)
        masked = torch.where(finite[:, None, None], rewards, torch.full_like(rewards, float("nan")))
        sample_adv, _, sample_stats = group_advantages(masked.reshape(P * N, M), self.grpo)
        rewrite_adv, _, rewrite_stats = group_advantages(masked.mean(dim=2), self.lm_grpo)
        stats = {"prompts_skipped_nan": int((~finite).sum()),
                 **{f"sample_{k}": v for k, v in sample_stats.items() if k != "groups_skipped_nan"},
                 **{f"rewrite_{k}": v for k, v in rewrite_stats.items() if k != "groups_skipped_nan"}}
        return sample_adv.view(P, N, M), rewrite_adv, stats

    def train_step(self) -> dict[str, Any]:
        """One step: rollout tree, rewards, both levels' advantages, the DiT update(s), the LM
        update, the syncs; returns its metrics (also written to metrics.jsonl)."""
        timer = Timer()
        cfg, N, M = self.config, self.N, self.M
        with timer("rollout"):
            tree = self.rollout(self.step)
        rewards = tree["rewards"]
        sample_adv, rewrite_adv, adv_stats = self.advantages(rewards)
        if adv_stats["prompts_skipped_nan"]:
            self.skipped_groups += adv_stats["prompts_skipped_nan"]
            warnings.warn(f"step {self.step}: reward returned NaN for {adv_stats['prompts_skipped_nan']} "
                          "prompt(s); skipped them (no update of the LM or the generator from them)",
                          stacklevel=2)
        # The generator: samples grouped by branch.
        branch_trained = (sample_adv != 0).any(dim=2)  # (P, N)
        trajectories: dict[str, list[Trajectory]] = {s.name: [] for s in self.generator.stages}
        for i, parts in enumerate(tree["pieces"]):
            rows_adv = sample_adv[i].reshape(N * M)
            rows_trained = branch_trained[i].repeat_interleave(M)
            for stage, result, rows in parts:
                trajectories[stage].append(Trajectory(self.generator.models[stage], result,
                                                      rows_adv[rows], bool(rows_trained[rows].any())))
        stats: dict[str, UpdateStats] = {}
        with timer("update"):
            for stage in self.generator.stages:
                if self.freeze_generator:
                    stats[stage.name] = UpdateStats()  # no update, no sync: weights as loaded
                    continue
                stats[stage.name] = ppo_update(stage.trainer, stage.reference, trajectories[stage.name],
                                               stage.optimizer, self.grpo,
                                               seed=derive_seed(cfg["seed"], self.step, 99))
            # The LM: branches grouped by prompt, on the refined branches' tokens.
            lm_adv = torch.stack([rewrite_adv[i, n] for i, n in tree["lm_rows"]])
            lm_trained = torch.tensor([bool((rewrite_adv[i] != 0).any()) for i, _ in tree["lm_rows"]])
            stats["lm"] = lm_grpo_update(self.refiner, self.lm_stage.trainer, self.lm_stage.reference,
                                         tree["lm"], lm_adv, lm_trained, self.lm_stage.optimizer,
                                         self.lm_grpo)
        with timer("sync"):
            sync_updated(self.stages, stats)
        self.last_stats, self.last_rollout = stats, tree
        self.step += 1
        record = {"step": self.step, **reward_stats(rewards, self.U, tree["reward_parts"]), **adv_stats,
                  "prompts_skipped_nan_total": self.skipped_groups,
                  **{k: v for s in self.stages for k, v in stats[s.name].summary(f"{s.name}_").items()},
                  **{f"{s.name}_weights_version": s.sync.version for s in self.stages},
                  **rewrite_stats(tree["lm"], self.refiner.tokenizer.eos_token_id),
                  "example_prompt": tree["prompts"][0], "example_rewrites": tree["texts"][0],
                  **{f"seconds_{k}": v for k, v in timer.seconds.items()}}
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, self.stages, {"skipped_groups": self.skipped_groups})
        return record

    # -- the run ----------------------------------------------------------------------------
    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps (resuming from ``output_dir``'s latest checkpoint); with an
        ``output_dir``, save the trained LM (and tokenizer, template, sampling) to
        ``<output_dir>/lm``: ``PromptRefiner.load`` and ``AutoModelForCausalLM.from_pretrained``
        read it. Like every method, the run also ends with a checkpoint at its last step and
        the trained generator exported as a model (``<output_dir>/model/``; for the workflow
        ``<output_dir>/t2i/model/`` and ``<output_dir>/i2v/model/``:
        :mod:`flowseam.training.export`).

        :returns: ``{"steps", "records", "lm", "weights_versions", "exported": {stage:
            {"model", "lora"}}}``
        """
        self.progress = progress
        records = run_training(self, self.stages, "unified_rl", "reward_mean")
        saved = None
        if self.files.output_dir is not None:
            saved = self.refiner.save(self.files.output_dir / LM_DIR)
        return {"steps": self.step, "records": records, "lm": str(saved) if saved else None,
                "weights_versions": {s.name: s.sync.version for s in self.stages},
                "exported": self.files.exported_paths()}

    def evaluate(self, seeds: list[int], prompts: list[str] | None = None,
                 refine: bool = True) -> torch.Tensor:
        """Mean reward per seed: for each prompt and seed ``s`` one rewrite (LM seed
        ``derive_seed(s, 3)``; the unrefined prompt with ``refine=False``) rendered by the
        generator served (ODE) with seed ``s``, scored against the prompt: ``(len(seeds),)``."""
        out = []
        seeds = [int(s) for s in seeds]
        for prompt in prompts or self.config["prompts"]:
            texts = (self.refiner.sample([prompt] * len(seeds), [derive_seed(s, 3) for s in seeds],
                                         self.lm_sampling).rewrites if refine else [prompt] * len(seeds))
            _, frames = self.generator.rollout(texts, seeds, sde=False)
            out.append(as_reward(self.reward, self.config["reward_timeout"])
                       .score([prompt] * len(seeds), frames).total)
        return torch.stack(out).mean(dim=0)


def reward_stats(rewards: torch.Tensor, unrefined: int,
                 parts: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Mean and std of the finite rewards ``(P, N, M)`` (and of each component's, ``parts``, for
    a weighted sum: :func:`~flowseam.training.common.reward_summary`), and the means of the
    refined and the unrefined branches (the latter only with unrefined branches)."""
    def mean(x: torch.Tensor) -> float:
        x = x[torch.isfinite(x)]
        return float(x.mean()) if x.numel() else float("nan")

    out = {**reward_summary(rewards, parts), "reward_refined_mean": mean(rewards[:, unrefined:])}
    if unrefined:
        out["reward_unrefined_mean"] = mean(rewards[:, :unrefined])
    return out


def rewrite_stats(rollout, eos_token_id: int) -> dict[str, float]:
    """The LM's mean rewrite length in tokens (EOS included) and the fraction that ended with
    EOS (the rest hit ``max_new_tokens``)."""
    lengths = rollout.completion_mask.sum(dim=1)
    last = rollout.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None].to(rollout.input_ids.device))
    return {"lm_rewrite_tokens_mean": float(lengths.float().mean()),
            "lm_eos_frac": float((last[:, 0].cpu() == eos_token_id).float().mean())}


def _load(path: str | None, key: str, platform: Platform, dtype: Any = None) -> ModelInstance:
    if not path:
        raise FlowseamError(f"config needs {key} = <checkpoint directory>")
    return load(path, platform=platform, dtype=dtype)

