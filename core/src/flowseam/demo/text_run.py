"""``flowseam demo --world text``: Flow-GRPO's text-rendering task on a tiny FLUX model.

:func:`run_text_demo` finds the ``text-t2i`` model (:mod:`flowseam.demo.build`; data:
:mod:`flowseam.demo.text`) and post-trains it with ``flowgrpo`` on the ``ocr`` reward
(:data:`TEXT_RL_CONFIG`). A gain means something only against a control
(:func:`compare_with_control`): the same run with the ``constant`` reward, whose advantages are
all 0 so that no weight moves, evaluated on the same disjoint held-out seed sets, gives the
seed-to-seed spread any gain must exceed. Every file is written atomically
(:mod:`flowseam.media`); the outputs, for users: docs/demo.md.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from .text import WORDS, text_prompt

#: held-out seeds start here (the rollouts use derive_seed(...) values, never these)
EVAL_SEED_BASE = 10_000

#: the text world's ``flowgrpo`` config (prompts, steps and group size come from the command
#: line). Every step rolls out a group of 8 for 4 of the 24 prompts. Measured with
#: bench/text_rl_control.py on the shipped model (held-out OCR reward 0.43 before; the control's
#: seed-set spread 0.013):
#:
#: * LoRA (rank 8, peft) at lr 2e-3 and no KL (beta = 0), the digits demo's setting: lr 5e-3
#:   lost 0.007 in 30 steps where 2e-3 gained 0.032.
#: * ``sde_window = [1, 3]``: the SDE (and the training) on the second and third of the eight
#:   steps, ODE elsewhere. After the first step the sign's layout is set and the letters' shapes
#:   are still open, which is where this model's mistakes are: 80 steps (one seed) gained 0.064
#:   against 0.040 with the digits' ``[0, 2]``. Noise 1.0 on ``[0, 3]`` collapsed the samples (-0.17).
#: * 4 prompts per step: 8 (twice the rollouts per update) gained less in 30 steps (0.013).
#: * 160 steps: the gain grows with steps and depends on the seed (rollout seeds and the LoRA's
#:   initial matrices). At 80 steps seeds 0, 1, 2 gained 0.049, 0.038, 0.021 (1.6 to 3.6 times
#:   the spread); at 160, seeds 1 and 2 gained 0.099 and 0.057 (7.4 and 4.2 times). 160 steps
#:   keep the whole demo within a few minutes on 2 CPU cores.
TEXT_RL_CONFIG: dict[str, Any] = dict(
    reward="ocr", prompts_per_step=4, seed=0,
    sampling=dict(num_steps=8, noise_level=0.7, sde_window=[1, 3]),
    grpo=dict(beta=0.0, clip_range=0.2, adv_clip_max=5.0, timestep_fraction=1.0,
              max_grad_norm=1.0),
    optim=dict(lr=2e-3, weight_decay=0.0),
    lora=dict(rank=8),
)
#: what the text world runs unless the command line says otherwise
TEXT_DEFAULTS = dict(steps=160, prompts=len(WORDS), group_size=8, eval_seeds=4, seed_sets=4)


def text_rl_config(words: list[str], steps: int, group_size: int, serve,
                   base: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    """The ``flowgrpo`` config for these words' prompts: ``base`` (default
    :data:`TEXT_RL_CONFIG`) sampling at the recipe's ``[serve]`` size and text length, with the RL
    step count and SDE settings; ``changes`` override top-level keys."""
    base = TEXT_RL_CONFIG if base is None else base
    keep = ("height", "width", "max_sequence_length")
    sampling = {**{k: getattr(serve, k) for k in keep if getattr(serve, k) is not None},
                **base["sampling"]}
    return dict(base, prompts=[text_prompt(w) for w in words], steps=steps,
                group_size=group_size, prompts_per_step=min(base["prompts_per_step"], len(words)),
                sampling=sampling, **changes)


def seed_sets(sets: int, per_set: int, base: int = EVAL_SEED_BASE) -> list[list[int]]:
    """``sets`` disjoint lists of ``per_set`` held-out seeds, from ``base`` up."""
    return [list(range(base + k * per_set, base + (k + 1) * per_set)) for k in range(sets)]


def evaluate_sets(model, params, sets: list[list[int]], words: list[str], reward,
                  keep_frames: int = 0) -> dict[str, Any]:
    """:func:`flowseam.demo.evaluate.text_ocr` on every seed set: the mean OCR reward and exact
    match over all, and per set (``per_set_reward``, ``per_set_exact``); with ``keep_frames``,
    also ``frames``: ``(len(words), keep_frames, H, W, 3)`` samples of the first seeds."""
    from .evaluate import text_ocr

    per = [text_ocr(model, params, s, words, reward) for s in sets]
    out = {"ocr_reward": float(np.mean([p["ocr_reward"] for p in per])),
           "exact_match": float(np.mean([p["exact_match"] for p in per])),
           "per_set_reward": [p["ocr_reward"] for p in per],
           "per_set_exact": [p["exact_match"] for p in per],
           "per_word_exact": {w: float(np.mean([p["per_word"][w] for p in per])) for w in words},
           "samples": int(sum(p["samples"] for p in per))}
    if keep_frames:
        seeds = [s for group in sets for s in group][:keep_frames]
        prompts = [text_prompt(w) for w in words for _ in seeds]
        frames = model.generate(prompts, params=params, seeds=seeds * len(words)).frames[:, 0]
        out["frames"] = frames.reshape(len(words), len(seeds), *frames.shape[1:])
    return out


def compare_with_control(model_path, words: list[str], steps: int, group: int, serve,
                         sets: list[list[int]], reward, platform, base: dict | None = None,
                         output_dir: Path | None = None, keep_frames: int = 4,
                         control: bool = True, log=print) -> dict[str, Any]:
    """The RL part of the text demo (and of ``bench/text_rl_control.py``): two ``flowgrpo``
    runs from the model at ``model_path`` with the same config (:func:`text_rl_config` of
    ``base``) and steps, each on a freshly loaded copy:

    * the **control**, ``reward = "constant"``: every advantage is 0, so its weights must not
      move (``control["weights_moved"]`` says whether they did); evaluated on ``sets``, the std
      of its per-set mean OCR rewards is ``control["spread"]`` (``spread_exact`` for the exact
      match);
    * the **run**, ``reward = "ocr"`` (``reward``: the instance, shared with the evaluations),
      evaluated on ``sets`` before and after (:func:`evaluate_sets`).

    The evaluations sample the run's own step count with the ODE (``eval_params``).
    ``control=False`` (exploration only) evaluates the untrained model as the control instead of
    running it: its weights never move, so only the check that they do not is skipped
    (``control["weights_moved"]`` is then None).

    :returns: ``{"before", "after", "control", "gain", "rl" (the FlowGRPO run), "result" (its
        summary), "eval_params", "seconds_control", "seconds_train", "seconds_evaluations"}``.
    """
    import torch

    from ..loading import load
    from ..training.flowgrpo import FlowGRPO

    def make(reward_name: str, out_dir: Path | None) -> FlowGRPO:
        model = load(model_path, platform=platform)
        config = text_rl_config(words, steps, group, serve, base=base, reward=reward_name,
                                output_dir=str(out_dir) if out_dir else None)
        # peft draws the LoRA A matrices from torch's global generator: seed it with the run's
        # seed, so a run's outcome does not depend on what ran before it in the process
        torch.manual_seed(int(config["seed"]))
        return FlowGRPO(config, model=model, reward=reward if reward_name == "ocr" else None)

    def weights(run: FlowGRPO) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in run.model.dit.named_parameters()}

    t0 = time.perf_counter()
    ctrl_run = make("constant", None)
    eval_params = _eval_params(ctrl_run)
    moved = None
    if control:
        log(f"\ncontrol: flowgrpo with the constant reward, {steps} steps")
        w0 = weights(ctrl_run)
        ctrl_run.run(progress=True)
        moved = any(not torch.equal(w0[n], p) for n, p in weights(ctrl_run).items())
        del w0
    ctrl = evaluate_sets(ctrl_run.model, eval_params, sets, words, reward)
    ctrl.update(reward="constant", steps=steps if control else 0, weights_moved=moved,
                spread=float(np.std(ctrl["per_set_reward"])),
                spread_exact=float(np.std(ctrl["per_set_exact"])))
    del ctrl_run
    seconds_control = time.perf_counter() - t0
    log(f"control: held-out OCR reward per seed set {np.round(ctrl['per_set_reward'], 3)} → "
        f"spread (std) {ctrl['spread']:.3f}; weights moved: {moved}")

    rl = make("ocr", output_dir)
    t0 = time.perf_counter()
    before = evaluate_sets(rl.model, eval_params, sets, words, reward, keep_frames=keep_frames)
    log(f"\nheld-out before RL: OCR reward {before['ocr_reward']:.3f}, exact match "
        f"{before['exact_match']:.0%} ({len(words)} prompts x {len(sets)} x {len(sets[0])} "
        "seeds)")
    t_train = time.perf_counter()
    result = rl.run(progress=True)
    t_trained = time.perf_counter()
    after = evaluate_sets(rl.model, eval_params, sets, words, reward, keep_frames=keep_frames)
    return {"before": before, "after": after, "control": ctrl,
            "gain": after["ocr_reward"] - before["ocr_reward"], "rl": rl, "result": result,
            "eval_params": eval_params, "seconds_control": round(seconds_control, 1),
            "seconds_train": round(t_trained - t_train, 1),
            "seconds_evaluations": round((t_train - t0) + (time.perf_counter() - t_trained), 1)}


def run_text_demo(opts) -> dict[str, Any]:
    """The text world's demo with :class:`flowseam.demo.run.DemoOptions`; returns the summary
    (also written to ``<output>/summary.json``).

    1. print the backend table (as ``flowseam backends``);
    2. find the ``text-t2i`` model by its recipe hash (the cache, then the shipped weights) or
       build it;
    3. the control and the ``flowgrpo`` run on the ``ocr`` reward, each evaluated on
       ``seed_sets`` disjoint sets of held-out seeds, every prompt once per seed: the mean OCR
       reward and the exact-match accuracy (:func:`compare_with_control`);
    4. print the figures and write ``summary.json``, ``samples_before.png`` /
       ``samples_after.png`` (one row per prompt, one column per held-out seed), ``reward.png``
       (the reward curve) and the post-trained model ``rl/model`` (diffusers format, LoRA
       merged).

    It runs on ``opts.threads`` (default :func:`flowseam.demo.run.default_threads`) torch
    threads, as many BLAS/OpenMP threads (threadpoolctl; restored afterwards) and as many
    onnxruntime threads for the OCR model, as the digits demo does."""
    import torch
    from threadpoolctl import threadpool_limits

    from .run import default_threads

    threads = opts.threads or default_threads()
    torch.set_num_threads(threads)
    with threadpool_limits(limits=threads):
        return _run_text_demo(opts, threads)


def _run_text_demo(opts, threads: int) -> dict[str, Any]:
    from .. import media
    from ..quiet import quiet_libraries
    from ..seam.report import print_backend_table
    from ..seam.platform import Platform
    from ..training import get_reward
    from .build import ensure_models, read_recipes
    from .evaluate import serve_params
    from .run import DEFAULT_BACKEND, rl_phases

    started, cpu_started = time.perf_counter(), time.process_time()
    quiet_libraries()
    out = Path(opts.output)
    backend = opts.backend or DEFAULT_BACKEND
    print_backend_table(backend=backend)
    print(f"\ndemo world: text; backend: {backend}\n")

    recipes = read_recipes(opts.recipes, world="text")
    t0 = time.perf_counter()
    paths = ensure_models(opts.cache, recipes, rebuild=opts.rebuild, quick=opts.quick,
                          use_shipped=not opts.no_shipped)
    summary: dict[str, Any] = {"world": "text", "models": {k: str(v) for k, v in paths.items()},
                               "seconds_models": round(time.perf_counter() - t0, 1)}
    if opts.build_only:
        summary["seconds_total"] = round(time.perf_counter() - started, 1)
        print(f"models ready in {summary['seconds_models']:.0f} s")
        return summary

    steps = opts.steps if opts.steps is not None else TEXT_DEFAULTS["steps"]
    n_words = opts.prompts if opts.prompts is not None else TEXT_DEFAULTS["prompts"]
    group = opts.group_size if opts.group_size is not None else TEXT_DEFAULTS["group_size"]
    per_set = opts.eval_seeds if opts.eval_seeds is not None else TEXT_DEFAULTS["eval_seeds"]
    n_sets = opts.seed_sets if opts.seed_sets is not None else TEXT_DEFAULTS["seed_sets"]
    words = list(WORDS[:n_words])
    sets = seed_sets(n_sets, per_set)
    reward = get_reward("ocr", threads=threads)
    serve = serve_params(recipes["text-t2i"].config)
    platform = Platform(backend)
    shutil.rmtree(out / "rl", ignore_errors=True)

    res = compare_with_control(paths["text-t2i"], words, steps, group, serve, sets, reward,
                               platform, output_dir=out / "rl", log=print)
    before, after, ctrl, rl, result = (res["before"], res["after"], res["control"], res["rl"],
                                       res["result"])
    records, gain, spread = result["records"], res["gain"], ctrl["spread"]
    eval_params = res["eval_params"]

    _write_samples(out / "samples_before.png", words, before.pop("frames"),
                   f"text-t2i before RL (OCR reward {before['ocr_reward']:.2f}, exact "
                   f"{before['exact_match']:.0%})")
    _write_samples(out / "samples_after.png", words, after.pop("frames"),
                   f"text-t2i after flowgrpo (OCR reward {after['ocr_reward']:.2f}, exact "
                   f"{after['exact_match']:.0%})")
    from .run import _write_reward_plot

    _write_reward_plot(out / "reward.png", records, np.asarray(before["per_set_reward"]),
                       np.asarray(after["per_set_reward"]), xlabel="flowgrpo step",
                       ylabel="ocr reward", title="flowgrpo on the text world: OCR reward "
                       "(PP-OCRv4)")
    summary.update({
        "backend": platform.name, "words": words, "prompts": [text_prompt(w) for w in words],
        "rl_steps": result["steps"], "group_size": group,
        "config": {k: v for k, v in rl.config.items() if k != "prompts"},
        "eval_seed_sets": sets, "eval_sampling": {"num_steps": eval_params.num_steps,
                                                  "height": eval_params.height,
                                                  "width": eval_params.width},
        "ocr_reward_before": before["ocr_reward"], "ocr_reward_after": after["ocr_reward"],
        "exact_match_before": before["exact_match"], "exact_match_after": after["exact_match"],
        "gain": gain, "before": before, "after": after,
        "control": ctrl,
        "gain_exceeds_control_spread": bool(gain > spread),
        "gain_over_spread": float(gain / spread) if spread > 0 else None,
        "samples_before": str(out / "samples_before.png"),
        "samples_after": str(out / "samples_after.png"), "reward_plot": str(out / "reward.png"),
        "trained_model": result.get("exported", {}).get("dit", {}).get("model"),
        "seconds_control": res["seconds_control"],
        "seconds_rl_phases": rl_phases(records, res["seconds_train"],
                                       res["seconds_evaluations"]),
        "seconds_total": round(time.perf_counter() - started, 1),
        "cpu_seconds_total": round(time.process_time() - cpu_started, 1),
    })
    with media.atomic_path(out / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    ratio = f"{gain / spread:.1f}x" if spread > 0 else "inf x"
    print(f"\nheld-out OCR reward ({len(words)} prompts x {n_sets * per_set} seeds): "
          f"{before['ocr_reward']:.3f} → {after['ocr_reward']:.3f} (gain {gain:+.3f}; control "
          f"seed-set spread {spread:.3f}: the gain is {ratio} the spread)")
    print(f"exact match: {before['exact_match']:.0%} → {after['exact_match']:.0%} (control "
          f"seed-set spread {ctrl['spread_exact']:.1%})")
    print(f"samples: {out / 'samples_before.png'}, {out / 'samples_after.png'}; plot: "
          f"{out / 'reward.png'}; metrics: {out / 'rl' / 'metrics.jsonl'}; summary: "
          f"{out / 'summary.json'}")
    if summary["trained_model"]:
        print(f"trained model: {summary['trained_model']} (flowseam generate --model "
              f"{summary['trained_model']} --prompt 'a sign that says \"42\"')")
    print(f"demo finished in {summary['seconds_total']:.0f} s "
          f"({summary['cpu_seconds_total']:.0f} CPU s)")
    return summary


def _eval_params(run):
    """The held-out evaluation's params: the run's sampling as ODE (its step count, size)."""
    from ..training.flowgrpo import sampling_params

    return sampling_params(run.sampling).replace(sde_rollout=False)


def _write_samples(path: Path, words: list[str], frames: np.ndarray, title: str) -> None:
    """A PNG grid: one row per word, one column per held-out seed (``frames``:
    ``(words, seeds, H, W, 3)``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .. import media

    rows, cols = frames.shape[:2]
    aspect = frames.shape[3] / frames.shape[2]
    fig = Figure(figsize=(0.9 * aspect * cols + 0.8, 0.9 * rows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for r in range(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.imshow(np.clip(frames[r, c], 0, 1), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r][0].set_ylabel(f'"{words[r]}"', fontsize=8, rotation=0, ha="right", va="center")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with media.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
