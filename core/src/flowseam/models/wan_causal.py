"""Causal Wan2.1 text-to-video (Self-Forcing / CausVid weights), run chunk by chunk with a KV
cache by the ``wan_causal`` loop (:mod:`flowseam.loops.causal`).

The DiT is diffusers' own ``WanTransformer3DModel``: Self-Forcing and CausVid fine-tune Wan2.1
weights without changing the architecture, only the attention pattern (block-causal over chunks
of latent frames: :mod:`flowseam.causal_attention`, the ``cached_attention`` op) and the sampler
(a few steps that predict x0 and re-noise it: the ``flow_match_step`` and ``flow_renoise`` ops).
diffusers' ``AnyFlowFARTransformer3DModel`` was the other candidate; it is a different network
(a dual-timestep flow-map embedding, FAR's compressed far-chunk tokens, no re-noising), so it
cannot load these weights. This card is selected by a ``"_flowseam_causal"`` entry (the
Self-Forcing settings) in a ``WanPipeline`` folder's ``model_index.json`` (docs/streaming.md);
:func:`convert_self_forcing_checkpoint` writes such a folder from a single-file checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..causal_attention import (
    KVCache,
    Window,
    block_causal_mask,
    causal_state,
    route_causal_attention,
)
from ..errors import InvalidInputError
from ..request import DiffusionParams, GenerationRequest, TaskType
from .card import ModelCard
from .instance import postprocess
from .split import SplitSupport
from .wan import _WAN_COMMON, WanT2V

#: ``_flowseam_causal`` keys flowseam implements, and their defaults (Self-Forcing's
#: ``configs/self_forcing_dmd.yaml``).
CAUSAL_CONFIG_DEFAULTS = dict(num_frame_per_block=3, denoising_step_list=[1000, 750, 500, 250],
                              timestep_shift=5.0, local_attn_size=-1, sink_size=0,
                              warp_denoising_step=True, context_noise=0)


def read_causal_config(index: dict[str, Any], source: str = "model_index.json") -> dict[str, Any]:
    """The checkpoint's ``_flowseam_causal`` settings over :data:`CAUSAL_CONFIG_DEFAULTS`.

    :raises ValueError: for a key flowseam does not implement, or a value it does not support
        (``warp_denoising_step`` false, ``context_noise`` other than 0), naming it.
    """
    given = dict(index.get("_flowseam_causal") or {})
    unknown = sorted(set(given) - set(CAUSAL_CONFIG_DEFAULTS))
    if unknown:
        raise InvalidInputError(
            f"{source}: _flowseam_causal has key(s) {unknown} that flowseam does not "
            f"implement; known: {sorted(CAUSAL_CONFIG_DEFAULTS)}")
    config = {**CAUSAL_CONFIG_DEFAULTS, **given}
    if config["warp_denoising_step"] is not True:
        raise InvalidInputError(
            f"{source}: warp_denoising_step={config['warp_denoising_step']!r} is not "
            "implemented; flowseam warps the step list by the flow shift (Self-Forcing)")
    if config["context_noise"] != 0:
        raise InvalidInputError(
            f"{source}: context_noise={config['context_noise']!r} is not implemented; "
            "the KV cache is written by a pass of the clean chunk at t = 0")
    steps = config["denoising_step_list"]
    if not steps or any(not 0 < t <= 1000 for t in steps) or list(steps) != sorted(steps, reverse=True):
        raise InvalidInputError(
            f"{source}: denoising_step_list={steps!r} must be timesteps in (0, 1000], "
            "decreasing")
    return config


class WanCausalT2V(WanT2V):
    """Causal Wan2.1 text-to-video: the step bodies of the ``wan_causal`` loop.

    Latents ``(B, 16, F, H / 8, W / 8)`` with ``F = (num_frames - 1) // 4 + 1`` latent frames,
    generated in chunks of ``chunk_frames`` latent frames.
    """

    def __init__(self, card: ModelCard, platform, components, path, solver=None,
                 **kwargs) -> None:
        super().__init__(card, platform, components, path, solver, **kwargs)
        self.read_index({})

    @classmethod
    def check_index(cls, index: dict[str, Any], source: str = "model_index.json") -> None:
        read_causal_config(index, source)

    def read_index(self, index: dict[str, Any], source: str = "model_index.json") -> None:
        """Take the checkpoint's ``_flowseam_causal`` settings as this instance's defaults
        (a card default applies only where the checkpoint says nothing).

        :raises ValueError: see :func:`read_causal_config`.
        """
        self.causal_config = cfg = read_causal_config(index, source)
        self.causal_given = set(index.get("_flowseam_causal") or {})
        self.card_defaults = dict(
            self.card.defaults, chunk_frames=cfg["num_frame_per_block"],
            flow_shift=cfg["timestep_shift"],
            local_attn_size=None if cfg["local_attn_size"] == -1 else cfg["local_attn_size"],
            sink_size=cfg["sink_size"], num_steps=len(cfg["denoising_step_list"]))

    def solver_line(self) -> str:
        """The sampler of the ``wan_causal`` loop (the checkpoint's scheduler is not used):
        ``flow_match_step`` to x0 and ``flow_renoise`` per chunk, with the ``_flowseam_causal``
        settings and where each came from."""
        shown = ("denoising_step_list", "timestep_shift", "num_frame_per_block",
                 "local_attn_size", "sink_size")
        parts = [f"{k}={self.causal_config[k]!r} "
                 f"({'checkpoint' if k in self.causal_given else 'card default'})" for k in shown]
        return ("solver flow_match_step + flow_renoise (Self-Forcing few-step, "
                "_flowseam_causal): " + ", ".join(parts))

    def route_attention(self) -> None:
        from .. import ops

        kernels = self.platform.kernels
        route_causal_attention(self.dit, kernels.get(ops.ATTENTION), kernels.get(ops.CACHED_ATTENTION))

    # -- 1. check -------------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> DiffusionParams:
        """Wan's checks, then the causal ones (chunk size, window, frame count), all before any
        model runs.

        :raises ValueError: naming the bad value and what is allowed.
        """
        # the checkpoint's serving defaults (flowseam.json) come before its causal config
        defaults = {**self.card_defaults, **self.serve_defaults}
        request = GenerationRequest(request.prompt, request.task,
                                    request.params.with_defaults(defaults),
                                    request.image, request.seeds)
        params = super().check(request)
        chunk = params.chunk_frames
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise InvalidInputError(
                f"chunk_frames={chunk!r} must be an integer >= 1 (latent frames per "
                "chunk; Self-Forcing's num_frame_per_block)")
        tf = self.vae_temporal_factor
        frames = (params.num_frames - 1) // tf + 1
        if frames % chunk:
            lo = max(chunk, frames // chunk * chunk)
            raise InvalidInputError(
                f"num_frames={params.num_frames} makes {frames} latent frames, not a multiple of "
                f"chunk_frames={chunk}; try num_frames={tf * (lo - 1) + 1} or "
                f"{tf * (lo + chunk - 1) + 1}")
        p_t, p_h, p_w = self.dit.config.patch_size
        limit = int(self.dit.config.rope_max_seq_len)
        for name, size in (("latent frames", frames // p_t),
                           ("height", params.height // self.vae_spatial_factor // p_h),
                           ("width", params.width // self.vae_spatial_factor // p_w)):
            if size > limit:
                raise InvalidInputError(
                    f"{name}: {size} positions exceed the DiT's rope_max_seq_len={limit}; "
                    f"generate a shorter or smaller video")
        sink, window = params.sink_size, params.local_attn_size
        if not isinstance(sink, int) or isinstance(sink, bool) or sink < 0:
            raise InvalidInputError(f"sink_size={sink!r} must be an integer >= 0 (latent frames)")
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < chunk + sink:
                raise InvalidInputError(
                    f"local_attn_size={window!r} must be an integer >= chunk_frames + sink_size = "
                    f"{chunk + sink} (latent frames: the window holds the sink and the chunk "
                    "itself), or None for no window")
        elif sink:
            raise InvalidInputError(
                f"sink_size={sink} needs a rolling window (local_attn_size); without "
                "one every frame is attended anyway")
        return params

    def check_loop_params(self, params: DiffusionParams) -> None:
        """The causal parameters are this card's own (checked in :meth:`check`); a step cache
        is refused (it runs in the flow_match loop)."""
        if params.cache is not None:
            raise InvalidInputError(
                f"cache={params.cache}: step caching runs in the flow_match loop "
                "(Wan T2V/I2V, FLUX.1); the causal loop's few-step sampler is not "
                "cached")

    def window(self, params: DiffusionParams) -> Window:
        return Window(params.local_attn_size, params.sink_size)

    def chunks(self, params: DiffusionParams) -> list[tuple[int, int]]:
        """``[(start frame, frames), ...]`` of the video's latent frames, in order."""
        frames = (params.num_frames - 1) // self.vae_temporal_factor + 1
        n = params.chunk_frames
        return [(s, n) for s in range(0, frames, n)]

    # -- 3. sigmas ------------------------------------------------------------------------------
    def schedule(self, params: DiffusionParams, latents: torch.Tensor) -> tuple[list[float], torch.Tensor]:
        """Self-Forcing's per-chunk schedule: timesteps ``t_i`` (the checkpoint's
        ``denoising_step_list`` when ``num_steps`` matches its length, else ``1000 (1 - i/N)``)
        warped by the flow shift, ``sigma = shift s / (1 + (shift - 1) s)`` with
        ``s = t / 1000`` (Self-Forcing's ``warp_denoising_step``, its scheduler's shift), then
        0. Returns N + 1 sigmas and the N timesteps ``sigma * 1000`` (float32) the DiT is given
        (Self-Forcing rounds them down to integers; flowseam keeps diffusers' float timesteps).
        """
        listed = self.causal_config["denoising_step_list"]
        n = params.num_steps
        steps = listed if n == len(listed) else [1000.0 * (1 - i / n) for i in range(n)]
        shift = params.flow_shift
        sigmas = [shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in steps] + [0.0]
        timesteps = torch.tensor([s * 1000 for s in sigmas[:-1]], dtype=torch.float32)
        return sigmas, timesteps.to(latents.device)

    # -- 4. velocity of one chunk ---------------------------------------------------------------
    def new_cache(self, params: DiffusionParams) -> KVCache:
        return KVCache(window=self.window(params))

    def chunk_velocity(self, latents: torch.Tensor, timestep: torch.Tensor, cond, params: DiffusionParams,
                       cache: KVCache | None, start: int, context: torch.Tensor | None = None,
                       dit: torch.nn.Module | None = None) -> torch.Tensor:
        """The (guided) velocity of the chunk ``latents`` ``(B, 16, n, h, w)`` starting at latent
        frame ``start``, at ``timestep`` ``(B,)``.

        With a ``cache`` the chunk attends to its keys/values (the KV-cached rollout). Without
        one it is the full recompute: the DiT runs over ``cat(context, latents)`` (the clean
        frames before ``start`` at t = 0, the chunk at ``timestep``) with the block-causal mask,
        and the chunk's part of the output is returned.
        """
        dit = self.dit if dit is None else dit
        if cache is not None:
            with causal_state(dit).chunk(dit, cache, start, latents, write=False):
                return self.velocity(latents, timestep, cond, params, dit=dit)
        x = latents if context is None or context.shape[2] == 0 else torch.cat([context, latents], 2)
        chunks = [c for c in self.chunks(params) if c[0] < start] + [(start, latents.shape[2])]
        p_t, p_h, p_w = dit.config.patch_size
        tokens_per_frame = (latents.shape[3] // p_h) * (latents.shape[4] // p_w)
        mask = block_causal_mask(chunks, tokens_per_frame, self.window(params)).to(latents.device)
        per_token = torch.zeros(latents.shape[0], x.shape[2] // p_t * tokens_per_frame,
                                dtype=timestep.dtype, device=timestep.device)
        per_token[:, start // p_t * tokens_per_frame:] = timestep[:, None]
        with causal_state(dit).masked(mask):
            return self.velocity(x, per_token, cond, params, dit=dit)[:, :, start:]

    def commit_chunk(self, latents: torch.Tensor, cond, params: DiffusionParams, cache: KVCache,
                     start: int, dit: torch.nn.Module | None = None) -> None:
        """One pass of the clean chunk at t = 0 that writes its keys/values into ``cache``
        (Self-Forcing's context pass); its output is discarded."""
        dit = self.dit if dit is None else dit
        t = torch.zeros(latents.shape[0], dtype=torch.float32, device=latents.device)
        with torch.no_grad(), causal_state(dit).chunk(dit, cache, start, latents, write=True):
            self.velocity(latents, t, cond, params, dit=dit)

    # -- 5. decode, chunk by chunk ----------------------------------------------------------------
    def stream_decoder(self) -> "StreamingWanDecoder":
        return StreamingWanDecoder(self)


class StreamingWanDecoder:
    """Decodes Wan latents chunk by chunk into frames, carrying the VAE's causal-conv cache from
    chunk to chunk, so the frames of all chunks together are exactly ``vae.decode`` of the whole
    video: diffusers' ``AutoencoderKLWan._decode`` runs its decoder frame by frame with that
    cache, and so does this, with the cache kept between calls. The first latent frame decodes
    to 1 frame, every later one to 4 (the VAE's temporal factor).

    :raises ValueError: for a VAE that tiles or patchifies (Wan2.2), which this does not stream.
    """

    def __init__(self, model: WanT2V) -> None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self.model = model
        vae = model.components["vae"]
        if getattr(vae, "use_tiling", False) or getattr(vae.config, "patch_size", None) is not None:
            raise InvalidInputError(
                "streaming decode needs a Wan2.1 VAE without tiling or patchify")
        self.vae = vae
        self.convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.feat_cache: list = [None] * self.convs
        self.first = True

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """One chunk ``(B, 16, n, h, w)`` → its frames ``(B, n*4 (or 1 + (n-1)*4 first), H, W, 3)``
        float32 in [0, 1]."""
        vae, model = self.vae, self.model
        device, dtype = model.component_device("vae"), model.component_dtype("vae")
        mean, inv_std = (t.to(device, dtype) for t in model.latent_stats())
        with torch.no_grad():
            x = vae.post_quant_conv(latents.to(device, dtype) / inv_std + mean)
            out = []
            for i in range(x.shape[2]):
                out.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self.feat_cache, feat_idx=[0],
                                       first_chunk=self.first))
                self.first = False
            video = torch.clamp(torch.cat(out, dim=2), min=-1.0, max=1.0)
        return postprocess(video)


def load_single_file_state_dict(path: str | Path, ema: bool = True) -> dict[str, torch.Tensor]:
    """The DiT weights of a public Self-Forcing / CausVid checkpoint, in diffusers'
    ``WanTransformer3DModel`` keys.

    The file is a ``.pt`` read with ``torch.load(weights_only=True)`` (never unpickled
    otherwise) or a ``.safetensors``; it holds either ``{"generator": sd, "generator_ema": sd}``
    (Self-Forcing, CausVid) or the state dict itself. Keys are the original Wan layout, under the
    ``model.`` prefix of their ``WanDiffusionWrapper``; diffusers' own converter
    (``convert_wan_transformer_to_diffusers``, what ``from_single_file`` uses) renames them.

    :param ema: take ``generator_ema`` when the file has it (else ``generator``).
    :raises ValueError: for a file that is neither, or that holds no Wan DiT weights.
    """
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data: Any = load_file(str(path))
    elif path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle.UnpicklingError for anything beyond tensors and dicts
            raise InvalidInputError(
                f"{path}: not a weights-only torch file ({type(exc).__name__}: {exc}); "
                "flowseam never unpickles arbitrary objects") from exc
    else:
        raise InvalidInputError(
            f"{path}: unsupported suffix {path.suffix!r}; use .pt/.pth or .safetensors")
    if isinstance(data, dict) and ("generator" in data or "generator_ema" in data):
        key = "generator_ema" if ema and "generator_ema" in data else "generator"
        data = data[key]
    if not isinstance(data, dict) or not all(torch.is_tensor(v) for v in data.values()):
        raise InvalidInputError(
            f"{path}: expected a state dict of tensors (or generator/generator_ema)")
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in data.items()}
    if not any(k.startswith("blocks.0.self_attn.") for k in state):
        raise InvalidInputError(
            f"{path}: no Wan DiT weights (no 'blocks.0.self_attn.*' keys, with or "
            f"without the 'model.' prefix); first keys: {sorted(state)[:5]}")
    return convert_wan_transformer_to_diffusers(state)


def convert_self_forcing_checkpoint(weights: str | Path, base: str | Path, output: str | Path, *,
                                    ema: bool = True, causal_config: dict[str, Any] | None = None) -> Path:
    """Write a flowseam causal checkpoint folder: the Wan2.1 T2V ``base`` (diffusers
    ``WanPipeline`` folder: tokenizer, text encoder, VAE, scheduler) with its transformer
    replaced by the Self-Forcing / CausVid DiT in ``weights``, and ``_flowseam_causal`` in
    ``model_index.json`` (diffusers ignores that key: the folder still loads as a
    ``WanPipeline``). Written to a temporary folder and renamed.

    :param causal_config: ``_flowseam_causal`` settings (default Self-Forcing's DMD config).
    :raises ValueError: if ``base`` is not a WanPipeline folder, ``output`` exists, or the
        weights do not fit the base transformer's config (missing or unexpected keys named).
    """
    import tempfile

    from diffusers import WanTransformer3DModel

    base, output = Path(base), Path(output)
    index_path = base / "model_index.json"
    if not index_path.is_file():
        raise InvalidInputError(
            f"--base {base}: no model_index.json (a diffusers Wan2.1 T2V folder)")
    index = json.loads(index_path.read_text())
    if index.get("_class_name") != "WanPipeline":
        raise InvalidInputError(f"--base {base}: _class_name={index.get('_class_name')!r}; need a "
                                "WanPipeline (Wan2.1 text-to-video) folder")
    if output.exists():
        raise InvalidInputError(f"--output {output} exists; choose a new folder")
    config = read_causal_config({"_flowseam_causal": causal_config or {}}, "causal_config")
    state = load_single_file_state_dict(weights, ema=ema)
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(base / "transformer"))
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise InvalidInputError(
            f"{weights} does not fit {base}'s transformer config: missing keys "
            f"{missing[:8]}, unexpected keys {unexpected[:8]}, other shapes "
            f"{[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in shapes[:4]]}")
    model.load_state_dict(state, strict=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        for entry in index:
            if not entry.startswith("_") and entry != "transformer" and (base / entry).exists():
                shutil.copytree(base / entry, tmp / entry)
        model.save_pretrained(tmp / "transformer")
        index["_flowseam_causal"] = {k: config[k] for k in CAUSAL_CONFIG_DEFAULTS}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


_CAUSAL_RULES = (
    "num_frames = 4k+1 whose latent frames (k+1) are a multiple of chunk_frames",
    "height and width divisible by 16 (VAE factor 8 x patch 2)",
    "chunk_frames >= 1; local_attn_size None or >= chunk_frames + sink_size; sink_size only "
    "with a window",
    "num_steps: the checkpoint's denoising_step_list (default 4: 1000, 750, 500, 250) or N "
    "uniform steps 1000 (1 - i/N), warped by the flow shift",
)

#: Self-Forcing's inference settings: 480x832, 81 frames (21 latent frames = 7 chunks of 3),
#: no CFG (the DMD-distilled model has guidance baked in).
_CAUSAL_DEFAULTS = dict(num_steps=4, guidance_scale=1.0, flow_shift=5.0, height=480, width=832,
                        num_frames=81, max_sequence_length=512, chunk_frames=3, sink_size=0)

WAN_CAUSAL_T2V = ModelCard(
    name="wan2.1-causal-t2v", pipeline_class="WanPipeline", tasks=(TaskType.T2V,),
    components=_WAN_COMMON, defaults=_CAUSAL_DEFAULTS, rules=_CAUSAL_RULES,
    instance=WanCausalT2V, loops=("wan_causal",), solver_from_scheduler=False,
    pipeline_options=("boundary_ratio", "expand_timesteps"),
    split=SplitSupport(no_split_reason="the causal loop attends chunk by chunk through a KV "
                       "cache; sequence parallelism of the cache is not implemented",
                       no_cfg_reason="the causal loop is not split over ranks"))
