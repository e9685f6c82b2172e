"""The ``wan_causal`` loop: a video generated chunk by chunk with a KV cache, and streamed.

Self-Forcing (Huang et al. 2025, ``pipeline/causal_inference.py``) and CausVid (Yin et al.
2025): the video's latent frames are split into chunks (``chunk_frames``, default 3); each chunk
is denoised in a few steps that predict the clean chunk ``x0`` and re-noise it with *fresh*
noise, attending to the keys/values of every earlier chunk, then one pass of the clean chunk at
t = 0 writes its keys/values into the cache. A chunk is final as soon as it is denoised, so
:func:`stream` decodes and yields it right away. The seam: the solver is the loops' one stepper
(:class:`~flowseam.loops.solvers.SolverSteps`) with Self-Forcing's sampler as its input and the
per-chunk sigma schedule as each chunk's stage; the DiT's attention is the platform's
``cached_attention`` (:mod:`flowseam.causal_attention`). More: docs/streaming.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .checks import check_finite, check_velocity, component_faults
from ..request import GenerationRequest
from .records import BehaviorRecord, ExecutionProfile, LoopResult, Model, StepCallback
from .solvers import X0_RENOISE, SolverSteps


#: The component kinds that turn a request into conditioning (stage 2).
ENCODERS = ("text_encoder", "tokenizer", "image_encoder", "image_processor")


@dataclass
class Chunk:
    """One finished chunk of a streamed video.

    :ivar index: the chunk's index; ``start_frame`` its first latent frame.
    :ivar latents: ``(B, 16, n, h, w)`` float32, the chunk's final latents.
    :ivar frames: ``(B, f, H, W, 3)`` float32 in [0, 1], its decoded frames (``f`` = 1 + 4 (n-1)
        for the first chunk, 4 n after; empty without decoding).
    :ivar seconds: wall seconds from the start of the request to this chunk being ready.
    :ivar result: on the last chunk only, the :class:`LoopResult` of the whole video.
    """

    index: int
    start_frame: int
    latents: torch.Tensor
    frames: np.ndarray
    seconds: float
    result: LoopResult | None = None


def stream(model: Model, request: GenerationRequest,
           profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
           decode: bool = True, step_callback: StepCallback | None = None) -> Iterator[Chunk]:
    """Generate ``request`` chunk by chunk, yielding each :class:`Chunk` as soon as it is decoded.

    Reads top to bottom: check inputs → encode prompt → prepare latents and sigmas → resolve
    kernels → per chunk: denoise, decode and yield, then write the cache. Each step is
    ``flow_match_step`` to x0 = x - sigma v, then ``flow_renoise`` to the next sigma. With
    ``sde_rollout`` each step is instead Flow-GRPO's SDE step ``flow_sde_step`` between the
    chunk's sigmas (within ``sde_window``, counted per chunk; the x0 / re-noise steps
    elsewhere), which gives every step a log-prob (the cache pass is unchanged). With
    ``kv_cache=False`` every velocity is a full recompute of the prefix with the block-causal
    mask.

    :param profile: SERVE, or ROLLOUT to capture a BehaviorRecord per (chunk, step).
    :param progress: show a tqdm progress bar over the chunks.
    :param decode: decode each chunk with the VAE (frames are empty otherwise).
    :param step_callback: ``step_callback(i, chunks * steps, chunk latents)`` after every step
        of every chunk (``i`` counts on across chunks); an exception it raises stops the loop.
    :raises ValueError: for invalid requests, before any model runs.
    :raises PluginFaultError: when a kernel or component raises or returns something wrong,
        naming the plugin, the step and chunk, the op and the kernel's ``impl_id``.
    """
    t_start = time.perf_counter()
    # 1. Check inputs: fill the defaults (card's, then the checkpoint's), validate, one
    #    generator per sample; switch the DiT to the request's LoRA set (flowseam.models.adapters).
    params = model.check(request)
    model.adapters.activate(params.lora)
    seeds = request.sample_seeds(params)
    generators = [torch.Generator().manual_seed(s) for s in seeds]

    # 2. Encode the prompt (a failing or non-finite encoder is named with its plugin).
    with component_faults(model, ENCODERS, "encoding the prompt"):
        cond = model.encode(request, params)
    check_finite(model, ("text_encoder",), cond.prompt_embeds, "returned non-finite prompt embeddings")
    model.placement.release_encoders()  # offload="text_encoder": freed once the prompts are encoded
    t_encoded = time.perf_counter()

    # 3. Prepare the whole video's initial noise (drawn at once, as Self-Forcing does), the
    #    chunks, and the per-chunk sigma schedule.
    with component_faults(model, ("vae", "image_encoder"), "preparing the latents"):
        noise = model.prepare_latents(request, params, generators, cond)
    sigmas, timesteps = model.schedule(params, noise)
    chunks = model.chunks(params)

    # 4. Resolve the kernels once: the stepper with Self-Forcing's sampler.
    solve = SolverSteps(model.platform.kernels, params, generators, sampler=X0_RENOISE,
                        outside_window="sampler", model=model)
    capture = profile is ExecutionProfile.ROLLOUT
    cache = model.new_cache(params) if params.kv_cache else None
    decoder = model.stream_decoder() if decode else None
    output = torch.zeros_like(noise)
    records: list[BehaviorRecord] = []
    seconds = {"encode": t_encoded - t_start, "denoise": 0.0, "decode": 0.0}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(chunks), desc=f"{model.card.name} chunks", unit="chunk", leave=False)

    for c, (start, n) in enumerate(chunks):
        t_chunk = time.perf_counter()
        x = noise[:, :, start:start + n]
        # 5. Denoise the chunk on the per-chunk schedule (the SDE window counts per chunk).
        solve.start(sigmas)
        with torch.no_grad():
            for i in range(len(timesteps)):
                t = timesteps[i].expand(x.shape[0])
                label = f"{i} of chunk {c}"
                with component_faults(model, ("dit",), f"predicting the velocity at step {label}"):
                    v = model.chunk_velocity(x, t, cond, params, cache, start,
                                             context=output[:, :, :start])
                check_velocity(model, label, v, x)
                step = solve(i, x, v, label=label)
                if capture:
                    records.append(BehaviorRecord(
                        len(records), x, step.next_latents, t, step.sigma, step.sigma_next,
                        step.sigma_max, step.log_prob, step.impl_id, chunk=c, start_frame=start))
                x = step.next_latents
                if step_callback is not None:
                    step_callback(c * len(timesteps) + i, len(chunks) * len(timesteps), x)
        output[:, :, start:start + n] = x
        t_denoised = time.perf_counter()
        seconds["denoise"] += t_denoised - t_chunk
        # 6. Decode the chunk and hand it over (before the cache pass: the chunk is final).
        frames = np.zeros((0,), np.float32)
        if decoder is not None:
            with component_faults(model, ("vae",), f"decoding chunk {c}"):
                frames = decoder.decode(x)
            check_finite(model, ("vae",), frames, f"decoded non-finite frames in chunk {c}")
        now = time.perf_counter()
        seconds["decode"] += now - t_denoised
        if bar is not None:
            bar.update(1)
        if c == 0:
            first_chunk = now - t_start
        result = None
        if c == len(chunks) - 1:
            if bar is not None:
                bar.close()
            seconds["total"] = now - t_start
            seconds["first_chunk"] = first_chunk
            result = LoopResult(frames=np.zeros((0,), np.float32), latents=output, params=params,
                                seeds=seeds, records=records, cond=cond, seconds=seconds,
                                kernels=solve.impl_ids, loop="wan_causal", chunks=len(chunks),
                                solver=solve.line(model.solver_line(), "per-chunk"),
                                kv_cache_peak_bytes=cache.peak_bytes if cache is not None else 0)
        yield Chunk(c, start, x, frames, now - t_start, result)
        # 7. Write the clean chunk's keys/values into the cache (one pass at t = 0).
        if cache is not None and c < len(chunks) - 1:
            t_commit = time.perf_counter()
            with component_faults(model, ("dit",), f"writing chunk {c} into the KV cache"):
                model.commit_chunk(x, cond, params, cache, start)
            seconds["denoise"] += time.perf_counter() - t_commit


def run(model: Model, request: GenerationRequest,
        profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
        decode: bool = True, step_callback: StepCallback | None = None) -> LoopResult:
    """The whole video at once: :func:`stream` with the chunks' frames joined along time.

    :returns: a :class:`LoopResult`; ``frames`` ``(B, F, H, W, 3)``, ``loop == "wan_causal"``,
        ``seconds["first_chunk"]`` the time to the first decoded chunk.
    """
    parts = list(stream(model, request, profile=profile, progress=progress, decode=decode,
                        step_callback=step_callback))
    result = parts[-1].result
    if decode:
        result.frames = np.concatenate([p.frames for p in parts], axis=1)
    return result


def record_velocity(model: Model, result: LoopResult, record: BehaviorRecord,
                    dit: torch.nn.Module | None = None) -> torch.Tensor:
    """The velocity ``dit`` predicts at ``record``'s step, as the rollout computed it: the cache
    of the chunks before ``record.chunk`` is rebuilt from the rollout's final (clean) latents with
    ``dit`` (no gradient: the context is data, as in Self-Forcing's training), then the chunk's
    velocity is computed (with gradients if enabled). With the rollout's own weights the result
    is bit for bit the rollout's velocity (C2).
    """
    params, start = result.params, record.start_frame
    context = result.latents[:, :, :start]
    cache = None
    if params.kv_cache:
        cache = model.new_cache(params)
        for c_start, n in model.chunks(params):
            if c_start >= start:
                break
            model.commit_chunk(context[:, :, c_start:c_start + n], result.cond, params, cache,
                               c_start, dit=dit)
    return model.chunk_velocity(record.latents, record.timestep, result.cond, params, cache, start,
                                context=context, dit=dit)
