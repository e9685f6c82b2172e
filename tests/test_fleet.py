"""Weights that travel: WeightUpdate (version, checksum, safetensors bytes), and the Ray rollout
fleet built from the driver's frozen Platform."""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest
import torch
from safetensors.torch import load as load_safetensors

import flowseam
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.weight_sync import WeightChecksumError, WeightRole, WeightSyncPlan


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
