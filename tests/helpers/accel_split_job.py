"""Run under torchrun (2 ranks) by tests/test_accel.py: one generation on ``Platform("accel")``
split with ``Parallel(sp=2)``. argv: checkpoint, output .npz (rank 0 writes the frames, the
resolved sequence_parallel_attention implementation id and the model's provenance line)."""

import sys

import numpy as np
import torch

import flowseam
from flowseam import DiffusionParams, ops

PARAMS = dict(num_steps=2, height=32, width=32, num_frames=5, guidance_scale=4.0)


def main() -> None:
    torch.set_num_threads(1)
    model = flowseam.load(sys.argv[1], flowseam.Platform("accel"), quiet=True,
                          parallel=flowseam.Parallel(sp=2))
    out = model.generate(["a red ball"], seeds=[7], params=DiffusionParams(**PARAMS))
    if model.parallel.rank == 0:
        impl = model.platform.kernels.get(ops.SEQUENCE_PARALLEL_ATTENTION).impl_id
        np.savez(sys.argv[2], frames=out.frames, impl_id=impl,
                 provenance=model.provenance(solver=False))


if __name__ == "__main__":
    main()
