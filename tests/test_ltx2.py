"""LTX-2: audio + video in one or two stages (cards ``ltx2-t2v``/``ltx2-i2v``, the ``ltx2`` loop).

Parity: on tiny checkpoints written by diffusers' own classes (``write_tiny_checkpoint``, sized
like diffusers' ``tests/pipelines/ltx2`` dummies), flowseam's stage 1, upsample and two-stage
outputs (frames and waveform) equal diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` /
``LTX2LatentUpsamplePipeline`` run the same way (the two-stage recipe of diffusers' docs: stage 1
with ``output_type="latent"``, upsample, stage 2 with ``latents``, ``audio_latents``,
``noise_scale`` = the first refine sigma and a scheduler without dynamic or terminal shift) within
1e-5; on a second checkpoint whose configs differ in every field that changes the numbers (and the
test checks they do change them).
"""

from __future__ import annotations

import json
import shutil
import wave

import numpy as np
import pytest
import torch
from conftest import plugin_env
from PIL import Image

import flowseam
from flowseam import DiffusionParams, FlowseamError, media
from flowseam.attention import RoutedAttnProcessor
from flowseam.cli import main as cli_main
from flowseam.testing.tiny import write_tiny_checkpoint

PROMPT = "a dog barking at a red ball"
REFINE = [0.909375, 0.725, 0.421875]
#: diffusers' LTX-2.3 guidance extras off (flowseam runs CFG only), as flowseam's docs say
PEER_OFF = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0,
                audio_modality_scale=1.0, audio_guidance_rescale=0.0)
#: a checkpoint that differs from the default tiny one in every config field that matters:
#: the distilled scheduler (static shift 1, no terminal stretch), VAE patch 1 (spatial factor 2)
#: with a timestep-conditioned decoder and scaling 0.8, 16 mel bins and 4 latent audio
#: channels, a snakebeta vocoder, the LTX-2.3 latent upsampler (no rational resampler), a
#: 3-layer text encoder
VARIANT = dict(
    scheduler=dict(use_dynamic_shifting=False, shift_terminal=None),
    vae=dict(patch_size=1, timestep_conditioning=True, scaling_factor=0.8),
    audio_vae=dict(mel_bins=16, latent_channels=4),
    vocoder=dict(act_fn="snakebeta"),
    latent_upsampler=dict(use_rational_resampler=False),
    text_encoder=dict(num_hidden_layers=3),
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx2")
    return {"t2v": write_tiny_checkpoint("ltx2-t2v", root / "t2v"),
            "i2v": write_tiny_checkpoint("ltx2-i2v", root / "i2v"),
            "variant": write_tiny_checkpoint("ltx2-t2v", root / "variant", seed=1, **VARIANT)}


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


@pytest.fixture(scope="module")
def models(ckpts, cpu):
    return {name: flowseam.load(path, platform=cpu) for name, path in ckpts.items()}


def _image(h=40, w=48, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def _params(**over):
    base = dict(num_steps=2, height=64, width=64, num_frames=5, frame_rate=25.0, guidance_scale=3.0,
                audio_guidance_scale=4.0, max_sequence_length=32, seed=3,
                negative_prompt="blurry", stages=2)
    return DiffusionParams(**{**base, **over})


class Peer:
    """diffusers' pipelines on one checkpoint, run as flowseam's params say."""

    def __init__(self, path) -> None:
        import diffusers
        from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2LatentUpsamplePipeline

        self.pipe = diffusers.DiffusionPipeline.from_pretrained(path)
        self.pipe.set_progress_bar_config(disable=True)
        self.config = dict(self.pipe.scheduler.config)
        upsampler = LTX2LatentUpsamplerModel.from_pretrained(path, subfolder="latent_upsampler")
        self.upsample_pipe = LTX2LatentUpsamplePipeline(vae=self.pipe.vae, latent_upsampler=upsampler)
        self.upsample_pipe.set_progress_bar_config(disable=True)

    def _call(self, p: DiffusionParams, generator, image=None, **kw):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            self.config, **({} if "latents" not in kw else dict(use_dynamic_shifting=False,
                                                                  shift_terminal=None)))
        extra = {} if image is None else {"image": image}
        return self.pipe(prompt=PROMPT, negative_prompt=p.negative_prompt, num_frames=p.num_frames,
                         frame_rate=p.frame_rate, max_sequence_length=p.max_sequence_length,
                         generator=generator, return_dict=False, **PEER_OFF, **extra, **kw)

    def stage1(self, p: DiffusionParams, size, output_type, generator, image=None):
        return self._call(p, generator, image, height=size[0], width=size[1],
                          num_inference_steps=p.num_steps, guidance_scale=p.guidance_scale,
                          audio_guidance_scale=p.audio_guidance_scale, output_type=output_type)

    def upsample(self, video_latents):
        return self.upsample_pipe(latents=video_latents, output_type="latent", return_dict=False)[0]

    def two_stage(self, p: DiffusionParams, image=None):
        g = torch.Generator().manual_seed(p.seed)
        video, audio = self.stage1(p, (p.height // 2, p.width // 2), "latent", g, image)
        return self._call(p, g, image, latents=self.upsample(video), audio_latents=audio,
                          height=p.height, width=p.width, num_inference_steps=len(REFINE),
                          sigmas=REFINE, noise_scale=REFINE[0], guidance_scale=1.0,
                          audio_guidance_scale=1.0, output_type="np")


def _close(ours, theirs, what):
    theirs = theirs.float().numpy() if torch.is_tensor(theirs) else np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: {ours.shape} vs {theirs.shape}"
    diff = float(np.abs(ours - theirs).max())
    assert diff <= 1e-5, f"{what}: max diff {diff:.3g}"


def _stage1_latents(model, result):
    """flowseam's stage-1 state as diffusers returns it with output_type="latent": the video
    latents unpacked and denormalised (B, C, F, H, W), the audio ones (B, C, L, M)."""
    layout = model.layout(result.latents, result.cond)
    video, audio = model.split(result.latents, layout)
    video = model.denormalize_video(model.unpack_video(video, layout.video))
    avae = model.components["audio_vae"]
    audio = model.unpack_audio(audio * avae.latents_std + avae.latents_mean, layout.audio)
    return video, audio


@pytest.mark.slow
def test_stage1_upsample_and_two_stage_equal_diffusers(ckpts, models):
    model, peer = models["t2v"], Peer(ckpts["t2v"])
    p = _params()
    # stage 1 alone (stages=1 at the base size): frames, waveform and the latents
    one = model.generate(PROMPT, params=p.replace(stages=1, height=32, width=32))
    video, audio = peer.stage1(p, (32, 32), "np", torch.Generator().manual_seed(3))
    _close(one.frames, video, "stage-1 frames")
    _close(one.audio, audio, "stage-1 waveform")
    assert one.audio.shape[:2] == (1, 2) and one.sample_rate == 16000
    lat_v, lat_a = peer.stage1(p, (32, 32), "latent", torch.Generator().manual_seed(3))
    ours_v, ours_a = _stage1_latents(model, one)
    _close(ours_v.numpy(), lat_v, "stage-1 video latents")
    _close(ours_a.numpy(), lat_a, "stage-1 audio latents")
    # the latent upsampler on the same latents: x2 spatially; it and the video VAE convolve
    # with oneDNN on the cpu backend (flowseam_cpu.ltx2), never torch's slow im2col kernels
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        up = model.upsample(one.latents, one.cond, one.params)
        model.decode(one.latents, one.params, one.cond)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::mkldnn_convolution" in ops
    assert not {"aten::slow_conv3d_forward", "aten::_slow_conv2d_forward"} & ops
    layout2 = model.layout(up, one.cond)
    ours_up = model.denormalize_video(model.unpack_video(model.split(up, layout2)[0], layout2.video))
    theirs_up = peer.upsample(lat_v)
    assert theirs_up.shape[-2:] == (2 * lat_v.shape[-2], 2 * lat_v.shape[-1])
    np.testing.assert_allclose(ours_up.numpy(), theirs_up.numpy(), rtol=1e-5, atol=1e-5)
    # the two stages end to end
    two = model.generate(PROMPT, params=p)
    video, audio = peer.two_stage(p)
    _close(two.frames, video, "two-stage frames")
    _close(two.audio, audio, "two-stage waveform")
    assert two.frames.shape == (1, 5, 64, 64, 3) and two.frames.std() > 0.01
    assert np.abs(two.audio).max() > 1e-3
    assert not np.allclose(two.frames[:, :, ::2, ::2], one.frames, atol=1e-2)  # stage 2 refined


@pytest.mark.slow
def test_two_stage_equals_diffusers_on_a_checkpoint_with_other_configs(ckpts, models):
    model, peer = models["variant"], Peer(ckpts["variant"])
    p = _params(frame_rate=24.0, guidance_scale=2.0, audio_guidance_scale=1.0, negative_prompt=None)
    ours = model.generate(PROMPT, params=p)
    video, audio = peer.two_stage(p)
    _close(ours.frames, video, "variant two-stage frames")
    _close(ours.audio, audio, "variant two-stage waveform")
    # the varied fields are read: the distilled scheduler leaves linspace(1, 1/N, N) as it is,
    # the default (real LTX-2) config shifts it by mu and stretches it to 0.1
    assert _stage1_sigmas(model, p) == pytest.approx([1.0, 0.5, 0.0])
    assert _stage1_sigmas(models["t2v"], p)[1] == pytest.approx(0.1, abs=1e-6)
    assert ours.frames.shape == (1, 5, 64, 64, 3) and model.vae_spatial == 2


def _stage1_sigmas(model, p: DiffusionParams) -> list[float]:
    request = flowseam.GenerationRequest(PROMPT, flowseam.TaskType.T2V, p)
    params = model.check(request)
    cond = model.encode(request, params)
    state = model.prepare_latents(request, params, [torch.Generator().manual_seed(0)], cond)
    return model.schedule(params, state, cond)[0]


@pytest.mark.slow
def test_image_to_video_two_stage_equals_diffusers(ckpts, models):
    model, peer = models["i2v"], Peer(ckpts["i2v"])
    p = _params()
    image = _image()
    ours = model.generate(PROMPT, image=image, params=p)
    video, audio = peer.two_stage(p, image=image)
    _close(ours.frames, video, "i2v two-stage frames")
    _close(ours.audio, audio, "i2v two-stage waveform")
    other = model.generate(PROMPT, image=_image(seed=1), params=p)
    assert np.abs(other.frames - ours.frames).max() > 1e-2  # the image conditions the video


@pytest.mark.parametrize("over,match", [
    (dict(num_frames=6), r"num_frames=6 is not of the form 2k\+1 \(LTX-2's video VAE.*try 5 or 7"),
    (dict(height=32), r"height=32 is not divisible by 64 .*stage 1 runs at 1/2.*try 64 or 128"),
    (dict(stages=1, width=48), r"width=48 is not divisible by 32"),
    (dict(stages=3), r"stages=3 must be an integer >= 1 and <= 2"),
    (dict(refine_sigmas=(0.5, 0.7)), r"refine_sigmas=\(0.5, 0.7\) must be a non-empty, strictly decreasing"),
    (dict(flow_shift=3.0), r"flow_shift=3.0 is not taken by ltx2-t2v"),
    (dict(frame_rate=0.0), r"frame_rate=0.0 must be a finite number > 0"),
    (dict(audio_guidance_scale=-1.0), r"audio_guidance_scale=-1.0 must be a finite number >= 0"),
    (dict(max_sequence_length=0), r"max_sequence_length=0 must be an integer >= 1"),
    (dict(num_steps=1), r"num_steps=1 must be >= 2 with this checkpoint's scheduler: its "
                        r"shift_terminal=0.1"),
])
def test_rules_are_checked_before_any_model_runs(models, over, match):
    model = models["t2v"]
    calls = []
    hooks = [model.components[n].register_forward_pre_hook(lambda *a: calls.append(1))
             for n in ("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder")]
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(PROMPT, params=_params(**over))
        with pytest.raises(ValueError, match="ltx2-t2v is text-to-video and takes no image"):
            model.generate(PROMPT, image=_image(), params=_params())
    finally:
        for h in hooks:
            h.remove()
    assert calls == []


def test_image_to_video_needs_an_image_and_other_cards_refuse_ltx2_parameters(models, ckpts, cpu):
    with pytest.raises(ValueError, match="ltx2-i2v is image-to-video: pass image="):
        models["i2v"].generate(PROMPT, params=_params())
    wan = flowseam.load(write_tiny_checkpoint("wan2.1-t2v", ckpts["t2v"].parent / "wan"), platform=cpu)
    for field, value in (("frame_rate", 24.0), ("stages", 2), ("audio_guidance_scale", 3.0)):
        with pytest.raises(ValueError, match=f"{field}={value!r} is not a parameter of this model"):
            wan.generate(PROMPT, params=DiffusionParams(num_steps=1, height=32, width=32,
                                                        num_frames=5, **{field: value}))


def _copy(ckpts, tmp_path, name="t2v"):
    path = tmp_path / name
    shutil.copytree(ckpts[name], path)
    return path


@pytest.mark.parametrize("drop", ["audio_vae", "vocoder", "connectors"])
def test_a_checkpoint_missing_a_component_is_refused_naming_it(ckpts, tmp_path, cpu, drop):
    path = _copy(ckpts, tmp_path)
    shutil.rmtree(path / drop)
    needs = r"ltx2-t2v needs tokenizer \(tokenizer\), text_encoder .* vocoder \(vocoder\); " \
            r"optionally latent_upsampler \(latent_upsampler\) for two-stage generation"
    with pytest.raises(FlowseamError, match=rf"missing '{drop}' \(model_index.json declares .*, but "
                                            rf"there is no {drop}/ folder\)\. {needs}"):
        flowseam.load(path, platform=cpu)
    index = json.loads((path / "model_index.json").read_text())
    index.pop(drop)
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FlowseamError, match=rf"missing '{drop}' \(model_index.json declares none\)"):
        flowseam.load(path, platform=cpu)


@pytest.mark.parametrize("scheduler, match", [
    (dict(stochastic_sampling=True), r"this config asks for flow_match_step\+flow_renoise"),
    (dict(_class_name="UniPCMultistepScheduler", use_flow_sigmas=True,
          prediction_type="flow_prediction", flow_shift=1.0),
     r"this config asks for unipc_step \(UniPCMultistepScheduler\)"),
    (dict(invert_sigmas=True), r"invert_sigmas=True .* is not implemented"),
])
def test_the_scheduler_is_read_as_for_every_card_and_what_the_loop_cannot_step_is_refused(
        ckpts, tmp_path, scheduler, match, monkeypatch):
    """The checkpoint's scheduler goes through flowseam.schedulers (its refusals apply); a
    scheduler the ltx2 loop does not step is refused by name before any weights load."""
    path = _copy(ckpts, tmp_path)
    file = path / "scheduler" / "scheduler_config.json"
    config = json.loads(file.read_text())
    if "_class_name" in scheduler:
        config = {"_class_name": scheduler["_class_name"]}
        index = json.loads((path / "model_index.json").read_text())
        index["scheduler"] = ["diffusers", scheduler["_class_name"]]
        (path / "model_index.json").write_text(json.dumps(index))
    file.write_text(json.dumps(dict(config, **scheduler)))
    monkeypatch.setattr(flowseam.Platform, "build_component", lambda *a, **k: pytest.fail(
        "a component was built before the scheduler was refused"))
    with pytest.raises(FlowseamError, match=match):
        flowseam.load(path, platform=flowseam.Platform("cpu"))


def test_a_checkpoints_serving_defaults_come_before_the_cards(ckpts, tmp_path, cpu, capsys):
    """flowseam.json (next to model_index.json) fills what a request leaves unset, as for
    every card; the request still beats it; the CLI names LTX-2's flags in its errors."""
    from flowseam import GenerationRequest, TaskType

    path = _copy(ckpts, tmp_path)
    serve = {"num_steps": 3, "height": 128, "width": 64, "num_frames": 7, "max_sequence_length": 16}
    (path / "flowseam.json").write_text(json.dumps({"serve": serve}))
    model = flowseam.load(path, platform=cpu)
    params = model.check(GenerationRequest(PROMPT, TaskType.T2V))
    assert {k: getattr(params, k) for k in serve} == serve  # the card's: 30, 1024x1536, 121, 1024
    assert params.frame_rate == model.card.defaults["frame_rate"]  # not in the file
    assert model.check(GenerationRequest(PROMPT, TaskType.T2V, DiffusionParams(num_steps=2))).num_steps == 2
    target = tmp_path / "clip.mp4"
    assert cli_main(["generate", "--model", str(path), "--prompt", PROMPT, "--frames", "6",
                     "--backend", "cpu", "--output", str(target)]) == 2
    assert "--frames=6 is not of the form 2k+1" in capsys.readouterr().err
    # a range error is refused before the model loads, in the flag's words too
    assert cli_main(["generate", "--model", str(path), "--prompt", PROMPT, "--audio-guidance", "-1",
                     "--backend", "cpu", "--output", str(target)]) == 2
    assert "--audio-guidance=-1.0 must be a finite number >= 0" in capsys.readouterr().err
    assert not target.exists()


def test_two_stages_need_the_upsampler_one_stage_does_not(ckpts, tmp_path, cpu):
    path = _copy(ckpts, tmp_path)
    shutil.rmtree(path / "latent_upsampler")
    model = flowseam.load(path, platform=cpu)
    assert "latent_upsampler" not in model.components
    with pytest.raises(ValueError, match=r"stages=2 needs the latent upsampler, and .* has no "
                                         r"latent_upsampler/ folder.*stages=1, --stages 1"):
        model.generate(PROMPT, params=_params())
    out = model.generate(PROMPT, params=_params(stages=1))
    assert out.frames.shape == (1, 5, 64, 64, 3) and out.audio.shape[:2] == (1, 2)
    # the CLI refuses it with exit status 2 and writes nothing
    target = tmp_path / "out" / "clip.mp4"
    assert cli_main(["generate", "--model", str(path), "--prompt", PROMPT, "--frames", "5",
                     "--height", "64", "--width", "64", "--steps", "1", "--backend", "cpu",
                     "--output", str(target)]) == 2
    assert not target.exists() and (not target.parent.exists() or not any(target.parent.iterdir()))


@pytest.mark.backends
def test_every_step_runs_the_platforms_kernel_and_components_fall_back_visibly(ckpts, fixture_plugins_dir,
                                                                              monkeypatch):
    """On a backend that builds only ``vae`` and registers its own ``flow_match_step``: every step of
    both stages runs that kernel (stage 2's re-noising the platform's ``flow_renoise``, cpu's
    here), LTX-2's new kinds fall back to cpu and say so, and every attention call of the DiT goes
    through the platform's attention op."""
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a") as reg:
        platform = flowseam.Platform("testdev_a", registry=reg)
        model = flowseam.load(ckpts["t2v"], platform=platform)
        recs = model.component_records
        assert (recs["vae"].plugin, recs["vae"].fallback) == ("testdev_a", False)
        for name, kind in (("connectors", "text_connectors"), ("audio_vae", "audio_vae"),
                           ("vocoder", "vocoder"), ("latent_upsampler", "latent_upsampler"),
                           ("transformer", "dit")):
            assert (recs[name].kind, recs[name].device, recs[name].fallback) == (kind, "cpu", True)
            assert f"no plugin serving 'testdev' builds '{kind}'" in recs[name].reason
            assert recs[name].reason in platform.explain()
        step = platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
        assert step.provenance.plugin == "testdev_a"
        procs = model.dit.attn_processors
        assert procs and all(isinstance(p, RoutedAttnProcessor) for p in procs.values())
        seen = []
        attention = platform.kernels.get(flowseam.ops.ATTENTION)
        for proc in procs.values():
            proc._mode.attn = lambda q, k, v, attn_mask=None, scale=None: \
                seen.append(q.shape) or attention(q, k, v, attn_mask, scale)
        # the text-only DiT values (flowseam.step_constants): caption projections, text K/V
        # (video and audio); the 4 RoPE modules' cos/sin of the stage's coordinates
        watched = {id(m) for name, m in model.dit.named_modules()
                   if name.endswith(model.STEP_CONSTANTS)}
        assert len(watched) == 2 + 2 * 3 * len(model.dit.transformer_blocks) + 4
        runs = []
        for cls in {type(m) for m in model.dit.modules() if id(m) in watched}:
            monkeypatch.setattr(cls, "forward", lambda self, x, _f=cls.forward, **kw:
                                runs.append(id(self)) or _f(self, x, **kw))
        p = _params(num_steps=2, guidance_scale=1.0, audio_guidance_scale=1.0)
        result = flowseam.run_loop(model, flowseam.GenerationRequest(PROMPT, flowseam.TaskType.T2V, p),
                                   flowseam.ExecutionProfile.ROLLOUT)
        assert [r.index for r in result.records] == list(range(5))  # 2 base + 3 refine steps
        # once per stage (2 stages, 5 steps): each stage's first step; the output equals
        # diffusers', which recomputes them at every step (test_stage1_upsample_and_two_stage...)
        assert sorted(r for r in runs if r in watched) == sorted([*watched, *watched])
        assert {r.impl_id for r in result.records} == {step.impl_id}
        renoise = platform.kernels.get(flowseam.ops.FLOW_RENOISE)  # testdev has none: cpu's
        assert renoise.provenance.plugin == "cpu"
        assert result.kernels == {flowseam.ops.FLOW_MATCH_STEP: step.impl_id,
                                  flowseam.ops.FLOW_RENOISE: renoise.impl_id}
        assert [r.sigma for r in result.records][2:] == pytest.approx(REFINE, abs=1e-6)
        assert result.solver.startswith(f"solver flow_match_step [{step.impl_id}] (ODE) on the "
                                        "stage-1 schedule: use_dynamic_shifting=True (checkpoint)")
        assert f"stage 2: flow_renoise [{renoise.impl_id}] to sigma 0.909375" in result.solver
        # 5 DiT calls x 2 blocks x 6 attentions (video, audio, 2 text cross, a2v, v2a)
        assert len(seen) == 5 * 2 * 6
        assert "testdev_a" in model.provenance() and "audio_vae=cpu/cpu float32 (fallback)" in model.provenance()
    flowseam.seam.discovery._CACHE = None


@pytest.mark.backends
def test_accel_leaves_the_new_kinds_to_cpu():
    reg = flowseam.seam.discovery.discover(refresh=True)
    rec = reg.records.get("accel")
    if rec is None or not rec.usable:
        pytest.skip(f"the accel backend is not usable here ({rec.status if rec else 'not installed'})")
    platform = flowseam.Platform("accel", registry=reg)
    for kind in ("text_connectors", "audio_vae", "vocoder", "latent_upsampler"):
        assert platform.component_plan(kind) == ("cpu", "cpu", True)
    assert platform.component_plan("dit") == ("accel", "accel", False)
    flowseam.seam.discovery._CACHE = None


def _generate_cli(ckpt, out, *extra):
    return cli_main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--frames", "9",
                     "--height", "64", "--width", "64", "--steps", "2", "--backend", "cpu",
                     "--output", str(out), *extra])


def test_generate_writes_mp4_with_h264_and_aac_wav_alone_and_gif_without_sound(ckpts, tmp_path, capsys):
    import av

    mp4 = tmp_path / "clip.mp4"
    assert _generate_cli(ckpts["t2v"], mp4, "--fps", "25") == 0
    assert "9 frame(s) of 64x64 with 2-channel AAC audio" in capsys.readouterr().out
    with av.open(str(mp4)) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, sound.codec_context.name) == ("h264", "aac")
        assert (video.width, video.height, sound.rate, sound.channels) == (64, 64, 16000, 2)
        assert video.average_rate == 25
        frames = sum(1 for _ in container.decode(video=0))
        container.seek(0)
        samples = sum(f.samples for f in container.decode(audio=0))
    assert frames == 9
    # 9 frames at 25 fps = 0.36 s; the waveform is a little shorter (causal audio latents), plus
    # the AAC encoder's priming
    assert 0.25 <= samples / 16000 <= 0.5

    wav = tmp_path / "clip.wav"
    assert _generate_cli(ckpts["t2v"], wav, "--fps", "25") == 0
    assert "s of 2-channel audio at 16000 Hz" in capsys.readouterr().out
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (2, 16000, 2)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert 0.25 <= w.getnframes() / 16000 <= 0.4 and np.abs(pcm).max() > 30  # not silence

    gif = tmp_path / "clip.gif"
    assert _generate_cli(ckpts["t2v"], gif) == 0
    assert "a GIF has no audio track; the audio is dropped" in capsys.readouterr().err
    assert gif.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["clip.gif", "clip.mp4",
                                                                           "clip.wav"]


def test_sound_outputs_are_atomic_and_checked(tmp_path, monkeypatch):
    import av

    frames = np.random.RandomState(0).rand(5, 32, 32, 3).astype(np.float32)
    audio = np.sin(np.linspace(0, 200, 3200, dtype=np.float32))[None].repeat(2, 0) * 0.5

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(av.AudioFrame, "from_ndarray", broken)
    with pytest.raises(OSError, match="disk full"):
        media.write_output(tmp_path / "v.mp4", frames, fps=25, audio=audio, sample_rate=16000)
    assert list(tmp_path.iterdir()) == []  # no half-written MP4
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"audio has shape \(3200,\); expected \(channels, samples\)"):
        media.write_output(tmp_path / "v.mp4", frames, audio=audio[0], sample_rate=16000)
    with pytest.raises(ValueError, match="sample_rate=None must be a positive number"):
        media.write_output(tmp_path / "v.wav", None, audio=audio)
    with pytest.raises(ValueError, match="this output has no sound to write"):
        media.write_output(tmp_path / "v.wav", frames)
    with pytest.warns(UserWarning, match="a GIF has no audio track; the audio is dropped"):
        media.write_output(tmp_path / "v.gif", frames, audio=audio, sample_rate=16000)
    assert [p.name for p in tmp_path.iterdir()] == ["v.gif"]
    # a .wav round trip: 16-bit PCM of the clipped waveform
    media.write_output(tmp_path / "a.wav", None, audio=audio * 3, sample_rate=16000)
    with wave.open(str(tmp_path / "a.wav")) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2).T
    np.testing.assert_array_equal(pcm, np.round(np.clip(audio * 3, -1, 1) * 32767).astype("<i2"))


def test_a_wav_output_needs_a_model_that_makes_sound(tmp_path, capsys):
    wan = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan")
    assert cli_main(["generate", "--model", str(wan), "--prompt", "x", "--frames", "5", "--height",
                     "32", "--width", "32", "--steps", "1", "--backend", "cpu",
                     "--output", str(tmp_path / "a.wav")]) == 2
    assert "wan2.1-t2v makes no sound" in capsys.readouterr().err
    assert not (tmp_path / "a.wav").exists()


@pytest.mark.parametrize("reward", ["brightness", "audio_rms"])
def test_flowgrpo_trains_the_dit_on_both_stages_with_first_epoch_ratio_one(ckpts, cpu, reward):
    from flowseam.training.flowgrpo import FlowGRPO

    model = flowseam.load(ckpts["t2v"], platform=cpu)
    before = {n: p.detach().clone() for n, p in model.dit.named_parameters()}
    sampling = dict(num_steps=2, height=64, width=64, num_frames=5, frame_rate=25.0,
                    guidance_scale=1.0, audio_guidance_scale=1.0, max_sequence_length=16, stages=2)
    g = FlowGRPO(dict(prompts=[PROMPT], reward=reward, group_size=2, steps=1, seed=0,
                      sampling=sampling, grpo=dict(beta=0.0, clip_range=0.2),
                      optim=dict(lr=1e-3)), model=model)
    trajectories, results, _, _ = g.rollout(0)
    records = results[0].records
    sde = cpu.kernels.get(flowseam.ops.FLOW_SDE_STEP)
    assert len(records) == 5 and all(r.impl_id == sde.impl_id and r.log_prob is not None
                                     for r in records)
    assert {r.latents.shape[1] for r in records[:2]} != {r.latents.shape[1] for r in records[2:]}
    g.progress = False
    record = g.train_step()
    first = torch.cat(g.last_stats.first_epoch_ratios)
    assert first.numel() == 2 * 5 and (first - 1).abs().max() <= 1e-6  # C2
    assert record["updated"] and record["reward_std"] > 0
    changed = [n for n, p in model.dit.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # the rollout instance got the trained DiT through the WeightSyncPlan


def test_an_audio_reward_on_a_silent_model_is_refused(tmp_path, cpu):
    from flowseam.training.flowgrpo import FlowGRPO

    model = flowseam.load(write_tiny_checkpoint("flux.1-t2i", tmp_path / "flux"), platform=cpu)
    g = FlowGRPO(dict(prompts=["x"], reward="audio_rms", group_size=2, steps=1,
                      sampling=dict(num_steps=2, height=32, width=32, max_sequence_length=16)),
                 model=model)
    with pytest.raises(ValueError, match="reward 'audio_rms' scores audio, and this model makes none"):
        g.train_step()
