"""RL on what the checkpoint says: SDE rollouts on a UniPC checkpoint's schedule, Wan2.2's
experts recorded per step and recomputed per expert, and what the trainers refuse."""

from __future__ import annotations

import copy

import diffusers
import pytest
import torch

import flowseam
from flowseam import DiffusionParams, ExecutionProfile, FlowseamError, GenerationRequest, ops
from flowseam.testing.tiny import write_tiny_checkpoint

RATIO_TOL = 1e-6
PARAMS = DiffusionParams(num_steps=4, height=32, width=32, num_frames=5, guidance_scale=5.0,
                         seed=3, sde_rollout=True)


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


@pytest.fixture(scope="module")
def unipc_wan(tmp_path_factory, cpu):
    path = write_tiny_checkpoint("wan2.1-t2v", tmp_path_factory.mktemp("unipc") / "wan",
                                 scheduler_class="UniPCMultistepScheduler")
    return flowseam.load(path, platform=cpu, quiet=True)


@pytest.fixture(scope="module")
def wan22(tmp_path_factory, cpu):
    path = write_tiny_checkpoint("wan2.2-t2v", tmp_path_factory.mktemp("wan22") / "wan22",
                                 scheduler_class="UniPCMultistepScheduler")
    return flowseam.load(path, platform=cpu, quiet=True)


def _rollout(model, params):
    request = GenerationRequest(["a red ball", "a blue cube"], model.card.task, params)
    return flowseam.run_loop(model, request, profile=ExecutionProfile.ROLLOUT, decode=False)


def _recompute(model, result, rec, dit=None):
    kernel = model.platform.kernels.pin(rec.impl_id)
    with torch.no_grad():
        v = model.velocity(rec.latents, rec.timestep, result.cond, result.params,
                           expert=rec.expert, dit=dit)
        out = kernel(rec.latents, v, rec.sigma, rec.sigma_next, prev_sample=rec.next_latents,
                     noise_level=result.params.noise_level, sigma_max=rec.sigma_max)
    return float((torch.exp(out.log_prob.double() - rec.log_prob.double()) - 1).abs().max())


def test_sde_rollout_on_a_unipc_checkpoint_runs_on_its_schedule(unipc_wan, cpu):
    """Flow-GRPO's first-order SDE steps on the sigmas and DiT timesteps of the checkpoint's
    UniPC schedule (the first sigma, 1 - 1e-6, taken as 1: finite log-probs); every log-prob
    recomputes with the pinned kernel (C2); without sde_rollout a ROLLOUT runs UniPC and equals
    serving bit for bit."""
    sched = diffusers.UniPCMultistepScheduler.from_config(unipc_wan.solver.config)
    sched.set_timesteps(PARAMS.num_steps)
    result = _rollout(unipc_wan, PARAMS)
    assert result.kernels == {ops.FLOW_SDE_STEP: cpu.kernels.get(ops.FLOW_SDE_STEP).impl_id}
    assert "first-order" in result.solver and "UniPCMultistepScheduler schedule" in result.solver
    sigmas = [r.sigma for r in result.records] + [result.records[-1].sigma_next]
    assert sigmas[0] == 1.0 and sched.sigmas[0].item() == pytest.approx(1 - 1e-6, abs=1e-6)
    assert sigmas[1:] == sched.sigmas[1:].tolist()
    assert [float(r.timestep[0]) for r in result.records] == sched.timesteps.float().tolist()
    for rec in result.records:
        assert torch.isfinite(rec.log_prob).all() and rec.expert == "transformer"
        assert _recompute(unipc_wan, result, rec) <= RATIO_TOL
    serve = flowseam.run_loop(unipc_wan, GenerationRequest(["a red ball", "a blue cube"],
                                                           unipc_wan.card.task,
                                                           PARAMS.replace(sde_rollout=False)),
                              decode=False)
    ode = _rollout(unipc_wan, PARAMS.replace(sde_rollout=False))
    assert torch.equal(serve.latents, ode.latents)
    assert ode.kernels == {ops.UNIPC_STEP: cpu.kernels.get(ops.UNIPC_STEP).impl_id}


def test_sde_window_outside_steps_are_euler_on_the_unipc_schedule(unipc_wan, cpu):
    result = _rollout(unipc_wan, PARAMS.replace(sde_window=(1, 2)))
    ids = [r.impl_id for r in result.records]
    assert ids == [cpu.kernels.get(ops.FLOW_MATCH_STEP).impl_id, cpu.kernels.get(ops.FLOW_SDE_STEP).impl_id,
                   cpu.kernels.get(ops.FLOW_MATCH_STEP).impl_id, cpu.kernels.get(ops.FLOW_MATCH_STEP).impl_id]
    assert [r.log_prob is not None for r in result.records] == [False, True, False, False]


def test_noise_level_zero_rollout_is_the_ode_and_trainers_refuse_it(unipc_wan, tmp_path):
    """Flow-GRPO's evaluation setting: the SDE steps are deterministic Euler steps (log-prob
    0), so the rollout equals the SDE-free Euler rollout on the same schedule; flowgrpo refuses
    to train on it."""
    zero = _rollout(unipc_wan, PARAMS.replace(noise_level=0.0))
    euler = _rollout(unipc_wan, PARAMS.replace(sde_window=(0, 1), noise_level=0.0))
    assert all(not r.log_prob.any() for r in zero.records)
    torch.testing.assert_close(zero.latents, euler.latents, rtol=0, atol=1e-6)
    with pytest.raises(FlowseamError, match=r"\[sampling\] noise_level=0 makes every SDE step"):
        flowseam.training.get_method("flowgrpo")(
            {"prompts": ["x"], "sampling": {"noise_level": 0.0}}, model=unipc_wan)


def test_wan22_rollout_records_each_steps_expert_and_recomputes_per_expert(wan22):
    """The API a multi-expert trainer builds on: every BehaviorRecord names its expert; a
    trainer's copy of that expert passed as ``dit=`` reproduces the rollout's log-prob (C2),
    and the other expert does not (the expert matters)."""
    result = _rollout(wan22, PARAMS)
    assert result.experts == ["transformer", "transformer", "transformer_2", "transformer_2"]
    assert [r.expert for r in result.records] == result.experts
    copies = {name: copy.deepcopy(module) for name, module in wan22.experts.items()}
    for rec in result.records:
        assert _recompute(wan22, result, rec, dit=copies[rec.expert]) <= RATIO_TOL
    rec = result.records[-1]  # a low-noise step, recomputed with the high-noise expert's weights
    assert _recompute(wan22, result, rec, dit=copies["transformer"]) > 1e-3
    with pytest.raises(ValueError, match="expert='transformer_3'"):
        wan22.velocity(rec.latents, rec.timestep, result.cond, result.params, expert="transformer_3")
    with pytest.raises(FlowseamError, match="2 DiT experts"):
        flowseam.training.get_method("flowgrpo")({"prompts": ["x"]}, model=wan22)


def test_guidance_scale_2_applies_to_the_low_noise_expert_only(wan22):
    """``guidance_scale_2`` changes the steps of transformer_2 and leaves transformer's alone."""
    base = _rollout(wan22, PARAMS.replace(sde_rollout=False))
    other = _rollout(wan22, PARAMS.replace(sde_rollout=False, guidance_scale_2=1.5))
    same = [torch.equal(a.next_latents, b.next_latents) for a, b in zip(base.records, other.records)]
    assert same == [True, True, False, False]


@pytest.mark.slow
def test_cli_names_the_solver_and_refuses_or_ignores_options(tmp_path):
    """``flowseam generate``: the load line (stderr) and the summary line name the solver that
    ran and where its settings came from; an unimplemented option exits 2 naming it, and
    ``--ignore-scheduler-option`` runs it with a warning."""
    import json

    from conftest import run_main

    ckpt = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan",
                                 scheduler_class="UniPCMultistepScheduler")
    args = ("generate", "--model", str(ckpt), "--prompt", "a cat", "--steps", "2", "--frames",
            "5", "--height", "32", "--width", "32", "--backend", "cpu")
    r = run_main(*args, "--flow-shift", "5", "--output", str(tmp_path / "a.gif"))
    assert r.returncode == 0, r.stderr
    assert "flowseam: loaded wan2.1-t2v" in r.stderr and "flow_shift=3.0 (checkpoint)" in r.stderr
    assert "solver unipc_step [cpu:unipc_step:cpu:generic:" in r.stdout
    assert "flow_shift=5.0 (request)" in r.stdout
    config = ckpt / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "thresholding": True}))
    r = run_main(*args, "--output", str(tmp_path / "b.gif"))
    assert r.returncode == 2 and "thresholding=True" in r.stderr
    assert "--ignore-scheduler-option" in r.stderr and not (tmp_path / "b.gif").exists()
    r = run_main(*args, "--ignore-scheduler-option", "thresholding", "--output",
                 str(tmp_path / "b.gif"))
    assert r.returncode == 0, r.stderr
    assert "ignoring scheduler option(s) thresholding=True" in r.stderr
    assert "thresholding=True ignored" in r.stdout
