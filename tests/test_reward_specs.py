"""How training methods name, build, call and check rewards: weighted sums (the total against a
numpy computation on the rollout frames, each component's mean and std in metrics.jsonl), bad
reward specs refused before any model loads (in every RL method), and rewards that fail at run
time (raise, a wrong shape, not numbers, an infinity, NaN everywhere, past their timeout) named
with their plugin — in a flowgrpo step and through ``flowseam train``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flowseam
from flowseam import FlowseamError, InvalidInputError, RewardFaultError, cli
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.flowgrpo import FlowGRPO
from flowseam.training.joint_multi_rl import JointMultiRL
from flowseam.training.metrics import read_metrics
from flowseam.rewards.spec import Reward, RewardComponent, as_reward, build_reward
from flowseam.training.unified_rl import UnifiedRL
from flowseam.training.workflow_rl import WorkflowRL

from conftest import plugin_env

SAMPLING = dict(num_steps=2, height=32, width=32, max_sequence_length=16)
FIXTURE = "flowseam-fixture-rewards"
MISSING = "/nonexistent/flowseam-checkpoint"  # loading it would fail: the reward must fail first


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("reward-specs") / "flux")


@pytest.fixture()
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


@pytest.fixture(scope="module")
def bad_rewards(isolated_plugin):
    """Every installed plugin plus the fixture package whose rewards break the contract."""
    with plugin_env(isolated_plugin(FIXTURE)) as reg:
        pass
    assert reg.records["bad_rewards"].status == "available", reg.records["bad_rewards"].reason
    return reg


def _cfg(**over):
    cfg = dict(prompts=["a ball", "a box"], reward="brightness", group_size=2, steps=1, seed=0,
               sampling=SAMPLING, grpo=dict(beta=0.0, clip_range=0.2), optim=dict(lr=1e-3))
    cfg.update(over)
    return cfg


# -- weighted sums ------------------------------------------------------------------------------

def test_a_weighted_sum_in_a_flowgrpo_run_is_the_sum_of_its_logged_components(flux, cpu, tmp_path):
    """total = 0.7 * brightness - 0.3 * channel_contrast(blue) per sample: the logged total
    against the logged components and against both rewards recomputed with numpy (float64) on
    the step's rollout frames; every component's mean and std in metrics.jsonl."""
    w_b, w_c = 0.7, -0.3
    g = FlowGRPO(_cfg(prompts_per_step=2, output_dir=str(tmp_path / "run"),
                      reward={"brightness": w_b, "channel_contrast": w_c},
                      reward_args={"channel_contrast": {"channel": 2}}),
                 model=flowseam.load(flux, platform=cpu))
    assert g.reward.name == "0.7*brightness + -0.3*channel_contrast"
    _, results, prompts, _ = g.rollout(0)  # what step 1 rolls out (seeded, weights unchanged)
    frames = np.concatenate([r.frames for r in results]).astype(np.float64)  # (4, F, H, W, 3)
    bright = frames.reshape(len(frames), -1).mean(axis=1)
    blue = frames[..., 2].reshape(len(frames), -1).mean(axis=1) - \
        frames[..., :2].reshape(len(frames), -1).mean(axis=1)
    total = w_b * bright + w_c * blue
    scores = g.reward.score([prompts[0]] * 2, results[0].frames)
    assert np.allclose(scores.total.numpy(), total[:2], atol=1e-6)
    assert np.allclose(scores.parts["brightness"].numpy(), bright[:2], atol=1e-6)
    assert np.allclose(scores.parts["channel_contrast"].numpy(), blue[:2], atol=1e-6)

    summary = g.run(progress=False)
    (rec,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rec == pytest.approx(summary["records"][0], nan_ok=True)
    assert rec["reward_mean"] == pytest.approx(total.mean(), abs=1e-6)
    assert rec["reward_std"] == pytest.approx(total.std(), abs=1e-6)
    assert rec["reward_brightness_mean"] == pytest.approx(bright.mean(), abs=1e-6)
    assert rec["reward_brightness_std"] == pytest.approx(bright.std(), abs=1e-6)
    assert rec["reward_channel_contrast_mean"] == pytest.approx(blue.mean(), abs=1e-6)
    assert rec["reward_channel_contrast_std"] == pytest.approx(blue.std(), abs=1e-6)
    # the total from the logged components alone (the mean is linear)
    assert rec["reward_mean"] == pytest.approx(
        w_b * rec["reward_brightness_mean"] + w_c * rec["reward_channel_contrast_mean"], abs=1e-6)
    assert rec["updated"] and rec["reward_std"] > 0


def test_a_nan_in_any_component_makes_that_sample_nan_and_labels_are_unique():
    def a(prompts, outputs):
        return torch.tensor([1.0, float("nan"), 3.0])

    def b(prompts, outputs):
        return np.array([[10.0], [20.0], [float("nan")]])  # (B, 1) numpy is taken as (B,)

    r = Reward([RewardComponent("a", a, 2.0, label="a"), RewardComponent("b", b, 0.5, label="b")],
               timeout=5, weighted=True)
    out = r.score(["x"] * 3, np.zeros((3, 1, 2, 2, 3), np.float32))
    assert out.total[0].item() == pytest.approx(2.0 * 1.0 + 0.5 * 10.0)
    assert math.isnan(out.total[1].item()) and math.isnan(out.total[2].item())
    assert out.total.dtype == torch.float32 and set(out.parts) == {"a", "b"}
    # two components that would share a label are labelled by their whole (sanitised) keys
    s = build_reward({"brightness": 1, "methods:brightness": 2})
    assert [c.label for c in s.components] == ["brightness", "methods_brightness"]
    assert [(c.plugin, c.distribution) for c in s.components] == [("methods", "flowseam")] * 2


# -- bad specs: refused before any model loads ---------------------------------------------------

BAD_SPECS = [
    (dict(reward="no_such_reward"),
     r"unknown reward 'no_such_reward'; registered rewards: \[.*'brightness'.*'channel_contrast'"),
    (dict(reward={"brightness": 0.5, "channel_contrast": float("nan")}),
     "reward weight channel_contrast=nan must be a finite number"),
    (dict(reward={"brightness": float("inf")}),
     "reward weight brightness=inf must be a finite number"),
    (dict(reward={"brightness": "0.5"}), "reward weight brightness='0.5' must be a finite number"),
    (dict(reward={"brightness": True}), "reward weight brightness=True must be a finite number"),
    (dict(reward={}), r"reward = \{\} names no reward"),
    (dict(reward={"brightness": 1, "nope": 1}), "unknown reward 'nope'"),
    (dict(reward="ftp://127.0.0.1:8000/ocr"),
     r"must start with http:// or https:// \(got ftp://\)"),
    (dict(reward="http://127.0.0.1:8000/"), "must end in the served reward's name"),
    (dict(reward={"brightness": 1.0, "audio_rms": 1.0}),
     r"mixes rewards of sound and of frames "
     r"\(\{'audio': \['audio_rms'\], 'video': \['brightness'\]\}\)"),
    (dict(reward={"brightness": 1.0}, reward_args={"ocr": {"threads": 1}}),
     r"reward_args names \['ocr'\], which are not components"),
    (dict(reward={"brightness": 1.0, "channel_contrast": 1.0}, reward_args={"channel_contrast": 2}),
     "reward_args for 'channel_contrast' must be a table"),
    (dict(reward="brightness", reward_args={"gamma": 2}),
     r"reward 'brightness' is a function and takes no reward_args; got \['gamma'\]"),
    (dict(reward="channel_contrast", reward_args={"chanel": 1}),
     r"reward_args \{'chanel': 1\} do not fit reward 'channel_contrast'.*it takes \['channel'\]"),
    (dict(reward="channel_contrast", reward_args={"channel": 5}), "channel=5 must be 0, 1 or 2"),
    (dict(reward="http://127.0.0.1:1/brightness", reward_args={"retry": 2}),
     r"reward_args \{'retry': 2\} do not fit reward server 'http://127.0.0.1:1/brightness'.*"
     r"takes \['api_key', 'timeout', 'retries'"),
]


@pytest.mark.parametrize("over, match", BAD_SPECS, ids=[m[:40] for _, m in BAD_SPECS])
def test_a_bad_reward_spec_is_refused_before_the_model_loads(over, match):
    with pytest.raises(InvalidInputError, match=match):
        FlowGRPO(_cfg(model=MISSING, **over))


def test_a_clip_directory_missing_files_is_refused_before_the_model_loads(tmp_path):
    empty = tmp_path / "clip"
    empty.mkdir()
    with pytest.raises(InvalidInputError, match=f"model directory '{empty}' lacks config.json"):
        FlowGRPO(_cfg(model=MISSING, reward={"clip_score": 1.0, "brightness": 1.0},
                      reward_args={"clip_score": {"model": str(empty)}}))


def test_a_bad_timeout_is_refused():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(FlowseamError, match="reward_timeout="):
            FlowGRPO(_cfg(model=MISSING, reward_timeout=bad))


METHODS = {
    "flowgrpo": lambda **over: FlowGRPO(_cfg(model=MISSING, **over)),
    "joint_multi_rl": lambda **over: JointMultiRL(_cfg(model=MISSING, **over)),
    "workflow_rl": lambda **over: WorkflowRL(dict(prompts=["a ball"], t2i_model=MISSING,
                                                  i2v_model=MISSING, **over)),
    "unified_rl": lambda **over: UnifiedRL(dict(
        prompts=["a ball"], lm_model=MISSING, model=MISSING,
        sampling=SAMPLING, **over)),
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_rl_method_builds_its_reward_before_loading_a_model(method):
    make = METHODS[method]
    with pytest.raises(InvalidInputError, match="unknown reward 'no_such_reward'"):
        make(reward="no_such_reward")
    with pytest.raises(InvalidInputError, match="reward weight b=nan must be a finite number"):
        make(reward={"brightness": 1.0, "b": float("nan")})
    with pytest.raises(InvalidInputError, match="https://"):
        make(reward="ftp://host/ocr")
    # with a good reward the same config fails later, on the checkpoint it cannot read
    with pytest.raises(Exception) as info:
        make(reward={"brightness": 1.0})
    assert not isinstance(info.value, InvalidInputError) or "reward" not in str(info.value)
    assert "nonexistent" in str(info.value) or "lm_model" in str(info.value), info.value


# -- rewards that fail at run time ---------------------------------------------------------------

def _by_fixture(exc: RewardFaultError, reward: str) -> None:
    text = str(exc)
    who = "of plugin 'bad_rewards' (flowseam-fixture-rewards 0.0.1)"
    assert f"reward '{reward}' {who}" in text, text
    assert "FLOWSEAM_DISABLE_PLUGINS=bad_rewards" in text and "\n" not in text, text
    assert (exc.plugin, exc.distribution, exc.version) == \
        ("bad_rewards", "flowseam-fixture-rewards", "0.0.1")


FAULTS = [
    (dict(reward="raises"), "raises",
     r"raised RuntimeError: the scorer's weights are not loaded \(scoring 2 samples\)"),
    (dict(reward="wrong_shape"), "wrong_shape", r"returned shape \(2, 3\) \(Tensor tensor"),
    (dict(reward="strings"), "strings", r"returned list \['good', 'good'\] for 2 samples, which is "
                                        "not numbers"),
    (dict(reward="infinite"), "infinite", r"returned an infinity for sample\(s\) \[0\] of 2"),
    (dict(reward="all_nan"), "all_nan", "returned NaN for every sample of step 1 \\(2 samples\\)"),
    (dict(reward={"brightness": 0.5, "all_nan": 0.5}), "all_nan", "NaN for every sample of step 1"),
    (dict(reward={"brightness": 0.5, "raises": 0.5}), "raises", "raised RuntimeError"),
    (dict(reward="sleeps", reward_args={"seconds": 3.0}, reward_timeout=0.2), "sleeps",
     r"did not return within reward_timeout=0.2 s \(scoring 2 samples\); its thread cannot be "
     "stopped"),
]


@pytest.mark.parametrize("over, name, match", FAULTS,
                         ids=[f[1] + str(i) for i, f in enumerate(FAULTS)])
def test_a_failing_reward_is_named_with_its_plugin_and_stops_the_step(bad_rewards, flux,
                                                                      monkeypatch, over, name,
                                                                      match):
    monkeypatch.setattr(flowseam.seam.discovery, "_CACHE", bad_rewards)
    model = flowseam.load(flux, platform=flowseam.Platform("cpu"), quiet=True)
    g = FlowGRPO(_cfg(prompts=["a ball"], **over), model=model)
    before = {n: p.detach().clone() for n, p in g.stage.policy.named_parameters()}
    with pytest.raises(RewardFaultError, match=match) as info:
        g.train_step()
    _by_fixture(info.value, name)
    assert info.value.what == f"reward {name}"
    if name == "raises":
        assert isinstance(info.value.__cause__, RuntimeError)
    assert g.step == 0
    assert all(torch.equal(before[n], p) for n, p in g.stage.policy.named_parameters())


def test_finite_weights_whose_sum_overflows_float32_are_refused():
    """1e39 is a finite weight, but 1e39 * brightness is no float32: refused, never an inf
    total handed to the advantages."""
    with pytest.raises(InvalidInputError, match=r"reward 1e\+39\*brightness: the weighted sum "
                                                r"is infinite in float32 for sample\(s\) \[0\]"):
        build_reward({"brightness": 1e39}).score(["a"], np.ones((1, 1, 2, 2, 3), np.float32))


def test_a_reward_that_calls_exit_is_a_fault_not_the_end_of_the_run():
    """SystemExit raised inside a reward (a library calling sys.exit) must not end `flowseam
    train` with status 0 and no model: it is the reward failing."""
    def exits(prompts, outputs):
        raise SystemExit(0)

    with pytest.raises(RewardFaultError, match=r"reward 'exits' .*raised SystemExit\(0\) "
                                               r"\(scoring 1 samples\)") as info:
        as_reward(exits).score(["a"], np.zeros((1, 1, 2, 2, 3), np.float32))
    assert isinstance(info.value.__cause__, SystemExit)


def test_a_callable_handed_to_the_method_is_named_too(flux, cpu):
    def broken(prompts, outputs):
        return None

    g = FlowGRPO(_cfg(), model=flowseam.load(flux, platform=cpu, quiet=True), reward=broken)
    with pytest.raises(RewardFaultError, match=r"reward 'broken' \(not registered by a plugin: "
                                               r"a callable from test_reward_specs.*returned "
                                               r"NoneType"):
        g.train_step()


# -- the CLI -------------------------------------------------------------------------------------

def _train(tmp_path, toml: str, capsys) -> tuple[int, str]:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    status = cli.main(["train", "--method", "flowgrpo", "--config", str(path),
                       "--output-dir", str(tmp_path / "out")])
    return status, capsys.readouterr().err


def test_flowseam_train_bad_reward_exits_2_with_one_line(tmp_path, capsys):
    status, err = _train(tmp_path, f'model = "{MISSING}"\nprompts = ["a"]\n'
                                   'reward = {brightness = 0.5, channel_contrast = nan}\n', capsys)
    assert status == cli.EXIT_USAGE == 2
    assert err.strip().splitlines() == [
        "flowseam: error: reward weight channel_contrast=nan must be a finite number"]


def test_flowseam_train_failing_reward_exits_3_with_one_line(bad_rewards, flux, tmp_path, capsys,
                                                            monkeypatch):
    monkeypatch.setattr(flowseam.seam.discovery, "_CACHE", bad_rewards)  # what discover() returns
    status, err = _train(tmp_path, f'model = "{flux}"\nbackend = "cpu"\nprompts = ["a"]\n'
                                   'reward = "wrong_shape"\ngroup_size = 2\nsteps = 1\n'
                                   '[sampling]\nnum_steps = 2\nheight = 32\nwidth = 32\n', capsys)
    assert status == cli.EXIT_PLUGIN_FAULT == 3
    faults = [line for line in err.splitlines() if "plugin fault" in line]
    assert len(faults) == 1 and "Traceback" not in err, err
    assert faults[0].startswith("flowseam: plugin fault: reward 'wrong_shape' of plugin "
                                "'bad_rewards' (flowseam-fixture-rewards 0.0.1) returned "
                                "shape (2, 3)")
