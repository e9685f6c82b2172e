"""Run training methods one after another as ranks of one torchrun job (the library API under
torchrun, as a user's script would): ``torchrun --nproc-per-node N distributed_job.py JOBS.json``.

``JOBS.json``: ``[{"method": NAME, "config": {...}, "weights": PATH or null}, ...]``. After each
run with a ``weights`` path, rank 0 writes the rollout copy of every trained DiT (what the trainer
synced to it) there as safetensors, keyed ``<stage>.<parameter>``.
"""

import json
import sys

from safetensors.torch import save_file

from flowseam.training import get_method


def main(jobs_file: str) -> None:
    for job in json.loads(open(jobs_file).read()):
        method = get_method(job["method"])(job["config"])
        method.run(progress=False)
        stages = getattr(method, "stages", None) or [method.stage]
        if job["weights"] and method.dp.is_main:
            save_file({f"{s.name}.{k}": v.contiguous() for s in stages
                       for k, v in s.model.dit.state_dict().items()}, job["weights"])


if __name__ == "__main__":
    main(sys.argv[1])
