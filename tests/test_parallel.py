"""Sequence (Ulysses) and CFG parallelism: one generation split over torch.distributed ranks.

Each split generation is compared with the same request run in one process (the reference is
flowseam's own unsplit loop, which tests/test_models.py checks against diffusers): frames within
1e-5. Each job also records what it split — the tokens and batch entering a DiT block, and the
calls each kind of attention routed — so a run that silently did not split would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import torchrun

import flowseam
from flowseam import DiffusionParams, InvalidInputError, Parallel
from flowseam.testing.tiny import write_tiny_checkpoint

WAN = dict(num_steps=2, height=32, width=32, num_frames=5, guidance_scale=4.0)
FLUX = dict(num_steps=2, height=32, width=32, max_sequence_length=16)
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    image = root / "image.npy"
    np.save(image, np.random.default_rng(0).random((32, 32, 3)).astype(np.float32))
    cards = ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-t2v", "flux.1-t2i")
    return {c: write_tiny_checkpoint(c, root / c) for c in cards} | {"image": image, "root": root}


def one_process(path, params, image=None) -> np.ndarray:
    model = flowseam.load(path, flowseam.Platform("cpu"), quiet=True)
    img = np.load(image) if image is not None else None
    return model.generate(["a red ball"], image=img, seeds=[7],
                          params=DiffusionParams(**params)).frames


def run_jobs(jobs: list[dict], root: Path, nproc: int) -> list[dict]:
    spec = root / f"jobs-{nproc}.json"
    spec.write_text(json.dumps(jobs))
    torchrun("parallel_job.py", spec, nproc=nproc)
    return [dict(np.load(j["out"])) for j in jobs]


def job(ckpts, card, sp, cfg, params, name, image=False) -> dict:
    return {"model": str(ckpts[card]), "sp": sp, "cfg": cfg, "params": params,
            "image": str(ckpts["image"]) if image else None,
            "out": str(ckpts["root"] / f"{name}.npz")}


@pytest.mark.slow
def test_two_ranks_equal_one_process_for_every_splittable_card(ckpts):
    """Wan2.1 T2V and I2V and Wan2.2's two experts with --sp 2 and with --cfg-parallel, FLUX.1
    with --sp 2: frames within 1e-5 of one process; the block saw half the tokens (sp) or half
    the batch (CFG); tokens that 2 does not divide are refused naming the count."""
    cases = [("wan2.1-t2v", WAN, False), ("wan2.1-i2v", WAN, True), ("wan2.2-t2v", WAN, False)]
    jobs = []
    for card, params, image in cases:
        jobs.append(job(ckpts, card, 2, False, params, f"{card}-sp2", image))
        jobs.append(job(ckpts, card, 1, True, params, f"{card}-cfg", image))
    jobs.append(job(ckpts, "flux.1-t2i", 2, False, FLUX, "flux-sp2"))
    odd = dict(WAN, height=48, width=48, num_frames=1)  # 1 x 3 x 3 = 9 tokens after patching
    jobs.append(job(ckpts, "wan2.1-t2v", 2, False, odd, "odd"))
    results = run_jobs(jobs, ckpts["root"], 2)

    # one process: latent 2 x 4 x 4 → 2 x 2 x 2 = 8 Wan tokens, a CFG batch of 2 (B = 1);
    # FLUX: 2 x 2 = 4 image + 16 text tokens, no CFG batch
    for k, (card, params, image) in enumerate(cases):
        ref = one_process(ckpts[card], params, ckpts["image"] if image else None)
        sp, cfg = results[2 * k], results[2 * k + 1]
        assert np.abs(sp["frames"] - ref).max() <= TOL, card
        assert np.abs(cfg["frames"] - ref).max() <= TOL, card
        assert {tuple(s[1:]) for s in sp["seen"]} == {(2, 4)}, card   # 8 tokens split in two
        assert {tuple(s[1:]) for s in cfg["seen"]} == {(1, 8)}, card  # one CFG branch per rank
        experts = {int(s[0]) for s in sp["seen"]} | {int(s[0]) for s in cfg["seen"]}
        assert experts == ({0, 1} if card.startswith("wan2.2") else {0}), card  # both ran split
        assert int(sp["self_calls"]) > 0 and int(sp["cross_calls"]) > 0
    flux = results[-2]
    assert np.abs(flux["frames"] - one_process(ckpts["flux.1-t2i"], FLUX)).max() <= TOL
    assert {tuple(s[1:]) for s in flux["seen"]} == {(1, 2)}  # 4 image tokens split in two
    assert "sequence_parallel_attention=cpu:" in str(flux["provenance"])
    assert "parallel: sp=2" in str(flux["provenance"])
    assert "9 tokens after patching, not a multiple of 2" in str(results[-1]["error"])


@pytest.mark.slow
def test_four_ranks_sequence_times_cfg_parallel(ckpts):
    """--sp 2 --cfg-parallel on 4 ranks: each rank half the tokens of one CFG branch."""
    out = run_jobs([job(ckpts, "wan2.1-t2v", 2, True, WAN, "sp2-cfg")], ckpts["root"], 4)[0]
    assert np.abs(out["frames"] - one_process(ckpts["wan2.1-t2v"], WAN)).max() <= TOL
    assert {tuple(s[1:]) for s in out["seen"]} == {(1, 4)}


def test_split_points_are_diffusers_context_parallel_plans():
    """The cards split where diffusers' own context-parallel plans (``_cp_plan``) do."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from flowseam.models import FLUX_T2I, WAN_T2V

    wan, flux = WanTransformer3DModel._cp_plan, FluxTransformer2DModel._cp_plan
    split = WAN_T2V.split.sequence
    assert split.outputs == {"rope": {i: p.split_dim for i, p in wan["rope"].items()}}
    assert split.inputs == {"blocks.0": {"hidden_states": wan["blocks.0"]["hidden_states"].split_dim}}
    assert split.gather == {"proj_out": wan["proj_out"].gather_dim}
    split = FLUX_T2I.split.sequence
    assert split.inputs == {"": {k: p.split_dim for k, p in flux[""].items()}}
    assert split.gather == {"proj_out": flux["proj_out"].gather_dim}


@pytest.mark.parametrize("card, parallel, message", [
    ("wan2.1-causal-t2v", Parallel(sp=2), "cannot split its sequence (the causal loop"),
    ("wan2.1-t2v", Parallel(sp=4), "has 2 attention heads, not a multiple of 4"),
    ("flux.1-t2i", Parallel(cfg=True), "no unconditional branch"),
    ("ltx2-t2v", Parallel(sp=2), "cannot split its sequence"),
])
def test_layouts_a_card_cannot_run_are_refused_before_weights_load(tmp_path, no_weights, card,
                                                                     parallel, message):
    path = write_tiny_checkpoint(card, tmp_path / card)
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(")):
        flowseam.load(path, flowseam.Platform("cpu"), quiet=True, parallel=parallel)


def test_parallel_arguments_are_checked():
    with pytest.raises(InvalidInputError, match="sp=0 must be an int >= 1"):
        Parallel(sp=0)
    with pytest.raises(InvalidInputError, match="cfg='yes'"):
        Parallel(cfg="yes")
    assert Parallel(sp=2, cfg=True).world_size == 4


def test_a_process_that_is_not_a_rank_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan")
    with pytest.raises(flowseam.FlowseamError, match="needs 2 ranks; this process is not one"):
        flowseam.load(path, flowseam.Platform("cpu"), quiet=True, parallel=Parallel(sp=2))


@pytest.mark.slow
def test_flowgrpo_split_rollouts_record_the_one_process_log_probs(ckpts, tmp_path):
    """flowgrpo with ``[parallel] sp = 2`` on 2 ranks: every sample's recorded log-probs equal a
    one-process rollout's (same seeds), every rank keeps its data-parallel share, and the first
    inner epoch's PPO ratio is 1 on every rank (C2, |ratio - 1| <= 1e-6)."""
    from safetensors.torch import load_file

    from flowseam.training.flowgrpo import FlowGRPO

    cfg = dict(model=str(ckpts["wan2.1-t2v"]), backend="cpu", prompts=["a red ball"],
               reward="brightness", group_size=4, prompts_per_step=1, steps=1, seed=3,
               sampling=dict(num_steps=3, height=32, width=32, num_frames=5, guidance_scale=4.0),
               grpo=dict(beta=0.04, clip_range=0.2))
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps(dict(cfg, parallel={"sp": 2})))
    torchrun("grpo_parallel_job.py", spec, tmp_path)
    ranks = [load_file(str(tmp_path / f"logprobs{i}.safetensors")) for i in range(2)]
    one = FlowGRPO(cfg)
    trajectories, _, _, _ = one.rollout(0)
    want = {}
    for traj in trajectories:
        lp = torch.stack([rec.log_prob for rec in traj.result.records], dim=1)
        want |= {f"seed{s}": row for s, row in zip(traj.result.seeds, lp)}
    got = ranks[0] | ranks[1]
    assert set(got) == set(want) and not set(ranks[0]) & set(ranks[1])
    for key, row in want.items():
        np.testing.assert_allclose(got[key].numpy(), row.numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    record = json.loads((tmp_path / "record.json").read_text())
    assert len(record["ratio_dev_first_epoch_by_rank"]) == 2
    assert max(record["ratio_dev_first_epoch_by_rank"]) <= 1e-6
    assert record["updated"]


def test_flowgrpo_parallel_must_take_every_rank(ckpts):
    from flowseam.training.flowgrpo import FlowGRPO

    cfg = dict(model=str(ckpts["wan2.1-t2v"]), prompts=["a"], group_size=4, steps=1,
               parallel={"sp": 2})
    with pytest.raises(flowseam.FlowseamError,
                       match=r"\[parallel\] sp=2 splits each rollout over 2 ranks, and takes every "
                             r"rank of the run; the run has 1 \(flowseam train --nproc 2\)"):
        FlowGRPO(cfg)
    with pytest.raises(flowseam.FlowseamError, match="the run has 4"):
        FlowGRPO.check_world_size(cfg, 4)
    with pytest.raises(flowseam.FlowseamError, match=r"config \[parallel\] sp=0: Input should be greater than or equal to 1"):
        FlowGRPO(dict(cfg, parallel={"sp": 0}))
