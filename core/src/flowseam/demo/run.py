"""``flowseam demo``: the main job end to end on real handwritten digits (the ``digits`` world;
``--world text`` runs :func:`flowseam.demo.text_run.run_text_demo` instead).

:func:`run_demo` finds the demo's two models (:mod:`flowseam.demo.build`), runs the built-in
``t2i-i2v`` workflow (:class:`flowseam.workflows.Workflow`) for the prompts, post-trains both of
its stages with ``workflow_rl`` on one reward computed on the final video only (``digit_video``),
and reports the mean final-video reward on held-out seeds before and after (:data:`RL_CONFIG`
says why the RL settings are what they are). Every file is written atomically
(:mod:`flowseam.media`); the outputs, for users: docs/demo.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from ..request import DiffusionParams
from .data import i2v_prompt, parse_prompt

#: the demo's prompts, in order (``--prompts N`` takes the first N)
PROMPTS = tuple(i2v_prompt(d, direction) for d, direction in (
    (3, "right"), (7, "left"), (0, "down"), (5, "up"), (2, "right"), (9, "left"), (4, "up"),
    (8, "down"), (6, "right"), (1, "left")))
#: the backend the demo runs on unless --backend names one
DEFAULT_BACKEND = "cpu"
#: held-out seeds start here (the RL rollouts use derive_seed(...) values, never these)
EVAL_SEED_BASE = 10_000

#: the workflow_rl config of the demo (prompts, steps and group size come from the command line).
#: Every step rolls out a group per prompt (up to 4 prompts). Three choices, each measured with
#: bench/demo_rl_control.py (held-out reward after 20 steps; 0.51 before) — see docs/demo.md:
#:
#: * ``sde_window = [0, 2]``: the SDE (and the training) on the first two of the eight steps only,
#:   ODE elsewhere (Flow-GRPO-Fast; MixGRPO). With the SDE on every step, one update at lr 3e-4
#:   lowered the log-prob of *every* sample by 0.11 per latent element, swamping the part that
#:   follows the advantage, and the reward fell (0.51 → 0.31); on the first two steps the
#:   common drop is 0.002 against a 0.004 slope per unit of advantage.
#: * LoRA (rank 8 on the attention projections, peft), as Flow-GRPO trains: the adapters start at
#:   zero, so Adam's first full-size steps do not shake the whole pretrained transformer (full
#:   fine-tuning with the window: +0.06 with one seed, -0.04 with another; LoRA: +0.14).
#: * no KL to a reference (beta = 0): twenty steps of LoRA stay close to the pretrained model.
RL_CONFIG: dict[str, Any] = dict(
    reward="digit_video", prompts_per_step=4, seed=0,
    t2i_sampling=dict(num_steps=8, noise_level=0.7, sde_window=[0, 2]),
    i2v_sampling=dict(num_steps=8, noise_level=0.7, sde_window=[0, 2]),
    grpo=dict(beta=0.0, clip_range=0.2, adv_clip_max=5.0, timestep_fraction=1.0, max_grad_norm=1.0),
    optim=dict(lr=2e-3, weight_decay=0.0),
    lora=dict(rank=8),
)


@dataclass
class DemoOptions:
    """What ``flowseam demo`` was asked to do (see ``flowseam demo --help``)."""

    backend: str | None = None
    steps: int = 20
    prompts: int = 4
    group_size: int = 8
    eval_seeds: int = 8
    output: Path = Path("outputs/demo")
    cache: Path | None = None
    recipes: Path | None = None
    build_only: bool = False
    rebuild: bool = False
    quick: bool = False
    no_shipped: bool = False
    threads: int | None = None
    fps: int = 4
    #: ``"digits"`` (the main job above) or ``"text"`` (:mod:`flowseam.demo.text_run`)
    world: str = "digits"
    #: text world: disjoint held-out seed sets (None: its default)
    seed_sets: int | None = None


def default_threads() -> int:
    """Half the CPU cores (at least 1). On a shared 2-core machine one thread is several times
    faster than two: OpenMP threads that wait for a descheduled sibling spin."""
    return max(1, (os.cpu_count() or 2) // 2)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``<output>/summary.json``).

    1. print the backend table (as ``flowseam backends``);
    2. find the demo models by their recipe hash (the cache, then the weights shipped in the
       package) or build them (:mod:`flowseam.demo.build`);
    3. run the ``t2i-i2v`` workflow for the prompts: a GIF and an MP4 per prompt and a PNG grid
       of every stage's frames;
    4. post-train both stages with the ``workflow_rl`` method on the ``digit_video`` reward,
       writing its metrics (JSON lines) and a PNG plot of the reward against the step;
    5. print the mean final-video reward on held-out seeds before and after, the classifier's
       accuracy on the generated digits, and write everything to ``summary.json``.

    It runs on ``opts.threads`` (default :func:`default_threads`) torch threads, and as many
    BLAS/OpenMP threads for numpy and scikit-learn (threadpoolctl; restored afterwards): with
    more OpenBLAS threads than free cores, fitting the reward's classifier takes many times the
    CPU time of one thread."""
    import torch
    from threadpoolctl import threadpool_limits

    from .build import check_world

    check_world(opts.world)
    if opts.world != "digits":
        raise InvalidInputError(f"run_demo runs the digits world, not world={opts.world!r}; "
                                "the text world is flowseam.demo.text_run.run_text_demo")
    threads = opts.threads or default_threads()
    torch.set_num_threads(threads)
    with threadpool_limits(limits=threads):
        return _run_demo(opts)


def _run_demo(opts: DemoOptions) -> dict[str, Any]:
    import torch

    from .. import media
    from ..quiet import quiet_libraries
    from ..seam.report import print_backend_table
    from ..loading import load
    from ..seam.platform import Platform
    from ..training.workflow_rl import WorkflowRL
    from ..workflows import Workflow
    from .build import ensure_models, read_recipes
    from .evaluate import digit_px, serve_params, t2i_accuracy

    started, cpu_started = time.perf_counter(), time.process_time()
    quiet_libraries()
    out = Path(opts.output)

    # 1. The backends, and the platform the demo runs on. cpu unless asked: accel compiles every
    # model per input shape (torch.compile), minutes of compilation on a 2-core machine before
    # the first sample.
    backend = opts.backend or DEFAULT_BACKEND
    print_backend_table(backend=backend)
    detected = Platform.detect().name
    print(f"\ndemo backend: {backend}" + ("" if opts.backend or detected == backend else
          f" — the demo's default, so that no model waits for a compiler; the highest-priority "
          f"backend here is {detected!r} (flowseam generate's default): --backend {detected} "
          "runs the demo on it"))
    print()

    # 2. The models: cached, shipped, or built now.
    recipes = read_recipes(opts.recipes)
    t0 = time.perf_counter()
    paths = ensure_models(opts.cache, recipes, rebuild=opts.rebuild, quick=opts.quick,
                          use_shipped=not opts.no_shipped)
    build_seconds = time.perf_counter() - t0
    summary: dict[str, Any] = {"models": {k: str(v) for k, v in paths.items()},
                               "seconds_models": round(build_seconds, 1)}
    if opts.build_only:
        summary["seconds_total"] = round(time.perf_counter() - started, 1)
        print(f"models ready in {build_seconds:.0f} s")
        return summary
    platform = Platform(backend)
    t2i = load(paths["digits-t2i"], platform=platform)
    i2v = load(paths["digits-i2v"], platform=platform)
    print(t2i.provenance())
    print(i2v.provenance())
    t2i_params = serve_params(recipes["digits-t2i"].config)
    i2v_params = serve_params(recipes["digits-i2v"].config)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(1, opts.prompts))]

    # 3. The workflow: text → image → video, for every prompt.
    workflow = Workflow(t2i, i2v)
    t0 = time.perf_counter()
    before = _run_workflow(workflow, prompts, t2i_params, i2v_params, out / "videos", opts.fps)
    _write_grid(out / "workflow_grid.png", prompts, before, "t2i-i2v workflow (before RL)")
    summary["seconds_workflow"] = round(time.perf_counter() - t0, 1)
    print(f"\nworkflow: {len(prompts)} prompt(s) → {out / 'videos'}, "
          f"grid {out / 'workflow_grid.png'}")

    # 4. workflow_rl on the digit_video reward, with held-out evaluations before and after.
    seeds = list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + opts.eval_seeds))
    # every demo run trains from the shipped models: a previous run's rl/ (its final checkpoint
    # would be resumed) goes, as its videos and figures are rewritten
    shutil.rmtree(out / "rl", ignore_errors=True)
    config = rl_config(prompts, opts.steps, opts.group_size, t2i_params, i2v_params,
                       output_dir=str(out / "rl"))
    rl = WorkflowRL(config, t2i=t2i, i2v=i2v)
    t0 = time.perf_counter()
    px = digit_px(recipes["digits-t2i"].config)
    acc_before = t2i_accuracy(t2i, t2i_params, len(seeds), seed=seeds[0], digit_px=px)
    reward_before = rl.evaluate(seeds).numpy()
    print(f"held-out reward before RL: {reward_before.mean():.3f} ± {reward_before.std():.3f} "
          f"({len(seeds)} seeds x {len(prompts)} prompt(s))")
    t2i_weights = {n: p.detach().clone() for n, p in t2i.dit.named_parameters()}
    t_train = time.perf_counter()
    evaluations = t_train - t0
    result = rl.run(progress=True)
    t_trained = time.perf_counter()
    reward_after = rl.evaluate(seeds).numpy()
    acc_after = t2i_accuracy(t2i, t2i_params, len(seeds), seed=seeds[0], digit_px=px)
    evaluations += time.perf_counter() - t_trained
    px_video = digit_px(recipes["digits-i2v"].config)
    t2i_changed = any(not torch.equal(t2i_weights[n], p) for n, p in t2i.dit.named_parameters())
    summary["seconds_rl"] = round(time.perf_counter() - t0, 1)
    records = result["records"]
    summary["seconds_rl_phases"] = rl_phases(records, t_trained - t_train, evaluations)
    _write_reward_plot(out / "reward.png", records, reward_before, reward_after)
    after = _run_workflow(workflow, prompts, t2i_params, i2v_params, out / "videos_after_rl",
                          opts.fps)
    _write_grid(out / "workflow_grid_after_rl.png", prompts, after, "t2i-i2v workflow (after RL)")

    # 5. The figures.
    summary.update({
        "backend": platform.name, "prompts": prompts, "rl_steps": result["steps"],
        "eval_seeds": seeds,
        "reward_before": {"mean": float(reward_before.mean()), "std": float(reward_before.std())},
        "reward_after": {"mean": float(reward_after.mean()), "std": float(reward_after.std())},
        "t2i_weights_changed": bool(t2i_changed),
        "trained_models": {k: v["model"] for k, v in result.get("exported", {}).items()},
        "generated_digit_accuracy_before": acc_before, "generated_digit_accuracy_after": acc_after,
        "workflow_video_accuracy_before": video_accuracy(prompts, before, px_video),
        "workflow_video_accuracy_after": video_accuracy(prompts, after, px_video),
        "seconds_total": round(time.perf_counter() - started, 1),
        "cpu_seconds_total": round(time.process_time() - cpu_started, 1),
    })
    with media.atomic_path(out / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nmean final-video reward on held-out seeds: {reward_before.mean():.3f} → "
          f"{reward_after.mean():.3f} (std over seeds {reward_before.std():.3f} → "
          f"{reward_after.std():.3f}); T2I transformer changed under the video reward: "
          f"{t2i_changed}")
    print(f"classifier accuracy of generated digits (T2I, 10 digits x {len(seeds)} held-out "
          f"seeds): "
          f"{acc_before['accuracy']:.0%} before RL, {acc_after['accuracy']:.0%} after")
    print(f"metrics: {out / 'rl' / 'metrics.jsonl'}; plot: {out / 'reward.png'}; "
          f"summary: {out / 'summary.json'}")
    for stage, paths in result.get("exported", {}).items():
        print(f"trained {stage} model: {paths['model']} (flowseam generate --model "
              f"{paths['model']} ...)")
    phases = summary["seconds_rl_phases"]
    print("where the RL time went (wall s): " + ", ".join(
        f"{k} {v:.0f}" for k, v in phases.items() if k != "training"))
    print(f"demo finished in {summary['seconds_total']:.0f} s "
          f"({summary['cpu_seconds_total']:.0f} CPU s)")
    return summary


#: the phases of a workflow_rl step (each step's metrics record has ``seconds_<phase>``)
RL_PHASES = ("rollout", "reward", "update", "sync")


def rl_phases(records: list[dict[str, Any]], training: float, evaluations: float) -> dict[str, float]:
    """Where the RL part of the demo spent its wall seconds: each step phase summed over the
    steps' records, ``other`` (the rest of the ``training`` seconds: checkpoint, export), and the
    held-out ``evaluations`` (reward and T2I accuracy, before and after)."""
    out = {p: sum(r.get(f"seconds_{p}", 0.0) for r in records) for p in RL_PHASES}
    out["other"] = max(0.0, training - sum(out.values()))
    out.update(training=training, evaluations=evaluations)
    return {k: round(v, 1) for k, v in out.items()}


def rl_config(prompts: list[str], steps: int, group_size: int, t2i_serve: DiffusionParams,
              i2v_serve: DiffusionParams, base: dict[str, Any] | None = None,
              **changes: Any) -> dict[str, Any]:
    """The demo's ``workflow_rl`` config: ``base`` (default :data:`RL_CONFIG`) for these prompts,
    steps and group size, each stage sampling at its recipe's ``[serve]`` size (``t2i_serve``,
    ``i2v_serve``) with the RL step count and SDE settings; ``changes`` override top-level keys."""
    base = RL_CONFIG if base is None else base
    per_step = min(base["prompts_per_step"], len(prompts))
    # a step's groups roll out as one batch (and are recomputed as one): the same samples and
    # seeds as one batch per group, 2.5 times fewer CPU seconds per step on the demo's models
    return dict(base, prompts=prompts, steps=steps, group_size=group_size,
                prompts_per_step=per_step, rollout_batch_size=per_step * group_size,
                t2i_sampling=_rl_sampling(base["t2i_sampling"], t2i_serve),
                i2v_sampling=_rl_sampling(base["i2v_sampling"], i2v_serve), **changes)


def apply_overrides(config: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """Apply ``KEY=VALUE`` overrides (a bench script's ``--set``) to ``config`` in place: dotted
    keys reach into tables (``optim.lr=5e-4``), the value is read as JSON (else kept as a
    string). Returns ``config``.

    :raises ValueError: for an item without ``=``."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidInputError(f"--set {item!r} must look like key=value")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        *tables, leaf = key.split(".")
        target = config
        for t in tables:
            target = target.setdefault(t, {})
        target[leaf] = value
    return config


def _rl_sampling(rl: dict[str, Any], serve: DiffusionParams) -> dict[str, Any]:
    """The RL stage's sampling: the serve size and text length, fewer steps, the SDE noise."""
    keep = ("height", "width", "num_frames", "guidance_scale", "flow_shift", "max_sequence_length")
    return {**{k: getattr(serve, k) for k in keep if getattr(serve, k) is not None}, **rl}


def _run_workflow(workflow, prompts, t2i_params, i2v_params, folder: Path, fps: int) -> list:
    """The workflow for every prompt (seed = its index), as one batch per stage; writes
    ``NN-<slug>.gif/.mp4`` and the image ``NN-<slug>.png``. Returns
    ``[(image (H, W, 3), video (F, H, W, 3))]``."""
    from .. import media

    res = workflow.run(list(prompts), t2i_params=t2i_params, i2v_params=i2v_params, seed=0)
    results = []
    for k, prompt in enumerate(prompts):
        image, video = res.stages[0].frames[k, 0], res.frames[k]
        slug = f"{k:02d}-" + prompt.replace("a handwritten digit ", "").replace(" ", "-")
        media.write_image(folder / f"{slug}.png", image)
        media.write_video(folder / f"{slug}.gif", video, fps=fps)
        media.write_video(folder / f"{slug}.mp4", video, fps=fps)
        results.append((image, video))
    return results


def video_accuracy(prompts: list[str], results: list, digit_px: int = 16) -> float:
    """Fraction of workflow videos whose mean class probability over frames names the prompted
    digit."""
    from .classifier import digit_probabilities

    hits = [digit_probabilities(video, digit_px).mean(0).argmax() == parse_prompt(p)[0]
            for p, (_, video) in zip(prompts, results)]
    return float(np.mean(hits))


def _write_grid(path: Path, prompts: list[str], results: list, title: str) -> None:
    """A PNG grid: one row per prompt, the T2I image then every video frame."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .. import media

    n_frames = results[0][1].shape[0]
    fig = Figure(figsize=(1.0 * (n_frames + 1) + 0.4, 1.05 * len(prompts) + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(prompts), n_frames + 1, squeeze=False)
    for r, (prompt, (image, video)) in enumerate(zip(prompts, results)):
        for c in range(n_frames + 1):
            ax = axes[r][c]
            ax.imshow(np.clip(image if c == 0 else video[c - 1], 0, 1), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title("T2I" if c == 0 else f"f{c - 1}", fontsize=8)
        digit, direction = parse_prompt(prompt)
        axes[r][0].set_ylabel(f"{digit}, {direction}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with media.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def _write_reward_plot(path: Path, records: list[dict], before: np.ndarray,
                       after: np.ndarray, xlabel: str = "workflow_rl step",
                       ylabel: str = "digit_video reward",
                       title: str = "workflow_rl on the final video: digit probability x motion"
                       ) -> None:
    """The mean training reward per step (and its running mean), with the held-out mean before
    and after RL (the error bars: the std of ``before`` / ``after``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .. import media

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] if r["reward_mean"] is not None else np.nan for r in records]
    fig = Figure(figsize=(6, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(steps, rewards, marker=".", lw=1, alpha=0.5,
            label="rollout reward (mean of the step's groups)")
    if len(rewards) >= 3:
        k = max(2, len(rewards) // 5)
        smooth = np.convolve(np.nan_to_num(rewards), np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=2, label=f"running mean ({k} steps)")
    for value, spread, x, name, color in ((before, before.std(), 0, "held-out, before", "gray"),
                                          (after, after.std(), steps[-1] if steps else 1,
                                           "held-out, after", "green")):
        ax.errorbar([x], [value.mean()], yerr=[spread], fmt="s", color=color, capsize=4,
                    label=f"{name}: {value.mean():.3f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with media.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
