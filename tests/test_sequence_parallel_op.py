"""The ``sequence_parallel_attention`` op beyond the cpu backend's Ulysses all-to-all: accel's
ring attention on 3 gloo ranks (every k/v block forwarded around the ring, heads that the ranks
do not divide, a value dim other than q's, bf16, a subgroup whose ranks are not the world's)
against the numpy float64 oracle on the whole sequence; and the conformance suite's 2-rank
check (flowseam.testing.conformance._split) failing, as a vendor's CI runs it, for a backend
whose kernel attends to its own rows only — the check is not vacuous.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import FIXTURES, HELPERS, pip_install_target, torchrun

from flowseam.ops import reference

pytest.importorskip("flowseam_accel")

sys.path.insert(0, str(HELPERS))
import ring_job  # noqa: E402  (its CASES: the shapes the ranks ran)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_ring_attention_on_three_ranks_equals_the_unsplit_oracle(tmp_path):
    torchrun("ring_job.py", tmp_path, nproc=3, timeout=300)
    got = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(3)]
    assert "subgroup_heads3" not in got[0]  # rank 0 is not in that group
    for name, (ranks, shape, dv, dtype, scale) in ring_job.CASES.items():
        parts = [got[i][name] for i in ranks]
        assert all(torch.is_tensor(p) for p in parts), parts  # no refusal: any heads split
        out = torch.cat(parts, dim=2)
        assert out.dtype == dtype and tuple(out.shape) == (*shape[:3], dv)
        q, k, v = (t.double().numpy() for t in ring_job.inputs(shape, dv, dtype))
        want = reference.attention(q, k, v, scale=scale)
        rtol, atol = reference.TOLERANCES[str(dtype).removeprefix("torch.")]
        np.testing.assert_allclose(out.double().numpy(), want, rtol=rtol, atol=atol,
                                   err_msg=name)


@pytest.mark.backends
def test_the_conformance_check_fails_for_a_kernel_that_skips_the_other_ranks(tmp_path):
    """flowseam-splitbad's kernel attends over each rank's own rows: every split case of the
    oracle check fails (the ranks' halves differ from the unsplit attention), and the
    bad-arguments check fails on the tensor that requires grad, which it accepts."""
    target = tmp_path / "site"
    pip_install_target([FIXTURES / "split" / "flowseam-splitbad"], target)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf",
                        "--pyargs", "flowseam.testing.conformance", "--flowseam-backend",
                        "splitbad", "-k", "test_kernel"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-3000:]
    failed = set(re.findall(r"^FAILED \S+::(\S+)", r.stdout, flags=re.M))
    from flowseam.testing.conformance._split import SPLIT_CASES
    from flowseam.testing.conformance._support import ATTENTION_DTYPES

    op = "sequence_parallel_attention@generic"
    want = {f"test_kernel_matches_oracle[splitbad-{op}-{dtype}-{case.id}]"
            for dtype in ATTENTION_DTYPES for case in SPLIT_CASES}
    want.add(f"test_kernel_rejects_bad_arguments[splitbad-{op}]")
    assert failed == want, r.stdout[-4000:]
    assert "accepted bad arguments on rank 0 (q requires grad (forward only))" in r.stdout
    assert "sequence_parallel_attention on 2 ranks, joined" in r.stdout
