"""Tiny, random-initialised diffusers checkpoints for tests (no download, CPU friendly).

:func:`write_tiny_checkpoint` builds a complete pipeline out of the *real* diffusers and
transformers classes, with every model shrunk to 25k-140k parameters, and saves it
with the pipeline's own ``save_pretrained`` (so ``model_index.json`` and every
``config.json`` are written by diffusers/transformers themselves). The directory loads back
with ``diffusers.DiffusionPipeline.from_pretrained(path)`` with ``HF_HUB_OFFLINE=1``.

This module imports only torch, diffusers, transformers, the standard library and, of flowseam,
the leaf :mod:`flowseam.quiet` (to keep the libraries quiet), so it can build fixtures for any
layer of the project.
"""

import json
import os
import pathlib

import diffusers
import torch
import transformers

from flowseam.quiet import library_output

__all__ = ["ALL_CARDS", "CARDS", "SCHEDULER_CLASSES", "clip_tokenizer", "t5_tokenizer",
           "write_tiny_checkpoint", "write_tiny_lm"]

#: The cards of the conformance suite (one checkpoint each), in a fixed order. ``ltx2-i2v`` is
#: not one: it runs the same DiT, VAE, audio VAE, vocoder and upsampler classes and the same
#: two-stage loop as ``ltx2-t2v`` (its image condition is tested against diffusers in flowseam's
#: own tests), and a compiling backend would compile all of them once more.
CARDS = ("wan2.1-t2v", "wan2.1-i2v", "flux.1-t2i", "wan2.1-causal-t2v", "ltx2-t2v")

#: Every card :func:`write_tiny_checkpoint` knows: :data:`CARDS`, Wan2.2's two-expert layouts
#: and LTX-2's image-to-video.
ALL_CARDS = CARDS + ("wan2.2-t2v", "wan2.2-i2v", "ltx2-i2v")

#: The scheduler classes it can write (``scheduler_class=``).
SCHEDULER_CLASSES = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")

#: Name of the small provenance file written next to ``model_index.json``.
METADATA_FILE = "flowseam_tiny.json"

# OpenAI CLIP normalisation constants (what the real Wan 2.1 I2V image processor uses).
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

_LTX2_PARTS = ("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder",
               "latent_upsampler", "scheduler")

# Which config dicts each card builds (= the keys accepted in ``**overrides``).
_OVERRIDABLE = {
    "wan2.1-t2v": ("text_encoder", "vae", "transformer", "scheduler"),
    "wan2.1-i2v": ("text_encoder", "image_encoder", "image_processor", "vae", "transformer",
                   "scheduler"),
    "flux.1-t2i": ("text_encoder", "text_encoder_2", "vae", "transformer", "scheduler"),
    "wan2.1-causal-t2v": ("text_encoder", "vae", "transformer", "scheduler", "causal"),
    "wan2.2-t2v": ("text_encoder", "vae", "transformer", "transformer_2", "scheduler"),
    "wan2.2-i2v": ("text_encoder", "vae", "transformer", "transformer_2", "scheduler"),
    "ltx2-t2v": _LTX2_PARTS,
    "ltx2-i2v": _LTX2_PARTS,
}


def write_tiny_checkpoint(card: str, path: "str | os.PathLike[str]", *, seed: int = 0,
                          scheduler_class: str = "FlowMatchEulerDiscreteScheduler",
                          boundary_ratio: float = 0.875, verbose: bool = False,
                          **overrides) -> pathlib.Path:
    """Write a tiny random diffusers pipeline for ``card`` into the directory ``path``.

    The models are initialised on CPU in float32, in a fixed order, inside
    ``torch.random.fork_rng`` after seeding torch's default CPU generator with ``seed`` (the
    CPU part of ``torch.manual_seed(seed)``), so the same ``(card, seed, overrides)`` always
    writes byte-identical files, and the caller's RNG state (CPU and CUDA) is left untouched.
    Everything is saved with the real pipeline's ``save_pretrained`` (safetensors), plus a
    ``flowseam_tiny.json`` recording ``card``, ``seed`` and ``overrides``.

    Cards and what is written (default sizes):

    ``"wan2.1-t2v"`` -> :class:`diffusers.WanPipeline`
        * ``transformer``: ``WanTransformer3DModel``, 2 layers, 2 heads x 16 dims (inner 32),
          ffn 64, patch (1, 2, 2), in/out 16 channels, text_dim 32, freq_dim 256.
        * ``vae``: ``AutoencoderKLWan``, base_dim 8, dim_mult [1, 1, 1, 1], 1 res block,
          z_dim 16 with Wan 2.1's real ``latents_mean``/``latents_std``; spatial factor 8,
          temporal factor 4 (as the real VAE).
        * ``text_encoder``: ``UMT5EncoderModel``, d_model 32, 2 layers, 4 heads x 8, d_ff 64.
        * ``tokenizer``: ``T5Tokenizer`` (Unigram, tokenizers backend) over printable ASCII
          (192 tokens, ``<pad>``=0, ``</s>``=1, ``<unk>``=2), model_max_length 512; built in
          memory, no download.
        * ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (Wan 2.1 480p shift;
          the real checkpoint ships UniPC, here it is FlowMatchEuler on purpose).

    ``"wan2.1-i2v"`` -> :class:`diffusers.WanImageToVideoPipeline`
        As above, plus ``image_encoder``: ``CLIPVisionModelWithProjection`` (as in the real
        Wan2.1-I2V checkpoints, so diffusers logs the same "Expected types for image_encoder"
        notice on load; hidden 32,
        2 layers, 4 heads, image 32 px, patch 8 -> 17 tokens), ``image_processor``:
        ``CLIPImageProcessor`` (the PIL backend class, 32 px resize + centre crop, OpenAI CLIP
        mean/std), and a transformer configured for Wan 2.1 I2V: ``in_channels`` = 2 * 16 + 4
        = 36, ``image_dim`` = 32 (CLIP hidden size), ``added_kv_proj_dim`` = 32 (inner dim).
        The pipeline needs the text length to be exactly 512 (WanAttnProcessor hard-codes it),
        which is the pipeline's default ``max_sequence_length``.

    ``"wan2.1-causal-t2v"`` -> flowseam's causal Wan layout
        The ``"wan2.1-t2v"`` pipeline, with ``"_flowseam_causal": {...}`` added to
        ``model_index.json`` (the ``causal`` override: Self-Forcing settings such as
        ``num_frame_per_block``; empty = flowseam's defaults). diffusers still loads it as a
        ``WanPipeline`` (it ignores the key).

    ``"flux.1-t2i"`` -> :class:`diffusers.FluxPipeline` (FLUX.1-dev-like)
        * ``transformer``: ``FluxTransformer2DModel``, 2 double + 2 single blocks, 2 heads x 16
          dims, ``axes_dims_rope`` (4, 6, 6), in_channels 64 (= 16 latent channels x 2x2
          packing), joint_attention_dim 32, pooled_projection_dim 32, guidance_embeds True.
        * ``vae``: ``AutoencoderKL``, 4 levels of 8 channels (factor 8), 16 latent channels,
          scaling_factor 0.3611, shift_factor 0.1159, no quant convs (as FLUX.1).
        * ``text_encoder`` + ``tokenizer``: ``CLIPTextModel`` (hidden 32, 2 layers, 77
          positions) + ``CLIPTokenizer`` (byte-level BPE over the 256 byte symbols, no merges,
          514 tokens, model_max_length 77), built in memory.
        * ``text_encoder_2`` + ``tokenizer_2``: ``T5EncoderModel`` (d_model 32, 2 layers) +
          the same ASCII ``T5Tokenizer`` as Wan (model_max_length 512).
        * ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0,
          use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
          max_image_seq_len=4096)`` (FLUX.1-dev's config).

    ``"wan2.2-t2v"`` / ``"wan2.2-i2v"`` -> :class:`diffusers.WanPipeline` /
    :class:`diffusers.WanImageToVideoPipeline` in Wan2.2 A14B's layout
        As the Wan2.1 cards, plus ``transformer_2`` (the low-noise expert: the same config as
        ``transformer``, unless overridden, initialised after it from the same seeded stream,
        so the two experts differ) and ``boundary_ratio`` (default 0.875). The I2V variant has
        no CLIP image encoder (``image_dim`` and ``added_kv_proj_dim`` null, as Wan2.2 I2V).
    ``"ltx2-t2v"`` -> :class:`diffusers.LTX2Pipeline`, ``"ltx2-i2v"`` ->
    :class:`diffusers.LTX2ImageToVideoPipeline` (the same components), sized like diffusers'
    own ``tests/pipelines/ltx2`` dummies:
        * ``transformer``: ``LTX2VideoTransformer3DModel``, 2 layers, video 2 heads x 8
          (4 latent channels, patch 1), audio 2 heads x 4 (4 channels = 2 latent channels x 2
          latent mel bins), caption_channels 32, split RoPE.
        * ``connectors``: ``LTX2TextConnectors`` (one 4 x 8 attention layer per modality, no
          learnable registers), fed the 3 hidden states of the text encoder.
        * ``vae``: ``AutoencoderKLLTX2Video``, 8 channels, 4 latent channels, one
          spatio-temporal scaling (spatial factor 2, temporal factor 2: frames 2k+1), random
          non-trivial ``latents_mean``/``latents_std`` buffers (as a real checkpoint has).
        * ``audio_vae``: ``AutoencoderKLLTX2Audio``, 16 kHz, hop 160, 8 mel bins, 2 latent
          channels (mel factor 4), random latent statistics.
        * ``vocoder``: ``LTX2Vocoder`` upsampling by 4 x 4 x 10 = 160 (the mel hop), so the
          waveform lasts as long as the video; 2 channels at 16 kHz.
        * ``text_encoder`` + ``tokenizer``: ``Gemma3ForConditionalGeneration`` (text: hidden 32,
          2 layers, 4 heads x 8; vision: a 1-layer SigLIP of 16 px) + a ``GemmaTokenizer`` over
          printable ASCII, built in memory (left padding, as LTX-2 uses).
        * ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with LTX-2's real config
          (dynamic shifting, base_shift 0.95, max_shift 2.05, base/max image seq len 1024/4096,
          shift_terminal 0.1).
        * ``latent_upsampler/``: ``LTX2LatentUpsamplerModel`` (x2 spatial, rational resampler,
          32 mid channels, 1 block per stage), saved in its own subfolder as LTX-2's converter
          does (it is not a pipeline component).

    With these sizes a 2-step call at 32x32 px (Wan: 5 frames) takes well under a second on
    two CPU cores. Height and width must be multiples of 16 for all three cards (VAE factor 8
    times patch/packing 2); Wan ``num_frames`` must be ``4k + 1``.

    Args:
        card: one of :data:`CARDS`.
        path: directory to write; created (with parents) if missing, must be empty if present.
        seed: seed for ``torch.manual_seed`` before the weights are initialised.
        scheduler_class: ``"FlowMatchEulerDiscreteScheduler"`` (default, with the card's
            config above) or ``"UniPCMultistepScheduler"`` (what the Wan2.1-Diffusers
            checkpoints ship: ``prediction_type="flow_prediction"``, ``use_flow_sigmas=True``,
            ``flow_shift=3.0``); ``scheduler=`` overrides are merged into its kwargs.
        boundary_ratio: the Wan2.2 cards' expert boundary (ignored by the other cards).
        verbose: let diffusers and transformers print their progress bars and notices while
            saving (off by default: :func:`flowseam.quiet.library_output`).
        **overrides: per-component config overrides, each a mapping merged into that
            component's constructor kwargs, e.g. ``transformer={"num_layers": 3}``,
            ``scheduler={"shift": 5.0}``, ``vae={"z_dim": 4}``. Accepted names:
            ``text_encoder``, ``vae``, ``transformer``, ``scheduler`` (all cards),
            ``image_encoder`` and ``image_processor`` (``wan2.1-i2v``), ``text_encoder_2``
            (``flux.1-t2i``), ``connectors``, ``audio_vae``, ``vocoder`` and
            ``latent_upsampler`` (the LTX-2 cards). Dependent sizes (the transformer's text/image/latent channel
            dims, Flux's rope axes, the text encoders' vocab size) are re-derived from the
            overridden configs unless overridden explicitly too.

    Returns:
        ``pathlib.Path`` of the written directory.

    Raises:
        ValueError: ``card`` is not one of :data:`CARDS` (the message names it and lists the
            allowed cards), or an override names a component the card does not have.
        TypeError: an override value is not a mapping (dict).
        FileExistsError: ``path`` exists and is a non-empty directory.
        NotADirectoryError: ``path`` exists and is not a directory.
    """
    if card not in ALL_CARDS:
        raise ValueError(f"unknown card {card!r}; allowed cards: {', '.join(ALL_CARDS)}")
    if scheduler_class not in SCHEDULER_CLASSES:
        raise ValueError(f"unknown scheduler_class {scheduler_class!r}; allowed: "
                         f"{', '.join(SCHEDULER_CLASSES)}")
    allowed = _OVERRIDABLE[card]
    for name, value in overrides.items():
        if name not in allowed:
            raise ValueError(f"card {card!r} has no overridable component {name!r}; "
                             f"allowed: {', '.join(allowed)}")
        if not isinstance(value, dict):
            raise TypeError(f"override {name!r} must be a dict of config values, "
                            f"got {type(value).__name__}")
    seed = int(seed)

    out = pathlib.Path(path)
    if out.exists():
        if not out.is_dir():
            raise NotADirectoryError(f"{str(out)!r} exists and is not a directory")
        if any(out.iterdir()):
            raise FileExistsError(f"{str(out)!r} is not empty; write tiny checkpoints into a new "
                                  "directory")

    # CPU-only equivalent of torch.manual_seed(seed): the models are built on CPU, and CUDA
    # generators are left alone; fork_rng restores the caller's CPU RNG state afterwards.
    with library_output(verbose):
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.random.default_generator.manual_seed(seed)
            unipc = scheduler_class == "UniPCMultistepScheduler"
            built = _BUILDERS[card]({k: dict(v) for k, v in overrides.items()
                                     if not (unipc and k == "scheduler")})
            pipe, extras = built if isinstance(built, tuple) else (built, {})
            pipe.scheduler = _scheduler(scheduler_class, pipe.scheduler,
                                        overrides.get("scheduler", {}))
            if card.startswith("wan2.2"):
                pipe.register_to_config(boundary_ratio=float(boundary_ratio))
        out.mkdir(parents=True, exist_ok=True)
        pipe.save_pretrained(out, safe_serialization=True)
        for subfolder, model in extras.items():  # models a pipeline does not hold (LTX-2's upsampler)
            model.save_pretrained(out / subfolder, safe_serialization=True)
    if card == "wan2.1-causal-t2v":
        index = json.loads((out / "model_index.json").read_text())
        index["_flowseam_causal"] = dict(overrides.get("causal", {}))
        (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    meta = {"generator": "flowseam.testing.tiny", "card": card, "seed": seed,
            "scheduler_class": scheduler_class, "overrides": overrides}
    if card.startswith("wan2.2"):
        meta["boundary_ratio"] = float(boundary_ratio)
    text = json.dumps(meta, indent=2, sort_keys=True, default=repr)
    (out / METADATA_FILE).write_text(text + "\n")
    return out


def write_tiny_lm(path: "str | os.PathLike[str]", *, seed: int = 0, **config) -> pathlib.Path:
    """Write a tiny random causal language model (a prompt refiner for ``unified_rl``) into the
    new directory ``path`` with ``save_pretrained``: it loads back with
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer``.

    * model: ``GPT2LMHeadModel``, 2 layers, 2 heads, width 32, 128 positions, no dropout
      (``**config`` overrides any ``GPT2Config`` field);
    * tokenizer: ``GPT2Tokenizer``, byte-level BPE over the 256 byte symbols with no merges
      (every byte is a token) plus ``<|endoftext|>`` (EOS, id 256), built in memory.

    The weights are drawn from torch's CPU generator seeded with ``seed`` inside
    ``torch.random.fork_rng`` (the caller's RNG state is left alone), so the same arguments
    write the same files.

    :raises FileExistsError: ``path`` exists and is not an empty directory.
    """
    out = pathlib.Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{str(out)!r} exists and is not an empty directory")
    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = transformers.GPT2Tokenizer(vocab=vocab, merges=[], model_max_length=128)
    settings = _merge(dict(vocab_size=len(vocab), n_positions=128, n_embd=32, n_layer=2, n_head=2,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=len(vocab) - 1, eos_token_id=len(vocab) - 1), config)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.random.default_generator.manual_seed(int(seed))
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- helpers


def _merge(defaults: dict, user: dict, derived: dict | None = None) -> dict:
    """``defaults | user``, then each ``derived[k](cfg)`` for keys the user did not set."""
    cfg = {**defaults, **user}
    for key, fn in (derived or {}).items():
        if key not in user:
            cfg[key] = fn(cfg)
    return cfg


def _finish(model: torch.nn.Module) -> torch.nn.Module:
    # Only cast when a caller changed torch's default dtype (a plain .to() on Wan logs a warning).
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.to(dtype=torch.float32)
    return model.eval()


def t5_tokenizer(model_max_length: int = 512):
    """A T5 (Unigram) tokenizer over printable ASCII, built in memory: 192 tokens, ``<pad>`` = 0,
    ``</s>`` = 1, ``<unk>`` = 2 (what the tiny Wan and FLUX checkpoints ship; tests that rebuild
    diffusers' own dummy pipelines use it in place of the hub's tiny-random-t5 tokenizer)."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for code in range(33, 127):
        vocab.append(("\u2581" + chr(code), -4.0))
        vocab.append((chr(code), -3.0))
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode symbol table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def clip_tokenizer(model_max_length: int = 77):
    """A byte-level CLIP BPE tokenizer with no merges (every byte is a token, 514 tokens), in
    memory (in place of the hub's tiny-random-clip tokenizer)."""
    symbols = list(_bytes_to_unicode().values())
    vocab = {}
    for s in symbols:
        vocab[s] = len(vocab)
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def _clip_image_processor(**kwargs):
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(**kwargs)


def _t5_like_config(vocab_size: int, user: dict) -> dict:
    return _merge(
        dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=32,
             feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
             pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False),
        user, {"vocab_size": lambda c: vocab_size})


def _wan_vae(user: dict):
    cfg = _merge(
        dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
             temperal_downsample=[False, True, True], dropout=0.0),
        user)
    if cfg["z_dim"] != 16:  # Wan 2.1's 16-channel statistics only fit z_dim 16
        cfg.setdefault("latents_mean", [0.0] * cfg["z_dim"])
        cfg.setdefault("latents_std", [1.0] * cfg["z_dim"])
    return _finish(diffusers.AutoencoderKLWan(**cfg))


def _scheduler(cls_name: str, euler, user: dict):
    """The card's FlowMatchEuler scheduler as built, or a UniPC one in the flow configuration
    (with the Euler shift as its flow_shift unless ``user`` says otherwise)."""
    if cls_name == "FlowMatchEulerDiscreteScheduler":
        return euler
    return diffusers.UniPCMultistepScheduler(**_merge(
        dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
             flow_shift=euler.config.shift, solver_order=2, solver_type="bh2"), user))


# --------------------------------------------------------------------------- builders


def _build_wan(ov: dict, *, i2v: bool, experts: int = 1):
    tokenizer = t5_tokenizer(512)
    text_encoder = _finish(transformers.UMT5EncoderModel(
        transformers.UMT5Config(**_t5_like_config(len(tokenizer), ov.get("text_encoder", {})))))

    image_encoder = image_processor = None
    if i2v and experts == 1:
        ie_cfg = _merge(
            dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                 num_attention_heads=4, num_channels=3, image_size=32, patch_size=8,
                 hidden_act="gelu", layer_norm_eps=1e-5, attention_dropout=0.0),
            ov.get("image_encoder", {}))
        image_encoder = _finish(transformers.CLIPVisionModelWithProjection(
            transformers.CLIPVisionConfig(**ie_cfg)))
        px = ie_cfg["image_size"]
        image_processor = _clip_image_processor(**_merge(
            dict(do_resize=True, size={"shortest_edge": px}, resample=3, do_center_crop=True,
                 crop_size={"height": px, "width": px}, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=True, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
                 do_convert_rgb=True),
            ov.get("image_processor", {})))

    vae = _wan_vae(ov.get("vae", {}))
    z = vae.config.z_dim
    text_dim = text_encoder.config.d_model

    derived = {
        "in_channels": (lambda c: 2 * z + 4) if i2v else (lambda c: z),
        "out_channels": lambda c: z,
        "text_dim": lambda c: text_dim,
    }
    if image_encoder is not None:
        derived["image_dim"] = lambda c: image_encoder.config.hidden_size
        derived["added_kv_proj_dim"] = lambda c: c["num_attention_heads"] * c["attention_head_dim"]
    tr_defaults = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                       freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                       qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                       added_kv_proj_dim=None, rope_max_seq_len=1024)
    tr_cfg = _merge(tr_defaults, ov.get("transformer", {}), derived)
    transformer = _finish(diffusers.WanTransformer3DModel(**tr_cfg))
    transformer_2 = None
    if experts == 2:  # the low-noise expert: transformer's config unless overridden
        transformer_2 = _finish(diffusers.WanTransformer3DModel(
            **{**tr_cfg, **ov.get("transformer_2", {})}))

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**_merge(
        dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        ov.get("scheduler", {})))

    if i2v:
        return diffusers.WanImageToVideoPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
            image_processor=image_processor, image_encoder=image_encoder, transformer=transformer,
            transformer_2=transformer_2)
    return diffusers.WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
        transformer=transformer, transformer_2=transformer_2)


def _build_flux(ov: dict):
    tokenizer = clip_tokenizer(77)
    clip_cfg = _merge(
        dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
             layer_norm_eps=1e-5, attention_dropout=0.0),
        ov.get("text_encoder", {}),
        {"vocab_size": lambda c: len(tokenizer),
         "bos_token_id": lambda c: tokenizer.bos_token_id,
         "eos_token_id": lambda c: tokenizer.eos_token_id,
         "pad_token_id": lambda c: tokenizer.pad_token_id})
    text_encoder = _finish(transformers.CLIPTextModel(transformers.CLIPTextConfig(**clip_cfg)))

    tokenizer_2 = t5_tokenizer(512)
    text_encoder_2 = _finish(transformers.T5EncoderModel(
        transformers.T5Config(**_t5_like_config(len(tokenizer_2), ov.get("text_encoder_2", {})))))

    vae_cfg = _merge(
        dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
             up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
             layers_per_block=1, act_fn="silu", latent_channels=16, norm_num_groups=4,
             sample_size=32,
             scaling_factor=0.3611, shift_factor=0.1159, force_upcast=True, use_quant_conv=False,
             use_post_quant_conv=False, mid_block_add_attention=True),
        ov.get("vae", {}))
    vae = _finish(diffusers.AutoencoderKL(**vae_cfg))

    def _rope_axes(c):  # FLUX.1 splits 128 as (16, 56, 56); keep that shape for any even head dim
        hw = (c["attention_head_dim"] * 7 // 16) // 2 * 2
        return (c["attention_head_dim"] - 2 * hw, hw, hw)

    tr_cfg = _merge(
        dict(patch_size=1, out_channels=None, num_layers=2, num_single_layers=2,
             attention_head_dim=16, num_attention_heads=2, guidance_embeds=True),
        ov.get("transformer", {}),
        {"in_channels": lambda c: 4 * vae.config.latent_channels,
         "joint_attention_dim": lambda c: text_encoder_2.config.d_model,
         "pooled_projection_dim": lambda c: text_encoder.config.hidden_size,
         "axes_dims_rope": _rope_axes})
    transformer = _finish(diffusers.FluxTransformer2DModel(**tr_cfg))

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**_merge(
        dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
             max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
        ov.get("scheduler", {})))

    return diffusers.FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def _gemma_tokenizer():
    """A Gemma (BPE) tokenizer over printable ASCII with no merges, built in memory."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    for code in range(33, 127):
        vocab.setdefault(chr(code), len(vocab))
        vocab.setdefault("\u2581" + chr(code), len(vocab))
    return transformers.GemmaTokenizer(vocab=vocab, merges=[])


def _randomise_latent_stats(model: torch.nn.Module) -> None:
    """Give the ``latents_mean``/``latents_std`` buffers real-looking values (a fresh LTX-2 VAE
    has zeros and ones, which would hide a missing (de)normalisation)."""
    with torch.no_grad():
        model.latents_mean.copy_(torch.randn_like(model.latents_mean) * 0.5)
        model.latents_std.copy_(torch.rand_like(model.latents_std) + 0.5)


def _build_ltx2(ov: dict, *, i2v: bool):
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2TextConnectors, LTX2Vocoder

    tokenizer = _gemma_tokenizer()
    te_text = _merge(
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
             query_pre_attn_scalar=8, sliding_window=16, rms_norm_eps=1e-6),
        ov.get("text_encoder", {}), {"vocab_size": lambda c: len(tokenizer)})
    te_vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                image_size=16, patch_size=4)
    text_encoder = _finish(transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**te_text), vision_config=te_vision,
        mm_tokens_per_image=4)))
    hidden = te_text["hidden_size"]

    connectors = _finish(LTX2TextConnectors(**_merge(
        dict(video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
             video_connector_num_layers=1, video_connector_num_learnable_registers=None,
             audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
             audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
             connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
             causal_temporal_positioning=False, rope_type="split"),
        ov.get("connectors", {}),
        {"caption_channels": lambda c: hidden,
         "text_proj_in_factor": lambda c: te_text["num_hidden_layers"] + 1})))

    vae = diffusers.AutoencoderKLLTX2Video(**_merge(
        dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
             decoder_block_out_channels=(8,), layers_per_block=(1,),
             decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
             decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
             downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
             timestep_conditioning=False, patch_size=2, patch_size_t=1, encoder_causal=True,
             decoder_causal=False),
        ov.get("vae", {})))
    _randomise_latent_stats(vae)
    vae = _finish(vae)

    audio_vae = diffusers.AutoencoderKLLTX2Audio(**_merge(
        dict(output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
             in_channels=2, resolution=32, latent_channels=2, norm_type="pixel",
             causality_axis="height", dropout=0.0, mid_block_add_attention=False,
             sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8),
        ov.get("audio_vae", {}),
        # the latent statistics have one entry per packed channel (latent channels x mel bins / 4)
        {"base_channels": lambda c: c["latent_channels"] * c["mel_bins"] // 4}))
    _randomise_latent_stats(audio_vae)
    audio_vae = _finish(audio_vae)
    audio_cfg = audio_vae.config

    vocoder = _finish(LTX2Vocoder(**_merge(
        dict(hidden_channels=32, out_channels=2, upsample_kernel_sizes=[8, 8, 20],
             upsample_factors=[4, 4, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
             leaky_relu_negative_slope=0.1),
        ov.get("vocoder", {}),
        {"in_channels": lambda c: audio_cfg.output_channels * audio_cfg.mel_bins,
         "output_sampling_rate": lambda c: audio_cfg.sample_rate})))

    latent_channels = vae.config.latent_channels
    transformer = _finish(diffusers.LTX2VideoTransformer3DModel(**_merge(
        dict(patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
             cross_attention_dim=16, audio_num_attention_heads=2, audio_attention_head_dim=4,
             audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
             rope_double_precision=False, rope_type="split"),
        ov.get("transformer", {}),
        {"in_channels": lambda c: latent_channels * c["patch_size"] ** 2 * c["patch_size_t"],
         "out_channels": lambda c: latent_channels * c["patch_size"] ** 2 * c["patch_size_t"],
         "audio_in_channels": lambda c: audio_cfg.latent_channels * audio_cfg.mel_bins // 4,
         "audio_out_channels": lambda c: audio_cfg.latent_channels * audio_cfg.mel_bins // 4,
         "caption_channels": lambda c: hidden})))

    upsampler = _finish(LTX2LatentUpsamplerModel(**_merge(
        dict(mid_channels=32, num_blocks_per_stage=1, dims=3, spatial_upsample=True,
             temporal_upsample=False, rational_spatial_scale=2.0, use_rational_resampler=True),
        ov.get("latent_upsampler", {}), {"in_channels": lambda c: latent_channels})))

    # LTX-2's real scheduler config (diffusers' convert_ltx2_to_diffusers.py, non-distilled)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**_merge(
        dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
             max_image_seq_len=4096, shift_terminal=0.1),
        ov.get("scheduler", {})))

    cls = diffusers.LTX2ImageToVideoPipeline if i2v else diffusers.LTX2Pipeline
    pipe = cls(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
               tokenizer=tokenizer, connectors=connectors, transformer=transformer,
               vocoder=vocoder)
    return pipe, {"latent_upsampler": upsampler}


_BUILDERS = {
    "wan2.1-causal-t2v": lambda ov: _build_wan(ov, i2v=False),
    "wan2.1-t2v": lambda ov: _build_wan(ov, i2v=False),
    "wan2.1-i2v": lambda ov: _build_wan(ov, i2v=True),
    "flux.1-t2i": _build_flux,
    "wan2.2-t2v": lambda ov: _build_wan(ov, i2v=False, experts=2),
    "wan2.2-i2v": lambda ov: _build_wan(ov, i2v=True, experts=2),
    "ltx2-t2v": lambda ov: _build_ltx2(ov, i2v=False),
    "ltx2-i2v": lambda ov: _build_ltx2(ov, i2v=True),
}
