"""CLIP-family scorers: ``clip_score``, ``pickscore`` and ``aesthetic``.

Each loads a CLIP model with transformers' ``CLIPModel`` from a local directory in the model's
published layout (nothing is downloaded; the directory is checked before anything loads, and
nothing is unpickled), and scores each image as its published code does, the source named in its
class: CLIPScore (:class:`ClipScore`), PickScore (:class:`PickScore`) or the LAION aesthetic
predictor (:class:`AestheticScore`); a video scores the mean over its sampled frames. Frames are
quantised to 8 bits and preprocessed by the directory's own CLIP image processor, as the
published scorers ran. The module imports neither torch nor transformers: they load when a
scorer is built. The files each needs, the formulas and the arguments: docs/rewards.md
("CLIP-family scorers").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import InvalidInputError

#: weight files CLIPModel.from_pretrained reads, in the order it prefers them
_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLE = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_IMAGE_CONFIGS = ("preprocessor_config.json", "processor_config.json")
_DTYPES = ("float32", "float16", "bfloat16")
#: the LAION aesthetic MLP: (state dict key prefix, out features); in features chain from the
#: CLIP projection dim (768 for ViT-L/14). Indices 1, 3, 5 are its Dropout layers.
_AESTHETIC_LAYERS = (("layers.0", 1024), ("layers.2", 128), ("layers.4", 64), ("layers.6", 16),
                     ("layers.7", 1))


def _check_int(reward: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidInputError(f"{reward} reward: {name}={value!r} is not allowed; expected an "
                                f"integer >= {low}")
    return int(value)


def _check_scale(reward: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"{reward} reward: scale={value!r} is not allowed; expected a "
                                "finite number > 0")
    return float(value)


def _check_device(reward: str, device):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError(f"{reward} reward: device={device!r} is not a torch device "
                                "(expected e.g. 'cpu', 'cuda', 'cuda:1')") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"{reward} reward: device={device!r}, and CUDA is not available "
                                "here (use 'cpu')")
    return dev


def _check_dtype(reward: str, dtype):
    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidInputError(f"{reward} reward: dtype={dtype!r} is not allowed; expected one "
                                f"of {', '.join(_DTYPES)}")
    return getattr(torch, name)


def _check_dir(reward: str, what: str, path) -> Path:
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidInputError(f"{reward} reward: {what}={path!r} is not allowed; expected the "
                                "path of a local directory in the model's published layout")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InvalidInputError(
            f"{reward} reward: {what} directory {str(p)!r} does not exist (or is not a "
            "directory); expected a local directory in the model's published layout, as "
            "transformers' CLIPModel.from_pretrained reads it (no download is attempted)")
    return p


def check_model_dir(reward: str, path) -> tuple[Path, dict, bool]:
    """Check a CLIP model directory without loading it.

    :returns: (the directory, its parsed ``config.json``, whether its weights are safetensors).
    :raises InvalidInputError: naming the directory and the missing files when it is absent, has
        no ``config.json``, a config that is not a CLIP config, or no weight file
        (``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin`` or
        ``pytorch_model.bin.index.json``).
    """
    p = _check_dir(reward, "model", path)
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    weights = [f for f in (*_SAFETENSORS, *_PICKLE) if (p / f).is_file()]
    if not weights:
        missing.append(" or ".join(_SAFETENSORS + _PICKLE))
    if missing:
        raise InvalidInputError(
            f"{reward} reward: model directory {str(p)!r} lacks {'; '.join(missing)}; expected "
            "a CLIP model in transformers' published layout: config.json and model.safetensors "
            "(as CLIPModel.save_pretrained writes them)")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{reward} reward: {str(p / 'config.json')!r} is not readable "
                                f"JSON ({e})") from e
    if not isinstance(config, dict) or config.get("model_type") != "clip":
        got = config.get("model_type") if isinstance(config, dict) else config
        raise InvalidInputError(
            f"{reward} reward: {str(p / 'config.json')!r} has model_type={got!r}; expected "
            "'clip' (a transformers CLIPModel checkpoint)")
    return p, config, weights[0] in _SAFETENSORS


def check_processor_dir(reward: str, path, tokenizer: bool = True) -> Path:
    """Check a CLIP processor directory (image processor, and the tokenizer when ``tokenizer``).

    :raises InvalidInputError: naming the directory and the missing files.
    """
    p = _check_dir(reward, "processor", path)
    missing = []
    if not any((p / f).is_file() for f in _IMAGE_CONFIGS):
        missing.append(" or ".join(_IMAGE_CONFIGS))
    if tokenizer and not (p / "tokenizer.json").is_file() and \
            not ((p / "vocab.json").is_file() and (p / "merges.txt").is_file()):
        missing.append("tokenizer.json or vocab.json with merges.txt")
    if missing:
        raise InvalidInputError(
            f"{reward} reward: processor directory {str(p)!r} lacks {'; '.join(missing)}; "
            "expected a CLIP processor in transformers' published layout (as "
            "CLIPProcessor.save_pretrained writes it); PickScore_v1 ships none: pass "
            "processor= the directory of laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    return p


def frame_indices(num_frames: int, frames: int) -> np.ndarray:
    """Which of ``num_frames`` frames a video is scored on: ``frames`` of them evenly spaced from
    first to last (``np.linspace(0, F - 1, frames)`` rounded), or all of them when it has
    ``frames`` or fewer (the convention of the ``ocr`` reward)."""
    if num_frames <= frames:
        return np.arange(num_frames)
    return np.round(np.linspace(0, num_frames - 1, frames)).astype(np.int64)


def _features(out):
    """The projected embedding ``get_*_features`` returns: a tensor (transformers 4), or the
    ``pooler_output`` of the output it returns (transformers 5)."""
    import torch

    return out if isinstance(out, torch.Tensor) else out.pooler_output


class _ClipScorer:
    """What the CLIP scorers share: argument checks, loading, batching and video averaging."""

    name = "clip"
    needs_text = True

    def __init__(self, model, processor=None, device=None, dtype="float32", batch_size: int = 16,
                 frames: int = 4) -> None:
        r = self.name
        self.batch_size = _check_int(r, "batch_size", batch_size, 1)
        self.frames = _check_int(r, "frames", frames, 1)
        self.dtype = _check_dtype(r, dtype)
        self.device = _check_device(r, device)
        self.model_dir, self.config, safetensors = check_model_dir(r, model)
        self.processor_dir = check_processor_dir(
            r, self.model_dir if processor is None else processor, tokenizer=self.needs_text)
        self._check_extra()
        self._load(safetensors)

    def _check_extra(self) -> None:
        """Subclasses check their own files here, before anything loads."""

    def _load(self, safetensors: bool) -> None:
        import torch
        from transformers import CLIPModel, CLIPTokenizer
        try:  # transformers >= 5: the PIL backend by name (the default needs torchvision)
            from transformers import CLIPImageProcessorPil as ImageProcessor
        except ImportError:  # before 5, CLIPImageProcessor is the PIL implementation
            from transformers import CLIPImageProcessor as ImageProcessor

        # safetensors when the directory has them; a pickle checkpoint only through torch's
        # weights_only unpickler (tensors and plain containers, no code runs)
        load = {"use_safetensors": True} if safetensors else \
            {"use_safetensors": False, "weights_only": True}
        clip = CLIPModel.from_pretrained(str(self.model_dir), **load)
        self.model = clip.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.image_processor = ImageProcessor.from_pretrained(str(self.processor_dir))
        self.tokenizer = CLIPTokenizer.from_pretrained(str(self.processor_dir)) \
            if self.needs_text else None
        self.max_length = int(self.model.config.text_config.max_position_embeddings)
        self._torch = torch

    # -- embeddings ------------------------------------------------------------------------------
    def image_embeddings(self, images: np.ndarray):
        """L2-normalised CLIP image embeddings. The images are preprocessed by the directory's
        CLIP image processor on its PIL backend (bicubic resize of the shortest edge, centre
        crop, CLIP's mean and std), the backend the published scorers ran.

        :param images: ``(N, H, W, 3)`` uint8 RGB.
        :returns: ``torch.Tensor (N, D)`` float32 on the scorer's device (D: the projection dim).
        """
        torch = self._torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                pixels = self.image_processor(images=list(images[i:i + self.batch_size]),
                                              return_tensors="pt")["pixel_values"]
                emb = _features(self.model.get_image_features(
                    pixel_values=pixels.to(device=self.device, dtype=self.dtype))).float()
                out.append(emb / emb.norm(p=2, dim=-1, keepdim=True))
        return torch.cat(out)

    def text_embeddings(self, prompts: Sequence[str]):
        """L2-normalised CLIP text embeddings, prompts truncated to the text model's
        ``max_position_embeddings`` tokens.

        :returns: ``torch.Tensor (len(prompts), D)`` float32 on the scorer's device.
        """
        torch = self._torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                tok = self.tokenizer(list(prompts[i:i + self.batch_size]), padding=True,
                                     truncation=True, max_length=self.max_length,
                                     return_tensors="pt")
                emb = _features(self.model.get_text_features(
                    input_ids=tok["input_ids"].to(self.device),
                    attention_mask=tok["attention_mask"].to(self.device))).float()
                out.append(emb / emb.norm(p=2, dim=-1, keepdim=True))
        return torch.cat(out)

    # -- the reward ------------------------------------------------------------------------------
    def _frame_scores(self, image_emb, text_emb):
        """``(N,)`` scores of ``N`` frames from their embeddings (each ``(N, D)``, normalised;
        ``text_emb`` is None for an image-only scorer)."""
        raise NotImplementedError

    def __call__(self, prompts: Sequence[str], outputs):
        """Score ``outputs`` against ``prompts``.

        :param prompts: ``list[str]`` of length B.
        :param outputs: ``(B, F, H, W, 3)`` (or ``(B, H, W, 3)``, one frame) float RGB in [0, 1],
            values outside clipped, quantised as ``round(x * 255)``; uint8 is taken as is.
        :returns: ``torch.Tensor (B,)`` float32 on the CPU; NaN for a sample with a non-finite
            pixel in its scored frames (the reward contract's "cannot score").
        :raises InvalidInputError: for outputs of another shape or a prompt count that does not
            match, or outputs that are neither float nor uint8.
        """
        torch = self._torch
        x = np.asarray(outputs)
        shape = x.shape
        if x.ndim == 4:
            x = x[:, None]
        if x.ndim != 5 or x.shape[-1] != 3 or 0 in x.shape:
            raise InvalidInputError(f"{self.name} reward: outputs have shape {shape}; expected "
                                    "(B, F, H, W, 3) (or (B, H, W, 3)) RGB")
        if isinstance(prompts, str) or len(prompts) != x.shape[0]:
            raise InvalidInputError(
                f"{self.name} reward: {len(prompts) if not isinstance(prompts, str) else 'a str'}"
                f" prompts for {x.shape[0]} outputs; expected a list of one prompt each")
        if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
            raise InvalidInputError(f"{self.name} reward: outputs have dtype {x.dtype}; expected "
                                    "float in [0, 1] (or uint8)")
        idx = frame_indices(x.shape[1], self.frames)
        x = x[:, idx]  # (B, n, H, W, 3)
        finite = np.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
        scores = np.full(x.shape[0], np.nan, dtype=np.float64)
        if finite.any():
            keep = np.flatnonzero(finite)
            n = len(idx)
            frames = x[keep] if x.dtype == np.uint8 else \
                np.round(np.clip(x[keep].astype(np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)
            image_emb = self.image_embeddings(frames.reshape(-1, *frames.shape[2:]))
            text_emb = None
            if self.needs_text:
                unique = sorted({prompts[b] for b in keep})  # a GRPO group shares its prompt
                emb = self.text_embeddings(unique)
                row = {p: i for i, p in enumerate(unique)}
                text_emb = emb[torch.tensor([row[prompts[b]] for b in keep for _ in range(n)],
                                            device=emb.device)]
            per_frame = self._frame_scores(image_emb, text_emb).double().cpu().numpy()
            scores[keep] = per_frame.reshape(len(keep), n).mean(axis=1)
        return torch.from_numpy(scores.astype(np.float32))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={str(self.model_dir)!r}, "
                f"processor={str(self.processor_dir)!r}, device={str(self.device)!r}, "
                f"dtype={str(self.dtype).removeprefix('torch.')!r}, "
                f"batch_size={self.batch_size}, frames={self.frames})")


class ClipScore(_ClipScorer):
    """``clip_score``: CLIPScore, ``scale * max(cos(E_I, E_C), 0)`` per frame (torchmetrics'
    definition with ``scale = 100``; Hessel et al. 2021 use ``w = 2.5``), the mean over a video's
    sampled frames. Range [0, scale].

    :param model: a CLIP model directory in transformers' published layout (e.g. the files of
        ``openai/clip-vit-large-patch14``, torchmetrics' default).
    :param processor: the directory of its processor (image processor and tokenizer); None: the
        model directory.
    :param device: a torch device; None: ``cuda`` when available, else ``cpu``.
    :param dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``: the model's weights and inputs
        (the cosine is computed in float32).
    :param batch_size: frames (and prompts) per forward pass, >= 1.
    :param frames: frames scored per video, sampled evenly from first to last, >= 1.
    :param scale: the multiplier ``w`` of the clamped cosine, a finite number > 0.
    :raises InvalidInputError: for an argument outside those values, or a directory that is
        missing or lacks files (naming them), before any model loads.
    """

    name = "clip_score"

    def __init__(self, model, processor=None, device=None, dtype="float32", batch_size: int = 16,
                 frames: int = 4, scale: float = 100.0) -> None:
        self.scale = _check_scale(self.name, scale)
        super().__init__(model, processor, device, dtype, batch_size, frames)

    def _frame_scores(self, image_emb, text_emb):
        return self.scale * (image_emb * text_emb).sum(dim=-1).clamp(min=0.0)


class PickScore(_ClipScorer):
    """``pickscore``: PickScore, ``scale * logit_scale.exp() * cos(E_I, E_C)`` per frame
    (Kirstain et al. 2023; the inference snippet of github.com/yuvalkirstain/PickScore), the
    mean over a video's sampled frames. ``logit_scale`` is the checkpoint's own parameter.
    Flow-GRPO's pickscore reward divides by 26 to bring PickScore_v1's scores near [0, 1]:
    ``scale = 1/26`` (``0.038461538461538464``) reproduces it.

    :param model: the PickScore model directory (the files of ``yuvalkirstain/PickScore_v1``).
    :param processor: the directory of its processor, image processor and tokenizer (the files of
        ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` for PickScore_v1); None: the model directory.
    :param device: a torch device; None: ``cuda`` when available, else ``cpu``.
    :param dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    :param batch_size: frames (and prompts) per forward pass, >= 1.
    :param frames: frames scored per video, sampled evenly from first to last, >= 1.
    :param scale: a multiplier of the score, a finite number > 0.
    :raises InvalidInputError: for an argument outside those values, or a directory that is
        missing or lacks files (naming them), before any model loads.
    """

    name = "pickscore"

    def __init__(self, model, processor=None, device=None, dtype="float32", batch_size: int = 16,
                 frames: int = 4, scale: float = 1.0) -> None:
        self.scale = _check_scale(self.name, scale)
        super().__init__(model, processor, device, dtype, batch_size, frames)

    def _frame_scores(self, image_emb, text_emb):
        logit_scale = self.model.logit_scale.detach().float().exp()
        return self.scale * logit_scale * (image_emb * text_emb).sum(dim=-1)


def aesthetic_mlp(embed_dim: int = 768):
    """The LAION aesthetic predictor's MLP as ``simple_inference.py`` defines it: ``layers`` =
    Linear(embed_dim, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
    Dropout(0.1), Linear(64, 16), Linear(16, 1), with no activations (the published
    ``linearMSE`` head). ``(N, embed_dim)`` float32 -> ``(N, 1)``; dropout is off in ``eval()``.
    """
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(embed_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16),
                nn.Linear(16, 1))

        def forward(self, embed):
            return self.layers(embed)

    return MLP()


def load_aesthetic_head(path, embed_dim: int = 768) -> dict:
    """Read and check the LAION aesthetic MLP's weights.

    :param path: ``sac+logos+ava1-l14-linearMSE.pth`` (a state dict of tensors, read with
        ``torch.load(weights_only=True)``) or a ``.safetensors`` file with the same keys.
    :param embed_dim: the CLIP projection dim the head reads (768 for ViT-L/14).
    :returns: ``{key: torch.Tensor}``, keys ``layers.{0,2,4,6,7}.{weight,bias}``.
    :raises InvalidInputError: for a missing file, one ``weights_only`` cannot read (a pickle of
        anything but tensors), or keys/shapes other than the architecture's (naming them).
    """
    import torch

    reward = AestheticScore.name
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidInputError(f"{reward} reward: head={path!r} is not allowed; expected the "
                                "path of the aesthetic MLP's weights (.pth or .safetensors)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInputError(
            f"{reward} reward: head file {str(p)!r} does not exist; expected the LAION aesthetic "
            "MLP's weights, e.g. sac+logos+ava1-l14-linearMSE.pth (a state dict) or a "
            ".safetensors file with its keys")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise InvalidInputError(
            f"{reward} reward: head file {str(p)!r} cannot be read as a state dict of tensors "
            f"(torch.load(weights_only=True) or safetensors; nothing is unpickled): {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InvalidInputError(f"{reward} reward: head file {str(p)!r} holds "
                                f"{type(state).__name__}, not a state dict of tensors")
    expected, fan_in = {}, int(embed_dim)
    for prefix, fan_out in _AESTHETIC_LAYERS:
        expected[f"{prefix}.weight"] = (fan_out, fan_in)
        expected[f"{prefix}.bias"] = (fan_out,)
        fan_in = fan_out
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(f"{k} {got[k]} (expected {expected[k]})" for k in set(got) & set(expected)
                       if got[k] != expected[k])
        raise InvalidInputError(
            f"{reward} reward: head file {str(p)!r} does not match the LAION aesthetic MLP "
            f"({embed_dim} -> 1024 -> 128 -> 64 -> 16 -> 1 on the CLIP embedding): "
            + "; ".join(s for s in (f"missing {missing}" if missing else "",
                                    f"unexpected {extra}" if extra else "",
                                    f"wrong shape {wrong}" if wrong else "") if s))
    return {k: v.float() for k, v in state.items()}


class AestheticScore(_ClipScorer):
    """``aesthetic``: the LAION aesthetic predictor, its linear MLP (768 → 1024 → 128 → 64 → 16 →
    1, dropout off) on the L2-normalised CLIP ViT-L/14 image embedding, per frame; the mean over a
    video's sampled frames, on the AVA rating scale (1-10). The prompt is not used. Source:
    github.com/christophschuhmann/improved-aesthetic-predictor (``simple_inference.py``), run as
    Flow-GRPO's ``AestheticScorer`` runs it, with transformers' ``CLIPModel`` and
    ``CLIPProcessor``.

    :param model: the CLIP ViT-L/14 directory (the files of ``openai/clip-vit-large-patch14``).
    :param head: the MLP's weights, ``sac+logos+ava1-l14-linearMSE.pth`` (read with
        ``torch.load(weights_only=True)``) or a ``.safetensors`` file with its keys.
    :param processor: the directory of the image processor; None: the model directory (no
        tokenizer is needed).
    :param device: a torch device; None: ``cuda`` when available, else ``cpu``.
    :param dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``: the CLIP model's (the MLP runs
        in float32).
    :param batch_size: frames per forward pass, >= 1.
    :param frames: frames scored per video, sampled evenly from first to last, >= 1.
    :raises InvalidInputError: for an argument outside those values, a directory that is missing
        or lacks files, or a head whose keys or shapes are not the MLP's (naming them), before
        the CLIP model loads.
    """

    name = "aesthetic"
    needs_text = False

    def __init__(self, model, head, processor=None, device=None, dtype="float32",
                 batch_size: int = 16, frames: int = 4) -> None:
        self.head_path = head
        super().__init__(model, processor, device, dtype, batch_size, frames)

    def _check_extra(self) -> None:
        embed_dim = int(self.config.get("projection_dim", 512))  # CLIPConfig's default
        self.head = load_aesthetic_head(self.head_path, embed_dim)
        self.head_path = Path(self.head_path).expanduser()

    def _load(self, safetensors: bool) -> None:
        super()._load(safetensors)
        mlp = aesthetic_mlp(int(self.head["layers.0.weight"].shape[1]))
        mlp.load_state_dict(self.head, strict=True)
        self.mlp = mlp.to(self.device).eval().requires_grad_(False)

    def _frame_scores(self, image_emb, text_emb):
        with self._torch.inference_mode():
            return self.mlp(image_emb.float())[:, 0]

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", head={str(self.head_path)!r})"
