"""Run under torchrun by tests/test_parallel.py: generations split over the ranks.

argv[1]: a JSON file with a list of jobs ``{"model", "sp", "cfg", "params", "image", "out"}``;
every rank loads each model with ``flowseam.Parallel(sp, cfg)`` and runs the same request; rank 0
writes ``out`` (.npz: the frames, the DiT's first-block token count and batch per forward, and
how many calls each kind of attention processor routed), or the error text of a refused request.
"""

import json
import os
import sys

import numpy as np
import torch

import flowseam
from flowseam import DiffusionParams


def main() -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    for job in json.load(open(sys.argv[1])):
        model = flowseam.load(job["model"], flowseam.Platform("cpu"), quiet=True,
                              parallel=flowseam.Parallel(sp=job["sp"], cfg=job["cfg"]))
        seen = []  # (expert index, batch, tokens) entering each expert's second block
        for e, expert in enumerate(model.experts.values()):
            block = expert.blocks[1] if hasattr(expert, "blocks") else expert.transformer_blocks[1]
            block.register_forward_pre_hook(
                lambda mod, args, kw, e=e: seen.append(
                    (e, *(args[0] if args else kw["hidden_states"]).shape[:2])),
                with_kwargs=True)
        image = np.load(job["image"]) if job.get("image") else None
        try:
            out = model.generate(["a red ball"], image=image, seeds=[7],
                                 params=DiffusionParams(**job["params"]))
        except ValueError as exc:
            if rank == 0:
                np.savez(job["out"], error=str(exc))
            continue
        if rank == 0:
            calls = {}
            for name, proc in model.dit.attn_processors.items():
                kind = "cross" if name.endswith("attn2.processor") else "self"
                calls[kind] = calls.get(kind, 0) + proc.calls
            np.savez(job["out"], frames=out.frames, seen=np.array(seen),
                     self_calls=calls.get("self", 0), cross_calls=calls.get("cross", 0),
                     provenance=model.provenance(solver=False))


if __name__ == "__main__":
    main()
