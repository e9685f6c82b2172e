"""RL: rollout = serve + capture, Flow-GRPO, kernel pinning (C2), WeightSyncPlan, checkpoints and
resume, NaN rewards, the constant-reward and informative-reward controls, workflow_rl, finetune."""

from __future__ import annotations

import json
from importlib import metadata

import numpy as np
import pytest
import torch

import flowseam
from flowseam import DiffusionParams, ExecutionProfile, FlowseamError, GenerationRequest, KernelPinError, TaskType
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training import get_method, get_reward
from flowseam.training.checkpoint import latest_checkpoint
from flowseam.training.flowgrpo import FlowGRPO
from flowseam.training.metrics import read_metrics
from flowseam.training.weight_sync import WeightRole, WeightSyncPlan
from flowseam.training.workflow_rl import WorkflowRL

SAMPLING = dict(num_steps=4, height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-ckpt")
    return {c: write_tiny_checkpoint(c, root / c) for c in ("wan2.1-t2v", "wan2.1-i2v", "flux.1-t2i")}


@pytest.fixture()
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _grpo(ckpts, cpu, **over):
    cfg = dict(prompts=["a ball", "a box"], reward="brightness", group_size=3, steps=2, seed=0,
               sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2), optim=dict(lr=1e-3))
    cfg.update(over)
    return FlowGRPO(cfg, model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu))


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_rollout_without_sde_is_bit_identical_to_serve_and_captures_records(ckpts, cpu):
    model = flowseam.load(ckpts["wan2.1-t2v"], platform=cpu)
    req = GenerationRequest("a cat", TaskType.T2V, DiffusionParams(num_steps=3, height=32, width=32,
                                                                   num_frames=5, seed=4))
    serve = flowseam.run_loop(model, req, ExecutionProfile.SERVE)
    roll = flowseam.run_loop(model, req, ExecutionProfile.ROLLOUT)
    assert np.array_equal(serve.frames, roll.frames) and serve.records == []
    assert len(roll.records) == 3
    step = cpu.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
    from diffusers import FlowMatchEulerDiscreteScheduler  # the peer's schedule, independently

    peer = FlowMatchEulerDiscreteScheduler(shift=3.0)
    peer.set_timesteps(3)
    assert [r.sigma for r in roll.records] + [roll.records[-1].sigma_next] == peer.sigmas.tolist()
    for i, rec in enumerate(roll.records):
        assert rec.impl_id == step.impl_id and rec.log_prob is None
        assert torch.equal(rec.timestep, peer.timesteps[i].expand(1))
        if i:
            assert torch.equal(rec.latents, roll.records[i - 1].next_latents)
    assert roll.records[-1].sigma_next == 0.0
    assert np.array_equal(flowseam.rollout_loop(model, req).frames, serve.frames)


def test_sde_rollout_gives_each_group_member_its_own_noise(ckpts, cpu):
    model = flowseam.load(ckpts["flux.1-t2i"], platform=cpu)
    req = GenerationRequest(["a ball"] * 3, TaskType.T2I, DiffusionParams(sde_rollout=True, **SAMPLING),
                            seeds=[1, 2, 3])
    res = flowseam.run_loop(model, req, ExecutionProfile.ROLLOUT)
    f = res.frames
    assert not np.array_equal(f[0], f[1]) and not np.array_equal(f[1], f[2])
    assert all(r.log_prob.shape == (3,) for r in res.records)
    assert res.records[0].sigma == 1.0 and res.records[0].sigma_max == res.records[1].sigma
    # the same seed alone reproduces row 1 (per-sample generators; batch size only changes
    # float rounding inside the DiT)
    solo = flowseam.run_loop(model, GenerationRequest("a ball", TaskType.T2I, req.params, seeds=[2]),
                             ExecutionProfile.ROLLOUT)
    assert np.abs(solo.frames[0] - f[1]).max() <= 1e-5


def test_sde_window_makes_only_those_steps_stochastic_and_trains_on_them(ckpts, cpu):
    model = flowseam.load(ckpts["flux.1-t2i"], platform=cpu)
    params = DiffusionParams(sde_rollout=True, sde_window=(1, 3), **SAMPLING)
    req = GenerationRequest(["a ball"] * 2, TaskType.T2I, params, seeds=[1, 2])
    res = flowseam.run_loop(model, req, ExecutionProfile.ROLLOUT)
    ode = cpu.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
    sde = cpu.kernels.get(flowseam.ops.FLOW_SDE_STEP)
    assert [r.log_prob is not None for r in res.records] == [False, True, True, False]
    assert [r.impl_id for r in res.records] == [ode.impl_id, sde.impl_id, sde.impl_id, ode.impl_id]
    # outside the window the step is the plain Euler step x + (sigma_next - sigma) * v
    first = res.records[0]
    v = model.velocity(first.latents, first.timestep, res.cond, res.params)
    assert torch.allclose(first.next_latents,
                          first.latents + (first.sigma_next - first.sigma) * v, atol=1e-6)
    # a window on the ODE path changes nothing: serve stays bit-identical
    plain = flowseam.run_loop(model, GenerationRequest(["a ball"] * 2, TaskType.T2I,
                                                       params.replace(sde_rollout=False), seeds=[1, 2]))
    ode_only = flowseam.run_loop(model, GenerationRequest(["a ball"] * 2, TaskType.T2I,
                                                          DiffusionParams(**SAMPLING), seeds=[1, 2]))
    assert np.array_equal(plain.frames, ode_only.frames)
    # flowgrpo trains on the window's steps only, with ratio 1 on the first epoch
    g = _grpo(ckpts, cpu, sampling=dict(SAMPLING, sde_window=[0, 2]))
    g.train_step()
    first_ratios = torch.cat(g.last_stats.first_epoch_ratios)
    assert first_ratios.numel() == 3 * 2 and (first_ratios - 1).abs().max() <= 1e-6
    for bad in ((2, 2), (4, 5), (-1, 1), (0,)):
        with pytest.raises(ValueError, match="sde_window"):
            flowseam.run_loop(model, GenerationRequest("a ball", TaskType.T2I,
                                                       params.replace(sde_window=bad)))


def test_flowgrpo_first_inner_epoch_ratio_is_one(ckpts, cpu):
    g = _grpo(ckpts, cpu, grpo=dict(beta=0.04, clip_range=0.2, inner_epochs=2))
    for _ in range(2):
        g.train_step()
        first = torch.cat(g.last_stats.first_epoch_ratios)
        assert first.numel() == 3 * 4
        assert (first - 1).abs().max() <= 1e-6
    later = torch.cat(g.last_stats.ratios[len(g.last_stats.first_epoch_ratios):])
    assert (later - 1).abs().max() > 0  # the second epoch sees updated weights


def test_recompute_pins_the_rollout_kernel(ckpts, cpu):
    g = _grpo(ckpts, cpu)
    trajs, results, prompts, _ = g.rollout(0)
    trajs[0].advantages = torch.tensor([1.0, -1.0, 0.5])
    trajs[0].result.records[0].impl_id = "cuda:flow_sde_step:cuda:sm90:flowseam-cuda==0.1.0"
    from flowseam.training.grpo import ppo_update
    with pytest.raises(KernelPinError, match="never substituted"):
        ppo_update(g.stage.policy, None, trajs, g.stage.optimizer, g.grpo, seed=0)


def test_constant_reward_leaves_every_parameter_unchanged(ckpts, cpu):
    g = _grpo(ckpts, cpu, reward="constant", steps=3)
    before, served = _params(g.stage.policy), _params(g.model.dit)
    summary = g.run(progress=False)
    assert all(torch.equal(before[n], p) for n, p in g.stage.policy.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in g.model.dit.named_parameters())
    assert all(r["frac_zero_std_groups"] == 1.0 and not r["updated"] for r in summary["records"])


def test_nan_reward_skips_the_group_with_a_warning(ckpts, cpu):
    """A NaN group is skipped; the step's other group has a constant reward (zero spread, so no
    update either): nothing moves. (NaN for every sample of a step is a reward fault:
    tests/test_reward_specs.py.)"""
    def flaky(prompts, outputs):
        r = torch.ones(len(prompts))
        return torch.full_like(r, float("nan")) if prompts[0] == "a ball" else r

    g = _grpo(ckpts, cpu, prompts=["a ball", "a box"], prompts_per_step=2, steps=1)
    g.reward = flaky
    before = _params(g.stage.policy)
    with pytest.warns(UserWarning, match="NaN"):
        rec = g.train_step()
    assert rec["groups_skipped_nan"] == 1 and rec["groups_skipped_nan_total"] == 1
    assert all(torch.equal(before[n], p) for n, p in g.stage.policy.named_parameters())
    assert all(torch.isfinite(p).all() for p in g.stage.policy.parameters())


def test_group_size_and_method_errors(ckpts, cpu):
    with pytest.raises(FlowseamError, match="group_size=1: Input should be greater than or equal to 2"):
        _grpo(ckpts, cpu, group_size=1)
    with pytest.raises(FlowseamError, match=r"unknown training method 'ppo'.*finetune.*flowgrpo.*workflow_rl"):
        get_method("ppo")
    with pytest.raises(FlowseamError, match="unknown reward 'aesthetics'"):
        get_reward("aesthetics")
    with pytest.raises(FlowseamError, match=r"config \[grpo\] has unknown key\(s\) \['clip'\]"):
        _grpo(ckpts, cpu, grpo=dict(clip=0.1))


def test_methods_are_plugins_workflow_rl_has_its_own_entry_point():
    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["workflow_rl"].value == "flowseam.training.builtin:workflow_rl"
    assert eps["workflow_rl"].dist.metadata["Name"] == "flowseam"
    assert get_method("workflow_rl") is WorkflowRL and get_method("flowgrpo") is FlowGRPO


def test_weight_sync_plan_versions_and_cache_invalidation(ckpts, cpu):
    import copy

    model = flowseam.load(ckpts["wan2.1-t2v"], platform=cpu)
    p = DiffusionParams(num_steps=1, height=32, width=32, num_frames=5, guidance_scale=1.0)
    student = copy.deepcopy(model.components["text_encoder"])
    plan = WeightSyncPlan(student, model, "text_encoder", WeightRole.STUDENT)
    a = model.generate("a cat", params=p).frames
    with torch.no_grad():
        for q in student.parameters():
            q.add_(0.5)
    assert plan.sync() == 1 and model.versions["text_encoder"] == 1
    b = model.generate("a cat", params=p).frames  # the cached embedding of v0 is not reused
    assert not np.array_equal(a, b)
    ema = WeightSyncPlan(student, model, "text_encoder", WeightRole.EMA, decay=0.5)
    ema.sync()
    ref = WeightSyncPlan(student, model, "text_encoder", WeightRole.REFERENCE)
    ref.sync()
    with pytest.raises(RuntimeError, match="synced once"):
        ref.sync()
    with pytest.raises(ValueError, match="'nope' is not in"):
        WeightSyncPlan(student, model, "nope")


def test_resume_is_bit_identical_and_a_crashed_save_keeps_the_previous(ckpts, cpu, tmp_path, monkeypatch):
    straight = _grpo(ckpts, cpu, steps=4, checkpoint_every=2, output_dir=str(tmp_path / "a"))
    straight.run(progress=False)
    half = _grpo(ckpts, cpu, steps=2, checkpoint_every=2, output_dir=str(tmp_path / "b"))
    half.run(progress=False)
    resumed = _grpo(ckpts, cpu, steps=4, checkpoint_every=2, output_dir=str(tmp_path / "b"))
    resumed.run(progress=False)
    a, b = _params(straight.stage.policy), _params(resumed.stage.policy)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(p, q) for p, q in zip(straight.model.dit.parameters(), resumed.model.dit.parameters()))
    ma, mb = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rs]  # noqa: E731
    assert strip(ma) == strip(mb) and [r["step"] for r in mb] == [1, 2, 3, 4]
    assert json.loads((latest_checkpoint(tmp_path / "b" / "checkpoints") / "state.json").read_text())["step"] == 4

    # a crash while writing step 6 leaves step 4 as the latest, loadable checkpoint
    import flowseam.training.checkpoint as ck

    def crash(*a, **k):
        raise OSError("power cut")

    monkeypatch.setattr(ck, "safetensors_bytes", crash)
    crashed = _grpo(ckpts, cpu, steps=6, checkpoint_every=2, output_dir=str(tmp_path / "b"))
    with pytest.raises(OSError, match="power cut"):
        crashed.run(progress=False)
    latest = latest_checkpoint(tmp_path / "b" / "checkpoints")
    assert latest.name == "step-000004"
    assert not [p for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.startswith(".step")]
    monkeypatch.undo()
    again = _grpo(ckpts, cpu, steps=4, checkpoint_every=2, output_dir=str(tmp_path / "b"))
    again.run(progress=False)  # resumes at step 4: nothing to do, weights as saved
    assert all(torch.equal(a[n], p) for n, p in again.stage.policy.named_parameters())


@pytest.mark.slow
def test_informative_reward_beats_the_constant_reward_control(ckpts, cpu):
    """Brightness reward for a few steps raises the held-out mean brightness by more than the
    seed-to-seed spread of the constant-reward control.

    The control's weights cannot move (every advantage is 0: asserted bit for bit by
    test_constant_reward_leaves_every_parameter_unchanged), so its held-out means are those of
    the untrained model: the control is evaluated without spending a training run on it."""
    from flowseam.rewards.simple import brightness

    # 10 steps: the gain passes the spread after 4 and is 3.5 spreads after 8 (measured); the
    # former 30-step run cost 4 minutes on 2 cores for the same verdict
    cfg = dict(prompts=["a ball"], group_size=4, steps=10, seed=0, sampling=SAMPLING,
               grpo=dict(beta=0.0, clip_range=0.2), optim=dict(lr=3e-3))
    control = FlowGRPO(dict(cfg, reward="constant"), model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu))
    control.reward = brightness
    held_out = [list(range(1000 + 8 * k, 1008 + 8 * k)) for k in range(4)]
    control_means = [float(control.evaluate(s).mean()) for s in held_out]
    spread = float(np.std(control_means))
    trained = FlowGRPO(dict(cfg, reward="brightness"), model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu))
    before = float(trained.evaluate(held_out[0]).mean())
    trained.run(progress=False)
    after = float(trained.evaluate(held_out[0]).mean())
    assert before == pytest.approx(control_means[0], abs=1e-7)  # same untrained model
    assert after - before > spread > 0, (before, after, spread)


def test_workflow_rl_trains_both_stages_from_the_video_reward(ckpts, cpu):
    wf = WorkflowRL(dict(prompts=["a ball"], reward="brightness", group_size=2, steps=1, seed=0,
                         t2i_sampling=dict(num_steps=2, height=32, width=32, max_sequence_length=16),
                         i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5),
                         grpo=dict(beta=0.04, clip_range=0.2), optim=dict(lr=1e-3, weight_decay=0.0),
                         t2i_optim=dict(lr=2e-4)),
                    t2i=flowseam.load(ckpts["flux.1-t2i"], platform=cpu),
                    i2v=flowseam.load(ckpts["wan2.1-i2v"], platform=flowseam.Platform("cpu")))
    # [t2i_optim] overrides [optim] for that stage only
    (t2i_group,), (i2v_group,) = (s.optimizer.param_groups for s in wf.stages)
    assert (t2i_group["lr"], t2i_group["weight_decay"]) == (2e-4, 0.0)
    assert (i2v_group["lr"], i2v_group["weight_decay"]) == (1e-3, 0.0)
    t2i_before, i2v_before = _params(wf.t2i.dit), _params(wf.i2v.dit)
    rec = wf.train_step()
    for name in ("t2i", "i2v"):
        first = torch.cat(wf.last_stats[name].first_epoch_ratios)
        assert (first - 1).abs().max() <= 1e-6, name
        assert rec[f"{name}_weights_version"] == 1
    assert wf.stages[0].sync.target is wf.t2i and wf.stages[1].sync.target is wf.i2v
    # credit across the model boundary: the T2I transformer moved under the video reward alone
    assert any(not torch.equal(t2i_before[n], p) for n, p in wf.t2i.dit.named_parameters())
    assert any(not torch.equal(i2v_before[n], p) for n, p in wf.i2v.dit.named_parameters())


def test_lora_trains_only_the_adapters(ckpts, cpu):
    g = _grpo(ckpts, cpu, lora=dict(rank=4), steps=1, grpo=dict(beta=0.0, clip_range=0.2))
    base = {n: p.clone() for n, p in g.model.dit.named_parameters() if "lora_" not in n}
    lora = {n: p.clone() for n, p in g.model.dit.named_parameters() if "lora_" in n}
    assert lora
    g.run(progress=False)
    now = dict(g.model.dit.named_parameters())
    assert all(torch.equal(base[n], now[n]) for n in base)
    assert any(not torch.equal(lora[n], now[n]) for n in lora)


def test_finetune_lowers_the_flow_matching_loss_and_saves_a_loadable_checkpoint(ckpts, cpu, tmp_path):
    from flowseam.training.finetune import Finetune

    rng = np.random.RandomState(0)
    data = [(f"digit {i}", np.clip(rng.rand(1, 32, 32, 3) * 0.2 + i / 4, 0, 1).astype(np.float32))
            for i in range(4)]
    ft = Finetune(dict(steps=15, batch_size=4, seed=0, output_dir=str(tmp_path / "ft"),
                       optim=dict(lr=3e-3), train=dict(p_uncond=0.0, sigma_sampling="uniform")),
                  model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu), dataset=data)
    probe = lambda: float(sum(ft.loss(p, f, 1000 + i) for i, (p, f) in enumerate(data)))  # noqa: E731
    with torch.no_grad():
        before = probe()
    summary = ft.run(progress=False)
    with torch.no_grad():
        after = probe()
    assert after < 0.8 * before, (before, after)
    reloaded = flowseam.load(summary["model"], platform=cpu)
    for (n, p), q in zip(ft.stage.policy.named_parameters(), reloaded.dit.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_train_cli(ckpts, tmp_path):
    from conftest import run_main

    cfg = tmp_path / "grpo.toml"
    cfg.write_text(f'''model = "{ckpts["flux.1-t2i"]}"
backend = "cpu"
prompts = ["a ball"]
reward = "brightness"
group_size = 2
steps = 2
output_dir = "{tmp_path / 'run'}"
[sampling]
num_steps = 2
height = 32
width = 32
max_sequence_length = 16
''')
    r = run_main("train", "--method", "flowgrpo", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 2
    # the README's train → generate: the run's model is what generate takes
    assert f"model: {tmp_path / 'run' / 'model'}" in r.stdout
    image = tmp_path / "after.png"
    g = run_main("generate", "--model", str(tmp_path / "run" / "model"), "--prompt", "a ball",
                 "--steps", "2", "--height", "32", "--width", "32", "--max-sequence-length", "16",
                 "--backend", "cpu", "--output", str(image))
    assert g.returncode == 0, g.stderr
    assert image.is_file()
    bad = run_main("train", "--method", "nosuch", "--config", str(cfg))
    assert bad.returncode != 0 and "registered methods" in bad.stderr


def test_group_advantages_hand_computed():
    from flowseam.training.grpo import GRPOConfig, group_advantages

    cfg = GRPOConfig(eps=0.0, adv_clip_max=5.0)
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, float("nan"), 1.0]])
    adv, valid, stats = group_advantages(rewards, cfg)
    s = (2.0 / 3.0) ** 0.5  # population std of 1, 2, 3
    torch.testing.assert_close(adv[0], torch.tensor([-1 / s, 0.0, 1 / s]))
    assert adv[1].tolist() == [0.0, 0.0, 0.0] and adv[2].tolist() == [0.0, 0.0, 0.0]
    assert valid.tolist() == [True, True, False]
    assert stats["groups_skipped_nan"] == 1 and stats["frac_zero_std_groups"] == pytest.approx(1 / 3)
    clipped, _, _ = group_advantages(rewards, GRPOConfig(eps=0.0, adv_clip_max=1.0))
    assert clipped[0].tolist() == [-1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="K >= 2"):
        group_advantages(torch.ones(2, 1), cfg)


def test_timestep_fraction_kl_and_metrics(ckpts, cpu, tmp_path):
    from flowseam.training.grpo import train_timesteps

    picked = train_timesteps(10, 0.5, seed=3)
    assert len(picked) == 5 and picked == sorted(set(picked)) and picked == train_timesteps(10, 0.5, 3)
    g = _grpo(ckpts, cpu, steps=1, output_dir=str(tmp_path), sampling=dict(SAMPLING, num_steps=4),
              grpo=dict(beta=0.04, clip_range=0.2, timestep_fraction=0.5))
    g.run(progress=False)
    assert len(g.last_stats.first_epoch_ratios) == 2  # ceil(0.5 * 4) steps, one group
    assert g.last_stats.kl_ref == [0.0, 0.0]  # policy == reference before the first update
    (rec,) = read_metrics(tmp_path / "metrics.jsonl")
    required = {"reward_mean", "reward_std", "adv_mean", "adv_std", "adv_min", "adv_max",
                "frac_zero_std_groups", "ratio_mean", "ratio_min", "ratio_max", "clip_frac",
                "approx_kl", "kl_ref", "grad_norm", "seconds_rollout", "seconds_reward",
                "seconds_update", "seconds_sync", "weights_version"}
    assert required <= set(rec), required - set(rec)
    assert rec["weights_version"] == 1 and rec["grad_norm"] > 0


def test_ema_sync_averages(ckpts, cpu):
    import copy

    model = flowseam.load(ckpts["flux.1-t2i"], platform=cpu)
    student = copy.deepcopy(model.dit)
    plan = WeightSyncPlan(student, model, "transformer", WeightRole.EMA, decay=0.25)
    plan.sync()  # the first sync copies
    first = {n: p.clone() for n, p in model.dit.named_parameters()}
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    plan.sync()
    for (n, p), q in zip(model.dit.named_parameters(), student.parameters()):
        torch.testing.assert_close(p, 0.25 * first[n] + 0.75 * q)
    assert plan.version == 2 and model.versions["transformer"] == 2


def test_yaml_and_toml_configs_load_alike(tmp_path):
    from flowseam.training.config import load_config

    (tmp_path / "a.yaml").write_text("prompts: [a ball]\ngroup_size: 3\nsampling:\n  num_steps: 2\n")
    (tmp_path / "a.toml").write_text('prompts = ["a ball"]\ngroup_size = 3\n[sampling]\nnum_steps = 2\n')
    assert load_config(tmp_path / "a.yaml") == load_config(tmp_path / "a.toml") == {
        "prompts": ["a ball"], "group_size": 3, "sampling": {"num_steps": 2}}
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(FlowseamError, match="unsupported suffix '.json'"):
        load_config(tmp_path / "b.json")


def test_workflow_rl_batches_across_groups_as_it_does_group_by_group(ckpts, cpu, monkeypatch):
    """``rollout_batch_size = 4`` rolls out two groups of two as one batch and recomputes it as
    one: the same rewards and the same gradients (norms before clipping) as one batch per group.
    One group's reward has no spread: its rows weigh nothing and are not counted in the mean.
    Both stages get the same advantages (one reward on the final video)."""
    import flowseam.training.workflow_rl as wrl

    def reward(prompts, videos):  # "a box": constant (zero std, not trained); "a ball": brightness
        return torch.tensor([0.5 if p == "a box" else float(v.mean()) for p, v in zip(prompts, videos)])

    seen, real = {}, wrl.ppo_update

    def spy(policy, reference, trajectories, *a, **k):
        stage = "t2i" if trajectories[0].model is wf.t2i else "i2v"
        seen[stage] = torch.cat([t.advantages for t in trajectories])
        return real(policy, reference, trajectories, *a, **k)

    monkeypatch.setattr(wrl, "ppo_update", spy)
    records = {}
    for batch in (None, 4):
        wf = WorkflowRL(dict(prompts=["a ball", "a box"], prompts_per_step=2, group_size=2, steps=1,
                             seed=2, rollout_batch_size=batch,
                             t2i_sampling=dict(num_steps=2, height=32, width=32, max_sequence_length=16),
                             i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5),
                             grpo=dict(beta=0.0, clip_range=0.2), optim=dict(lr=1e-3)),
                        t2i=flowseam.load(ckpts["flux.1-t2i"], platform=cpu),
                        i2v=flowseam.load(ckpts["wan2.1-i2v"], platform=cpu), reward=reward)
        records[batch] = wf.train_step()
        assert seen["t2i"].shape == (4,) and torch.equal(seen["t2i"], seen["i2v"])
        assert seen["t2i"][:2].abs().sum() > 0 and not seen["t2i"][2:].any()  # "a box": 0
        # the trained group's 2 rows at each of the 2 SDE steps, whatever the batching
        assert [len(r) for r in wf.last_stats["i2v"].ratios] == [2, 2], batch
    per_group, batched = records[None], records[4]
    assert per_group["frac_zero_std_groups"] == batched["frac_zero_std_groups"] == 0.5
    assert batched["reward_mean"] == pytest.approx(per_group["reward_mean"], abs=1e-6)
    for stage in ("t2i", "i2v"):
        assert per_group[f"{stage}_grad_norm"] > 0
        assert batched[f"{stage}_grad_norm"] == pytest.approx(per_group[f"{stage}_grad_norm"], rel=1e-4)


def test_workflow_rl_logs_each_component_of_a_weighted_sum_reward(ckpts, cpu):
    """reward = {brightness = 0.5, channel_contrast = 2.0} on the final videos: each component's
    mean and std next to the total, whose mean is their weighted sum."""
    wf = WorkflowRL(dict(prompts=["a ball"], reward={"brightness": 0.5, "channel_contrast": 2.0},
                         group_size=2, steps=1, seed=0,
                         t2i_sampling=dict(num_steps=2, height=32, width=32, max_sequence_length=16),
                         i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5)),
                    t2i=flowseam.load(ckpts["flux.1-t2i"], platform=cpu),
                    i2v=flowseam.load(ckpts["wan2.1-i2v"], platform=flowseam.Platform("cpu")))
    rec = wf.train_step()
    assert rec["reward_mean"] == pytest.approx(
        0.5 * rec["reward_brightness_mean"] + 2.0 * rec["reward_channel_contrast_mean"], abs=1e-6)
    assert rec["reward_brightness_std"] > 0 and rec["reward_channel_contrast_std"] > 0
