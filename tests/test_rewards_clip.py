"""The CLIP-family rewards (``clip_score``, ``pickscore``, ``aesthetic``) on tiny random CLIP
models written in transformers' published layout, each score checked against an independent
float64 computation of its published formula: the CLIP towers run by transformers in float64,
then the projection, normalisation, cosine, scale and the aesthetic MLP in numpy from the weights
read back from the files."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from flowseam.errors import InvalidInputError

transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file as load_numpy  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import CLIPConfig, CLIPModel, CLIPTokenizer  # noqa: E402

from flowseam.rewards.clip import AestheticScore, ClipScore, PickScore  # noqa: E402

try:
    from transformers import CLIPImageProcessorPil as ImageProcessor
except ImportError:
    from transformers import CLIPImageProcessor as ImageProcessor

MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])
LOGIT_SCALE = 3.2  # not CLIPConfig's initial value: the scorer must read the checkpoint's
PROJ = 16


def _write_tokenizer(d) -> CLIPTokenizer:
    """A byte-level CLIP BPE vocabulary (every byte, alone and word-final) with two merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate([*chars, *(c + "</w>" for c in chars), "at</w>",
                                         "cat</w>", "<|startoftext|>", "<|endoftext|>"])}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\na t</w>\nc at</w>\n")
    return CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))


def _processor(d) -> CLIPTokenizer:
    tok = _write_tokenizer(d)
    tok.save_pretrained(str(d))
    ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}) \
        .save_pretrained(str(d))
    return tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{"clip": model + processor, "model_only": model, "processor": processor, "head_pth",
    "head_st": the aesthetic MLP's weights}, each in the published layout."""
    root = tmp_path_factory.mktemp("clip")
    proc = root / "processor"
    proc.mkdir()
    tok = _processor(proc)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=PROJ)
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    with torch.no_grad():
        model.logit_scale.fill_(LOGIT_SCALE)
    out = {"processor": proc}
    for name in ("clip", "model_only"):
        (root / name).mkdir()
        model.save_pretrained(str(root / name))
        out[name] = root / name
    _processor(out["clip"])
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((out["clip"] / "config.json").read_text())
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    _processor(bin_dir)
    out["bin"] = bin_dir
    g = torch.Generator().manual_seed(1)
    dims = [PROJ, 1024, 128, 64, 16, 1]
    head = {}
    for i, idx in enumerate((0, 2, 4, 6, 7)):
        bound = 1 / math.sqrt(dims[i])
        head[f"layers.{idx}.weight"] = (torch.rand(dims[i + 1], dims[i], generator=g) * 2 - 1) \
            * bound * 3
        head[f"layers.{idx}.bias"] = (torch.rand(dims[i + 1], generator=g) * 2 - 1) * bound
    torch.save(head, root / "head.pth")
    save_file(head, str(root / "head.safetensors"))
    out["head_pth"], out["head_st"] = root / "head.pth", root / "head.safetensors"
    return out


# -- the independent computation ------------------------------------------------------------------
class Oracle:
    """CLIP embeddings in float64: the towers by transformers (float64), pixels, projections,
    normalisation and scores in numpy from the weights read back from model.safetensors."""

    def __init__(self, d):
        self.w = {k: v.astype(np.float64) for k, v in
                  load_numpy(str(d["clip"] / "model.safetensors")).items()}
        self.model = CLIPModel.from_pretrained(str(d["clip"])).double().eval()
        self.tok = CLIPTokenizer.from_pretrained(str(d["processor"]))
        self.processor = ImageProcessor.from_pretrained(str(d["processor"]))

    def image(self, frames01: np.ndarray, resize: bool = False) -> np.ndarray:
        """(N, D) normalised embeddings of (N, H, W, 3) frames in [0, 1]."""
        u8 = np.round(np.clip(frames01, 0, 1) * 255).astype(np.uint8)
        if resize:  # the image processor's own resize and crop
            pixels = self.processor(images=list(u8), return_tensors="pt")["pixel_values"].double()
        else:  # 32x32 frames: resize and crop are the identity; rescale and CLIP mean/std here
            assert u8.shape[1:3] == (32, 32)
            pixels = torch.from_numpy(((u8 / 255.0 - MEAN) / STD).transpose(0, 3, 1, 2))
        with torch.no_grad():
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output.numpy()
        e = pooled @ self.w["visual_projection.weight"].T
        return e / np.linalg.norm(e, axis=-1, keepdims=True)

    def text(self, prompts) -> np.ndarray:
        rows = []
        for p in prompts:
            ids = self.tok(p, truncation=True, max_length=16, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                rows.append(self.model.text_model(input_ids=ids).pooler_output.numpy()[0])
        e = np.stack(rows) @ self.w["text_projection.weight"].T
        return e / np.linalg.norm(e, axis=-1, keepdims=True)

    def cos(self, prompts, frames01, resize=False) -> np.ndarray:
        return (self.image(frames01, resize) * self.text(prompts)).sum(-1)

    def aesthetic(self, frames01, head, resize=False) -> np.ndarray:
        x = self.image(frames01, resize)
        for idx in (0, 2, 4, 6, 7):  # the published head: Linear layers, no activation
            x = x @ head[f"layers.{idx}.weight"].astype(np.float64).T + \
                head[f"layers.{idx}.bias"].astype(np.float64)
        return x[:, 0]


@pytest.fixture(scope="module")
def oracle(dirs):
    return Oracle(dirs)


PROMPTS = ["a cat", "a red sign that says \"42\"", "a dog on the mat", "a cat",
           "an extremely long prompt that runs far past the sixteen tokens of the tiny model"]


def _images(n, seed=0, hw=(32, 32)):
    return np.random.default_rng(seed).random((n, 1, *hw, 3))


# -- the scores ---------------------------------------------------------------------------------
def test_clip_score_is_100_times_the_clamped_cosine(dirs, oracle):
    """CLIPScore = 100 * max(cos, 0) per image (torchmetrics' definition), batched across a
    batch boundary, the long prompt truncated to the model's max length."""
    x = _images(5)
    cos = oracle.cos(PROMPTS, x[:, 0])
    assert (cos < 0).any() and (cos > 0).any(), "the data must exercise the clamp"
    reward = ClipScore(model=str(dirs["clip"]), device="cpu", batch_size=2)
    got = reward(PROMPTS, x)
    assert got.dtype == torch.float32 and got.shape == (5,)
    np.testing.assert_allclose(got.numpy(), 100 * np.maximum(cos, 0), rtol=1e-4, atol=1e-3)
    hessel = ClipScore(model=dirs["clip"], device="cpu", scale=2.5)(PROMPTS, x)
    np.testing.assert_allclose(hessel.numpy(), 2.5 * np.maximum(cos, 0), rtol=1e-4, atol=1e-5)


def test_the_prompt_changes_the_clip_score(dirs, oracle):
    x = np.repeat(_images(1, seed=3), 4, axis=0)
    prompts = ["a cat", "a dog", "zebra crossing", "0123"]
    got = ClipScore(model=dirs["clip"], device="cpu", scale=1.0)
    scores = got(prompts, x).numpy()
    raw = oracle.cos(prompts, x[:, 0])
    np.testing.assert_allclose(scores, np.maximum(raw, 0), rtol=1e-4, atol=1e-5)
    assert len(set(np.round(raw, 6))) == 4 and np.ptp(scores) > 1e-3


def test_pickscore_is_logit_scale_exp_times_the_cosine(dirs, oracle):
    """PickScore = logit_scale.exp() * cos, unclamped, the checkpoint's logit_scale; the
    processor in its own directory (PickScore_v1's layout); scale=1/26 is Flow-GRPO's."""
    x = _images(5, seed=1)
    cos = oracle.cos(PROMPTS, x[:, 0])
    assert oracle.w["logit_scale"] == pytest.approx(LOGIT_SCALE)
    expected = math.exp(LOGIT_SCALE) * cos
    reward = PickScore(model=dirs["model_only"], processor=dirs["processor"], device="cpu")
    np.testing.assert_allclose(reward(PROMPTS, x).numpy(), expected, rtol=1e-4, atol=1e-3)
    flow_grpo = PickScore(model=dirs["clip"], device="cpu", scale=1 / 26)(PROMPTS, x)
    np.testing.assert_allclose(flow_grpo.numpy(), expected / 26, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head", ["head_pth", "head_st"])
def test_aesthetic_is_the_laion_mlp_on_the_normalised_image_embedding(dirs, oracle, head):
    weights = load_numpy(str(dirs["head_st"]))
    x = _images(4, seed=2)
    expected = oracle.aesthetic(x[:, 0], weights)
    reward = AestheticScore(model=dirs["model_only"], head=dirs[head], processor=dirs["processor"],
                            device="cpu", batch_size=3)
    got = reward(["ignored"] * 4, x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.ptp(got) > 1e-3, "different images score differently"


def test_a_video_scores_the_mean_over_evenly_sampled_frames(dirs, oracle):
    """F = 5 frames, frames=3: frames 0, 2 and 4, each scored as an image, averaged; frames
    that are not 32x32 go through the processor's resize and crop."""
    video = np.random.default_rng(4).random((2, 5, 36, 44, 3))
    prompts = ["a cat", "a dog"]
    per_frame = np.stack([oracle.cos(prompts, video[:, f], resize=True) for f in (0, 2, 4)], 1)
    got = ClipScore(model=dirs["clip"], device="cpu", frames=3)(prompts, video).numpy()
    np.testing.assert_allclose(got, (100 * np.maximum(per_frame, 0)).mean(1), rtol=1e-4,
                               atol=1e-3)
    weights = load_numpy(str(dirs["head_st"]))
    per_frame = np.stack([oracle.aesthetic(video[:, f], weights, resize=True) for f in range(5)])
    got = AestheticScore(model=dirs["clip"], head=dirs["head_st"], device="cpu",
                         frames=8)(prompts, video).numpy()
    np.testing.assert_allclose(got, per_frame.mean(0), rtol=1e-4, atol=1e-5)


def test_a_pickle_checkpoint_loads_only_through_weights_only(dirs, oracle, monkeypatch):
    """A directory with only pytorch_model.bin is read by torch's weights_only unpickler (every
    torch.load call transformers makes has weights_only=True) and scores the same."""
    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    x = _images(2, seed=5)
    got = PickScore(model=dirs["bin"], device="cpu")(PROMPTS[:2], x).numpy()
    assert calls and all(w is True for w in calls), calls
    np.testing.assert_allclose(got, math.exp(LOGIT_SCALE) * oracle.cos(PROMPTS[:2], x[:, 0]),
                               rtol=1e-4, atol=1e-3)


def test_non_finite_pixels_score_nan_and_the_rest_score(dirs, oracle):
    x = _images(3, seed=6)
    x[1, 0, 3, 3, 0] = np.nan
    got = ClipScore(model=dirs["clip"], device="cpu", scale=1.0)(PROMPTS[:3], x).numpy()
    assert np.isnan(got[1]) and np.isfinite(got[[0, 2]]).all()
    keep = [0, 2]
    np.testing.assert_allclose(got[keep], np.maximum(oracle.cos([PROMPTS[i] for i in keep],
                                                                x[keep, 0]), 0),
                               rtol=1e-4, atol=1e-5)


def test_bfloat16_runs_and_stays_close(dirs, oracle):
    x = _images(2, seed=7)
    got = ClipScore(model=dirs["clip"], device="cpu", dtype="bfloat16")(PROMPTS[:2], x).numpy()
    np.testing.assert_allclose(got, 100 * np.maximum(oracle.cos(PROMPTS[:2], x[:, 0]), 0),
                               atol=5.0)


def test_through_get_reward(dirs, oracle):
    """The ``clip_score`` the rewards plugin registers, built with reward_args, through the
    method's own score check."""
    from flowseam.training import get_reward
    from flowseam.rewards.spec import score

    reward = get_reward("clip_score", model=str(dirs["clip"]), device="cpu")
    assert isinstance(reward, ClipScore)
    x = _images(2, seed=8)
    np.testing.assert_allclose(score(reward, PROMPTS[:2], x).numpy(),
                               100 * np.maximum(oracle.cos(PROMPTS[:2], x[:, 0]), 0),
                               rtol=1e-4, atol=1e-3)
    assert isinstance(get_reward("pickscore", model=dirs["clip"], device="cpu"), PickScore)
    assert isinstance(get_reward("aesthetic", model=dirs["clip"], head=dirs["head_st"],
                                 device="cpu"), AestheticScore)


# -- refused before anything loads --------------------------------------------------------------
@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model, tokenizer or image processor load fails the test."""
    def fail(*args, **kwargs):
        raise AssertionError("a model loaded before the arguments were checked")

    for cls in (CLIPModel, CLIPTokenizer, ImageProcessor):
        monkeypatch.setattr(cls, "from_pretrained", fail)


def _only(tmp_path, src, *names):
    d = tmp_path / "partial"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_bytes((src / n).read_bytes())
    return d


def test_missing_directories_and_files_are_refused_before_loading(dirs, tmp_path, nothing_loads):
    missing = tmp_path / "nowhere"
    with pytest.raises(InvalidInputError, match="nowhere.*does not exist"):
        ClipScore(model=str(missing))
    d = _only(tmp_path, dirs["clip"], "config.json", "preprocessor_config.json", "vocab.json",
              "merges.txt")
    with pytest.raises(InvalidInputError, match=r"partial.*lacks model\.safetensors"):
        ClipScore(model=d)
    (d / "model.safetensors").write_bytes((dirs["clip"] / "model.safetensors").read_bytes())
    (d / "config.json").unlink()
    with pytest.raises(InvalidInputError, match=r"lacks config\.json"):
        PickScore(model=d)
    with pytest.raises(InvalidInputError, match=r"lacks preprocessor_config\.json or processor_"
                                                r"config\.json; tokenizer\.json or vocab\.json"
                                                r".*pass processor="):
        PickScore(model=dirs["model_only"])
    with pytest.raises(InvalidInputError, match=r"lacks preprocessor_config\.json"):
        AestheticScore(model=dirs["model_only"], head=dirs["head_st"])
    with pytest.raises(InvalidInputError, match="processor directory.*does not exist"):
        PickScore(model=dirs["model_only"], processor=missing)
    bad = tmp_path / "siglip"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidInputError, match="model_type='siglip'; expected 'clip'"):
        ClipScore(model=bad, processor=dirs["processor"])


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size=0"), ({"frames": 0}, "frames=0"),
    ({"frames": 2.5}, "frames=2.5"), ({"dtype": "int8"}, "dtype='int8'"),
    ({"device": "nowhere"}, "device='nowhere'"), ({"scale": float("nan")}, "scale=nan"),
    ({"scale": -1}, "scale=-1"), ({"model": None}, "model=None")])
def test_bad_arguments_are_refused_before_loading(dirs, nothing_loads, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        ClipScore(**{"model": dirs["clip"], **kwargs})


def test_a_bad_aesthetic_head_is_refused_naming_what_differs(dirs, tmp_path, nothing_loads):
    head = load_numpy(str(dirs["head_st"]))
    wrong = {**head, "layers.2.weight": np.zeros((128, 1000), np.float32)}
    del wrong["layers.7.bias"]
    save_file({k: torch.from_numpy(v) for k, v in wrong.items()}, str(tmp_path / "w.safetensors"))
    with pytest.raises(InvalidInputError, match=r"missing \['layers.7.bias'\].*layers.2.weight "
                                                r"\(128, 1000\) \(expected \(128, 1024\)\)"):
        AestheticScore(model=dirs["clip"], head=tmp_path / "w.safetensors")
    with pytest.raises(InvalidInputError, match=r"layers.0.weight \(1024, 16\) \(expected "
                                                r"\(1024, 768\)\)"):
        from flowseam.rewards.clip import load_aesthetic_head
        load_aesthetic_head(dirs["head_st"], 768)
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pth")  # a pickled module, not a dict
    with pytest.raises(InvalidInputError, match=r"module\.pth.*weights_only"):
        AestheticScore(model=dirs["clip"], head=tmp_path / "module.pth")
    with pytest.raises(InvalidInputError, match="head file.*does not exist"):
        AestheticScore(model=dirs["clip"], head=tmp_path / "none.pth")


def test_bad_outputs_are_refused(dirs):
    reward = ClipScore(model=dirs["clip"], device="cpu")
    with pytest.raises(InvalidInputError, match=r"shape \(2, 1, 32, 32\)"):
        reward(["a", "b"], np.zeros((2, 1, 32, 32)))
    with pytest.raises(InvalidInputError, match="1 prompts for 2 outputs"):
        reward(["a"], np.zeros((2, 1, 32, 32, 3)))
    with pytest.raises(InvalidInputError, match="dtype int64"):
        reward(["a", "b"], np.zeros((2, 1, 32, 32, 3), dtype=np.int64))
    x = _images(2, seed=9)
    u8 = np.round(x * 255).astype(np.uint8)  # taken as already quantised
    np.testing.assert_array_equal(reward(["a", "b"], u8).numpy(), reward(["a", "b"], x).numpy())


def test_importing_the_module_loads_neither_torch_nor_transformers():
    code = ("import sys, flowseam.rewards.clip, flowseam.rewards.plugin; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
