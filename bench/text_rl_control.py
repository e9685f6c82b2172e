"""Does flowgrpo on the ocr reward beat a constant-reward control on the text world?

Two runs of the ``flowgrpo`` method from the demo's ``text-t2i`` model (``flowseam demo --world
text --build-only`` finds or builds it), with the same config (the demo's
``flowseam.demo.text_run.TEXT_RL_CONFIG``, ``--set`` overrides) and number of steps
(``flowseam.demo.text_run.compare_with_control``, what ``flowseam demo --world text`` runs):

* **control**: ``reward = "constant"``. Every group has zero spread, so every advantage is 0 and
  no weight moves (checked); evaluated with the ocr reward on ``--seed-sets`` disjoint sets of
  held-out seeds (every prompt once per seed, ODE at the RL step count), the spread (std) of its
  per-set means is the seed-to-seed noise of the figure;
* **trained**: ``reward = "ocr"`` (PP-OCRv4's recogniser, rapidocr-onnxruntime), evaluated on the
  same seed sets before and after.

It prints a table: the held-out OCR reward and exact-match accuracy before and after, the gain,
the control's spread, and gain / spread. ``--json`` writes every figure to a file.

    python bench/text_rl_control.py                   # the demo's setting
    python bench/text_rl_control.py --set optim.lr=1e-3 --set lora.rank=4
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo's)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="how many of the 24 words (default: all)")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--seeds-per-set", type=int, default=None)
    parser.add_argument("--seed-sets", type=int, default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", help="a text-to-image checkpoint (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the RL config (dotted keys for tables, value as JSON), "
                             "e.g. --set optim.lr=1e-3 --set sampling.sde_window=[0,3]")
    parser.add_argument("--skip-control", action="store_true",
                        help="evaluate the untrained model instead of running the control (its "
                             "weights never move, so only for quick exploration)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    import flowseam
    from flowseam.quiet import quiet_libraries
    from flowseam.demo.build import ensure_models, read_recipes
    from flowseam.demo.evaluate import serve_params
    from flowseam.demo.run import apply_overrides, default_threads
    from flowseam.demo.text import WORDS
    from flowseam.demo.text_run import (TEXT_DEFAULTS, TEXT_RL_CONFIG, compare_with_control,
                                        seed_sets)
    from flowseam.training import get_reward

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    quiet_libraries()
    recipes = read_recipes(world="text")
    model = args.model or ensure_models(recipes=recipes)["text-t2i"]
    steps = args.steps if args.steps is not None else TEXT_DEFAULTS["steps"]
    group = args.group_size or TEXT_DEFAULTS["group_size"]
    words = list(WORDS[:args.prompts or TEXT_DEFAULTS["prompts"]])
    sets = seed_sets(args.seed_sets or TEXT_DEFAULTS["seed_sets"],
                     args.seeds_per_set or TEXT_DEFAULTS["eval_seeds"])
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in TEXT_RL_CONFIG.items()}
    apply_overrides(base, args.set)
    reward = get_reward("ocr", threads=threads)

    started = time.perf_counter()
    res = compare_with_control(model, words, steps, group,
                               serve_params(recipes["text-t2i"].config), sets, reward,
                               flowseam.Platform(args.backend), base=base, keep_frames=0,
                               control=not args.skip_control)
    before, after, ctrl = res["before"], res["after"], res["control"]
    gain = res["gain"]
    gain_exact = after["exact_match"] - before["exact_match"]
    rows = [
        ("held-out OCR reward", before["ocr_reward"], after["ocr_reward"], gain, ctrl["spread"]),
        ("exact match", before["exact_match"], after["exact_match"], gain_exact,
         ctrl["spread_exact"]),
    ]
    print(f"\nflowgrpo on the ocr reward vs a constant-reward control: {steps} steps, "
          f"{len(words)} prompts, group {group}, {len(sets)} seed sets x {len(sets[0])} seeds "
          f"(control weights moved: {ctrl['weights_moved']})")
    print(f"{'':22s} {'before':>8s} {'after':>8s} {'gain':>8s} {'control spread':>15s} "
          f"{'gain/spread':>12s}")
    for name, b, a, g, sp in rows:
        ratio = f"{g / sp:.1f}" if sp > 0 else "inf"
        print(f"{name:22s} {b:8.3f} {a:8.3f} {g:+8.3f} {sp:15.3f} {ratio:>12s}")
    print(f"per seed set, OCR reward: before {np.round(before['per_set_reward'], 3).tolist()}, "
          f"after {np.round(after['per_set_reward'], 3).tolist()}, control "
          f"{np.round(ctrl['per_set_reward'], 3).tolist()}")
    total = time.perf_counter() - started
    print(f"wall time: control {res['seconds_control']:.0f} s, RL {res['seconds_train']:.0f} s, "
          f"evaluations {res['seconds_evaluations']:.0f} s, total {total:.0f} s")
    if args.json:
        figures = {"steps": steps, "words": words, "group_size": group, "seed_sets": sets,
                   "config": base, "before": before, "after": after, "control": ctrl,
                   "gain": gain, "gain_exact": gain_exact,
                   "gain_over_spread": gain / ctrl["spread"] if ctrl["spread"] > 0 else None,
                   "records": res["result"]["records"], "seconds_total": round(total, 1)}
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2, default=float)


if __name__ == "__main__":
    main()
