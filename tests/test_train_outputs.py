"""A finished training run is a model you can use: every run with an ``output_dir`` ends with a
checkpoint at its last step and its result in diffusers format (``model/``, the trained
transformer merged; a LoRA run also a standard diffusers LoRA file), which flowseam and diffusers
load; a rerun resumes and says so; a bad sampling table fails before the first step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import flowseam
from flowseam import DiffusionParams, FlowseamError
from flowseam.cli import main
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.checkpoint import latest_checkpoint
from flowseam.training.flowgrpo import FlowGRPO
from flowseam.training.metrics import read_metrics
from flowseam.training.workflow_rl import WorkflowRL

SAMPLING = dict(num_steps=2, height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-out")
    return {c: write_tiny_checkpoint(c, root / c) for c in ("flux.1-t2i", "wan2.1-i2v")}


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _grpo(ckpts, cpu, out, **over):
    cfg = dict(prompts=["a ball"], reward="brightness", group_size=2, steps=2, seed=0,
               output_dir=str(out), sampling=SAMPLING, grpo=dict(beta=0.0, clip_range=0.2),
               optim=dict(lr=1e-2))
    cfg.update(over)
    return FlowGRPO(cfg, model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu))


def _diffusers_images(pipe, seed=3):
    return pipe("a ball", num_inference_steps=2, height=32, width=32, guidance_scale=3.5,
                max_sequence_length=16, generator=torch.Generator().manual_seed(seed),
                output_type="np").images


def test_a_lora_run_ends_as_a_merged_model_and_a_diffusers_lora_file(ckpts, cpu, tmp_path):
    import diffusers

    out = tmp_path / "run"
    run = _grpo(ckpts, cpu, out, lora=dict(rank=4), checkpoint_every=0)
    summary = run.run(progress=False)
    # a checkpoint at the last step although checkpoint_every = 0
    assert latest_checkpoint(out / "checkpoints").name == "step-000002"
    exported = summary["exported"]["dit"]
    assert exported == {"model": str(out / "model"),
                        "lora": str(out / "pytorch_lora_weights.safetensors")}
    info = json.loads((out / "model" / "flowseam.json").read_text())
    assert info["trained"] == {"method": "flowgrpo", "step": 2, "stage": "dit",
                               "base_model": str(ckpts["flux.1-t2i"])}

    # flowseam loads the merged model (no adapters left) and samples what the trained in-memory
    # instance samples (its LoRA layers unmerged: equal up to float rounding)
    merged = flowseam.load(out / "model", platform=cpu)
    assert not [n for n, _ in merged.dit.named_parameters() if "lora" in n]
    params = DiffusionParams(num_steps=2, height=32, width=32, max_sequence_length=16, seed=3)
    ours = merged.generate("a ball", params=params).frames[:, 0]
    trained = run.model.generate("a ball", params=params).frames[:, 0]
    np.testing.assert_allclose(ours, trained, atol=1e-5)

    # diffusers, independently: its own LoRA loader on the base checkpoint gives that image, and
    # its pipeline loads the exported model directory as it is
    pipe = diffusers.FluxPipeline.from_pretrained(ckpts["flux.1-t2i"])
    pipe.set_progress_bar_config(disable=True)
    base = _diffusers_images(pipe)
    pipe.load_lora_weights(out)
    with_lora = _diffusers_images(pipe)
    assert np.abs(with_lora - base).max() > 1e-3  # the adapters trained: the file matters
    np.testing.assert_allclose(ours, with_lora, atol=1e-4)
    exported_pipe = diffusers.DiffusionPipeline.from_pretrained(out / "model")
    exported_pipe.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(_diffusers_images(exported_pipe), with_lora, atol=1e-4)


def test_the_last_step_is_checkpointed_and_a_rerun_resumes_saying_so(ckpts, cpu, tmp_path, capsys):
    out = tmp_path / "run"
    first = _grpo(ckpts, cpu, out, steps=3, checkpoint_every=2)
    first.run(progress=False)
    assert latest_checkpoint(out / "checkpoints").name == "step-000003"
    trained = {n: p.detach().clone() for n, p in first.stage.policy.named_parameters()}

    again = _grpo(ckpts, cpu, out, steps=3, checkpoint_every=2)
    again.run(progress=True)  # nothing left to do: step 3 is not redone
    printed = capsys.readouterr().out
    assert f"flowgrpo: resuming from step-000003 in {out} (step 3 of 3)" in printed
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert all(torch.equal(trained[n], p) for n, p in again.stage.policy.named_parameters())


def test_a_bad_sampling_table_fails_before_any_step(ckpts, cpu, tmp_path, capsys):
    with pytest.raises(FlowseamError, match=r"config \[sampling\]: height=30 is not divisible by 16"):
        _grpo(ckpts, cpu, tmp_path / "a", sampling=dict(SAMPLING, height=30))
    config = tmp_path / "grpo.toml"
    config.write_text(f'model = "{ckpts["flux.1-t2i"]}"\nbackend = "cpu"\nprompts = ["a ball"]\n'
                      f'group_size = 2\nsteps = 1\noutput_dir = "{tmp_path / "b"}"\n'
                      '[sampling]\nnum_steps = 2\nheight = 32\nwidth = 32\n')
    argv = ["train", "--method", "flowgrpo", "--config", str(config)]
    assert main(argv + ["--set", "sampling.height=30"]) == 2
    err = capsys.readouterr().err
    assert "[sampling]: height=30 is not divisible by 16" in err
    assert "flowgrpo:" not in err and "Traceback" not in err  # no progress bar started
    assert not (tmp_path / "b").exists()
    # a run with nowhere to write its model is refused before anything loads
    config.write_text(config.read_text().replace(f'output_dir = "{tmp_path / "b"}"\n', ""))
    assert main(argv) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_workflow_rl_exports_each_stage_under_its_name(ckpts, cpu, tmp_path):
    wf = WorkflowRL(dict(prompts=["a ball"], reward="brightness", group_size=2, steps=1, seed=0,
                         output_dir=str(tmp_path / "wf"),
                         t2i_sampling=SAMPLING,
                         i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5),
                         grpo=dict(beta=0.0, clip_range=0.2), optim=dict(lr=1e-3)),
                    t2i=flowseam.load(ckpts["flux.1-t2i"], platform=cpu),
                    i2v=flowseam.load(ckpts["wan2.1-i2v"], platform=cpu))
    summary = wf.run(progress=False)
    assert set(summary["exported"]) == {"t2i", "i2v"}
    for stage in wf.stages:
        model_dir = tmp_path / "wf" / stage.name / "model"
        assert summary["exported"][stage.name]["model"] == str(model_dir)
        loaded = flowseam.load(model_dir, platform=cpu)
        assert loaded.card is stage.model.card
        for (name, p), q in zip(stage.policy.named_parameters(), loaded.dit.parameters()):
            assert torch.equal(p, q), (stage.name, name)
