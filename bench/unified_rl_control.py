"""Does unified_rl (prompt refiner + generator, one reward) beat a constant-reward control on
held-out requests of the digits world?

The refiner is :mod:`flowseam.demo.refiner_lm`'s tiny GPT-2, pretrained from scratch with the
causal-LM loss on noisy (request, prompt) pairs (``--noise`` of the targets name a random digit,
and independently a random direction), so it maps a loose request ("draw me a 7 sliding to the
left") to the generators' prompt language only part of the time. The generator is the demo's
t2i → i2v workflow (``--generator workflow``, the final-video reward ``digit_video``) or its
text-to-image model alone (``--generator t2i``, ``digit_image``), kept frozen
(``freeze_generator``; ``--set freeze_generator=false`` trains it too). Two runs of ``unified_rl`` from
the same models, config and number of steps, on the training requests:

* **control**: ``reward = "constant"``: every advantage is 0, no weight moves (the LM's nor the
  DiTs': checked bit for bit); evaluated with the real reward on ``--seed-sets`` disjoint sets of
  held-out seeds, the spread (std) of its per-set means is the seed-to-seed noise of the figure;
* **trained**: the real reward, evaluated on the same seed sets before and after. "Before" is
  the control's evaluation (the same weights bit for bit, the same seeds, a deterministic ODE:
  running it twice gives the same numbers, so it runs once).

Evaluation: the first ``--held-out`` held-out requests (never seen in pretraining or RL), one LM
rewrite per seed, the generator served (ODE) with that seed, scored against the request. It also
prints how often the LM's rewrites name the requested digit and direction, before and after.
``--json`` writes the figures and the trained run's per-step metrics.

    python bench/unified_rl_control.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generator", choices=("workflow", "t2i"), default="workflow")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--rewrites", type=int, default=4)
    parser.add_argument("--samples-per-rewrite", type=int, default=2)
    parser.add_argument("--held-out", type=int, default=12, help="held-out requests evaluated")
    parser.add_argument("--seeds-per-set", type=int, default=4)
    parser.add_argument("--seed-sets", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.3, help="label noise of the LM's pretraining")
    parser.add_argument("--lm-steps", type=int, default=800, help="pretraining steps of the LM")
    parser.add_argument("--refiner", help="a pretrained refiner directory (default: build it)")
    parser.add_argument("--out", default="outputs/bench/unified_rl", help="where the refiner is built")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the RL config (dotted keys for tables, value as JSON), "
                             "e.g. --set lm_optim.lr=3e-4")
    parser.add_argument("--skip-control", action="store_true",
                        help="evaluate the untrained system instead of running the control (its "
                             "weights never move, so only for quick exploration)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    import flowseam
    from flowseam.quiet import quiet_libraries
    from flowseam.demo.build import ensure_models, read_recipes
    from flowseam.demo.evaluate import serve_params
    from flowseam.demo.refiner_lm import build_refiner, request_split, rewrite_accuracy
    from flowseam.demo.run import EVAL_SEED_BASE, RL_CONFIG, apply_overrides, default_threads, rl_config
    from flowseam.prompt_refiner import PromptRefiner
    from flowseam.training import get_reward
    from flowseam.training.unified_rl import UnifiedRL

    torch.set_num_threads(args.threads or default_threads())
    quiet_libraries()
    started = time.perf_counter()
    recipes = read_recipes()
    paths = ensure_models(recipes=recipes)
    refiner_dir = Path(args.refiner) if args.refiner else \
        Path(args.out) / f"refiner-noise{args.noise}-steps{args.lm_steps}"
    if not (refiner_dir / "config.json").is_file():
        print(f"pretraining the refiner into {refiner_dir} ...", flush=True)
        build_refiner(refiner_dir, steps=args.lm_steps, noise=args.noise)
    t_refiner = time.perf_counter() - started

    train, held = request_split()
    held = held[:args.held_out]
    held_prompts = [r for r, _, _ in held]
    n = args.seeds_per_set
    seed_sets = [list(range(EVAL_SEED_BASE + k * n, EVAL_SEED_BASE + (k + 1) * n))
                 for k in range(args.seed_sets)]
    reward_name = "digit_video" if args.generator == "workflow" else "digit_image"

    t2i_serve = serve_params(recipes["digits-t2i"].config)
    i2v_serve = serve_params(recipes["digits-i2v"].config)
    # The refiner is what this proves: the generator renders but is not updated (with M = 2
    # samples per rewrite its Flow-GRPO advantages are ±0.71 for every pair, mostly noise), and
    # the LM learns at 3e-4 with a KL of 0.04 to the pretrained LM (at 1e-3 it collapses after
    # about 9 steps, with or without the KL; see docs/benchmarks.md, unified_rl).
    base = dict(RL_CONFIG, prompts_per_step=args.prompts_per_step, freeze_generator=True,
                lm_sampling=dict(temperature=1.0, max_new_tokens=8),
                lm_grpo=dict(beta=0.04, clip_range=0.2), lm_optim=dict(lr=3e-4, weight_decay=0.0))
    config = rl_config([r for r, _, _ in train], args.steps, 2, t2i_serve, i2v_serve, base=base,
                       rewrites=args.rewrites, samples_per_rewrite=args.samples_per_rewrite)
    config.pop("group_size")
    if args.generator == "t2i":
        config["sampling"] = config.pop("t2i_sampling")
        config.pop("i2v_sampling")
    apply_overrides(config, args.set)

    def make(reward: str) -> UnifiedRL:
        platform = flowseam.Platform(args.backend)
        refiner = PromptRefiner.load(refiner_dir, platform=platform)
        t2i = flowseam.load(paths["digits-t2i"], platform=platform)
        if args.generator == "t2i":
            return UnifiedRL(dict(config, reward=reward), refiner=refiner, model=t2i)
        i2v = flowseam.load(paths["digits-i2v"], platform=platform)
        return UnifiedRL(dict(config, reward=reward), refiner=refiner, t2i=t2i, i2v=i2v)

    def per_set(run: UnifiedRL) -> list[float]:
        return [float(run.evaluate(s, held_prompts).mean()) for s in seed_sets]

    def lm_accuracy(run: UnifiedRL) -> dict[str, float]:
        return rewrite_accuracy(run.refiner, held, [s for k in seed_sets for s in k])

    def weights(run: UnifiedRL) -> list[torch.Tensor]:
        modules = [run.refiner.lm, *(m.components[m.DIT] for m in run.generator.models.values())]
        return [p.detach().clone() for m in modules for p in m.parameters()]

    t0 = time.perf_counter()
    control = make("constant")
    loaded = weights(control)
    if not args.skip_control:
        control.run(progress=True)
    control_still = all(torch.equal(a, b) for a, b in zip(loaded, weights(control)))
    control.reward = get_reward(reward_name)
    control_means = per_set(control)
    spread = float(np.std(control_means))
    t_control = time.perf_counter() - t0

    trained = make(reward_name)
    acc_before = lm_accuracy(trained)
    # The control's weights (LM and every DiT) are the loaded ones bit for bit, so its evaluation
    # (same seeds, deterministic ODE) is the untrained system's: reused, not run twice.
    before = control_means if control_still else per_set(trained)
    t0 = time.perf_counter()
    result = trained.run(progress=True)
    t_train = time.perf_counter() - t0
    after = per_set(trained)
    acc_after = lm_accuracy(trained)
    gain = float(np.mean(after) - np.mean(before))
    records = result["records"]
    figures = {
        "generator": args.generator, "reward": reward_name, "steps": args.steps,
        "tree": [args.prompts_per_step, args.rewrites, args.samples_per_rewrite],
        "held_out_requests": held_prompts, "seed_sets": len(seed_sets), "seeds_per_set": n,
        "noise": args.noise, "lm_steps": args.lm_steps, "config": config,
        "control_ran": not args.skip_control, "control_weights_unchanged": control_still,
        "control_per_set": control_means, "control_spread": spread,
        "before_per_set": before, "after_per_set": after, "before_mean": float(np.mean(before)),
        "after_mean": float(np.mean(after)), "gain": gain, "gain_exceeds_spread": gain > spread,
        "rewrite_accuracy_before": acc_before, "rewrite_accuracy_after": acc_after,
        "train_reward_per_step": [r["reward_mean"] for r in records],
        "train_records": records,
        "lm_ratio_dev_first_epoch_max": max(r["lm_ratio_dev_first_epoch"] for r in records),
        "seconds_refiner": round(t_refiner, 1), "seconds_control": round(t_control, 1),
        "seconds_train": round(t_train, 1), "seconds_total": round(time.perf_counter() - started, 1),
    }
    print(f"control (constant reward, {args.steps} steps{'' if not args.skip_control else ', skipped'}): "
          f"LM and DiT(s) bit-identical {control_still}; held-out mean {np.mean(control_means):.4f}, per seed set "
          f"{np.round(control_means, 4).tolist()} → spread (std) {spread:.4f}")
    print(f"trained ({reward_name}, {args.steps} steps): {np.mean(before):.4f} → {np.mean(after):.4f} "
          f"(gain {gain:+.4f}, {gain / spread if spread else float('inf'):.1f} spreads; per set "
          f"{np.round(before, 3).tolist()} → {np.round(after, 3).tolist()})")
    print(f"LM rewrites of held-out requests naming the requested digit/direction/both: "
          f"{acc_before['digit']:.2f}/{acc_before['direction']:.2f}/{acc_before['both']:.2f} → "
          f"{acc_after['digit']:.2f}/{acc_after['direction']:.2f}/{acc_after['both']:.2f}")
    print(f"wall time: refiner {t_refiner:.0f} s, control {t_control:.0f} s, RL {t_train:.0f} s, "
          f"total {figures['seconds_total']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
