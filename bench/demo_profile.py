"""Where one ``workflow_rl`` step of ``flowseam demo`` spends its time.

Loads the demo's models (the shipped weights, or the cache: as ``flowseam demo`` finds them),
builds the demo's RL config (:func:`flowseam.demo.run.rl_config`: its prompts, groups of 8, the
same sampling), runs ``--steps`` training steps and prints, per step, the wall seconds of each
phase (rollout / reward / update / sync, from the step's metrics record) and the step's CPU
seconds; with ``--profile N`` it also runs one more step under ``torch.profiler`` and prints the
``N`` torch ops with the most self CPU time, and how many torch ops ran. The load average
(``os.getloadavg``) is printed before and after: on a shared machine, report it with the figures.

    python bench/demo_profile.py --steps 2 --profile 15
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps (default 2)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then one step under torch.profiler: print its N costliest ops")
    args = parser.parse_args()

    import flowseam
    from flowseam.quiet import quiet_libraries
    from flowseam.demo.build import ensure_models, read_recipes
    from flowseam.demo.evaluate import serve_params
    from flowseam.demo.run import PROMPTS, default_threads, rl_config
    from flowseam.training.workflow_rl import WorkflowRL
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(args.threads or default_threads())
    threadpool_limits(limits=torch.get_num_threads())  # numpy / scikit-learn, as flowseam demo
    quiet_libraries()
    print(f"load average before: {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    recipes = read_recipes()
    paths = ensure_models(None, recipes)
    platform = flowseam.Platform("cpu")
    t2i = flowseam.load(paths["digits-t2i"], platform=platform)
    i2v = flowseam.load(paths["digits-i2v"], platform=platform)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    config = rl_config(prompts, args.steps + (1 if args.profile else 0), args.group_size,
                       serve_params(recipes["digits-t2i"].config),
                       serve_params(recipes["digits-i2v"].config))
    rl = WorkflowRL(config, t2i=t2i, i2v=i2v)
    phases = ("rollout", "reward", "update", "sync")
    print("step  " + "  ".join(f"{p:>8}" for p in phases) + "     wall      CPU  (seconds)")
    for _ in range(args.steps):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        record = rl.train_step()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        print(f"{record['step']:>4}  " + "  ".join(f"{record[f'seconds_{p}']:8.2f}" for p in phases)
              + f"  {wall:7.2f}  {cpu:7.2f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rl.train_step()
        events = prof.key_averages()
        print(f"\none step under torch.profiler: {sum(e.count for e in events):,} op calls; "
              f"top {args.profile} by self CPU:")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
