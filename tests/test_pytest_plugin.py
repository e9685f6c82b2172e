"""flowseam's pytest plugin (``pytest11`` entry point): ``--flowseam-backend``, the
``flowseam_platform`` fixture, the ``flowseam_cases`` marker, skipping unusable backends with
their reason, and the expected-failures file format of the conformance suite.

The inner pytest runs are subprocesses: an in-process run restores ``sys.modules`` afterwards,
which would drop (and later re-import) the parts of torch that a backend imported, and torch
does not survive being imported twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import plugin_env

import flowseam
from flowseam.testing.conformance.expectations import parse_xfail_file

pytest_plugins = ["pytester"]

PLATFORM_TEST = """
def test_platform(flowseam_platform, request):
    assert flowseam_platform.name == request.node.callspec.id
    assert flowseam_platform.device_chain[-1] == "cpu"
"""


def _outcomes(result) -> dict[str, int]:
    return result.parseoutcomes()


def test_registered_as_a_pytest11_entry_point_and_cheap_to_import():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert eps["flowseam"] == "flowseam.testing.pytest_plugin"
    code = ("import sys, flowseam.testing.pytest_plugin; "
            "heavy = [m for m in ('torch', 'numpy', 'diffusers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


@pytest.mark.backends
def test_default_is_every_installed_backend_unusable_ones_skipped_with_reason(pytester):
    with plugin_env() as reg:
        backends = reg.backends()
    usable = [r for r in backends if r.usable]
    unusable = [r for r in backends if not r.usable]
    pytester.makepyfile(PLATFORM_TEST)
    result = pytester.runpytest_subprocess("-rs")
    assert _outcomes(result).get("passed") == len(usable)
    assert _outcomes(result).get("skipped", 0) == len(unusable)
    for r in unusable:
        result.stdout.fnmatch_lines([f"*flowseam backend '{r.name}' is {r.status}: *"])


def test_unavailable_broken_and_blocked_backends_are_skipped_with_their_reason(
        pytester, fixture_plugins_dir, monkeypatch):
    pytester.makepyfile(PLATFORM_TEST)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(fixture_plugins_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FLOWSEAM_PLUGINS", "cpu,unavailable_dev,broken_import,testdev_a")
    monkeypatch.setenv("FLOWSEAM_DISABLE_PLUGINS", "testdev_a")
    result = pytester.runpytest_subprocess(
        "-rs", "--flowseam-backend", "cpu,unavailable_dev",
        "--flowseam-backend", "broken_import", "--flowseam-backend", "testdev_a")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines_random([
        "*flowseam backend 'unavailable_dev' is unavailable: *no NPU driver*",
        "*flowseam backend 'broken_import' is broken: *flowseam_vendor_sdk_that_does_not_exist*",
        "*flowseam backend 'testdev_a' is blocked: listed in FLOWSEAM_DISABLE_PLUGINS*",
    ])


def test_an_unknown_backend_is_a_usage_error_naming_the_installed_ones(pytester):
    pytester.makepyfile(PLATFORM_TEST)
    result = pytester.runpytest_subprocess("--flowseam-backend", "tpu9000")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--flowseam-backend 'tpu9000'*not installed; installed backends: *cpu*"])


def test_platform_fixture_and_flowseam_cases_run_per_selected_backend(pytester):
    """One inner run (a pytest process with torch and the backends imported costs seconds):
    the ``flowseam_platform`` fixture runs once per selected backend, and ``flowseam_cases``
    parametrizes per backend, an empty case list skipping with its reason."""
    pytester.makepyfile(test_platform=PLATFORM_TEST, test_cases="""
        import pytest

        def cases(backend):
            for op in sorted({k.op for k in backend.record.kernels}):
                yield op, op

        @pytest.mark.flowseam_cases(cases=cases)
        def test_op(flowseam_platform, flowseam_case):
            assert flowseam_platform.kernels.get(flowseam_case).provenance.plugin == "cpu"

        @pytest.mark.flowseam_cases(cases=lambda backend: [], empty="no such thing")
        def test_nothing(flowseam_platform, flowseam_case):
            raise AssertionError("never runs")
    """)
    result = pytester.runpytest_subprocess("--flowseam-backend", "cpu", "-v", "-rs")
    result.assert_outcomes(passed=1 + len(flowseam.ops.ALL_OPS), skipped=1)
    result.stdout.fnmatch_lines_random(["*test_platform[[]cpu[]] PASSED*",
                                        "flowseam backend cpu (flowseam-cpu *): available",
                                        "*test_op[[]cpu-flow_sde_step[]] PASSED*",
                                        "*nothing to check for flowseam backend 'cpu': no such thing*"])


def test_tests_without_the_fixture_discover_nothing(pytester):
    """The plugin is loaded by every pytest run: a run that never asks for a backend must not
    scan the plugins (which would import torch and every backend)."""
    pytester.makepyfile("""
        import sys

        def test_plain():
            assert "torch" not in sys.modules
            plugins = sys.modules.get("flowseam.seam.discovery")
            assert plugins is None or plugins.DISCOVERY_SCANS == 0
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_xfail_file_format():
    entries = parse_xfail_file(
        "# comment\n\n"
        "test_kernels.py::test_kernel_matches_oracle[vendor-flow_sde_step@*-float16-*]  fp16 log-prob\n"
        "test_loops.py::test_serve_parity_with_cpu[vendor-flux.1-t2i]   known: tf32 convs\n",
        "x.txt")
    assert [(e.where, e.reason) for e in entries] == [("x.txt:3", "fp16 log-prob"),
                                                      ("x.txt:4", "known: tf32 convs")]
    wild, exact = entries
    assert wild.matches("test_kernels.py::test_kernel_matches_oracle[vendor-flow_sde_step@sm90-float16-first]")
    assert not wild.matches("test_kernels.py::test_kernel_matches_oracle[vendor-flow_sde_step@sm90-float32-first]")
    assert exact.matches("test_loops.py::test_serve_parity_with_cpu[vendor-flux.1-t2i]")
    assert not exact.matches("test_loops.py::test_serve_parity_with_cpu[vendor-flux.1-t2iX]")
    with pytest.raises(ValueError, match=r"x.txt:1: .* has no reason"):
        parse_xfail_file("test_loops.py::test_serve_parity_with_cpu[vendor-flux.1-t2i]\n", "x.txt")
    with pytest.raises(ValueError, match=r"x.txt:1: 'test_serve_parity' is not a test id"):
        parse_xfail_file("test_serve_parity  some reason\n", "x.txt")


def test_conformance_expectations_are_validated():
    with pytest.raises(ValueError, match="both in overrides and in falls_back"):
        flowseam.ConformanceExpectations(overrides=["dit"], falls_back=["dit"])
    with pytest.raises(ValueError, match="must be a list of kind names"):
        flowseam.ConformanceExpectations(overrides="dit")
    assert flowseam.ConformanceExpectations(overrides=["dit", "vae"]).overrides == ("dit", "vae")


class _Record:
    def __init__(self, name, kinds):
        self.name, self.component_kinds = name, tuple(kinds)


class _Registry:
    def __init__(self, answer):
        self.answer = answer

    def call(self, record, hook):
        assert hook == "flowseam_conformance_expectations"
        return self.answer


def test_expectations_default_to_the_declarations_and_read_the_xfail_file(tmp_path):
    from flowseam.testing.conformance.expectations import resolve

    accel_like = resolve(_Record("accel", ["dit", "vae"]), _Registry(None))
    assert not accel_like.explicit and accel_like.torch_device == "cpu"
    assert [accel_like.placement(k) for k in ("dit", "vae", "text_encoder", "image_encoder")] == \
        ["override", "override", "fallback", "fallback"]
    cpu_like = resolve(_Record("cpu", ["*"]), _Registry(None))
    assert {cpu_like.placement(k) for k in ("dit", "text_encoder", "tokenizer")} == {"override"}

    (tmp_path / "xfail.txt").write_text("test_loops.py::test_serve_parity_with_cpu[v-*]  tf32\n")
    explicit = resolve(_Record("v", ["dit", "vae"]), _Registry(flowseam.ConformanceExpectations(
        overrides=["dit"], xfail_file=tmp_path / "xfail.txt", torch_device="cuda:0")))
    assert explicit.explicit and explicit.torch_device == "cuda:0"
    assert [explicit.placement(k) for k in ("dit", "vae", "text_encoder")] == \
        ["override", "either", "fallback"]  # vae is declared but may be declined
    assert [e.reason for e in explicit.xfails] == ["tf32"]

    with pytest.raises(TypeError, match="expected flowseam.ConformanceExpectations"):
        resolve(_Record("v", []), _Registry({"overrides": ["dit"]}))
    with pytest.raises(OSError):
        resolve(_Record("v", []), _Registry(flowseam.ConformanceExpectations(
            xfail_file=tmp_path / "missing.txt")))
