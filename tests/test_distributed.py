"""Data-parallel training on torch.distributed (gloo, 2 CPU processes): a 2-rank run equals a
1-rank run of the same global batch, C2 holds on every rank, rank 0 alone writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import flowseam
from flowseam import FlowseamError
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.checkpoint import latest_checkpoint
from flowseam.training.distributed import DataParallel
from flowseam.training.metrics import read_metrics

SAMPLING = dict(num_steps=3, height=32, width=32, max_sequence_length=16)
#: C1 tolerance of a 2-rank run against a 1-rank run: each rank's DiT sees batches of 2 instead
#: of 4 rows and runs 1 torch thread instead of the test process's, so float sums round
#: differently; the group-relative advantage divides reward differences by their std, so its
#: relative error is larger than the rewards'
TOL = dict(rewards=1e-5, advantages=1e-3, weights=1e-5)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("dist") / "flux")


def _toml(path, cfg):
    lines, tables = [], []
    for k, v in cfg.items():
        (tables if isinstance(v, dict) else lines).append((k, v))
    fmt = lambda v: str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')  # noqa: E731
    text = "".join(f"{k} = {fmt(v)}\n" for k, v in lines)
    for name, table in tables:
        text += f"[{name}]\n" + "".join(f"{k} = {fmt(v)}\n" for k, v in table.items())
    path.write_text(text)
    return path


def test_shards_cover_every_sample_once_with_equal_work():
    """Hand-checked sharding rule: members when K % N == 0, else whole groups."""
    def shards(G, K, N):
        return [DataParallel(rank=r, world_size=N).shard_groups(G, K) for r in range(N)]

    member = shards(2, 4, 2)
    assert [s.parts() for s in member] == [[(0, [0, 1]), (1, [0, 1])], [(0, [2, 3]), (1, [2, 3])]]
    group = shards(4, 3, 2)
    assert [s.parts() for s in group] == [[(0, [0, 1, 2]), (1, [0, 1, 2])],
                                         [(2, [0, 1, 2]), (3, [0, 1, 2])]]
    for G, K, N in ((1, 8, 4), (3, 2, 2), (2, 3, 2), (6, 5, 3)):
        cover = sorted((g, k) for s in shards(G, K, N) for g, ks in s.parts() for k in ks)
        assert cover == [(g, k) for g in range(G) for k in range(K)], (G, K, N)
        assert len({len(s.parts()) for s in shards(G, K, N)}) == 1  # same batches per rank
    full = torch.arange(8.0).view(2, 4)
    assert member[1].local(full).tolist() == [[2.0, 3.0], [6.0, 7.0]]
    with pytest.raises(FlowseamError, match=r"group_size=3 × prompts_per_step=1 cannot be split "
                                            r"evenly over 2 ranks"):
        DataParallel(rank=0, world_size=2).shard_groups(1, 3)
    with pytest.raises(FlowseamError, match="batch_size=3 cannot be split evenly over 2 ranks"):
        DataParallel(rank=0, world_size=2).shard_rows(3)


def test_nproc_errors_before_any_rank_starts(flux, tmp_path, capsys):
    from flowseam.cli import main

    cfg = _toml(tmp_path / "c.toml", dict(model=str(flux), prompts=["a"], group_size=3, steps=1))
    assert main(["train", "--method", "flowgrpo", "--config", str(cfg), "--nproc", "0"]) == 2
    assert "--nproc=0 must be >= 1" in capsys.readouterr().err
    assert main(["train", "--method", "flowgrpo", "--config", str(cfg), "--nproc", "2"]) == 2
    assert "group_size=3 × prompts_per_step=1 cannot be split evenly over 2 ranks" in capsys.readouterr().err
    with pytest.raises(FlowseamError, match="fsdp = true needs several ranks"):
        DataParallel.from_env(fsdp=True)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_flowgrpo(flux, tmp_path):
    """`flowseam train --nproc 2` (gloo) vs the same config on one process: same metrics and
    final weights within TOL, the first inner epoch's ratio is 1 on each rank, and only rank 0
    wrote (one metrics line per step, one checkpoint)."""
    from conftest import run_cli

    from flowseam.training.flowgrpo import FlowGRPO

    cfg = dict(model=str(flux), backend="cpu", prompts=["a ball", "a box", "a cup"],
               reward="brightness", group_size=4, prompts_per_step=2, steps=2, seed=3,
               checkpoint_every=2, sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2),
               optim=dict(lr=1e-3))
    two = _toml(tmp_path / "two.toml", dict(cfg, output_dir=str(tmp_path / "two")))
    r = run_cli("train", "--method", "flowgrpo", "--config", str(two), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("flowgrpo: 2 steps") == 1  # rank 0 reports

    flowseam.plugins._CACHE = None
    one = FlowGRPO(dict(cfg, output_dir=str(tmp_path / "one")))
    assert one.dp.world_size == 1
    one.run(progress=False)

    m2, m1 = read_metrics(tmp_path / "two" / "metrics.jsonl"), read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in m2] == [1, 2]
    for a, b in zip(m2, m1):
        assert a["ratio_dev_first_epoch_by_rank"] and len(a["ratio_dev_first_epoch_by_rank"]) == 2
        assert max(a["ratio_dev_first_epoch_by_rank"]) <= 1e-6  # C2 on every rank
        assert b["ratio_dev_first_epoch"] <= 1e-6
        for key in ("reward_mean", "reward_std"):
            assert a[key] == pytest.approx(b[key], rel=TOL["rewards"]), key
        for key in ("adv_mean", "adv_std", "adv_min", "adv_max", "kl_ref", "grad_norm", "ratio_mean"):
            assert a[key] == pytest.approx(b[key], rel=TOL["advantages"], abs=1e-7), key
        assert a["weights_version"] == b["weights_version"] and a["updated"] and b["updated"]
        assert {k for k in a if not k.startswith("seconds_")} - {k for k in b} == {
            "ratio_dev_first_epoch_by_rank"}
    w2 = load_file(str(latest_checkpoint(tmp_path / "two" / "checkpoints") / "weights-dit.safetensors"))
    w1 = load_file(str(latest_checkpoint(tmp_path / "one" / "checkpoints") / "weights-dit.safetensors"))
    start = flowseam.load(flux, platform=flowseam.Platform("cpu")).dit.state_dict()
    assert w2.keys() == w1.keys()
    moved = max(float((w1[n] - start[n]).abs().max()) for n in w1)
    diff = max(float((w2[n] - w1[n]).abs().max()) for n in w1)
    assert moved > 1e-4 and diff <= TOL["weights"], (moved, diff)  # trained, and equally
