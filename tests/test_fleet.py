"""Weights that travel: WeightUpdate (version, checksum, safetensors bytes), and the Ray rollout
fleet built from the driver's frozen Platform."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os

import pytest
import torch
from safetensors.torch import load as load_safetensors

import flowseam
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.weight_sync import WeightChecksumError, WeightRole, WeightSyncPlan
from test_distributed import OPTIM, TOL


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("fleet") / "flux")


def test_weight_update_carries_version_checksum_and_the_synced_weights(flux):
    cpu = flowseam.Platform("cpu")
    trainer_side, worker_side = flowseam.load(flux, platform=cpu), flowseam.load(flux, platform=cpu)
    student = copy.deepcopy(trainer_side.dit)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.25)

    class Receiver:
        got = []

        def push(self, update):
            self.got.append(update)

    plan = WeightSyncPlan(student, trainer_side, "transformer", WeightRole.EMA, decay=0.5,
                          receivers=[Receiver()])
    plan.sync()  # the first EMA sync copies
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    plan.sync()  # now averages: what travels is the average, computed once on the trainer
    first, second = Receiver.got
    assert (first.version, second.version) == (1, 2) and second.role is WeightRole.EMA
    assert second.checksum == hashlib.sha256(second.data).hexdigest()
    sent = load_safetensors(second.data)
    assert sent.keys() == trainer_side.dit.state_dict().keys()
    for name, value in trainer_side.dit.state_dict().items():
        assert torch.equal(sent[name], value), name

    before = worker_side.versions["transformer"]
    second.apply(worker_side)
    assert worker_side.versions["transformer"] == before + 1  # its caches miss from now on
    for (name, a), b in zip(worker_side.dit.state_dict().items(), trainer_side.dit.state_dict().values()):
        assert torch.equal(a, b), name

    # a flipped byte is refused before anything changes
    corrupted = bytearray(second.data)
    corrupted[-1] ^= 0xFF
    bad = dataclasses.replace(second, data=bytes(corrupted))
    fresh = flowseam.load(flux, platform=cpu)
    untouched = {n: p.clone() for n, p in fresh.dit.state_dict().items()}
    with pytest.raises(WeightChecksumError, match="weight update v2 of 'transformer': sha256"):
        bad.apply(fresh)
    assert all(torch.equal(untouched[n], p) for n, p in fresh.dit.state_dict().items())
    wan = flowseam.load(write_tiny_checkpoint("wan2.1-t2v", fresh.path.parent / "wan"), platform=cpu)
    with pytest.raises(ValueError, match="does not fit wan2.1-t2v"):
        second.apply(wan)


# -- the Ray fleet ------------------------------------------------------------------------------
SAMPLING = dict(num_steps=2, height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the Ray tests need flowseam[ray]")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written offline
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def trainers(flux, ray_cluster):
    """The same flowgrpo run twice: in this process, and on a fleet of 2 rollout workers (one
    torch thread each) plus 1 reward worker. Each test advances both by one step. The reward is
    a weighted sum, so the reward worker returns each component's scores too."""
    from flowseam.training.flowgrpo import FlowGRPO

    flowseam.seam.discovery._CACHE = None
    cpu = flowseam.Platform("cpu")
    cfg = dict(prompts=["a ball", "a box"], reward={"brightness": 1.0, "channel_contrast": 0.5},
               group_size=4, prompts_per_step=1,
               steps=10, seed=5, sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2), optim=OPTIM)
    local = FlowGRPO(cfg, model=flowseam.load(flux, platform=cpu))
    remote = FlowGRPO(dict(cfg, ray=dict(rollout_workers=2, reward_workers=1)),
                      model=flowseam.load(flux, platform=cpu))
    yield local, remote
    remote.close()


def _same_step(local, remote):
    """One step of each; the fleet's step equals the in-process one within TOL."""
    a, b = local.train_step(), remote.train_step()
    assert a["step"] == b["step"] and a["weights_version"] == b["weights_version"]
    assert b["ratio_dev_first_epoch"] <= 1e-6  # the trainer's pinned recompute of a worker's rollout
    for key in ("reward_mean", "reward_std", "reward_brightness_mean", "reward_brightness_std",
                "reward_channel_contrast_mean", "reward_channel_contrast_std"):
        assert b[key] == pytest.approx(a[key], rel=TOL["rewards"]), key
    for key in ("adv_mean", "adv_std", "adv_min", "adv_max", "kl_ref", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=TOL["advantages"], abs=1e-7), key
    wa, wb = local.stage.policy.state_dict(), remote.stage.policy.state_dict()
    assert max(float((wa[n] - wb[n]).abs().max()) for n in wa) <= TOL["weights"]
    return a, b


@pytest.mark.slow  # a local Ray and 3 actors
def test_fleet_step_equals_the_in_process_step(trainers):
    """Two rollout actors built from the driver's frozen Platform (no plugin discovery), rewards
    in their own actor: one flowgrpo step equals the same step run in-process."""
    local, remote = trainers
    described = remote.fleet.describe()
    assert len(described) == 2 and len({d["pid"] for d in described} | {os.getpid()}) == 3
    for d in described:
        assert d["platform"] == remote.model.platform.to_dict()
        assert d["discovered_plugins"] is False and d["torch_threads"] == 1
    before = dict(remote.fleet.stats)
    _same_step(local, remote)
    assert remote.fleet.stats["shares"] - before["shares"] == 2  # the group split over 2 workers
    assert remote.fleet.stats["rerun"] == before["rerun"]


@pytest.mark.slow  # a local Ray and 3 actors
def test_a_stale_worker_is_detected_and_never_used(trainers):
    """A worker that holds an older version (here: other weights under version - 1) refuses to
    roll out; the fleet pushes it the current weights and reruns, so the step still equals the
    in-process one."""
    from flowseam.training.fleet import StaleWeightsError
    from flowseam.training.weight_sync import WeightUpdate

    local, remote = trainers
    ray, fleet = remote.fleet._ray, remote.fleet
    current = fleet.versions["transformer"]
    wrong = copy.deepcopy(remote.model.dit)
    with torch.no_grad():
        for p in wrong.parameters():
            p.add_(0.1)
    ray.get(fleet.workers[1].apply.remote(WeightUpdate.of(wrong, "transformer", WeightRole.STUDENT,
                                                          current - 1)))
    request = flowseam.GenerationRequest("a ball", flowseam.TaskType.T2I,
                                         flowseam.DiffusionParams(sde_rollout=True, **SAMPLING), seeds=[0])
    meta, _ = fleet.workers[1].rollout.options(num_returns=2).remote(request, {"transformer": current},
                                                                     "rollout")
    with pytest.raises(StaleWeightsError, match=f"holds weight versions {{'transformer': {current - 1}}}"):
        ray.get(meta)
    stale = fleet.stats["stale"]
    _same_step(local, remote)
    assert fleet.stats["stale"] - stale == 1  # worker 1's share was refused, then rerun


@pytest.mark.slow  # a local Ray and 3 actors
def test_a_worker_killed_during_a_step_is_replaced_and_its_share_rerun(trainers, monkeypatch):
    """SIGKILL one rollout actor right after the step's first share went to it: a new actor takes
    its placement bundle, receives the current weights, reruns what the dead one held; the step
    loses and duplicates nothing (it equals the in-process step)."""
    import signal

    local, remote = trainers
    fleet = remote.fleet
    victim = fleet.describe()[0]["pid"]
    submit, killed = fleet._submit, []

    def submit_then_kill(share, worker, expected, prompts):
        submit(share, worker, expected, prompts)
        if worker == 0 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(share.index)

    monkeypatch.setattr(fleet, "_submit", submit_then_kill)
    before = dict(fleet.stats)
    _same_step(local, remote)
    assert killed == [0]
    assert fleet.stats["replaced"] - before["replaced"] == 1
    assert fleet.stats["rerun"] - before["rerun"] == 1  # worker 0's share
    assert fleet.stats["shares"] - before["shares"] == 2
    (replacement, _) = fleet.describe()
    assert replacement["pid"] != victim and replacement["discovered_plugins"] is False
    assert fleet._ray.get(fleet.workers[0].apply.remote(fleet._updates["transformer"])) == \
        fleet.versions["transformer"]


@pytest.mark.slow  # a local Ray and 3 actors
def test_fleet_refuses_what_the_cluster_cannot_hold(trainers):
    from flowseam import FlowseamError
    from flowseam.training.fleet import RolloutFleet

    _, remote = trainers
    with pytest.raises(FlowseamError, match=r"5 rollout workers of \{'CPU': 1\} need \{'CPU': 5\}"):
        RolloutFleet(remote.model, 5)
    with pytest.raises(FlowseamError, match="placement='EVERYWHERE'; allowed: PACK"):
        RolloutFleet(remote.model, 1, placement="EVERYWHERE")


@pytest.mark.slow  # a local Ray and 3 actors (+ 1 reward actor here)
def test_a_reward_workers_fault_reaches_the_trainer_as_it_is(trainers):
    """A reward that raises in a reward actor: the trainer gets the RewardFaultError itself
    (naming the reward and its plugin, one line), not Ray's wrapper with a remote traceback."""
    from flowseam import RewardFaultError
    from flowseam.rewards.simple import ChannelContrast
    from flowseam.rewards.spec import Reward, RewardComponent

    _, remote = trainers
    fleet = remote.fleet
    broken = ChannelContrast(0)
    broken.channel = 7  # indexes past the 3 channels: IndexError in the actor
    worker = fleet._reward_cls.remote(Reward([RewardComponent(
        "channel_contrast", broken, plugin="methods", distribution="flowseam", version="0.1.0")]))
    kept, fleet.reward_workers = fleet.reward_workers, [worker]
    try:
        request = flowseam.GenerationRequest(["a ball"] * 2, flowseam.TaskType.T2I,
                                             flowseam.DiffusionParams(sde_rollout=True, **SAMPLING),
                                             seeds=[0, 1])
        with pytest.raises(RewardFaultError, match=r"reward 'channel_contrast' of plugin 'methods' "
                                                   r"\(flowseam 0.1.0\) raised IndexError") as info:
            fleet.rollout([request], [["a ball"] * 2])
        assert type(info.value) is RewardFaultError and "\n" not in str(info.value)
        assert info.value.plugin == "methods" and info.value.what == "reward channel_contrast"
    finally:
        fleet.reward_workers = kept
        fleet._ray.kill(worker, no_restart=True)
