"""unified_rl: a prompt-refining causal LM and the generator trained from one reward.

The refiner's sampling contract (behaviour log-prob before truncation, left padding, position
ids) checked against an independent per-row forward; C2 on both sides; the two advantage levels
by hand; unrefined baseline branches; constant reward → nothing moves; bit-identical resume and
a loadable LM at the end; config errors before any model loads; the t2i-i2v workflow as the
generator; the CLI."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

import flowseam
from flowseam import FlowseamError
from flowseam.prompt_refiner import PromptRefiner, RefinerSampling
from flowseam.testing.tiny import write_tiny_checkpoint, write_tiny_lm
from flowseam.training.metrics import read_metrics
from flowseam.training.unified_rl import UnifiedRL

SAMPLING = dict(num_steps=3, height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("unified")
    return {"flux.1-t2i": write_tiny_checkpoint("flux.1-t2i", root / "flux"),
            "lm": write_tiny_lm(root / "lm", seed=1)}


@pytest.fixture()
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _config(ckpts, **over):
    cfg = dict(lm_model=str(ckpts["lm"]), lm_template="{request} =>", model=str(ckpts["flux.1-t2i"]),
               backend="cpu", prompts=["a ball", "a red box on a table"], reward="brightness",
               prompts_per_step=2, rewrites=3, unrefined_rewrites=0, samples_per_rewrite=2, steps=1,
               seed=0, sampling=SAMPLING, lm_sampling=dict(max_new_tokens=5),
               grpo=dict(beta=0.04, clip_range=0.2), optim=dict(lr=1e-3),
               lm_grpo=dict(beta=0.04), lm_optim=dict(lr=1e-3))
    cfg.update(over)
    return cfg


def _unified(ckpts, cpu, **over):
    return UnifiedRL(_config(ckpts, **over), refiner=PromptRefiner.load(ckpts["lm"], platform=cpu),
                     model=flowseam.load(ckpts["flux.1-t2i"], platform=cpu))


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_refiner_stores_the_untruncated_tempered_log_prob_of_every_sampled_token(ckpts, cpu):
    """The stored log-prob is log_softmax(logits / T) before top-k/top-p, as an independent
    forward of each row alone (no padding, default positions) computes it; the recompute on the
    rollout's buffer equals it bit for bit; truncation shapes what is sampled."""
    from transformers import AutoModelForCausalLM

    refiner = PromptRefiner.load(ckpts["lm"], platform=cpu, template="{request} =>")
    prompts = ["a ball", "a red box on a wooden table", "x"]  # different lengths: left padding
    sampling = RefinerSampling(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=6)
    ro = refiner.sample(prompts, [3, 4, 5], sampling)
    assert ro.input_ids.shape == (3, ro.prompt_length + 6)
    assert (ro.attention_mask[:, :ro.prompt_length] == 0).any()  # someone is padded on the left
    assert torch.equal(refiner.token_log_probs(ro)[ro.completion_mask], ro.log_probs[ro.completion_mask])

    peer = AutoModelForCausalLM.from_pretrained(ckpts["lm"]).eval()  # loaded independently
    tok = refiner.tokenizer
    for b, prompt in enumerate(prompts):
        own = tok(f"{prompt} =>", add_special_tokens=False)["input_ids"]
        completion = ro.completion_ids[b][ro.completion_mask[b]].tolist()
        with torch.no_grad():
            logits = peer(torch.tensor([own + completion])).logits[0, len(own) - 1:-1].double()
        want = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        got = ro.log_probs[b][ro.completion_mask[b]].double()
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (b, got, want)
        # untruncated: top-k/top-p renormalisation would have made every log-prob larger
        assert (got < 0).all()
    # a changed input changes the result (the forward reads the tokens, not a cache)
    other = refiner.sample(["a ball", "a blue box on a wooden table", "x"], [3, 4, 5], sampling)
    assert not torch.equal(other.log_probs[1], ro.log_probs[1])
    # top_k = 1 samples the argmax of the tempered logits
    greedy = refiner.sample(prompts, [1, 2, 3], RefinerSampling(top_k=1, max_new_tokens=3))
    L = greedy.prompt_length
    with torch.no_grad():
        logits = refiner.lm(input_ids=greedy.input_ids, attention_mask=greedy.attention_mask,
                            position_ids=greedy.position_ids).logits[:, L - 1:-1]
    assert torch.equal(logits.argmax(-1)[greedy.completion_mask], greedy.completion_ids[greedy.completion_mask])


def test_rewrites_end_at_eos_and_the_rest_is_masked(ckpts, cpu):
    refiner = PromptRefiner.load(ckpts["lm"], platform=cpu)
    eos = refiner.tokenizer.eos_token_id
    with torch.no_grad():  # final hidden state = 5 e/|e|²: the EOS logit is 5, the others ~0
        e = refiner.lm.lm_head.weight[eos]
        refiner.lm.transformer.ln_f.weight.zero_()
        refiner.lm.transformer.ln_f.bias.copy_(5.0 * e / e.dot(e))
    ro = refiner.sample(["a ball"] * 6, list(range(6)), RefinerSampling(max_new_tokens=6))
    lengths = ro.completion_mask.sum(1)
    assert (lengths < 6).any() and (lengths > 1).any(), lengths
    for b, n in enumerate(lengths.tolist()):
        if n < 6:
            assert ro.completion_ids[b, n - 1] == eos and not ro.completion_mask[b, n:].any()
            assert (ro.completion_ids[b, n:] == refiner.tokenizer.pad_token_id).all()
            assert (ro.log_probs[b, n:] == 0).all()


def test_first_epoch_ratios_are_one_on_both_sides_and_both_learn(ckpts, cpu):
    u = _unified(ckpts, cpu, lm_grpo=dict(beta=0.04, inner_epochs=2), grpo=dict(beta=0.04, clip_range=0.2))
    lm_before, dit_before = _params(u.refiner.lm), _params(u.generator.models["dit"].dit)
    rec = u.train_step()
    lm = u.last_stats["lm"]
    assert (torch.cat(lm.first_epoch_ratios) - 1).abs().max() <= 1e-6
    assert rec["lm_ratio_dev_first_epoch"] <= 1e-6 and rec["dit_ratio_dev_first_epoch"] <= 1e-6
    # the second LM epoch sees the weights the first one changed
    assert (torch.cat(lm.ratios[1:]) - 1).abs().max() > 0
    assert rec["lm_weights_version"] == 1 and rec["dit_weights_version"] == 1  # one sync a step
    assert u.refiner.versions["lm"] == 1
    # both moved, the rollout copies through their WeightSyncPlans
    assert any(not torch.equal(lm_before[n], p) for n, p in u.refiner.lm.named_parameters())
    assert any(not torch.equal(dit_before[n], p) for n, p in u.generator.models["dit"].dit.named_parameters())
    assert all(torch.equal(p, q) for p, q in zip(u.refiner.lm.parameters(), u.lm_stage.policy.parameters()))
    # separate optimizers
    assert u.lm_stage.optimizer is not u.generator.stages[0].optimizer
    for key in ("lm_clip_frac", "lm_approx_kl", "lm_kl_ref", "lm_grad_norm", "dit_grad_norm",
                "sample_adv_std", "rewrite_adv_std", "lm_rewrite_tokens_mean", "lm_eos_frac"):
        assert key in rec


def test_advantages_per_level_by_hand(ckpts, cpu):
    u = _unified(ckpts, cpu, prompts_per_step=2, rewrites=3, samples_per_rewrite=2)
    r = torch.tensor([[[1.0, 3.0], [2.0, 2.0], [0.0, 6.0]],
                      [[1.0, float("nan")], [1.0, 1.0], [1.0, 1.0]]])
    sample_adv, rewrite_adv, stats = u.advantages(r)
    eps = u.grpo.eps
    # samples grouped by rewrite: [1, 3] → ±1/(1 + eps); [2, 2] zero spread → 0; [0, 6] → ±3/(3 + eps)
    assert torch.allclose(sample_adv[0], torch.tensor([[-1 / (1 + eps), 1 / (1 + eps)], [0, 0],
                                                       [-3 / (3 + eps), 3 / (3 + eps)]]), atol=1e-6)
    # rewrites grouped by prompt on their mean reward [2, 2, 3]: mean 7/3, std sqrt(2)/3
    mean, std = 7 / 3, 2 ** 0.5 / 3
    want = torch.tensor([(2 - mean), (2 - mean), (3 - mean)]) / (std + u.lm_grpo.eps)
    assert torch.allclose(rewrite_adv[0], want, atol=1e-5)
    # a NaN anywhere in a prompt's tree skips the whole prompt at both levels
    assert (sample_adv[1] == 0).all() and (rewrite_adv[1] == 0).all()
    assert stats["prompts_skipped_nan"] == 1


def test_unrefined_branches_keep_the_prompt_and_are_the_lms_baseline(ckpts, cpu):
    # with the generator frozen: the LM alone learns, the DiT stays as loaded
    u = _unified(ckpts, cpu, rewrites=3, unrefined_rewrites=1, prompts_per_step=2, freeze_generator=True)
    lm_before, dit_before = _params(u.refiner.lm), _params(u.generator.models["dit"].dit)
    rec = u.train_step()
    assert rec["lm_weights_version"] == 1 and rec["lm_grad_norm"] > 0
    assert any(not torch.equal(lm_before[n], p) for n, p in u.refiner.lm.named_parameters())
    assert rec["dit_weights_version"] == 0 and rec["dit_grad_norm"] == 0.0
    assert all(torch.equal(dit_before[n], p) for n, p in u.generator.models["dit"].dit.named_parameters())
    tree = u.last_rollout
    for prompt, texts in zip(tree["prompts"], tree["texts"]):
        assert texts[0] == prompt
    assert tree["lm_rows"] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert tree["lm"].input_ids.shape[0] == 4  # only refined branches went through the LM
    assert tree["texts"][0][1:] == tree["lm"].rewrites[:2]
    r = tree["rewards"]
    assert rec["reward_unrefined_mean"] == pytest.approx(float(r[:, :1].mean()))
    assert rec["reward_refined_mean"] == pytest.approx(float(r[:, 1:].mean()))


def test_constant_reward_leaves_the_lm_and_the_dit_bit_identical(ckpts, cpu):
    u = _unified(ckpts, cpu, reward="constant", steps=2)
    lm, dit = _params(u.refiner.lm), _params(u.generator.models["dit"].dit)
    out = u.run(progress=False)
    assert all(torch.equal(lm[n], p) for n, p in u.refiner.lm.named_parameters())
    assert all(torch.equal(dit[n], p) for n, p in u.generator.models["dit"].dit.named_parameters())
    assert out["weights_versions"] == {"lm": 0, "dit": 0}
    assert all(r["lm_grad_norm"] == 0.0 and r["dit_grad_norm"] == 0.0 for r in out["records"])


def test_resume_is_bit_identical_and_the_run_ends_with_a_loadable_lm(ckpts, cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    straight = _unified(ckpts, cpu, steps=2, checkpoint_every=1, output_dir=str(tmp_path / "a"))
    straight.run(progress=False)
    half = _unified(ckpts, cpu, steps=1, checkpoint_every=1, output_dir=str(tmp_path / "b"))
    half.run(progress=False)
    resumed = _unified(ckpts, cpu, steps=2, checkpoint_every=1, output_dir=str(tmp_path / "b"))
    out = resumed.run(progress=False)
    for a, b in ((straight.refiner.lm, resumed.refiner.lm),
                 (straight.generator.models["dit"].dit, resumed.generator.models["dit"].dit)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rs]  # noqa: E731
    ma, mb = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert strip(ma) == strip(mb) and [r["step"] for r in mb] == [1, 2]
    # the trained LM, its tokenizer, template and sampling are saved and load back
    saved = tmp_path / "b" / "lm"
    again = PromptRefiner.load(saved, platform=cpu)
    assert again.template == "{request} =>" and again.sampling.max_new_tokens == 5
    peer = AutoModelForCausalLM.from_pretrained(saved)
    assert all(torch.equal(p, q) for p, q in zip(peer.parameters(), resumed.refiner.lm.parameters()))
    assert again.refine(["a ball"], [7]) == resumed.refiner.refine(["a ball"], [7])
    # and, like every method, the trained generator as a diffusers-format model beside it
    assert out["exported"] == {"dit": {"model": str(tmp_path / "b" / "model")}}
    exported = flowseam.load(tmp_path / "b" / "model", platform=cpu)
    assert all(torch.equal(p, q) for p, q in zip(exported.dit.parameters(),
                                                 resumed.generator.models["dit"].dit.parameters()))


def test_the_workflow_as_generator_trains_the_lm_and_both_stages(ckpts, cpu, tmp_path):
    i2v_ckpt = write_tiny_checkpoint("wan2.1-i2v", tmp_path / "i2v")
    u = UnifiedRL(_config(ckpts, model=None, prompts_per_step=1, rewrites=2, sampling={},
                          t2i_sampling=SAMPLING,
                          i2v_sampling=dict(num_steps=2, height=32, width=32, num_frames=5),
                          i2v_optim=dict(lr=5e-4)),
                  refiner=PromptRefiner.load(ckpts["lm"], platform=cpu),
                  t2i=flowseam.load(ckpts["flux.1-t2i"], platform=cpu),
                  i2v=flowseam.load(i2v_ckpt, platform=flowseam.Platform("cpu")))
    assert [s.name for s in u.stages] == ["lm", "t2i", "i2v"]
    assert u.stages[2].optimizer.param_groups[0]["lr"] == 5e-4
    before = {s.name: _params(s.sync.target.components[s.sync.component]) for s in u.stages}
    rec = u.train_step()
    for s in u.stages:
        assert rec[f"{s.name}_ratio_dev_first_epoch"] <= 1e-6
        now = s.sync.target.components[s.sync.component]
        assert any(not torch.equal(before[s.name][n], p) for n, p in now.named_parameters()), s.name


@pytest.mark.parametrize("over, message", [
    (dict(rewrites=1), r"config rewrites=1: Input should be greater than or equal to 2"),
    (dict(unrefined_rewrites=3), r"unrefined_rewrites=3 must be an integer in \[0, 2\]"),
    (dict(samples_per_rewrite=1), r"config samples_per_rewrite=1: Input should be greater than or equal to 2"),
    (dict(prompts_per_step=0), r"config prompts_per_step=0: Input should be greater than or equal to 1"),
    (dict(t2i_model="x"), r"either model = .* or t2i_model \+ i2v_model .*; the config gives both"),
    (dict(model=None), r"the config gives neither"),
    (dict(t2i_sampling=dict(num_steps=2)), r"\['t2i_sampling'\] do not apply"),
    (dict(lm_template="rewrite: {prompt}"), r"lm_template='rewrite: \{prompt\}' must be a string "
                                            r"with exactly one '\{request\}' field"),
    (dict(lm_sampling=dict(top_p=0.0)), r"\[lm_sampling\] top_p=0.0: must be in \(0, 1\]"),
    (dict(lm_sampling=dict(temperature=0)), r"\[lm_sampling\] temperature=0(\.0)?: must be a number > 0"),
    (dict(lm_grpo=dict(clip=0.1)), r"\[lm_grpo\] has unknown key\(s\) \['clip'\]; allowed: "),
    (dict(lm_grpo=dict(beta=-1.0)), r"config \[lm_grpo\] beta=-1.0: Input should be greater than or equal to 0"),
    (dict(lm_optim=dict(learning_rate=1.0)), r"\[lm_optim\] has unknown key\(s\) \['learning_rate'\]"),
    (dict(rewrite=4), r"config has unknown key\(s\) \['rewrite'\]; allowed: "),
    (dict(prompts=[]), r"config prompts=\[\]: List should have at least 1 item"),
    (dict(freeze_generator="yes"), r"config freeze_generator='yes': Input should be a valid boolean"),
    (dict(lm_model=None), r"config needs lm_model"),
])
def test_config_errors_name_the_key_before_any_model_loads(ckpts, over, message, monkeypatch):
    import flowseam.training.unified_rl as mod

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(mod, "load", no_loading)
    monkeypatch.setattr(mod.PromptRefiner, "load", no_loading)
    with pytest.raises(FlowseamError, match=message):
        UnifiedRL(_config(ckpts, **over))


def test_more_than_one_rank_is_refused(ckpts, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FlowseamError, match="unified_rl runs on one process; 2 ranks"):
        UnifiedRL(_config(ckpts))


def test_unified_rl_is_a_method_plugin_with_its_own_entry_point():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["unified_rl"] == "flowseam.training.builtin:unified_rl"
    from flowseam.training import get_method

    assert get_method("unified_rl") is UnifiedRL


def test_digit_requests_parse_and_the_held_out_split_is_disjoint():
    from flowseam.demo.data import parse_prompt
    from flowseam.demo.refiner_lm import request_split, tokenizer

    assert parse_prompt("draw me a 7 sliding to the left") == (7, "left")
    assert parse_prompt("show the number four going up") == (4, "up")
    train, held = request_split()
    assert len(train) + len(held) == 480 and not {r for r, _, _ in train} & {r for r, _, _ in held}
    assert all(parse_prompt(r) == (d, direction) for r, d, direction in train + held)
    tok = tokenizer()
    ids = tok("draw me a 7 sliding to the left => a handwritten digit seven moving left",
              add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids


@pytest.mark.slow
def test_train_cli_runs_unified_rl_and_refuses_a_bad_key(ckpts, tmp_path):
    from conftest import run_main

    cfg = _config(ckpts, output_dir=str(tmp_path / "run"), steps=1, prompts_per_step=1, rewrites=2)
    lines = []
    for key, value in cfg.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
    (tmp_path / "u.toml").write_text("\n".join(lines) + "\n")
    done = run_main("train", "--method", "unified_rl", "--config", str(tmp_path / "u.toml"))
    assert done.returncode == 0, done.stderr
    (rec,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rec["lm_ratio_dev_first_epoch"] <= 1e-6 and rec["dit_ratio_dev_first_epoch"] <= 1e-6
    assert (tmp_path / "run" / "lm" / "config.json").is_file()
    bad = run_main("train", "--method", "unified_rl", "--config", str(tmp_path / "u.toml"),
                   "--set", "rewrites=1")
    assert bad.returncode == 2 and "rewrites=1: Input should be greater than or equal to 2" in bad.stderr


def test_a_weighted_sum_reward_logs_each_component(ckpts, cpu):
    """reward = {brightness = 0.5, channel_contrast = 2.0}: every sample of the tree scored by
    both components ((P, N, M) each), the total their weighted sum, each component's mean and std
    in the step's record."""
    u = _unified(ckpts, cpu, reward={"brightness": 0.5, "channel_contrast": 2.0},
                 prompts_per_step=1)
    rec = u.train_step()
    tree = u.last_rollout
    parts = tree["reward_parts"]
    assert {k: tuple(v.shape) for k, v in parts.items()} == \
        {"brightness": (1, 3, 2), "channel_contrast": (1, 3, 2)}
    expected = 0.5 * parts["brightness"].double() + 2.0 * parts["channel_contrast"].double()
    assert torch.allclose(tree["rewards"].double(), expected, atol=1e-6)
    for label in parts:
        assert rec[f"reward_{label}_mean"] == pytest.approx(float(parts[label].mean()), abs=1e-6)
        assert rec[f"reward_{label}_std"] == pytest.approx(float(parts[label].std(unbiased=False)),
                                                           abs=1e-6)
