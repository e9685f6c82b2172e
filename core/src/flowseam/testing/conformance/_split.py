"""The conformance check of ``sequence_parallel_attention``: the op runs on real ranks.

The op is a collective (contract: :data:`flowseam.ops.SEQUENCE_PARALLEL_ATTENTION`), so one process
cannot call it. The check starts 2 processes (``python -m flowseam.testing.conformance._split
SPEC``, gloo, rendezvous through a file in a temporary directory: no port to pick); each rebuilds
the platform under test from ``Platform.to_dict()``, pins the implementation under test by its id,
passes its contiguous half of the rows of the same seeded q/k/v of every case (:data:`SPLIT_CASES` x
:data:`ATTENTION_DTYPES`) with the platform's own ``attention`` kernel, and saves what it got back
(or the error it raised). The parent joins the halves, and the tests compare them with the numpy
float64 oracle on the whole q/k/v (the unsplit call); the same processes check that every rank
refuses the contract's bad arguments with ``ValueError``. All cases of one implementation run in one
pair of processes, once per session (cached here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._support import ATTENTION_DTYPES, SPLIT_CASES, WORLD, SplitCase, randn

#: Seconds the pair of processes may take in all (starting torch, the platform, every case).
TIMEOUT_S = 300
#: Seconds a collective may wait for the other rank before gloo gives up (a kernel that hangs).
COLLECTIVE_TIMEOUT_S = 60


#: The contract's bad arguments, per rank: id → what is wrong (the shapes are built in
#: :func:`_bad_arguments`). Every rank must raise ValueError before any message is sent.
BAD_ARGUMENTS = {
    "requires_grad": "q requires grad (forward only)",
    "kv_rows": "k and v have other local rows than q (self-attention)",
    "three_d": "3-d q, k, v",
}


def case_key(dtype: str, case: SplitCase) -> str:
    return f"{dtype}-{case.id}"


def full_inputs(case: SplitCase, dtype: str, device: str):
    """The whole seeded q, k, v of ``case`` (what the oracle sees)."""
    return tuple(randn(case.shape, seed, dtype, device) for seed in (41, 42, 43))


# -- the parent's side -------------------------------------------------------------------------

_RESULTS: dict[tuple[str, str], dict] = {}


def split_results(platform: Any, impl_id: str, device: str) -> dict:
    """The results of every case for implementation ``impl_id`` of ``platform``, computed once:
    ``{"cases": {key: {"out": whole output tensor} | {"error": (type, message, is ValueError)}},
    "bad": {id: [(type, message, is ValueError) or None per rank]}}``.

    :raises AssertionError: when the processes fail or time out (with their stderr).
    """
    spec = {"platform": platform.to_dict(), "impl_id": impl_id, "device": device}
    key = (json.dumps(spec, sort_keys=True), impl_id)
    if key not in _RESULTS:
        _RESULTS[key] = _run(spec)
    return _RESULTS[key]


def _run(spec: dict) -> dict:
    import torch

    with tempfile.TemporaryDirectory(prefix="flowseam-split-") as tmp:
        root = Path(tmp)
        spec = dict(spec, out=str(root), store=str(root / "store"))
        (root / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
        procs = []
        for rank in range(WORLD):
            err = open(root / f"stderr{rank}.txt", "w")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "flowseam.testing.conformance._split",
                 str(root / "spec.json")], env=dict(env, RANK=str(rank)),
                stdout=subprocess.DEVNULL, stderr=err), err))
        failed = []
        try:
            for rank, (proc, _) in enumerate(procs):
                try:
                    code = proc.wait(timeout=TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    code = "timed out"
                if code != 0:
                    failed.append((rank, code))
        finally:
            for proc, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                err.close()
        if failed:
            tails = "\n".join(f"--- rank {r} ({c}):\n"
                              + (root / f"stderr{r}.txt").read_text()[-3000:] for r, c in failed)
            raise AssertionError(f"the {WORLD} processes of the sequence_parallel_attention check "
                                 f"did not finish (rank, exit code): {failed}\n{tails}")
        ranks = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    cases = {}
    for key in ranks[0]["cases"]:
        got = [r["cases"][key] for r in ranks]
        errors = [g["error"] for g in got if "error" in g]
        cases[key] = ({"error": errors[0], "all_ranks": len(errors) == WORLD} if errors
                      else {"out": torch.cat([g["out"] for g in got], dim=2)})
    bad = {name: [r["bad"][name] for r in ranks] for name in BAD_ARGUMENTS}
    return {"cases": cases, "bad": bad}


# -- a rank's side -----------------------------------------------------------------------------

def _error(exc: BaseException) -> tuple[str, str, bool]:
    return type(exc).__name__, str(exc), isinstance(exc, ValueError)


def _bad_arguments(name: str, dtype: str, device: str):
    if name == "requires_grad":
        q = randn((1, 4, 4, 8), 1, dtype, device).requires_grad_()
        return q, randn((1, 4, 4, 8), 2, dtype, device), randn((1, 4, 4, 8), 3, dtype, device)
    if name == "kv_rows":
        return (randn((1, 4, 4, 8), 1, dtype, device), randn((1, 4, 3, 8), 2, dtype, device),
                randn((1, 4, 3, 8), 3, dtype, device))
    return tuple(randn((4, 4, 8), s, dtype, device) for s in (1, 2, 3))


def main(spec_path: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from flowseam import ops
    from flowseam.seam.platform import Platform

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    device = spec["device"]
    if device.startswith("cuda") and torch.cuda.device_count() >= WORLD:
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"  # CPU tensors; a kernel moving device tensors on gloo stages them
    dist.init_process_group(backend, init_method=f"file://{spec['store']}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        platform = Platform.from_dict(spec["platform"])
        kernel = platform.kernels.pin(spec["impl_id"])
        attention = platform.kernels.get(ops.ATTENTION)
        group = dist.new_group(list(range(WORLD)))
        cases: dict[str, dict] = {}
        for dtype in ATTENTION_DTYPES:
            for case in SPLIT_CASES:
                q, k, v = full_inputs(case, dtype, device)
                rows = case.shape[2] // WORLD
                mine = [t[:, :, rank * rows:(rank + 1) * rows].contiguous() for t in (q, k, v)]
                try:
                    out = kernel(*mine, group=group, attention=attention, scale=case.scale)
                    cases[case_key(dtype, case)] = {"out": out.detach().cpu()}
                except Exception as exc:  # judged by the parent's test, per case
                    cases[case_key(dtype, case)] = {"error": _error(exc)}
        bad: dict[str, Any] = {}
        for name in BAD_ARGUMENTS:
            try:
                kernel(*_bad_arguments(name, "float32", device), group=group,
                       attention=attention)
                bad[name] = None
            except Exception as exc:
                bad[name] = _error(exc)
        torch.save({"cases": cases, "bad": bad}, Path(spec["out"]) / f"rank{rank}.pt.tmp")
        os.replace(Path(spec["out"]) / f"rank{rank}.pt.tmp", Path(spec["out"]) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
