"""Serve what the checkpoint says: flowseam's default call equals diffusers' default call.

Every pipeline here is built the way diffusers' own tests build theirs: the
``get_dummy_components()`` of ``tests/pipelines/wan/test_wan.py``, ``test_wan_image_to_video.py``,
``test_wan_22.py``, ``test_wan_22_image_to_video.py`` and ``flux/test_pipeline_flux.py``
(diffusers' main), rebuilt here with no download: the hub's ``hf-internal-testing/tiny-random-t5``
and ``tiny-random-clip`` are replaced by models of the same architecture with flowseam's
in-memory tokenizers (:mod:`flowseam.testing.tiny`). Their configs differ from flowseam's own
tiny checkpoints on purpose (T5EncoderModel, head dim 12, a 3-channel VAE base, rope length 32,
an I2V transformer with ``image_dim`` but no ``added_kv_proj_dim``, a one-level FLUX VAE with one
latent channel, no guidance embedding), and each is saved with ``save_pretrained`` and served
with several scheduler configs written into its ``scheduler/`` folder.

For each one, flowseam's call with *no* scheduler parameters (``flowseam.load`` reads the
checkpoint) equals diffusers' default call (``DiffusionPipeline.from_pretrained``) on the same
prompt, seed and size within 1e-5. Every varied input is checked to change the output (else the
parity would prove nothing): the prompt by >= 1e-3, each scheduler setting by >= 2e-4
(20x the parity tolerance).

diffusers' dummy weights condition weakly on text (a prompt moves the output by 4e-4 at
guidance 1); the Wan and FLUX text projections' last layers are scaled up here (the same saved
weights serve both libraries).

Stochastic sampling: diffusers' pipelines call ``scheduler.step`` without a generator (the noise
then comes from torch's global RNG); flowseam draws it from the request's per-sample generators,
which is what diffusers' ``step(..., generator=...)`` does when handed the pipeline's generators,
so the diffusers side here passes them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import flowseam
from flowseam import DiffusionParams, FlowseamError
from flowseam.testing.tiny import clip_tokenizer, t5_tokenizer

TOL = 1e-5          # parity with diffusers (max abs over frames in [0, 1])
PROMPT_EFFECT = 1e-3
SETTING_EFFECT = 2e-4
PROMPTS = ["dance monkey", "a red ball rolling on the grass"]

EULER = diffusers.FlowMatchEulerDiscreteScheduler
UNIPC = functools.partial(diffusers.UniPCMultistepScheduler, prediction_type="flow_prediction",
                          use_flow_sigmas=True)


# -- diffusers' dummy components, rebuilt locally -----------------------------------------------

def _t5():
    """hf-internal-testing/tiny-random-t5's architecture (d_model 32, 5 layers, 4 heads x 8,
    d_ff 37, 8 buckets, ReLU), with flowseam's in-memory tokenizer."""
    tokenizer = t5_tokenizer()
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=5, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.1, feed_forward_proj="relu",
        layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return transformers.T5EncoderModel(config).eval(), tokenizer


def _wan_transformer(in_channels: int, **extra):
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=in_channels, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        **extra)
    with torch.no_grad():  # stronger text conditioning (module docstring)
        transformer.condition_embedder.text_embedder.linear_2.weight.mul_(10)
    return transformer


def wan_components(*, i2v: bool = False, wan22: bool = False) -> dict:
    """test_wan.py / test_wan_image_to_video.py / test_wan_22*.py ``get_dummy_components()``;
    Wan2.2's second expert gets its own seed (diffusers' test seeds both with 0, which makes the
    experts identical and the switch invisible)."""
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                     num_res_blocks=1, temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    scheduler = UNIPC(flow_shift=3.0) if wan22 else EULER(shift=7.0)
    text_encoder, tokenizer = _t5()
    torch.manual_seed(0)
    extra = {"image_dim": 4} if i2v and not wan22 else {}
    transformer = _wan_transformer(36 if i2v else 16, **extra)
    components = dict(transformer=transformer, vae=vae, scheduler=scheduler,
                      text_encoder=text_encoder, tokenizer=tokenizer, transformer_2=None)
    if wan22:
        torch.manual_seed(1)
        components.update(transformer_2=_wan_transformer(36 if i2v else 16), boundary_ratio=0.875)
    if i2v and not wan22:
        torch.manual_seed(0)
        components["image_encoder"] = transformers.CLIPVisionModelWithProjection(
            transformers.CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=32,
                                          intermediate_size=16, patch_size=1))
        torch.manual_seed(0)
        components["image_processor"] = transformers.CLIPImageProcessor(crop_size=32, size=32)
    elif i2v:
        components.update(image_encoder=None, image_processor=None)
    return components


def flux_components() -> dict:
    """flux/test_pipeline_flux.py ``get_dummy_components()``."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8])
    with torch.no_grad():  # stronger text conditioning (module docstring)
        transformer.context_embedder.weight.mul_(10)
    clip_config = transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=5, pad_token_id=1, vocab_size=1000,
        hidden_act="gelu", projection_dim=32)
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(clip_config).eval()
    torch.manual_seed(0)
    text_encoder_2, tokenizer_2 = _t5()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035)
    return dict(scheduler=EULER(), text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                tokenizer=clip_tokenizer(), tokenizer_2=tokenizer_2, transformer=transformer,
                vae=vae, image_encoder=None, feature_extractor=None)


BUILDERS = {
    "wan-t2v": (diffusers.WanPipeline, wan_components),
    "wan-i2v": (diffusers.WanImageToVideoPipeline, functools.partial(wan_components, i2v=True)),
    "wan22-t2v": (diffusers.WanPipeline, functools.partial(wan_components, wan22=True)),
    "wan22-i2v": (diffusers.WanImageToVideoPipeline,
                  functools.partial(wan_components, i2v=True, wan22=True)),
    "flux": (diffusers.FluxPipeline, flux_components),
}

#: the call of each pipeline: size, steps, guidance, text length (diffusers' dummy inputs,
#: made non-square, with a batch of two where the card takes one)
CALLS = {
    "wan-t2v": dict(prompts=PROMPTS, height=16, width=32, num_frames=5, guidance=6.0,
                    max_sequence_length=16, steps=4),
    "wan-i2v": dict(prompts=PROMPTS[:1], height=16, width=32, num_frames=5, guidance=6.0,
                    max_sequence_length=16, steps=4),
    "wan22-t2v": dict(prompts=PROMPTS[:1], height=16, width=32, num_frames=5, guidance=6.0,
                      max_sequence_length=16, steps=4),
    "wan22-i2v": dict(prompts=PROMPTS[:1], height=16, width=32, num_frames=5, guidance=6.0,
                      max_sequence_length=16, steps=4),
    "flux": dict(prompts=PROMPTS, height=16, width=24, num_frames=None, guidance=5.0,
                 max_sequence_length=48, steps=4),
}


class Checkpoints:
    """Each dummy pipeline saved once; scheduler variants as sibling folders that link to its
    component folders and hold their own ``scheduler/scheduler_config.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._bases: dict[str, Path] = {}
        self._variants: dict[tuple[str, str], Path] = {}

    def base(self, name: str) -> Path:
        if name not in self._bases:
            cls, build = BUILDERS[name]
            path = self.root / name
            cls(**build()).save_pretrained(path)
            self._bases[name] = path
        return self._bases[name]

    def variant(self, name: str, variant: str, scheduler) -> Path:
        key = (name, variant)
        if key not in self._variants:
            base, path = self.base(name), self.root / f"{name}-{variant}"
            path.mkdir()
            for item in base.iterdir():
                if item.name not in ("scheduler", "model_index.json"):
                    (path / item.name).symlink_to(item)
            scheduler.save_pretrained(path / "scheduler")
            index = json.loads((base / "model_index.json").read_text())  # as save_pretrained
            index["scheduler"] = ["diffusers", type(scheduler).__name__]  # would write it
            (path / "model_index.json").write_text(json.dumps(index))
            self._variants[key] = path
        return self._variants[key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("diffusers-dummies"))


@pytest.fixture(scope="module")
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _image():
    rng = np.random.RandomState(0)
    return Image.fromarray((rng.rand(40, 48, 3) * 255).astype(np.uint8))


def ours(path: Path, name: str, cpu, *, prompts=None, seed: int = 0, **params) -> flowseam.LoopResult:
    """flowseam's default call: no scheduler parameter, the checkpoint decides."""
    call = CALLS[name]
    model = flowseam.load(path, platform=cpu, quiet=True)
    p = DiffusionParams(num_steps=call["steps"], height=call["height"], width=call["width"],
                        num_frames=call["num_frames"], guidance_scale=call["guidance"],
                        max_sequence_length=call["max_sequence_length"], seed=seed,
                        negative_prompt="negative" if name.startswith("wan") else None)
    image = _image() if name.endswith("i2v") else None
    return model.generate(prompts or call["prompts"], image=image, params=p.replace(**params))


def theirs(path: Path, name: str, *, prompts=None, seed: int = 0, **kwargs) -> np.ndarray:
    """diffusers' default call on the same checkpoint, with one generator per sample."""
    call = CALLS[name]
    prompts = prompts or call["prompts"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    if pipe.scheduler.config.get("stochastic_sampling"):  # see the module docstring
        pipe.scheduler.step = functools.partial(pipe.scheduler.step, generator=generators)
    args = dict(prompt=prompts, num_inference_steps=call["steps"], height=call["height"],
                width=call["width"], guidance_scale=call["guidance"], generator=generators,
                max_sequence_length=call["max_sequence_length"], output_type="np")
    if name == "flux":
        return pipe(**{**args, **kwargs}).images[:, None]
    args.update(num_frames=call["num_frames"], negative_prompt="negative")
    if name.endswith("i2v"):
        args["image"] = _image()
    return pipe(**{**args, **kwargs}).frames


def _diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# -- the cases ----------------------------------------------------------------------------------

#: (pipeline, variant id, scheduler written into the checkpoint, request changes)
CASES = [
    ("wan-t2v", "dummy_shift7", EULER(shift=7.0), {}),  # the 6.7e-2 row
    ("wan-t2v", "shift7_guidance1", EULER(shift=7.0), {"guidance_scale": 1.0}),
    ("wan-t2v", "shift_terminal", EULER(shift=7.0, shift_terminal=0.1), {}),
    ("wan-t2v", "karras", EULER(shift=7.0, use_karras_sigmas=True), {}),
    ("wan-t2v", "exponential", EULER(shift=7.0, use_exponential_sigmas=True), {}),
    ("wan-t2v", "beta", EULER(shift=7.0, use_beta_sigmas=True), {}),
    ("wan-t2v", "stochastic", EULER(shift=7.0, stochastic_sampling=True), {}),
    ("wan-t2v", "unipc_order1", UNIPC(flow_shift=7.0, solver_order=1), {"guidance_scale": 1.0}),
    ("wan-t2v", "unipc_order2", UNIPC(flow_shift=3.0), {}),  # the Wan2.1-Diffusers config
    ("wan-t2v", "unipc_order3_bh1", UNIPC(flow_shift=7.0, solver_order=3, solver_type="bh1",
                                          final_sigmas_type="sigma_min"), {"num_steps": 5}),
    ("wan-t2v", "unipc_order3_bh2", UNIPC(flow_shift=7.0, solver_order=3), {"num_steps": 5}),
    ("wan-i2v", "dummy_shift7", EULER(shift=7.0), {}),  # the 2.5e-2 row
    ("wan-i2v", "unipc_order2", UNIPC(flow_shift=3.0), {}),
    ("flux", "dummy", EULER(), {}),  # use_dynamic_shifting=False, shift 1.0: the 8.9e-3 row
    ("flux", "static_shift3", EULER(shift=3.0), {}),  # the 1.0e-2 row
    ("flux", "dynamic", EULER(use_dynamic_shifting=True), {}),
    ("flux", "dynamic_linear", EULER(use_dynamic_shifting=True, time_shift_type="linear",
                                     base_shift=0.8, max_shift=1.5), {}),
    ("flux", "stochastic", EULER(shift=3.0, stochastic_sampling=True), {}),
    ("flux", "unipc_dynamic", UNIPC(use_dynamic_shifting=True), {}),
    ("wan22-t2v", "two_experts", UNIPC(flow_shift=3.0), {}),
    ("wan22-t2v", "guidance_2", UNIPC(flow_shift=3.0), {"guidance_scale_2": 2.0}),
    ("wan22-i2v", "two_experts", UNIPC(flow_shift=3.0), {}),
]

#: variant id → the variant of the same pipeline it must differ from (the setting matters)
DIFFERS_FROM = {
    "shift_terminal": "dummy_shift7", "karras": "dummy_shift7", "exponential": "dummy_shift7",
    "beta": "dummy_shift7", "stochastic": "dummy_shift7", "unipc_order2": "dummy_shift7",
    "unipc_order3_bh2": "unipc_order3_bh1", "static_shift3": "dummy", "dynamic": "static_shift3",
    "dynamic_linear": "dynamic", "unipc_dynamic": "dynamic", "guidance_2": "two_experts",
}


@pytest.fixture(scope="module")
def outputs() -> dict:
    return {}


@pytest.mark.parametrize("name,variant,scheduler,request_changes", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_default_call_equals_diffusers(checkpoints, cpu, outputs, name, variant, scheduler,
                                       request_changes):
    path = checkpoints.variant(name, variant, scheduler)
    result = ours(path, name, cpu, **request_changes)
    call_kwargs = {k: v for k, v in request_changes.items() if k != "num_steps"}
    if "num_steps" in request_changes:
        call_kwargs["num_inference_steps"] = request_changes["num_steps"]
    reference = theirs(path, name, **call_kwargs)
    assert result.frames.shape == reference.shape
    assert _diff(result.frames, reference) <= TOL, \
        f"{name} {variant}: max |flowseam - diffusers| = {_diff(result.frames, reference):.3g}"
    outputs[(name, variant)] = result.frames
    # the solver that ran is named, with where its settings came from
    assert result.solver.startswith("solver ") and "(checkpoint)" in result.solver
    assert f"({type(scheduler).__name__}, checkpoint)" in result.solver
    other = DIFFERS_FROM.get(variant)
    if other is not None and (name, other) in outputs:  # the setting changes the output
        assert _diff(outputs[(name, other)], result.frames) >= SETTING_EFFECT, \
            f"{name}: {variant} and {other} give the same output; the parity proves nothing"


@pytest.mark.parametrize("name,guidance", [("wan-t2v", 1.0), ("wan-i2v", 6.0), ("flux", 5.0),
                                           ("wan22-t2v", 6.0), ("wan22-i2v", 6.0)])
def test_text_conditioning_is_strong_enough_to_prove_parity(checkpoints, cpu, name, guidance):
    """A different prompt moves the output by >= 1e-3 at the guidance the parity cases use
    (else a parity test whose text path were wrong would still pass). guidance 1 for Wan T2V;
    the I2V output is dominated by its image, and its parity cases run with CFG."""
    path = checkpoints.base(name)
    a = ours(path, name, cpu, prompts=PROMPTS[:1], guidance_scale=guidance).frames
    b = ours(path, name, cpu, prompts=PROMPTS[1:], guidance_scale=guidance).frames
    assert _diff(a, b) >= PROMPT_EFFECT, \
        f"{name}: the prompt moves the output by only {_diff(a, b):.2g} < {PROMPT_EFFECT}"


def test_unipc_orders_1_to_3_match_diffusers_and_differ(checkpoints, cpu):
    """UniPC at orders 1, 2 and 3 (6 steps, so order 3 runs twice) equals diffusers at each
    order, and the orders give different outputs (the solver's history is used)."""
    runs = {}
    for order in (1, 2, 3):
        path = checkpoints.variant("wan-t2v", f"unipc_order{order}_6steps",
                                   UNIPC(flow_shift=5.0, solver_order=order))
        runs[order] = ours(path, "wan-t2v", cpu, num_steps=6, prompts=PROMPTS[:1]).frames
        reference = theirs(path, "wan-t2v", prompts=PROMPTS[:1], num_inference_steps=6)
        assert _diff(runs[order], reference) <= TOL, f"order {order}: {_diff(runs[order], reference):.3g}"
    assert _diff(runs[1], runs[2]) >= SETTING_EFFECT and _diff(runs[2], runs[3]) >= SETTING_EFFECT


def test_wan22_switches_experts_at_the_boundary_as_diffusers_does(checkpoints, cpu):
    """Two experts, each built through the platform, switching where diffusers switches
    (``t >= boundary_ratio * 1000`` → transformer): the steps' experts are recorded, and the
    output differs from diffusers' with transformer_2 replaced by transformer (the switch
    matters)."""
    path = checkpoints.variant("wan22-t2v", "two_experts", UNIPC(flow_shift=3.0))
    model = flowseam.load(path, platform=cpu, quiet=True)
    assert list(model.experts) == ["transformer", "transformer_2"]
    assert model.experts.boundary_timestep == 875.0
    assert {r.kind for n, r in model.component_records.items() if n.startswith("transformer")} == {"dit"}
    result = ours(path, "wan22-t2v", cpu)
    config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "UniPCMultistepScheduler"
    # UniPC with flow_shift 3, 4 steps: timesteps 999, 900, 750, 500; boundary 875
    assert result.experts == ["transformer", "transformer", "transformer_2", "transformer_2"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer_2 = pipe.transformer
    one = pipe(prompt=PROMPTS[:1], negative_prompt="negative", num_inference_steps=4, height=16,
               width=32, num_frames=5, guidance_scale=6.0, max_sequence_length=16,
               generator=[torch.Generator().manual_seed(0)], output_type="np").frames
    assert _diff(result.frames, one) >= SETTING_EFFECT


# -- what flowseam refuses or reports ------------------------------------------------------------

REFUSED = [
    (EULER(invert_sigmas=True), "invert_sigmas=True"),
    (UNIPC(predict_x0=False), "predict_x0=False"),
    (diffusers.UniPCMultistepScheduler(), "use_flow_sigmas=False"),
    (UNIPC(solver_order=4), "solver_order=4"),
    (UNIPC(thresholding=True), "thresholding=True"),
    (UNIPC(lower_order_final=False), "lower_order_final=False"),
    (EULER(use_dynamic_shifting=True), "use_dynamic_shifting=True needs a resolution-dependent mu"),
    (diffusers.DPMSolverMultistepScheduler(), "_class_name='DPMSolverMultistepScheduler'"),
]


@pytest.mark.parametrize("index", range(len(REFUSED)), ids=[m.split("=")[0] for _, m in REFUSED])
def test_unimplemented_scheduler_options_are_refused_by_name(checkpoints, cpu, index):
    scheduler, match = REFUSED[index]
    path = checkpoints.variant("wan-t2v", f"refused{index}", scheduler)
    with pytest.raises(FlowseamError, match=match):
        flowseam.load(path, platform=cpu, quiet=True)


def test_an_unknown_option_is_refused_or_ignored_with_a_warning_on_request(checkpoints, cpu,
                                                                          capsys):
    path = checkpoints.variant("wan-t2v", "unknown_key", EULER(shift=7.0))
    config = path / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "sigma_jitter": 0.1,
                                  "invert_sigmas": True}))
    with pytest.raises(FlowseamError, match=r"(?s)sigma_jitter=0.1 is not an option.*invert_sigmas"):
        flowseam.load(path, platform=cpu, quiet=True)
    with pytest.warns(UserWarning, match=r"ignoring scheduler option\(s\).*sigma_jitter=0.1"):
        model = flowseam.load(path, platform=cpu,
                              ignore_scheduler_options=["sigma_jitter", "invert_sigmas"])
    line = capsys.readouterr().err
    assert "sigma_jitter=0.1 ignored" in line and "invert_sigmas=True ignored" in line and "shift=7.0 (checkpoint)" in line
    assert model.solver.config["invert_sigmas"] is False


def test_load_line_and_provenance_name_the_solver_and_sources(checkpoints, cpu, capsys, tmp_path):
    """One line at load: the solver and each schedule setting with its source; a request's
    flow_shift shows as ``request``; a key the checkpoint leaves out takes the card default."""
    path = checkpoints.variant("wan-t2v", "unipc_order2", UNIPC(flow_shift=3.0))
    model = flowseam.load(path, platform=cpu)
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("flowseam: loaded")][-1]
    assert line.startswith("flowseam: loaded wan2.1-t2v from ")
    assert ("solver unipc_step (UniPCMultistepScheduler, checkpoint): flow_shift=3.0 (checkpoint), "
            "use_dynamic_shifting=False (checkpoint), solver_order=2 (checkpoint), "
            "solver_type='bh2' (checkpoint), lower_order_final=True (checkpoint), "
            "final_sigmas_type='zero' (checkpoint)") in line
    assert model.solver.describe() in model.provenance()
    result = model.generate("x", params=DiffusionParams(num_steps=2, height=16, width=16,
                                                        num_frames=5, flow_shift=5.0,
                                                        max_sequence_length=16))
    assert "flow_shift=5.0 (request)" in result.solver and "[cpu:unipc_step:" in result.solver
    assert result.kernels == {"unipc_step": cpu.kernels.get("unipc_step").impl_id}
    # a hand-written config with no shift: the card's default, said so
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in path.iterdir():
        if item.name not in ("scheduler", "model_index.json"):
            (bare / item.name).symlink_to(item.resolve())
    index = json.loads((path / "model_index.json").read_text())
    (bare / "model_index.json").write_text(json.dumps(
        {**index, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    (bare / "scheduler").mkdir()
    (bare / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler"}))
    solver = flowseam.load(bare, platform=cpu, quiet=True).solver
    assert solver.config["shift"] == 3.0 and solver.source("shift") == "card default"
    assert solver.source("stochastic_sampling") == "diffusers default"
    # model_index.json names the class diffusers loads: a scheduler_config.json naming another
    # one is refused (diffusers would silently drop its keys), or run as diffusers does on request
    (bare / "model_index.json").write_text(json.dumps(index))  # names UniPC
    with pytest.raises(FlowseamError, match="model_index.json names the scheduler "
                                            "'UniPCMultistepScheduler'"):
        flowseam.load(bare, platform=cpu, quiet=True)
    with pytest.warns(UserWarning, match="_class_name='FlowMatchEulerDiscreteScheduler'"):
        solver = flowseam.load(bare, platform=cpu, quiet=True,
                               ignore_scheduler_options=["_class_name"]).solver
    assert solver.scheduler_class == "UniPCMultistepScheduler"
    # no scheduler folder at all: the card's scheduler (Wan: the Wan2.1-Diffusers UniPC), said so
    (bare / "scheduler" / "scheduler_config.json").unlink()
    (bare / "scheduler").rmdir()
    (bare / "model_index.json").write_text(json.dumps({**index, "scheduler": [None, None]}))
    solver = flowseam.load(bare, platform=cpu, quiet=True).solver
    assert (solver.scheduler_class, solver.source("_class_name")) == ("UniPCMultistepScheduler",
                                                                      "card default")
    assert solver.config["flow_shift"] == 3.0 and solver.source("flow_shift") == "card default"


def test_wan22_layouts_are_served_or_refused_naming_the_component(checkpoints, cpu, tmp_path):
    base = checkpoints.base("wan22-t2v")

    def layout(**changes) -> Path:
        path = tmp_path / f"layout{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        for item in base.iterdir():
            if item.name != "model_index.json":
                (path / item.name).symlink_to(item)
        index = json.loads((base / "model_index.json").read_text())
        (path / "model_index.json").write_text(json.dumps({**index, **changes}))
        return path

    with pytest.raises(FlowseamError, match="declares transformer_2 but boundary_ratio is null"):
        flowseam.load(layout(boundary_ratio=None), platform=cpu, quiet=True)
    with pytest.raises(FlowseamError, match="expand_timesteps=True"):
        flowseam.load(layout(expand_timesteps=True), platform=cpu, quiet=True)
    with pytest.raises(FlowseamError, match="boundary_ratio=1.5"):
        flowseam.load(layout(boundary_ratio=1.5), platform=cpu, quiet=True)
    with pytest.warns(UserWarning, match=r"safety_checker .* is not loaded: an unknown component"):
        model = flowseam.load(layout(safety_checker=["diffusers", "StableDiffusionSafetyChecker"]),
                              platform=cpu, quiet=True)
    assert "safety_checker" in model.unused_components
    assert "not loaded: safety_checker" in model.provenance()
    with pytest.raises(ValueError, match="guidance_scale_2=2.0 is for two-expert"):
        flowseam.load(checkpoints.base("wan-t2v"), platform=cpu, quiet=True).generate(
            "x", params=DiffusionParams(guidance_scale_2=2.0, num_steps=1, height=16, width=16,
                                        num_frames=5, max_sequence_length=16))


def test_i2v_text_length_follows_the_transformer(checkpoints, cpu):
    """The 512-token split applies only where the transformer has image cross-attention
    projections (added_kv_proj_dim): diffusers' I2V dummy (image_dim 4, no projections) serves
    16 tokens; flowseam's tiny Wan2.1 I2V (with projections) refuses anything but 512."""
    from flowseam.testing.tiny import write_tiny_checkpoint

    base = checkpoints.base("wan-i2v")
    model = flowseam.load(base, platform=cpu, quiet=True)
    assert model.dit.config.image_dim == 4 and model.dit.config.added_kv_proj_dim is None
    params = DiffusionParams(num_steps=1, height=16, width=16, num_frames=5, max_sequence_length=16)
    assert model.generate("x", image=_image(), params=params).frames.shape == (1, 5, 16, 16, 3)
    tiny = flowseam.load(write_tiny_checkpoint("wan2.1-i2v", checkpoints.root / "tiny-i2v"),
                         platform=cpu, quiet=True)
    with pytest.raises(ValueError, match="max_sequence_length=16 must be 512.*added_kv_proj_dim"):
        tiny.generate("x", image=_image(), params=params.replace(height=32, width=32))
