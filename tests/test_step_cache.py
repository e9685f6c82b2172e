"""Adaptive step caching (flowseam.loops.step_cache): the policy's decisions and predictions
against hand computations, CFG branches cached separately, quality on trained weights (the
demo's digit models), RL rollouts, the command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import flowseam
from flowseam import DiffusionParams, ExecutionProfile, GenerationRequest, TaskType
from flowseam.loops.step_cache import CachePolicy, StepCache, normalize_cache
from conftest import run_main

WEIGHTS = Path(flowseam.__file__).parent / "demo" / "weights"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


# -- the policy by hand ----------------------------------------------------------------------------

def _run(policy: CachePolicy, sigmas, fields):
    """Drive a StepCache with analytic branch velocities ``fields[b](sigma)``; returns the
    velocities it handed out per step and the branch lists it asked to compute."""
    cache = StepCache(policy, sigmas)
    asked, out = [], []
    for i in range(len(sigmas) - 1):
        def compute(branches, s=sigmas[i]):
            asked.append(list(branches))
            return [fields[b](s) for b in branches]
        out.append(cache.velocity(i, "transformer", len(fields), compute, lambda vs: torch.stack(vs)))
    return cache, asked, out


def test_extrapolation_is_exact_for_a_velocity_linear_in_sigma_and_reuse_is_not():
    """v(sigma) = a + b sigma: its measured rate is ||b|| / ||v||; first-order extrapolation
    reproduces v exactly on skipped steps, reuse returns the last computed v."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.1, -0.1])
    field = lambda s: a + b * s  # noqa: E731
    sigmas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.0]
    cache, asked, out = _run(CachePolicy("extrapolate", 0.5, max_skips=2), sigmas, [field])
    for i, v in enumerate(out):
        assert torch.allclose(v[0], field(sigmas[i]), atol=1e-6), i
    # by hand: after the warm-up (steps 0, 1) the rate is ||v(0.9) - v(1)|| / (||v(0.9)|| * 0.1)
    # = ||b|| / ||v(0.9)|| = 0.064, so steps 2 and 3 add 0.0064 each (< 0.5: skipped); step 4
    # computes (max_skips=2), steps 5 skips, the last step (6) computes
    rate = float(b.norm() / field(0.9).norm())
    assert 2 * rate * 0.1 < 0.5
    assert cache.skipped == [False, False, True, True, False, True, False]
    assert asked == [[0]] * 4
    assert cache.steps_computed == 4 and cache.steps_skipped == 3
    _, _, reused = _run(CachePolicy("reuse", 0.5, max_skips=2), sigmas, [field])
    assert torch.equal(reused[2][0], field(0.9)) and torch.equal(reused[3][0], field(0.9))


def test_threshold_zero_computes_every_step():
    cache, asked, _ = _run(CachePolicy("extrapolate", 0.0), [1.0, 0.75, 0.5, 0.25, 0.0],
                           [lambda s: torch.tensor([s, 1.0])])
    assert cache.steps_skipped == 0 and asked == [[0]] * 4


def test_cfg_branches_are_cached_separately():
    """A branch whose velocity never changes is skipped after the warm-up while the other,
    changing fast, is computed every step: the DiT is asked for that branch alone."""
    still = lambda s: torch.tensor([1.0, 1.0])  # noqa: E731
    moving = lambda s: torch.tensor([10.0 * s, -5.0 * s * s + 1])  # noqa: E731
    sigmas = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    cache, asked, _ = _run(CachePolicy("reuse", 0.05, max_skips=5), sigmas, [still, moving])
    assert asked == [[0, 1], [0, 1], [1], [1], [0, 1]]  # the last step computes both
    assert cache.branches_skipped == 2 and cache.steps_skipped == 0


def test_policies_parse_and_refuse_what_they_do_not_know():
    assert normalize_cache("extrapolate:0.1") == CachePolicy("extrapolate", 0.1)
    assert normalize_cache({"name": "reuse", "threshold": 0.2, "max_skips": 2}) == \
        CachePolicy("reuse", 0.2, max_skips=2)
    assert hash(DiffusionParams(cache="reuse:0.1")) == hash(DiffusionParams(cache=CachePolicy("reuse", 0.1)))
    for bad, match in (("fast:0.1", "cache='fast' is unknown; policies: reuse, extrapolate"),
                       ("reuse", "must be NAME:THRESHOLD"), ("reuse:-1", "threshold=-1.0 must be a number >= 0"),
                       ({"name": "reuse", "threshold": 0.1, "speed": 2}, "unknown keys"),
                       ({"name": "reuse", "threshold": 0.1, "warmup": 1}, "warmup=1")):
        with pytest.raises(ValueError, match=match):
            DiffusionParams(cache=bad)


# -- in the loop -------------------------------------------------------------------------------

def _tiny(card: str, tmp_path_factory) -> Path:
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(card, tmp_path_factory.mktemp(card) / card)


def test_wan_cfg_runs_only_the_branches_it_computes(cpu, tmp_path_factory):
    """Wan T2V with CFG: threshold 0 gives the uncached frames bit for bit; with a cache, some DiT
    calls carry one branch (a batch of B instead of 2B), and the counts add up."""
    model = flowseam.load(_tiny("wan2.1-t2v", tmp_path_factory), platform=cpu, quiet=True)
    params = DiffusionParams(num_steps=12, height=32, width=32, num_frames=5, guidance_scale=5.0,
                             max_sequence_length=16)
    uncached = model.generate("a red ball", params=params)
    exact = model.generate("a red ball", params=params.replace(cache="extrapolate:0"))
    assert np.array_equal(exact.frames, uncached.frames) and exact.cache["steps_skipped"] == 0
    batches = []
    hook = model.dit.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["hidden_states"].shape[0]),
                                               with_kwargs=True)
    try:
        cached = model.generate("a red ball", params=params.replace(cache="extrapolate:0.5"))
    finally:
        hook.remove()
    c = cached.cache
    assert c["branches_computed"] + c["branches_skipped"] == 2 * 12
    assert c["steps_computed"] + c["steps_skipped"] == 12
    assert sum(batches) == c["branches_computed"] and len(batches) == c["steps_computed"]
    assert c["branches_skipped"] > 0 and uncached.cache is None


@pytest.mark.parametrize("kind", ["t2i", "i2v"])
def test_trained_digit_models_keep_their_output_while_skipping_steps(cpu, kind):
    """On trained weights (the demo's FLUX.1 and Wan I2V digit models, 30 steps) the extrapolate
    policy at 0.2 skips at least a third of the steps at PSNR >= 30 dB against uncached, and a
    higher threshold skips more."""
    model = flowseam.load(WEIGHTS / f"digits-{kind}", platform=cpu, quiet=True)
    params = DiffusionParams(num_steps=30, height=32, width=32, seed=3)
    image = None
    if kind == "i2v":
        params = params.replace(num_frames=9, guidance_scale=1.0, flow_shift=1.0)
        rng = np.random.RandomState(0)
        image = np.clip(rng.rand(32, 32, 3) * 0.2 + np.eye(32)[..., None], 0, 1).astype(np.float32)
    prompt = "a handwritten digit three" + (" moving left" if kind == "i2v" else "")
    uncached = model.generate(prompt, image=image, params=params).frames
    cached = model.generate(prompt, image=image, params=params.replace(cache="extrapolate:0.2"))
    more = model.generate(prompt, image=image, params=params.replace(cache="extrapolate:1.0"))
    assert cached.cache["steps_skipped"] >= 10
    assert psnr(cached.frames, uncached) >= 30
    assert more.cache["steps_skipped"] >= cached.cache["steps_skipped"]
    assert 0 < psnr(more.frames, uncached) < np.inf  # skipping changed the output


def test_rollouts_refuse_a_cache_unless_asked_and_then_say_so(cpu, tmp_path_factory):
    model = flowseam.load(_tiny("flux.1-t2i", tmp_path_factory), platform=cpu, quiet=True)
    params = DiffusionParams(num_steps=8, height=32, width=32, max_sequence_length=16)
    request = GenerationRequest("a ball", TaskType.T2I, params.replace(cache="extrapolate:0.5"))
    with pytest.raises(ValueError, match="in an RL rollout.*in_rollouts=True"):
        flowseam.rollout_loop(model, request)
    asked = CachePolicy("extrapolate", 0.5, in_rollouts=True)
    result = flowseam.rollout_loop(model, GenerationRequest("a ball", TaskType.T2I,
                                                            params.replace(cache=asked)))
    assert all(r.cache == "extrapolate:0.5" for r in result.records)
    predicted = [r.predicted for r in result.records]
    assert sum(predicted) == result.cache["steps_skipped"] > 0
    served = flowseam.run_loop(model, request, profile=ExecutionProfile.SERVE)
    assert np.array_equal(served.frames, result.frames)  # capture changes nothing


def test_diffusers_cache_hooks_on_the_dit_are_refused_before_it_runs(cpu, tmp_path_factory):
    """diffusers' ``enable_cache`` on flowseam's DiT is refused naming the way out (it failed
    inside the first DiT call, blaming the backend), and works again after ``disable_cache``."""
    from diffusers import FirstBlockCacheConfig

    model = flowseam.load(_tiny("wan2.1-t2v", tmp_path_factory), platform=cpu, quiet=True)
    params = DiffusionParams(num_steps=2, height=32, width=32, num_frames=5, max_sequence_length=16)
    before = model.generate("a red ball", params=params).frames
    calls = []
    hook = model.dit.register_forward_pre_hook(lambda *a: calls.append(1))
    model.dit.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    try:
        with pytest.raises(ValueError, match=r"DiT 'transformer' has diffusers' cache hooks enabled"
                                             r".*disable_cache\(\).*--cache reuse:0.05"):
            model.generate("a red ball", params=params)
        assert calls == []
    finally:
        model.dit.disable_cache()
        hook.remove()
    assert np.array_equal(model.generate("a red ball", params=params).frames, before)


def test_causal_and_ltx2_cards_refuse_what_their_loops_do_not_apply(cpu, tmp_path_factory):
    """The causal card refuses a cache policy; LTX-2 refuses a cache policy and a LoRA set
    (its loop applies neither), before any model runs."""
    model = flowseam.load(_tiny("wan2.1-causal-t2v", tmp_path_factory), platform=cpu, quiet=True)
    with pytest.raises(ValueError, match="step caching runs in the flow_match loop"):
        model.generate("x", params=DiffusionParams(cache="reuse:0.1", height=32, width=32))
    ltx = flowseam.load(_tiny("ltx2-t2v", tmp_path_factory), platform=cpu, quiet=True)
    for bad, match in ((dict(cache="reuse:0.1"), "cache=reuse:0.1: ltx2-t2v runs the ltx2 loop"),
                       (dict(lora=["x.safetensors"]), "lora: ltx2-t2v runs the ltx2 loop")):
        with pytest.raises(ValueError, match=match):
            ltx.generate("x", params=DiffusionParams(**bad))


@pytest.mark.slow
def test_generate_cli_reports_computed_and_skipped_steps(tmp_path):
    out = tmp_path / "three.png"
    common = ["generate", "--model", str(WEIGHTS / "digits-t2i"), "--prompt",
              "a handwritten digit three", "--steps", "20", "--height", "32", "--width", "32",
              "--backend", "cpu"]
    r = run_main(*common, "--cache", "extrapolate:0.2", "--output", str(out))
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert out.is_file() and "cache extrapolate:0.2: " in line and " steps computed, " in line
    computed, skipped = (int(line.split("cache extrapolate:0.2: ")[1].split(" ")[i]) for i in (0, 3))
    assert computed + skipped == 20 and skipped > 0
    r = run_main(*common, "--cache", "fast:1", "--output", str(tmp_path / "bad.png"))
    assert r.returncode == 2 and "cache='fast' is unknown" in r.stderr
    assert not (tmp_path / "bad.png").exists()
