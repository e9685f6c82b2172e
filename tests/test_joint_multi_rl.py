"""joint_multi_rl: Flow-GRPO over Wan2.2's two DiT experts, each trained on the steps it produced.

C2 per expert; the step → expert map checked against diffusers' own schedule and asserted at
replay; the SDE window decides which experts learn (and an idle expert is warned about);
separate optimizers, learning rates, freeze and LoRA per expert; constant reward → every expert
bit-identical; bit-identical resume; config errors before any weights load; the CLI; an
informative reward beats the constant-reward control (slow)."""

from __future__ import annotations

import json
from importlib import metadata

import diffusers
import numpy as np
import pytest
import torch

import flowseam
from flowseam.models.experts import Experts
from flowseam import FlowseamError
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.joint_multi_rl import JointMultiRL, check_expert_map
from flowseam.training.metrics import read_metrics

# guidance 1: no CFG pass (half the cost); 4 steps with the tiny card's shift 3 and boundary 0.875
SAMPLING = dict(num_steps=4, height=32, width=32, num_frames=5, max_sequence_length=16,
                guidance_scale=1.0)
EXPERTS = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint("wan2.2-t2v", tmp_path_factory.mktemp("joint") / "wan22")


@pytest.fixture()
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _config(**over):
    cfg = dict(prompts=["a ball", "a box"], reward="brightness", group_size=2, steps=1, seed=0,
               sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2), optim=dict(lr=1e-3))
    cfg.update(over)
    return cfg


def _joint(ckpt, cpu, **over):
    return JointMultiRL(_config(**over), model=flowseam.load(ckpt, platform=cpu, quiet=True))


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _same(before, module):
    return all(torch.equal(before[n], p) for n, p in module.named_parameters())


def _expert_of_each_step() -> list[str]:
    """The oracle: diffusers' scheduler timesteps for 4 steps (the tiny checkpoint's
    FlowMatchEuler, shift 3) against WanPipeline's rule ``t >= boundary_ratio * 1000``."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    return ["transformer" if float(t) >= 875.0 else "transformer_2" for t in scheduler.timesteps]


def test_each_expert_learns_from_its_own_steps_with_first_epoch_ratio_one(ckpt, cpu):
    oracle = _expert_of_each_step()
    assert set(oracle) == set(EXPERTS)  # the boundary lies inside the schedule
    j = _joint(ckpt, cpu, grpo=dict(beta=0.04, clip_range=0.2, inner_epochs=2),
               experts={"transformer_2": {"lr": 5e-4}})
    served = {name: _params(m) for name, m in j.model.experts.items()}
    rec = j.train_step()
    for name in EXPERTS:
        stats = j.last_stats[name]
        assert rec[f"{name}_ratio_dev_first_epoch"] <= 1e-6
        assert (torch.cat(stats.ratios[len(stats.first_epoch_ratios):]) - 1).abs().max() > 0  # epoch 2 moved
        assert rec[f"{name}_sde_steps"] == rec[f"{name}_trained_steps"] == oracle.count(name)
        assert rec[f"{name}_weights_version"] == 1 and rec[f"{name}_updated"]
        assert not _same(served[name], j.model.experts[name])  # synced into the rollout instance
    assert [s.name for s in j.stages] == list(EXPERTS)
    opt = {s.name: s.optimizer for s in j.stages}
    assert opt["transformer"] is not opt["transformer_2"]
    assert opt["transformer"].param_groups[0]["lr"] == 1e-3 and opt["transformer_2"].param_groups[0]["lr"] == 5e-4


def test_the_sde_window_decides_which_expert_learns_and_an_idle_one_is_warned(ckpt, cpu):
    oracle = _expert_of_each_step()
    low = [i for i, e in enumerate(oracle) if e == "transformer_2"]
    j = _joint(ckpt, cpu, sampling=dict(SAMPLING, sde_window=[low[0], low[-1] + 1]))
    high, low_before = _params(j.model.experts["transformer"]), _params(j.model.experts["transformer_2"])
    with pytest.warns(UserWarning, match="expert 'transformer' gets no SDE step"):
        rec = j.train_step()
    assert rec["transformer_sde_steps"] == 0 and not rec["transformer_updated"]
    assert rec["transformer_2_sde_steps"] == len(low) and rec["transformer_2_updated"]
    assert _same(high, j.model.experts["transformer"])  # no optimizer step: not even weight decay
    assert _same(high, j.stages[0].policy)
    assert not _same(low_before, j.model.experts["transformer_2"])


def test_constant_reward_leaves_every_expert_bit_identical(ckpt, cpu):
    j = _joint(ckpt, cpu, reward="constant", steps=2)
    before = {name: _params(m) for name, m in j.model.experts.items()}
    out = j.run(progress=False)
    assert all(_same(before[name], m) for name, m in j.model.experts.items())
    assert all(_same(before[s.name], s.policy) for s in j.stages)
    assert out["weights_versions"] == {"transformer": 0, "transformer_2": 0}


def test_a_frozen_expert_stays_as_loaded_and_lora_is_per_expert(ckpt, cpu, tmp_path):
    j = _joint(ckpt, cpu, experts={"transformer": {"freeze": True},
                                   "transformer_2": {"lora": {"rank": 2}}}, output_dir=str(tmp_path))
    assert [s.name for s in j.stages] == ["transformer_2"]
    high = _params(j.model.experts["transformer"])
    assert not any("lora_" in n for n in high)
    trained = [n for n, p in j.stages[0].policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    base = {n: p for n, p in _params(j.stages[0].policy).items() if "lora_" not in n}
    out = j.run(progress=False)
    rec = out["records"][0]
    assert _same(high, j.model.experts["transformer"]) and "transformer_updated" not in rec
    assert rec["transformer_sde_steps"] == _expert_of_each_step().count("transformer")
    now = _params(j.stages[0].policy)
    assert all(torch.equal(base[n], now[n]) for n in base)  # only the adapters moved
    assert rec["transformer_2_updated"]
    # the saved model has the adapters fused: it loads without peft and gives the trained velocity
    saved = flowseam.load(out["model"], platform=cpu, quiet=True)
    assert not any("lora_" in n for n, _ in saved.experts["transformer_2"].named_parameters())
    _, results, _, _ = j.rollout(1)
    res, last = results[0], results[0].records[-1]
    with torch.no_grad():
        want = j.model.velocity(last.latents, last.timestep, res.cond, res.params, expert="transformer_2")
        got = j.model.velocity(last.latents, last.timestep, res.cond, res.params, expert="transformer_2",
                               dit=saved.experts["transformer_2"])
        untrained = j.model.velocity(last.latents, last.timestep, res.cond, res.params,
                                     expert="transformer_2", dit=flowseam.load(ckpt, platform=cpu,
                                                                              quiet=True).experts["transformer_2"])
    assert torch.allclose(got, want, atol=1e-5) and not torch.equal(untrained, want)


def test_the_step_expert_map_is_asserted_at_replay(ckpt, cpu):
    j = _joint(ckpt, cpu)
    _, results, _, _ = j.rollout(0)
    assert [r.expert for r in results[0].records] == results[0].experts == _expert_of_each_step()
    check_expert_map(j.model, results[0])
    # another boundary (0.1 * 1000): step 1 is transformer's now
    j.model.experts = Experts(j.model.card.experts, j.model.components, 100.0, j.model.card.name)
    with pytest.raises(FlowseamError, match=r"step 1 .* recorded as produced by 'transformer_2', but "
                                            r"wan2.2-t2v assigns it to 'transformer'"):
        check_expert_map(j.model, results[0])


def test_resume_is_bit_identical(ckpt, cpu, tmp_path):
    straight = _joint(ckpt, cpu, steps=2, checkpoint_every=1, output_dir=str(tmp_path / "a"))
    straight.run(progress=False)
    half = _joint(ckpt, cpu, steps=1, checkpoint_every=1, output_dir=str(tmp_path / "b"))
    half.run(progress=False)
    resumed = _joint(ckpt, cpu, steps=2, checkpoint_every=1, output_dir=str(tmp_path / "b"))
    out = resumed.run(progress=False)
    for name in EXPERTS:
        assert all(torch.equal(p, q) for p, q in zip(straight.model.experts[name].parameters(),
                                                     resumed.model.experts[name].parameters()))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rs]  # noqa: E731
    ma, mb = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert strip(ma) == strip(mb) and [r["step"] for r in mb] == [1, 2]
    assert mb[1]["transformer_weights_version"] == 2 and mb[1]["transformer_2_weights_version"] == 2
    # the run ends with a loadable model: both trained experts, as the rollout instance holds them
    assert out["model"] == str(tmp_path / "b" / "model")
    assert out["exported"] == {name: {"model": out["model"]} for name in EXPERTS}
    saved = flowseam.load(tmp_path / "b" / "model", platform=cpu, quiet=True)
    for name in EXPERTS:
        assert all(torch.equal(p, q) for p, q in zip(saved.experts[name].parameters(),
                                                     resumed.model.experts[name].parameters()))


@pytest.mark.parametrize("over, message", [
    (dict(experts={"transformer_3": {}}), r"\[experts\] names \['transformer_3'\], which the model "
                                          r"does not have; its DiT experts are \['transformer', 'transformer_2'\]"),
    (dict(experts={"transformer": {"freeze": True}, "transformer_2": {"freeze": True}}),
     r"every expert is frozen"),
    (dict(experts={"transformer": {"learning_rate": 1.0}}),
     r"\[experts.transformer\] has unknown key\(s\) \['learning_rate'\]"),
    (dict(experts={"transformer": {"lr": float("inf")}}), r"\[experts.transformer\] lr=inf: .*finite"),
    (dict(optim={"lr": -1}), r"\[optim\] lr=-1: Input should be greater than 0"),
    (dict(experts={"transformer": {"freeze": "yes"}}), r"\[experts.transformer\] freeze='yes': Input should be a valid boolean"),
    (dict(experts={"transformer_2": {"lora": {"r": 4}}}), r"\[experts.transformer_2.lora\] has unknown key"),
    (dict(ray={"rollout_workers": 2}), r"config has unknown key\(s\) \['ray'\]"),
    (dict(group_size=1), r"group_size=1: Input should be greater than or equal to 2"),
    (dict(sampling=dict(SAMPLING, noise_level=0)), r"noise_level=0"),
])
def test_config_errors_name_the_key_before_any_weights_load(ckpt, over, message, monkeypatch):
    import flowseam.training.joint_multi_rl as mod

    def no_loading(*a, **k):
        raise AssertionError("weights were loaded before the config was checked")

    monkeypatch.setattr(mod, "load", no_loading)
    with pytest.raises(FlowseamError, match=message):
        JointMultiRL(dict(_config(**over), model=str(ckpt), backend="cpu"))


def test_more_than_one_rank_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FlowseamError, match="joint_multi_rl runs on one process; 2 ranks"):
        JointMultiRL(_config(model="unused"))


def test_joint_multi_rl_is_a_method_plugin_with_its_own_entry_point():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["joint_multi_rl"] == "flowseam.training.builtin:joint_multi_rl"
    from flowseam.training import get_method

    assert get_method("joint_multi_rl") is JointMultiRL


@pytest.mark.slow
def test_informative_reward_beats_the_constant_reward_control(ckpt, cpu):
    """Brightness reward for a few steps raises the held-out mean brightness of the two-expert
    model beyond the seed-to-seed spread of the constant-reward control (whose experts cannot
    move: test_constant_reward_leaves_every_expert_bit_identical, so it is evaluated
    untrained)."""
    from flowseam.rewards.simple import brightness

    cfg = _config(prompts=["a ball"], group_size=4, steps=8, grpo=dict(beta=0.0, clip_range=0.2),
                  optim=dict(lr=3e-3))
    control = _joint(ckpt, cpu, **dict(cfg, reward="constant"))
    control.reward = brightness
    held_out = [list(range(1000 + 8 * k, 1008 + 8 * k)) for k in range(4)]
    control_means = [float(control.evaluate(s).mean()) for s in held_out]
    spread = float(np.std(control_means))
    trained = _joint(ckpt, cpu, **cfg)
    before = float(trained.evaluate(held_out[0]).mean())
    trained.run(progress=False)
    after = float(trained.evaluate(held_out[0]).mean())
    assert before == pytest.approx(control_means[0], abs=1e-7)
    assert after - before > spread > 0, (before, after, spread)


@pytest.mark.slow
def test_train_cli_runs_joint_multi_rl_and_refuses_a_bad_expert(ckpt, tmp_path):
    from conftest import run_main

    cfg = tmp_path / "joint.toml"
    cfg.write_text(f'''model = "{ckpt}"
backend = "cpu"
prompts = ["a ball"]
reward = "brightness"
group_size = 2
steps = 1
output_dir = "{tmp_path / 'run'}"
[sampling]
{chr(10).join(f"{k} = {json.dumps(v)}" for k, v in SAMPLING.items())}
[experts.transformer_2]
lr = 5e-4
''')
    done = run_main("train", "--method", "joint_multi_rl", "--config", str(cfg))
    assert done.returncode == 0, done.stderr
    (rec,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rec["transformer_ratio_dev_first_epoch"] <= 1e-6 and rec["transformer_2_ratio_dev_first_epoch"] <= 1e-6
    bad = run_main("train", "--method", "joint_multi_rl", "--config", str(cfg),
                   "--set", 'experts={"transformer_9": {}}')
    assert bad.returncode == 2 and "which the model does not have" in bad.stderr


def test_a_weighted_sum_reward_logs_each_component(ckpt, cpu):
    """reward = {brightness = 0.5, channel_contrast = 2.0}: the step's record holds each
    component's mean and std next to the total, and the total's mean is their weighted sum."""
    j = _joint(ckpt, cpu, reward={"brightness": 0.5, "channel_contrast": 2.0})
    rec = j.train_step()
    assert rec["reward_mean"] == pytest.approx(
        0.5 * rec["reward_brightness_mean"] + 2.0 * rec["reward_channel_contrast_mean"], abs=1e-6)
    assert rec["reward_brightness_std"] > 0 and rec["reward_channel_contrast_std"] > 0
