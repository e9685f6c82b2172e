"""Does workflow_rl on the demo's digit_video reward beat a constant-reward control?

Two runs of the ``workflow_rl`` method, from the same demo models (``flowseam demo --build-only``
finds or builds them), with the same config and number of steps:

* **control**: ``reward = "constant"``. Every group has zero spread, so every advantage is 0 and
  no weight moves; evaluated with the digit_video reward on ``--seed-sets`` disjoint sets of
  held-out seeds, the spread (std) of its per-set means is the seed-to-seed noise of the figure.
* **trained**: ``reward = "digit_video"``, evaluated on the same seed sets before and after.

It prints the mean held-out reward before and after, the gain, the control's spread, whether the
gain exceeds it, and whether the text-to-image transformer's weights moved under the video reward
alone (credit across the model boundary). ``--json`` writes the figures to a file.

    python bench/demo_rl_control.py --steps 20 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seeds-per-set", type=int, default=8)
    parser.add_argument("--seed-sets", type=int, default=4)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--t2i", help="a text-to-image checkpoint (default: the demo's)")
    parser.add_argument("--i2v", help="an image-to-video checkpoint (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the demo's RL config (dotted keys for tables, value as "
                             "JSON), e.g. --set optim.lr=5e-4 --set grpo.beta=0.01")
    parser.add_argument("--skip-control", action="store_true",
                        help="evaluate the untrained models instead of running the control (its "
                             "weights never move, so only for quick exploration)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    import flowseam
    from flowseam.quiet import quiet_libraries
    from flowseam.demo.build import ensure_models, read_recipes
    from flowseam.demo.evaluate import serve_params
    from flowseam.demo.run import (EVAL_SEED_BASE, PROMPTS, RL_CONFIG, apply_overrides, default_threads,
                                   rl_config)
    from flowseam.training import get_reward
    from flowseam.training.workflow_rl import WorkflowRL

    torch.set_num_threads(args.threads or default_threads())
    quiet_libraries()
    recipes = read_recipes()
    paths = {"digits-t2i": args.t2i, "digits-i2v": args.i2v}
    if not (args.t2i and args.i2v):
        paths = {**ensure_models(recipes=recipes), **{k: v for k, v in paths.items() if v}}
    prompts = list(PROMPTS[:args.prompts])
    n = args.seeds_per_set
    seed_sets = [list(range(EVAL_SEED_BASE + k * n, EVAL_SEED_BASE + (k + 1) * n))
                 for k in range(args.seed_sets)]

    base = {k: dict(v) if isinstance(v, dict) else v for k, v in RL_CONFIG.items()}
    apply_overrides(base, args.set)
    t2i_serve = serve_params(recipes["digits-t2i"].config)
    i2v_serve = serve_params(recipes["digits-i2v"].config)

    def make(reward: str) -> WorkflowRL:
        platform = flowseam.Platform(args.backend)
        t2i = flowseam.load(paths["digits-t2i"], platform=platform)
        i2v = flowseam.load(paths["digits-i2v"], platform=platform)
        config = rl_config(prompts, args.steps, args.group_size, t2i_serve, i2v_serve, base=base,
                           reward=reward)
        return WorkflowRL(config, t2i=t2i, i2v=i2v)

    def per_seed(run: WorkflowRL) -> np.ndarray:
        """``(sets, seeds_per_set)``: each held-out seed's reward (mean over the prompts)."""
        return np.stack([run.evaluate(s).numpy() for s in seed_sets])

    started = time.perf_counter()
    control = make("constant")
    if not args.skip_control:
        control.run(progress=True)
    control.reward = get_reward("digit_video")
    control_seeds = per_seed(control)
    control_means = control_seeds.mean(1).tolist()
    spread = float(np.std(control_means))
    seed_std = float(control_seeds.std())
    t_control = time.perf_counter() - started

    trained = make("digit_video")
    t2i_before = {n: p.detach().clone() for n, p in trained.t2i.dit.named_parameters()}
    before = per_seed(trained).mean(1).tolist()
    t0 = time.perf_counter()
    trained.run(progress=True)
    t_train = time.perf_counter() - t0
    after_seeds = per_seed(trained)
    after = after_seeds.mean(1).tolist()
    t2i_moved = max(float((t2i_before[n] - p.detach()).abs().max())
                    for n, p in trained.t2i.dit.named_parameters())
    gain = float(np.mean(after) - np.mean(before))

    figures = {
        "steps": args.steps, "prompts": prompts, "group_size": args.group_size,
        "seed_sets": len(seed_sets), "seeds_per_set": args.seeds_per_set,
        "config": base, "control_per_set": control_means, "control_spread": spread,
        "control_seed_std": seed_std, "control_mean": float(control_seeds.mean()),
        "after_seed_std": float(after_seeds.std()),
        "before_per_set": before, "after_per_set": after,
        "before_mean": float(np.mean(before)), "after_mean": float(np.mean(after)), "gain": gain,
        "gain_exceeds_spread": gain > spread, "gain_exceeds_seed_std": gain > seed_std,
        "t2i_max_abs_weight_change": t2i_moved,
        "seconds_control": round(t_control, 1), "seconds_train": round(t_train, 1),
        "seconds_total": round(time.perf_counter() - started, 1),
    }
    print(f"control (constant reward, {args.steps} steps): held-out mean {np.mean(control_means):.4f}; "
          f"std over the {control_seeds.size} held-out seeds {seed_std:.4f}; per seed set "
          f"{np.round(control_means, 4).tolist()} → spread (std) {spread:.4f}")
    print(f"trained (digit_video, {args.steps} steps): {np.mean(before):.4f} → "
          f"{np.mean(after):.4f} (gain {gain:+.4f}; per set {np.round(before, 3).tolist()} → "
          f"{np.round(after, 3).tolist()})")
    print(f"gain > control seed-to-seed std: {gain > seed_std}; gain > control per-set spread: "
          f"{gain > spread}; T2I transformer max |Δw| under the video "
          f"reward: "
          f"{t2i_moved:.2e}")
    print(f"wall time: control {t_control:.0f} s, RL {t_train:.0f} s, "
          f"total {figures['seconds_total']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
