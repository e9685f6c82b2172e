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
from flowseam.seam.components import KINDS
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


def test_the_provenance_line_marks_every_fallback_and_names_dtypes(tmp_path):
    """What ``flowseam generate`` prints after its output: each component as device/plugin and
    dtype, each kernel by its implementation id; whatever landed past the platform's first
    device is marked ``(fallback)``, components and kernels alike."""
    import re

    with plugin_env() as reg:
        platform = flowseam.Platform.detect(registry=reg)
        model = flowseam.load(write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan"), platform=platform)
    line = model.provenance()
    first = platform.device_chain[0]
    comps = re.findall(r"(\w+)=(\w+)/(\w+) (\S+?)( \(fallback\))?[,;]", line)
    assert {c[0] for c in comps} == {"transformer", "vae", "text_encoder"}, line
    for name, device, plugin, dtype, marked in comps:
        record = model.component_records[name]
        assert (device, plugin, dtype) == (record.device, record.plugin, "float32"), line
        assert bool(marked) == (device != first), line
    kernels = re.findall(r"(\w+)=(\w+):\w+:(\w+):\S+?==\S+?( \(fallback\))?(?:,|;|$)", line)
    assert {k[0] for k in kernels} == set(platform.kernels.ops()), line
    for op, plugin, device, marked in kernels:
        assert bool(marked) == (device != first), line
