"""Run under torchrun by tests/test_parallel.py: a ``flowgrpo`` run whose rollouts are split over
the ranks (``[parallel]``), as a user's script would drive it.

argv: a JSON config, an output directory. Each rank writes ``logprobs{rank}.safetensors``: for
every sample of step 0 it kept, ``seed{S}`` → the log-prob of each SDE step ``(T,)`` float32 (what
its rollout recorded); then every rank runs one training step and rank 0 writes that step's
metrics record to ``record.json``.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from flowseam.training.flowgrpo import FlowGRPO


def main(config_file: str, out: str) -> None:
    torch.set_num_threads(1)
    method = FlowGRPO(json.loads(open(config_file).read()))
    trajectories, _, _, _ = method.rollout(0)
    kept = {}
    for traj in trajectories:
        log_probs = torch.stack([r.log_prob for r in traj.result.records
                                 if r.log_prob is not None], dim=1)  # (B, T)
        for seed, row in zip(traj.result.seeds, log_probs):
            kept[f"seed{seed}"] = row.contiguous()
    save_file(kept, os.path.join(out, f"logprobs{method.dp.rank}.safetensors"))
    record = method.train_step()
    if method.dp.is_main:
        with open(os.path.join(out, "record.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
