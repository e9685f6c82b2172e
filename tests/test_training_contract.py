"""The training-method contract (:class:`flowseam.seam.TrainingMethod`): a third party's method
(tests/fixtures/plugins/isolated/flowseam-fixture-method, RAFT) is listed, shows its config and
runs through ``flowseam train`` exactly as flowseam's own do; what breaks the contract is the
plugin's fault, named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_main

import flowseam
from flowseam.seam import TrainingMethod
from flowseam.testing.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def method_plugin(isolated_plugin):
    return isolated_plugin("flowseam-fixture-method")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("raft") / "flux")


def _config(tmp_path, flux, **extra) -> str:
    lines = [f'model = "{flux}"', 'prompts = ["a ball", "a cat"]', "steps = 2",
             f'output_dir = "{tmp_path / "run"}"', *(f"{k} = {v}" for k, v in extra.items()),
             "[sampling]", "num_steps = 2", "height = 32", "width = 32"]
    path = tmp_path / "raft.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_builtin_methods_are_written_against_the_contract():
    from flowseam.training import registered_methods

    methods = registered_methods()
    assert {"finetune", "flowgrpo", "workflow_rl", "joint_multi_rl", "unified_rl"} <= set(methods)
    for name, cls in methods.items():
        assert issubclass(cls, TrainingMethod) and cls.name == name, name


def test_a_third_party_method_is_listed_and_shows_its_config(method_plugin):
    helped = run_main("train", "--help", path=method_plugin)
    assert helped.returncode == 0
    assert "  raft            RAFT: fine-tune on the best of several samples per prompt" in \
        helped.stdout
    shown = run_main("train", "--method", "raft", "--show-config", path=method_plugin)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("# raft: RAFT: fine-tune on the best")
    assert "samples_per_prompt = 2" in shown.stdout and "[sampling]" in shown.stdout


def test_a_third_party_method_trains_through_flowseam_train(method_plugin, flux, tmp_path):
    """Its first step's reward is the mean brightness of what the untrained model generates for
    the step's seeds (recomputed here with numpy from a generation of our own); the DiT it saves
    is not the checkpoint's any more."""
    import torch
    from diffusers import FluxTransformer2DModel

    done = run_main("train", "--method", "raft", "--config", _config(tmp_path, flux),
                    path=method_plugin)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("raft: 2 steps; last: {'step': 2"), done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    model = flowseam.load(flux, platform=flowseam.Platform("cpu"), quiet=True)
    params = flowseam.DiffusionParams(num_steps=2, height=32, width=32)
    frames = model.generate(["a ball", "a ball", "a cat", "a cat"], params=params,
                            seeds=[0, 1, 2, 3]).frames
    brightness = np.asarray(frames, np.float64).reshape(4, -1).mean(axis=1)
    assert records[0]["reward_mean"] == pytest.approx(brightness.mean(), abs=1e-6)
    assert records[0]["reward_kept_mean"] == pytest.approx(
        brightness.reshape(2, 2).max(axis=1).mean(), abs=1e-6)
    trained = FluxTransformer2DModel.from_pretrained(tmp_path / "run" / "transformer")
    base = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), base.parameters()))


def test_its_world_size_check_runs_before_any_rank_starts(method_plugin, flux, tmp_path):
    refused = run_main("train", "--method", "raft", "--config", _config(tmp_path, flux),
                       "--nproc", "2", path=method_plugin)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == ("flowseam: error: raft runs on one process; --nproc 2 is "
                                      "not supported (drop --nproc)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, command, what", [
    ("not_a_method", "--show-config", "which is not a subclass of flowseam.seam.TrainingMethod"),
    ("virtual", "--show-config", "which is not a subclass of flowseam.seam.TrainingMethod"),
    ("no_run", "--show-config", "NoRun, which does not implement run of flowseam.seam."
                                "TrainingMethod"),
    ("list_config", "--show-config", "ListConfig, whose default_config() returned ['steps']; "
                                     "expected a mapping"),
    ("returns_nothing", "--config", "ReturnsNothing, whose run() returned None; expected a "
                                    "TrainingSummary"),
    ("no_progress", "--config", "NoProgress, whose run(progress=...) does not take what the "
                                "contract passes"),
    ("exits", "--show-config", "'fixture_method.exits:Exits', which cannot be imported: "
                               "SystemExit: 0"),
])
def test_a_method_that_breaks_the_contract_is_its_plugins_fault(method_plugin, flux, tmp_path,
                                                                 name, command, what):
    """Exit 3 naming the plugin, one line, nothing on stdout (a module imported by path prints
    to stderr and cannot exit the process)."""
    args = ["--show-config"] if command == "--show-config" else \
        ["--config", _config(tmp_path, flux)]
    out = run_main("train", "--method", name, *args, path=method_plugin)
    assert out.returncode == 3, out.stderr
    assert what in out.stderr and "Traceback" not in out.stderr and out.stdout == ""
    assert "flowseam: plugin fault: plugin 'raft' (flowseam-fixture-method 0.0.1)" in out.stderr


def test_a_mistyped_method_is_the_users_to_fix_whatever_other_plugins_do(method_plugin):
    """A name nobody registers is bad input (exit 2), even when another method's import path
    fails: listing the registered names imports none of them."""
    out = run_main("train", "--method", "raft_", "--show-config", path=method_plugin)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("flowseam: error: unknown training method 'raft_'; registered "
                                 "methods: [") and "'exits'" in out.stderr
    listed = run_main("train", "--help", path=method_plugin)
    assert listed.returncode == 0 and "  raft            RAFT" in listed.stdout
    assert "  exits           (unusable: PluginLoadError" in listed.stdout
