"""Run under torchrun (3 ranks) by tests/test_sequence_parallel_op.py: accel's ring attention on
the whole world and on the subgroup of ranks 1 and 2 (group ranks differ from global ranks there).

argv[1]: an output directory; rank r writes ``rank{r}.pt``: {case id: the output rows it got, or
the error text}.
"""

import os
import sys

import torch
import torch.distributed as dist

from flowseam_accel.kernels import ring_attention

#: case id → (ranks of the group, (B, H, S, D), Dv, dtype, scale); S is split over the group.
CASES = {
    "world_heads5_dv6": ((0, 1, 2), (2, 5, 12, 8), 6, torch.float32, None),
    "world_bf16": ((0, 1, 2), (1, 2, 9, 4), 4, torch.bfloat16, 0.5),
    "subgroup_heads3": ((1, 2), (1, 3, 10, 8), 8, torch.float32, None),
}


def inputs(shape, dv, dtype):
    g = torch.Generator().manual_seed(17)
    q, k = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn((*shape[:3], dv), generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = {}
    for name, (ranks, shape, dv, dtype, scale) in CASES.items():
        group = dist.new_group(list(ranks))  # a collective of the whole world
        if rank not in ranks:
            continue
        me, rows = ranks.index(rank), shape[2] // len(ranks)
        q, k, v = (t[:, :, me * rows:(me + 1) * rows] for t in inputs(shape, dv, dtype))
        try:
            got[name] = ring_attention(q, k, v, group=group, scale=scale)
        except ValueError as exc:
            got[name] = str(exc)
    torch.save(got, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
