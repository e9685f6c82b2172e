"""The wan_causal loop: KV-cached chunk rollout vs full recompute (C1), parity with an independent
public implementation, the Self-Forcing checkpoint converter, streaming (frames, CLI, fragmented
MP4, failure mid-stream), RL on the causal loop (records per (chunk, step), C2) and bad input."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import flowseam
from flowseam import DiffusionParams, ExecutionProfile, GenerationRequest, TaskType, ops
from flowseam.testing.tiny import write_tiny_checkpoint
from conftest import run_main

PROMPT = "a red ball rolling on the grass"
# 21 frames = 6 latent frames = 3 chunks of 2; 32x32 pixels = 4x4 latents (2x2 tokens per frame)
BASE = dict(num_frames=21, height=32, width=32, chunk_frames=2, seed=5)
# Self-Forcing's denoising_step_list [1000, 750, 500, 250] warped by shift 5, by hand:
# sigma = 5 s / (1 + 4 s) for s = 1, 0.75, 0.5, 0.25
SELF_FORCING_SIGMAS = [1.0, 3.75 / 4.0, 2.5 / 3.0, 1.25 / 2.0, 0.0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint("wan2.1-causal-t2v", tmp_path_factory.mktemp("causal") / "ckpt")


@pytest.fixture(scope="module")
def model(ckpt):
    flowseam.seam.discovery._CACHE = None
    return flowseam.load(ckpt, platform=flowseam.Platform("cpu"))


def _generate(model, **over):
    return model.generate(PROMPT, params=DiffusionParams(**{**BASE, **over}))


def _dit_calls(model):
    calls = []
    handle = model.dit.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


# -- the loop ----------------------------------------------------------------------------------

@pytest.mark.backends  # resolves kernels and generates: rerun with only cpu
def test_card_selected_from_checkpoint_and_kernels_on_the_seam(ckpt, model):
    index = json.loads((ckpt / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["_flowseam_causal"] == {}
    assert model.card.name == "wan2.1-causal-t2v" and model.card.loops == ("wan_causal",)
    result = _generate(model)
    kernels = model.platform.kernels
    assert result.loop == "wan_causal" and result.chunks == 3
    assert result.kernels == {ops.FLOW_MATCH_STEP: kernels.get(ops.FLOW_MATCH_STEP).impl_id,
                              ops.FLOW_RENOISE: kernels.get(ops.FLOW_RENOISE).impl_id}
    assert result.frames.shape == (1, 21, 32, 32, 3) and result.latents.shape == (1, 16, 6, 4, 4)
    # the schedule is Self-Forcing's, computed by hand above
    sigmas, timesteps = model.schedule(result.params, result.latents)
    np.testing.assert_allclose(sigmas, SELF_FORCING_SIGMAS, rtol=1e-12)
    np.testing.assert_allclose(timesteps.numpy(), np.array(SELF_FORCING_SIGMAS[:-1]) * 1000, rtol=1e-6)
    # every self-attention call of a chunk went to cached_attention, through the platform
    calls, handle = [], None
    cached = kernels.get(ops.CACHED_ATTENTION)
    state = flowseam.causal_attention.causal_state(model.dit)
    original = state.cached_attention
    state.cached_attention = lambda *a, **k: calls.append(a[3] is None or a[3].shape[2]) or original(*a, **k)
    try:
        _generate(model)
    finally:
        state.cached_attention = original
    layers = model.dit.config.num_layers
    # 3 chunks x 4 steps + 2 cache passes, each with one call per layer; the cache holds 0, 2
    # and 4 frames of 4 tokens for chunks 0, 1, 2
    assert len(calls) == (3 * 4 + 2) * layers
    assert sorted(set(calls)) == [True, 8, 16]
    assert original is cached


@pytest.mark.backends
@pytest.mark.parametrize("window", [None, (3, 1)], ids=["no_window", "window3_sink1"])
def test_kv_cache_equals_full_recompute_with_block_causal_mask(model, window):
    """C1: the KV-cached rollout (3 chunks) equals recomputing the whole prefix at every step
    with an explicit block-causal mask (and the window's mask), within 1e-5 — with and without
    a rolling window (which, for the last chunk, evicts a frame: the outputs differ)."""
    over = {} if window is None else dict(local_attn_size=window[0], sink_size=window[1])
    cached = _generate(model, **over)
    full = _generate(model, kv_cache=False, **over)
    np.testing.assert_allclose(cached.latents.numpy(), full.latents.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached.frames, full.frames, rtol=1e-5, atol=1e-5)
    assert float(cached.latents.abs().max()) > 0.5
    if window is not None:  # the window must matter, or the test proves nothing about it
        unbounded = _generate(model)
        assert float((unbounded.latents - cached.latents).abs().max()) > 1e-3
        # chunk 0 has nothing to evict, so the window changes nothing there
        assert torch.allclose(unbounded.latents[:, :, :2], cached.latents[:, :, :2], atol=1e-5)


def test_rolling_window_bounds_the_cache(model):
    """The KV cache's peak grows with the video without a window and stays flat with one."""
    def peak(frames, **over):
        params = DiffusionParams(**{**BASE, "num_frames": frames, "chunk_frames": 1, "num_steps": 1,
                                    **over})
        return flowseam.run_loop(model, GenerationRequest(PROMPT, TaskType.T2V, params),
                                 decode=False).kv_cache_peak_bytes

    config = model.dit.config  # keys and values of 4 tokens per frame in every layer, float32
    per_frame = 2 * config.num_layers * config.num_attention_heads * config.attention_head_dim * 4 * 4
    # 4 and 6 one-frame chunks: every chunk but the last is committed
    assert peak(13) == 3 * per_frame and peak(21) == 5 * per_frame
    # window 3, sink 1: the sink frame, the previous frame and the chunk just committed
    assert peak(13, local_attn_size=3, sink_size=1) == peak(21, local_attn_size=3, sink_size=1) \
        == 3 * per_frame


def test_kv_cache_equals_full_recompute_with_cfg(model):
    cached = _generate(model, guidance_scale=4.0, negative_prompt="blurry")
    full = _generate(model, guidance_scale=4.0, negative_prompt="blurry", kv_cache=False)
    plain = _generate(model)
    np.testing.assert_allclose(cached.latents.numpy(), full.latents.numpy(), rtol=1e-5, atol=1e-5)
    assert float((plain.latents - cached.latents).abs().max()) > 1e-3


def test_equals_skyreels_v2_diffusion_forcing_transformer(ckpt, model):
    """Parity with an independent public implementation on the same tiny weights: diffusers'
    ``SkyReelsV2Transformer3DModel`` (SkyReels-V2's diffusion-forcing DiT, the Wan2.1 network
    with per-frame timesteps and its own block-causal mask, ``num_frame_per_block``) loads the
    checkpoint's transformer; the rollout below runs it over the whole prefix at every step
    (clean frames at t = 0, the chunk at t) with Self-Forcing's sampler written out by hand
    (x0 = x - sigma v; x = (1 - sigma') x0 + sigma' noise), drawing noise in the same order from
    the same seed, with diffusers' own WanPipeline.encode_prompt. flowseam's KV-cached rollout
    must equal it within 1e-5. (diffusers' AnyFlowFARPipeline is a different network and
    sampler, so it cannot run these weights; Self-Forcing's code needs its CUDA-sized caches.)"""
    from diffusers import SkyReelsV2Transformer3DModel, WanPipeline

    n = BASE["chunk_frames"]
    pipe = WanPipeline.from_pretrained(ckpt)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False,
                                       max_sequence_length=512)
        sky = SkyReelsV2Transformer3DModel.from_pretrained(ckpt / "transformer",
                                                           num_frame_per_block=n).eval()
        g = torch.Generator().manual_seed(BASE["seed"])
        noise = torch.randn((1, 16, 6, 4, 4), generator=g)
        out = torch.zeros_like(noise)
        for start in range(0, 6, n):
            x = noise[:, :, start:start + n]
            for s, s_next in zip(SELF_FORCING_SIGMAS[:-1], SELF_FORCING_SIGMAS[1:]):
                ts = torch.tensor([[0.0] * start + [s * 1000.0] * n])
                v = sky(torch.cat([out[:, :, :start], x], 2), timestep=ts,
                        encoder_hidden_states=embeds, enable_diffusion_forcing=True,
                        return_dict=False)[0][:, :, start:]
                x0 = x - s * v
                x = (1 - s_next) * x0 + s_next * torch.randn((1, 16, n, 4, 4), generator=g) \
                    if s_next > 0 else x0
            out[:, :, start:start + n] = x
    ours = _generate(model)
    np.testing.assert_allclose(ours.latents.numpy(), out.numpy(), rtol=1e-5, atol=1e-5)
    # the prefix matters: without it (each chunk alone) the result differs
    assert float((ours.latents[:, :, 2:] - noise[:, :, 2:]).abs().max()) > 0.1


@pytest.mark.backends  # resolves kernels and generates: rerun with only cpu
def test_streamed_chunks_are_the_video(model):
    calls, handle = _dit_calls(model)
    try:
        chunks = model.generate_stream(PROMPT, params=DiffusionParams(**BASE))
        first = next(chunks)
        at_first = len(calls)
        rest = list(chunks)
    finally:
        handle.remove()
    # the first chunk arrives after its 4 steps, before its cache pass and any later chunk ran
    assert at_first == 4 and len(calls) == 3 * 4 + 2
    assert first.index == 0 and first.frames.shape == (1, 5, 32, 32, 3)  # 1 + 4 (n - 1)
    assert [c.frames.shape[1] for c in rest] == [8, 8]
    assert first.seconds <= rest[0].seconds <= rest[1].seconds
    whole = _generate(model)
    streamed = np.concatenate([first.frames] + [c.frames for c in rest], axis=1)
    np.testing.assert_array_equal(streamed, whole.frames)
    # and the per-chunk decode equals the VAE decoding the whole video at once
    np.testing.assert_allclose(model.decode(whole.latents, whole.params), whole.frames, atol=1e-6)
    assert rest[-1].result.seconds["first_chunk"] == pytest.approx(first.seconds)


def test_finetune_refuses_a_causal_checkpoint(model):
    from flowseam.training.finetune import Finetune

    with pytest.raises(flowseam.FlowseamError, match="runs the wan_causal loop"):
        Finetune(dict(data="x.jsonl"), model=model)


def test_step_callback_counts_chunks_and_steps_and_cancels(model):
    """``flowseam serve``'s progress and cancellation hook: called after every (chunk, step)."""
    seen = []
    req = GenerationRequest(PROMPT, TaskType.T2V, DiffusionParams(**{**BASE, "num_steps": 2}))
    flowseam.run_loop(model, req, decode=False,
                      step_callback=lambda i, n, latents: seen.append((i, n, latents.shape[2])))
    assert seen == [(i, 6, 2) for i in range(6)]

    def cancel(i, n, latents):
        if i == 2:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        flowseam.run_loop(model, req, decode=False, step_callback=cancel)


def test_flow_match_models_refuse_to_stream_and_causal_params(tmp_path):
    ckpt = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan")
    wan = flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    with pytest.raises(ValueError, match="does not stream"):
        wan.generate_stream(PROMPT)
    with pytest.raises(ValueError, match=r"chunk_frames=2.*does not generate in chunks"):
        wan.generate(PROMPT, params=DiffusionParams(num_frames=5, height=32, width=32,
                                                    chunk_frames=2))


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("over,match", [
    (dict(num_frames=17), r"num_frames=17 makes 5 latent frames, not a multiple of chunk_frames=2;"
                          r" try num_frames=13 or 21"),
    (dict(chunk_frames=0), r"chunk_frames=0 must be an integer >= 1"),
    (dict(local_attn_size=2, sink_size=1), r"local_attn_size=2 must be an integer >= "
                                           r"chunk_frames \+ sink_size = 3"),
    (dict(sink_size=1), r"sink_size=1 needs a rolling window"),
    (dict(sink_size=-1, local_attn_size=4), r"sink_size=-1 must be an integer >= 0"),
    (dict(num_frames=20), r"num_frames=20 is not of the form 4k\+1"),
    (dict(num_steps=0), r"num_steps=0"),
])
def test_bad_input_refused_before_any_model_runs(model, over, match):
    calls, handle = _dit_calls(model)
    try:
        with pytest.raises(ValueError, match=match):
            _generate(model, **over)
        with pytest.raises(ValueError, match=match):
            next(model.generate_stream(PROMPT, params=DiffusionParams(**{**BASE, **over})))
    finally:
        handle.remove()
    assert calls == []


def test_frames_beyond_the_rope_table_refused(tmp_path):
    ckpt = write_tiny_checkpoint("wan2.1-causal-t2v", tmp_path / "c", transformer={"rope_max_seq_len": 4})
    short = flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    with pytest.raises(ValueError, match=r"latent frames: 6 positions exceed the DiT's rope_max_seq_len=4"):
        _generate(short)


def test_unimplemented_checkpoint_settings_refused_before_loading(tmp_path, monkeypatch):
    ckpt = write_tiny_checkpoint("wan2.1-causal-t2v", tmp_path / "c", causal={"warp_denoising_step": False})
    built = []
    monkeypatch.setattr(flowseam.Platform, "build_component",
                        lambda self, kind, spec: built.append(kind))
    with pytest.raises(ValueError, match="warp_denoising_step=False is not implemented"):
        flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    index = json.loads((ckpt / "model_index.json").read_text())
    index["_flowseam_causal"] = {"num_frame_per_blok": 3}
    (ckpt / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"\['num_frame_per_blok'\] that flowseam does not implement"):
        flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    assert built == []


def test_checkpoint_settings_are_the_defaults(tmp_path):
    ckpt = write_tiny_checkpoint("wan2.1-causal-t2v", tmp_path / "c",
                                 causal={"num_frame_per_block": 1, "denoising_step_list": [1000, 500],
                                         "timestep_shift": 3.0})
    m = flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    result = m.generate(PROMPT, params=DiffusionParams(num_frames=9, height=32, width=32))
    assert result.chunks == 3 and result.params.num_steps == 2 and result.params.flow_shift == 3.0
    sigmas, _ = m.schedule(result.params, result.latents)
    assert sigmas == pytest.approx([1.0, 3 * 0.5 / (1 + 2 * 0.5), 0.0])


def test_cli_bad_input_exits_2(ckpt, tmp_path, capsys):
    from flowseam import cli

    out = tmp_path / "v.mp4"
    code = cli.main(["generate", "--model", str(ckpt), "--prompt", "x", "--frames", "17",
                     "--height", "32", "--width", "32", "--chunk-frames", "2", "--stream",
                     "--backend", "cpu", "--output", str(out)])
    assert code == 2 and "--frames=17 makes 5 latent frames" in capsys.readouterr().err  # the flag
    assert list(tmp_path.iterdir()) == []
    code = cli.main(["generate", "--model", str(ckpt), "--prompt", "x", "--stream",
                     "--output", str(tmp_path / "v.gif")])
    assert code == 2
    assert "--stream writes one model's video progressively as .mp4" in capsys.readouterr().err


# -- the Self-Forcing / CausVid checkpoint layout ----------------------------------------------

def _to_original_wan_keys(state: dict) -> dict:
    """diffusers WanTransformer3DModel keys → the original Wan2.1 layout (Wan's ``model.py``:
    self_attn/cross_attn q k v o, norm3 = the cross-attention norm, ffn.0/ffn.2, modulation,
    head.head/head.modulation, text_embedding, time_embedding, time_projection), written out by
    hand from that layout, not from diffusers' converter."""
    fixed = {
        "condition_embedder.time_embedder.linear_1": "time_embedding.0",
        "condition_embedder.time_embedder.linear_2": "time_embedding.2",
        "condition_embedder.text_embedder.linear_1": "text_embedding.0",
        "condition_embedder.text_embedder.linear_2": "text_embedding.2",
        "condition_embedder.time_proj": "time_projection.1",
        "proj_out": "head.head", "patch_embedding": "patch_embedding",
    }
    block = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q",
             "attn1.norm_k": "self_attn.norm_k", "attn2.to_q": "cross_attn.q",
             "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
             "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q",
             "attn2.norm_k": "cross_attn.norm_k", "norm2": "norm3",
             "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
    out = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            out["head.modulation"] = value
            continue
        if key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            if rest == "scale_shift_table":
                out[f"blocks.{i}.modulation"] = value
                continue
            module, param = rest.rsplit(".", 1)
            out[f"blocks.{i}.{block[module]}.{param}"] = value
            continue
        module, param = key.rsplit(".", 1)
        out[f"{fixed[module]}.{param}"] = value
    return out


def test_converter_loads_the_self_forcing_single_file_layout(tmp_path, ckpt, model):
    """A tiny state dict written in Self-Forcing's layout (``{"generator", "generator_ema"}``,
    original Wan keys under ``model.``) converts into a causal checkpoint whose transformer holds
    exactly those weights (EMA preferred) and generates what the same weights do."""
    from diffusers import WanTransformer3DModel

    base = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "base")
    trained = WanTransformer3DModel.from_pretrained(ckpt / "transformer").state_dict()
    original = {f"model.{k}": v for k, v in _to_original_wan_keys(trained).items()}
    assert len(original) == len(trained) and "model.blocks.0.self_attn.q.weight" in original
    weights = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": {k: v * 0.5 for k, v in original.items()}, "generator_ema": original},
               weights)
    out = flowseam.models.wan_causal.convert_self_forcing_checkpoint(weights, base, tmp_path / "sf")
    index = json.loads((out / "model_index.json").read_text())
    assert index["_flowseam_causal"]["num_frame_per_block"] == 3
    converted = WanTransformer3DModel.from_pretrained(out / "transformer").state_dict()
    assert converted.keys() == trained.keys()
    assert all(torch.equal(converted[k], trained[k]) for k in trained)
    sf = flowseam.load(out, platform=flowseam.Platform("cpu"))
    assert sf.card.name == "wan2.1-causal-t2v"
    small = dict(num_frames=9, chunk_frames=1, num_steps=2)
    np.testing.assert_array_equal(_generate(sf, **small).latents.numpy(),
                                  _generate(model, **small).latents.numpy())
    # the non-EMA weights and a safetensors file load too
    from safetensors.torch import save_file

    st = tmp_path / "causvid.safetensors"
    save_file({k: v.contiguous() for k, v in original.items()}, str(st))
    sd = flowseam.models.wan_causal.load_single_file_state_dict(st)
    assert all(torch.equal(sd[k], trained[k]) for k in trained)
    plain = flowseam.models.wan_causal.load_single_file_state_dict(weights, ema=False)
    assert torch.equal(plain["proj_out.weight"], trained["proj_out.weight"] * 0.5)


def test_converter_never_unpickles_and_names_mismatches(tmp_path):
    base = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "base")
    evil = tmp_path / "evil.pt"
    torch.save({"generator": {"x": torch.zeros(1)}, "code": Path("/")}, evil)  # not weights-only
    with pytest.raises(ValueError, match="not a weights-only torch file"):
        flowseam.models.wan_causal.load_single_file_state_dict(evil)
    wrong = tmp_path / "wrong.pt"
    torch.save({"generator": {"model.blocks.0.self_attn.q.weight": torch.zeros(3, 3)}}, wrong)
    with pytest.raises(ValueError, match="does not fit .*missing keys"):
        flowseam.models.wan_causal.convert_self_forcing_checkpoint(wrong, base, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# -- streaming to a file ----------------------------------------------------------------------

def _read_frames(path: Path) -> int:
    import imageio.v2 as imageio

    try:
        with imageio.get_reader(path, format="FFMPEG") as reader:
            return sum(1 for _ in reader)
    except Exception:
        return 0


def test_fragmented_mp4_plays_while_written(tmp_path):
    """After each chunk's frames are written, a reader decodes them from the growing temporary
    file, before the next chunk arrives — all but the newest frame, whose duration the MP4
    muxer learns from the frame after it (it comes with the next chunk, or at close); the
    output path appears only at the end."""
    from flowseam.media import StreamingVideoWriter

    out = tmp_path / "v.mp4"
    rng = np.random.default_rng(0)
    chunks = [rng.random((n, 32, 32, 3)).astype(np.float32) for n in (5, 8, 8)]
    with StreamingVideoWriter(out, fps=8) as writer:
        written = 0
        for chunk in chunks:
            writer.write(chunk)
            written += len(chunk)
            deadline = time.monotonic() + 30
            while _read_frames(writer.tmp) < written - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _read_frames(writer.tmp) == written - 1, "the frames written so far do not play"
            assert not out.exists()
    assert _read_frames(out) == 21 and not writer.tmp.exists()


def test_cli_stream_writes_mp4_and_prints_time_to_first_chunk(ckpt, tmp_path):
    """The command (``flowseam generate --stream``: ``flowseam.cli.main``, run in this process;
    what a real process adds — its exit status, one error line — is tested once for every
    command: test_hostile_inputs.py::test_the_flowseam_process_exits_with_one_error_line)."""
    out = tmp_path / "v.mp4"
    r = run_main("generate", "--model", str(ckpt), "--prompt", PROMPT, "--frames", "21",
                 "--height", "32", "--width", "32", "--chunk-frames", "2", "--steps", "2",
                 "--seed", "5", "--stream", "--backend", "cpu", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "time-to-first-chunk:" in r.stdout and "5 frame(s)" in r.stdout
    assert "3 chunks, streamed" in r.stdout
    assert _read_frames(out) == 21
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]


def test_failure_mid_stream_leaves_no_file(ckpt, tmp_path, monkeypatch, capsys):
    from flowseam import cli
    from flowseam.models.wan_causal import WanCausalT2V

    commits = []
    real = WanCausalT2V.commit_chunk

    def failing(self, *args, **kwargs):
        commits.append(1)
        if len(commits) == 2:  # after the first chunk was written to the file
            raise RuntimeError("simulated failure in chunk 2")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalT2V, "commit_chunk", failing)
    out = tmp_path / "v.mp4"
    code = cli.main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--frames", "21",
                     "--height", "32", "--width", "32", "--chunk-frames", "2", "--stream",
                     "--backend", "cpu", "--output", str(out)])
    # a component's run-time fault: exit 3, naming the plugin and what it was doing
    err = capsys.readouterr().err
    assert code == 3 and "simulated failure in chunk 2" in err and "plugin 'cpu'" in err, err
    assert "writing chunk 1 into the KV cache" in err
    assert len(commits) == 2
    assert list(tmp_path.iterdir()) == []  # neither the output nor the temporary file


# -- RL on the causal loop ----------------------------------------------------------------------

def test_rollout_records_per_chunk_and_step_and_serve_parity(model):
    params = DiffusionParams(**BASE)
    req = GenerationRequest(PROMPT, TaskType.T2V, params)
    serve = flowseam.run_loop(model, req, ExecutionProfile.SERVE)
    roll = flowseam.run_loop(model, req, ExecutionProfile.ROLLOUT)
    assert torch.equal(serve.latents, roll.latents) and serve.records == []
    kernels = model.platform.kernels
    euler, renoise = kernels.get(ops.FLOW_MATCH_STEP), kernels.get(ops.FLOW_RENOISE)
    assert [(r.chunk, r.start_frame) for r in roll.records] == [(c, 2 * c) for c in range(3) for _ in range(4)]
    # x0 + fresh noise to the next sigma (flow_renoise) on 3 steps; the last is x0 (flow_match_step)
    assert [r.impl_id for r in roll.records] == \
        [renoise.impl_id, renoise.impl_id, renoise.impl_id, euler.impl_id] * 3
    assert [r.sigma for r in roll.records[:4]] == pytest.approx(SELF_FORCING_SIGMAS[:-1])
    # with sde_rollout every (chunk, step) is Flow-GRPO's SDE step with a log-prob
    sde_params = params.replace(sde_rollout=True, num_frames=13, num_steps=3)  # 2 chunks x 3 steps
    sde = flowseam.run_loop(model, GenerationRequest([PROMPT] * 2, TaskType.T2V, sde_params,
                                                     seeds=[1, 2]), ExecutionProfile.ROLLOUT)
    sde_kernel = kernels.get(ops.FLOW_SDE_STEP)
    assert len(sde.records) == 6 and {r.impl_id for r in sde.records} == {sde_kernel.impl_id}
    assert all(r.log_prob is not None and r.log_prob.shape == (2,) for r in sde.records)
    # the loop's recompute (cache rebuilt from the clean prefix) reproduces each log-prob (C2)
    for rec in sde.records:
        with torch.no_grad():
            v = flowseam.record_velocity(model, sde, rec)
            out = kernels.pin(rec.impl_id)(rec.latents, v, rec.sigma, rec.sigma_next,
                                           prev_sample=rec.next_latents, sigma_max=rec.sigma_max)
        assert torch.equal(out.log_prob, rec.log_prob)
    # an sde_window counts per chunk; outside it the chunk sampler runs (x0, re-noise), not Euler
    win = flowseam.run_loop(model, GenerationRequest([PROMPT] * 2, TaskType.T2V,
                                                     sde_params.replace(sde_window=(1, 2)),
                                                     seeds=[1, 2]), ExecutionProfile.ROLLOUT)
    assert [r.impl_id for r in win.records] == \
        [renoise.impl_id, sde_kernel.impl_id, euler.impl_id] * 2
    assert [r.log_prob is not None for r in win.records] == [False, True, False] * 2


@pytest.mark.slow
def test_flowgrpo_trains_a_causal_checkpoint_with_ratio_one(ckpt):
    """flowgrpo on the causal loop: one PPO ratio per (chunk, step) and sample; on the first
    inner epoch each is 1 within 1e-6 (C2, the pinned kernel and the rebuilt KV cache); the
    second epoch sees the updated weights; the rollout instance gets the new weights."""
    from flowseam.training.flowgrpo import FlowGRPO

    model = flowseam.load(ckpt, platform=flowseam.Platform("cpu"))
    before = {n: p.detach().clone() for n, p in model.dit.named_parameters()}
    g = FlowGRPO(dict(prompts=[PROMPT], reward="brightness", group_size=2, steps=1, seed=0,
                      sampling=dict(num_steps=2, height=32, width=32, num_frames=13, chunk_frames=2,
                                    max_sequence_length=16),
                      grpo=dict(beta=0.04, clip_range=0.2, inner_epochs=2), optim=dict(lr=1e-3)),
                 model=model)
    record = g.train_step()
    first = torch.cat(g.last_stats.first_epoch_ratios)
    assert first.numel() == 2 * 2 * 2  # 2 chunks x 2 steps, 2 samples
    assert float((first - 1).abs().max()) <= 1e-6
    later = torch.cat(g.last_stats.ratios[len(g.last_stats.first_epoch_ratios):])
    assert float((later - 1).abs().max()) > 0
    assert record["updated"] and record["weights_version"] == 1
    assert any(not torch.equal(before[n], p) for n, p in model.dit.named_parameters())
