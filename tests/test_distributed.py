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
#: AdamW's eps in these comparisons is at the scale of the gradients (elements ~1e-4..1e-2 after
#: clipping to norm 1): Adam moves an element by about lr * g / (|g| + eps), which with the default
#: eps = 1e-8 turns an element whose gradient is at float noise (~1e-8, a bias feeding a norm)
#: into a move of up to ±lr on rounding alone (seen: 1e-3 with lr = 1e-3) and hides a wrongly
#: scaled gradient (a missing factor of the world size) entirely. With lr / eps = 1 the update is
#: 1-Lipschitz in g, so the weights agree as well as the gradients do (~1e-6)
OPTIM = dict(lr=1e-3, adam_eps=1e-3)


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
               reward={"brightness": 1.0, "channel_contrast": 0.5},  # components gathered too
               group_size=4, prompts_per_step=2, steps=2, seed=3,
               checkpoint_every=2, sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2),
               optim=OPTIM)
    two = _toml(tmp_path / "two.toml", dict(cfg, output_dir=str(tmp_path / "two")))
    r = run_cli("train", "--method", "flowgrpo", "--config", str(two), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("flowgrpo: 2 steps") == 1  # rank 0 reports

    flowseam.seam.discovery._CACHE = None
    one = FlowGRPO(dict(cfg, output_dir=str(tmp_path / "one")))
    assert one.dp.world_size == 1
    one.run(progress=False)

    m2, m1 = read_metrics(tmp_path / "two" / "metrics.jsonl"), read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in m2] == [1, 2]
    for a, b in zip(m2, m1):
        assert a["ratio_dev_first_epoch_by_rank"] and len(a["ratio_dev_first_epoch_by_rank"]) == 2
        assert max(a["ratio_dev_first_epoch_by_rank"]) <= 1e-6  # C2 on every rank
        assert b["ratio_dev_first_epoch"] <= 1e-6
        for key in ("reward_mean", "reward_std", "reward_brightness_mean", "reward_brightness_std",
                    "reward_channel_contrast_mean", "reward_channel_contrast_std"):
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


@pytest.mark.slow
def test_two_ranks_equal_one_rank_workflow_rl_finetune_and_fsdp(flux, tmp_path):
    """One torchrun job of 2 ranks (the library API under torchrun) runs workflow_rl (groups
    split whole over the ranks), finetune (the batch split by rows) and flowgrpo with FSDP2
    (a sharded policy and reference; one step, a checkpoint of the sharded AdamW state, then a
    second run resuming from it); each equals the same run, uninterrupted, on one process."""
    import json

    import numpy as np
    from conftest import torchrun

    from flowseam.training import get_method

    i2v = write_tiny_checkpoint("wan2.1-i2v", tmp_path / "wan-i2v")
    rng = np.random.RandomState(0)
    for i in range(4):
        np.save(tmp_path / f"x{i}.npy", np.clip(rng.rand(1, 32, 32, 3) * 0.3 + i / 5, 0, 1).astype(np.float32))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"digit {i}", "video": f"x{i}.npy"}) + "\n"
                                                 for i in range(4)))
    grpo = dict(beta=0.04, clip_range=0.2)
    jobs = {
        "workflow_rl": dict(t2i_model=str(flux), i2v_model=str(i2v), t2i_backend="cpu", i2v_backend="cpu",
                            prompts=["a ball", "a box"], group_size=3, prompts_per_step=2, steps=1, seed=1,
                            t2i_sampling=dict(num_steps=2, height=32, width=32, max_sequence_length=16),
                            i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5),
                            grpo=grpo, optim=OPTIM),
        "finetune": dict(model=str(flux), backend="cpu", data=str(tmp_path / "data.jsonl"), steps=2,
                         batch_size=4, seed=2, optim=OPTIM,
                         train=dict(p_uncond=0.5, sigma_sampling="uniform")),
        "flowgrpo": dict(model=str(flux), backend="cpu", prompts=["a ball"], group_size=2, steps=2,
                         seed=4, checkpoint_every=1, sampling=dict(SAMPLING, num_steps=2), grpo=grpo,
                         optim=OPTIM, distributed=dict(fsdp=True)),
    }
    spec = [{"method": m, "config": dict(c, output_dir=str(tmp_path / f"two-{m}")),
             "weights": str(tmp_path / f"two-{m}.safetensors")} for m, c in jobs.items()]
    spec.insert(2, dict(spec[2], config=dict(spec[2]["config"], steps=1), weights=None))  # then resume
    (tmp_path / "jobs.json").write_text(json.dumps(spec))
    torchrun("distributed_job.py", tmp_path / "jobs.json")

    for name, cfg in jobs.items():
        flowseam.seam.discovery._CACHE = None
        one = get_method(name)(dict(cfg, output_dir=str(tmp_path / f"one-{name}"),
                                    distributed={}))
        one.run(progress=False)
        m2 = read_metrics(tmp_path / f"two-{name}" / "metrics.jsonl")
        m1 = read_metrics(tmp_path / f"one-{name}" / "metrics.jsonl")
        assert len(m2) == len(m1) == cfg["steps"], name
        for a, b in zip(m2, m1):
            for key, value in b.items():
                if key.startswith("seconds_") or not isinstance(value, float):
                    continue
                rel = TOL["rewards"] if key.startswith(("reward", "loss")) else TOL["advantages"]
                assert a[key] == pytest.approx(value, rel=rel, abs=1e-7), (name, key)
            devs = [v for k, v in a.items() if k.endswith("ratio_dev_first_epoch_by_rank")]
            assert len(devs) == (2 if name == "workflow_rl" else 0 if name == "finetune" else 1), name
            assert all(len(d) == 2 and max(d) <= 1e-6 for d in devs), (name, devs)  # C2 per rank
        two = load_file(str(tmp_path / f"two-{name}.safetensors"))
        stages = getattr(one, "stages", None) or [one.stage]
        mine = {f"{s.name}.{k}": v for s in stages for k, v in s.model.dit.state_dict().items()}
        assert two.keys() == mine.keys()
        diff = max(float((two[k] - mine[k]).abs().max()) for k in mine)
        assert diff <= TOL["weights"], (name, diff)
        assert any(not torch.equal(mine[k], v) for k, v in
                   {f"{s.name}.{k}": v for s in stages for k, v in
                    flowseam.load(s.model.path, platform=flowseam.Platform("cpu")).dit.state_dict().items()}.items()), name
