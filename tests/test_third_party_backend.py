"""A third-party backend installed like any vendor's package (tests/fixtures/backends): discovery,
its one kernel and one component override, the cpu fallback for everything else, and flowseam's
conformance suite run on it in a subprocess, exactly as a vendor's CI would run it: it passes
for the correct backend (with its expected failures), reports an unexpected pass, and fails,
naming the test, for a backend with a subtly wrong kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, pip_install_target, plugin_env, run_main

import flowseam
from flowseam import DiffusionParams, ops
from flowseam.testing.tiny import write_tiny_checkpoint

BACKENDS = sorted(p for p in (FIXTURES / "backends").iterdir() if (p / "pyproject.toml").is_file())


@pytest.fixture(scope="module")
def vendor_dir(tmp_path_factory) -> Path:
    """flowseam-tinyvendor and flowseam-tinyvendor-bad, pip-installed into a scratch target."""
    target = tmp_path_factory.mktemp("vendor-backends")
    pip_install_target(BACKENDS, target)
    return target


def conformance(target: Path, backend: str, *args: str, cwd: Path,
                **env: str) -> subprocess.CompletedProcess:
    """``python -m pytest --pyargs flowseam.testing.conformance --flowseam-backend BACKEND`` in
    a subprocess, with the vendor packages on PYTHONPATH, from an unrelated directory."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), full.get("PYTHONPATH")]))
    full.update(env)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfExX",
           "--pyargs", "flowseam.testing.conformance", "--flowseam-backend", backend, *args]
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=900)


def _failed(stdout: str) -> set[str]:
    return set(re.findall(r"^FAILED \S+::(\S+)", stdout, flags=re.M))


@pytest.mark.backends
def test_discovered_through_its_entry_point(vendor_dir):
    with plugin_env(vendor_dir) as reg:
        rec = reg.records["tinyvendor"]
        assert (rec.status, rec.distribution, rec.version, rec.device) == \
            ("available", "flowseam-tinyvendor", "0.1.0", "tinyvendor")
        assert [(k.op, k.arch) for k in rec.kernels] == [(ops.FLOW_MATCH_STEP, "generic")]
        assert rec.component_kinds == ("vae",)
    rows = {r["name"]: r for r in json.loads(run_main("backends", "--json", path=vendor_dir).stdout)}
    assert rows["tinyvendor"]["ops"] == ["flow_match_step@generic"]
    assert rows["tinyvendor"]["components"] == ["vae"]
    assert rows["tinyvendor_bad"]["ops"] == ["flow_sde_step@generic"]


@pytest.mark.backends
def test_overrides_one_kernel_and_one_component_and_the_rest_falls_back(vendor_dir, tmp_path):
    ckpt = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan")
    with plugin_env(vendor_dir) as reg:
        platform = flowseam.Platform("tinyvendor", registry=reg)
        assert platform.device_chain == ("tinyvendor", "cpu")
        plugins = {op: k.provenance.plugin for op, k in platform.kernels.resolved().items()}
        # its one kernel, and every other op of flowseam from cpu
        assert plugins == {op: "tinyvendor" if op == ops.FLOW_MATCH_STEP else "cpu"
                           for op in ops.ALL_OPS}
        model = flowseam.load(ckpt, platform=platform)
        recs = model.component_records
        assert (recs["vae"].plugin, recs["vae"].device, recs["vae"].fallback) == \
            ("tinyvendor", "tinyvendor", False)
        for name, kind in (("transformer", "dit"), ("text_encoder", "text_encoder")):
            assert (recs[name].device, recs[name].fallback) == ("cpu", True)
            assert f"no plugin serving 'tinyvendor' builds '{kind}'" in recs[name].reason
        assert "no plugin serving 'tinyvendor' builds 'dit'" in platform.explain()
        out = model.generate("a cat", params=DiffusionParams(num_steps=2, height=32, width=32,
                                                             num_frames=5, guidance_scale=1.0))
        step = platform.kernels.get(ops.FLOW_MATCH_STEP)
        assert out.kernels == {ops.FLOW_MATCH_STEP: step.impl_id}
        assert out.frames.shape == (1, 5, 32, 32, 3)


@pytest.mark.slow
def test_conformance_suite_passes_with_the_backends_expected_failures(vendor_dir, tmp_path):
    proc = conformance(vendor_dir, "tinyvendor", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # its conformance-xfail.txt lists the four float64 flow_match_step checks
    assert re.search(r"\b4 xfailed\b", proc.stdout), proc.stdout[-3000:]
    assert "test_kernel_matches_oracle[tinyvendor-flow_match_step@generic-float64-first]" in proc.stdout
    assert "no float64 unit" in proc.stdout


def test_an_unexpected_pass_fails_the_run(vendor_dir, tmp_path):
    proc = conformance(vendor_dir, "tinyvendor", "-k", "test_kernel_matches_oracle and float64",
                       cwd=tmp_path, TINYVENDOR_FLOAT64="1")
    assert proc.returncode == 1, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "XPASS(strict)" in proc.stdout
    assert len(_failed(proc.stdout)) == 4, proc.stdout[-3000:]


def test_conformance_suite_fails_for_a_subtly_wrong_kernel(vendor_dir, tmp_path):
    # The kernel checks only (-k): the model tests would pass, and cost most of the run's time.
    proc = conformance(vendor_dir, "tinyvendor_bad", "-k", "test_kernels", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-6000:] + proc.stderr[-3000:]
    failed = _failed(proc.stdout)
    assert "test_kernel_matches_oracle[tinyvendor_bad-flow_sde_step@generic-float32-first]" in failed
    assert all("flow_sde_step" in name for name in failed), failed
    # C2 alone cannot see it (the wrong kernel agrees with itself); the oracle does.
    assert not any(name.startswith("test_sde_recompute") for name in failed), failed
    assert re.search(r"\b\d+ passed\b", proc.stdout), proc.stdout[-3000:]


# -- the complete backend of docs/writing-a-backend.md ------------------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def guide_files() -> dict[str, str]:
    """The files of the guide's complete backend: the code blocks titled with a path."""
    return dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', GUIDE.read_text(), flags=re.S))


@pytest.fixture(scope="module")
def halfcpu_dir(tmp_path_factory) -> Path:
    """flowseam-halfcpu, written from the guide's code blocks and pip-installed."""
    root = tmp_path_factory.mktemp("guide-backend")
    for name, text in guide_files().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    target = root / "target"
    pip_install_target([root / "flowseam-halfcpu"], target)
    return target


def test_the_guides_complete_backend_is_under_100_lines_and_mixes_precisions(halfcpu_dir, tmp_path):
    files = guide_files()
    assert set(files) == {"flowseam-halfcpu/pyproject.toml",
                          "flowseam-halfcpu/src/flowseam_halfcpu/__init__.py"}
    assert len(files["flowseam-halfcpu/src/flowseam_halfcpu/__init__.py"].splitlines()) < 100
    spec = flowseam.ComponentSpec("transformer", "diffusers.WanTransformer3DModel",
                                  str(write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan")),
                                  "transformer")
    with plugin_env(halfcpu_dir, FLOWSEAM_PLUGINS="cpu,halfcpu") as reg:
        platform = flowseam.Platform("halfcpu", registry=reg)
        dit = platform.build_component("dit", spec)
    # bf16 with the norms diffusers keeps in float32: the mixed-precision case the suite must
    # judge by its lowest precision
    assert platform.components[-1].dtype == "bfloat16+float32"
    assert flowseam.seam.components.compute_dtype(dit) is torch.bfloat16


@pytest.mark.slow
def test_the_guides_complete_backend_passes_the_conformance_suite(halfcpu_dir, tmp_path):
    proc = conformance(halfcpu_dir, "halfcpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\b\d+ passed\b", proc.stdout) and "xfail" not in proc.stdout


def test_a_dtype_mismatch_in_a_component_names_the_dtypes_and_the_fix():
    from flowseam.seam.components import cast_inputs
    from flowseam.testing.conformance._support import _Recorder

    module = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with pytest.raises(AssertionError) as info:
        _Recorder(module, [])(torch.randn(2, 4))  # float32 in, as a caller holding float32 does
    text = str(info.value)
    assert "Linear.forward failed in the serve loop: the component's parameters are bfloat16, " \
           "its floating-point inputs were float32: RuntimeError" in text
    assert "flowseam.seam.components.cast_inputs(module)" in text
    out = _Recorder(cast_inputs(module, names=("input",)), [])(torch.randn(2, 4))
    assert out.dtype is torch.bfloat16 and out.shape == (2, 3)


def test_cast_inputs_casts_the_activations_and_leaves_timesteps_and_coordinates_alone():
    """As diffusers' pipelines do: latents and embeddings in the model's dtype, the timestep
    and the RoPE coordinates in float32 (bfloat16 cannot hold 999.0 - 0.5: it rounds to 1000)."""
    from flowseam.seam.components import cast_inputs

    seen = {}

    class DiT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4).to(torch.bfloat16)

        def forward(self, hidden_states, timestep, encoder_hidden_states=None, video_coords=None):
            seen.update(hidden_states=hidden_states.dtype, timestep=timestep,
                        encoder_hidden_states=encoder_hidden_states.dtype, video_coords=video_coords)
            return self.proj(hidden_states)

    t, coords = torch.tensor([998.5]), torch.arange(300.0).reshape(1, 3, 100)
    cast_inputs(DiT())(torch.randn(1, 4), t, encoder_hidden_states=torch.randn(1, 2, 4),
                       video_coords=coords)
    assert seen["hidden_states"] is torch.bfloat16 and seen["encoder_hidden_states"] is torch.bfloat16
    assert seen["timestep"].dtype is torch.float32 and float(seen["timestep"]) == 998.5
    assert float(t.to(torch.bfloat16)) != 998.5  # what casting it would have done
    assert seen["video_coords"] is coords
