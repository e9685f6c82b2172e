"""Whatever backends are installed or blocked, the detected platform serves every op and every
component kind, ending in cpu. scripts/test runs this file twice: with every backend installed,
and with every backend but cpu blocked (``FLOWSEAM_DISABLE_PLUGINS``), where generation must run
entirely on the cpu fallback."""

from __future__ import annotations

import os

import pytest
from conftest import plugin_env

import flowseam
from flowseam import DiffusionParams, ops
from flowseam.components import KINDS
from flowseam.testing.tiny import write_tiny_checkpoint

#: the fallback to cpu depends on which backends are installed: rerun in the blocked-backend pass
pytestmark = pytest.mark.backends


def _blocked() -> set[str]:
    raw = os.environ.get("FLOWSEAM_DISABLE_PLUGINS", "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def test_detected_platform_serves_every_op_and_kind_and_never_a_blocked_backend():
    with plugin_env() as reg:
        platform = flowseam.Platform.detect(registry=reg)
        assert platform.device_chain[-1] == "cpu"
        for name in _blocked() & set(reg.records):
            assert reg.records[name].status == "blocked"
            assert reg.records[name].reason == "listed in FLOWSEAM_DISABLE_PLUGINS"
        serving = {p["name"] for p in platform.to_dict()["plugins"]}
        assert not serving & _blocked()
        assert set(platform.kernels.ops()) == set(ops.ALL_OPS)
        for kind in KINDS:
            device, plugin, fallback = platform.component_plan(kind)
            assert device in platform.device_chain and plugin in serving
            assert fallback == (device != platform.device_chain[0])


def test_generation_falls_back_to_cpu_when_the_other_backends_are_absent(tmp_path):
    with plugin_env() as reg:
        platform = flowseam.Platform.detect(registry=reg)
        if platform.name != "cpu":
            pytest.skip(f"{platform.name!r} is installed and not blocked; its conformance run "
                        "checks generation on it (scripts/test reruns this file with it blocked)")
        model = flowseam.load(write_tiny_checkpoint("flux.1-t2i", tmp_path / "flux"))
        assert model.platform.device_chain == ("cpu",)
        assert {(r.device, r.plugin, r.fallback) for r in model.component_records.values()} == \
            {("cpu", "cpu", False)}
        out = model.generate("a cat", params=DiffusionParams(num_steps=2, height=32, width=32))
        assert out.frames.shape == (1, 1, 32, 32, 3)
        assert set(out.kernels.values()) == {platform.kernels.get(ops.FLOW_MATCH_STEP).impl_id}
