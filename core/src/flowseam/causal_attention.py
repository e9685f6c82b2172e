"""Chunk-by-chunk attention for a causal video DiT: a per-layer KV cache, on the seam.

A causal loop (:mod:`flowseam.loops.causal`) drives the real diffusers ``WanTransformer3DModel``
one chunk of latent frames at a time (Self-Forcing, Huang et al. 2025; CausVid, Yin et al.
2025). :func:`route_causal_attention` installs on every self-attention (``attn1``), through
diffusers' public ``set_attn_processor``, a processor that runs diffusers' own
``WanAttnProcessor`` unchanged and sends its one SDPA call to the platform: the ``attention`` op
outside a chunk; the ``cached_attention`` op inside :meth:`CausalAttention.chunk` (the chunk's
queries over the earlier chunks' cached keys/values plus its own); ``attention`` with the
block-causal mask inside :meth:`CausalAttention.masked` (the full recompute of a prefix, which
the KV-cached rollout must equal). Cross-attention keeps the plain route; the kernels are
resolved when the model is loaded. With a rolling window (:class:`Window`) the cache keeps only
what the next chunk may see, so memory stays flat as the video grows.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .attention import RoutedAttnProcessor, compiling, routed_processor
from .errors import InvalidInputError


@dataclass(frozen=True)
class Window:
    """Which earlier frames a chunk sees: Self-Forcing's rolling window (``local_attn_size`` and
    ``sink_size``, in latent frames).

    A chunk starting at frame ``s`` with ``n`` frames attends to the frames ``f < s + n`` with
    ``f < sink_size`` (the attention sink) or ``f >= s + n - (local_attn_size - sink_size)``
    (the most recent frames, itself included); :meth:`KVCache.trim` drops everything else, and
    the same rule gives the mask of the full recompute (:func:`block_causal_mask`).

    :param local_attn_size: frames attended, the chunk itself included; None: every frame.
    :param sink_size: the first frames, always attended (with a window only).
    """

    local_attn_size: int | None = None
    sink_size: int = 0

    def visible(self, frame: int, end: int) -> bool:
        """Whether a query frame of the chunk ending (exclusive) at ``end`` sees ``frame``."""
        if frame >= end:
            return False
        if self.local_attn_size is None:
            return True
        return frame < self.sink_size or frame >= end - (self.local_attn_size - self.sink_size)


@dataclass
class KVCache:
    """The keys/values (after RoPE) of the committed clean chunks, one pair per self-attention
    layer: ``k[layer]`` ``(B, heads, frames * tokens_per_frame, head_dim)``; ``frames`` lists the
    frame index of each cached frame, in order."""

    window: Window = field(default_factory=Window)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    frames: list[int] = field(default_factory=list)
    #: the first frame not yet committed (the next chunk's start)
    end: int = 0
    tokens_per_frame: int = 0
    #: the most bytes the cache ever held (``bench/causal.py`` reports it)
    peak_bytes: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def trim(self, end: int) -> None:
        """Drop the frames the chunk ending at ``end`` cannot see (rolling window)."""
        keep = [i for i, f in enumerate(self.frames) if self.window.visible(f, end)]
        if len(keep) == len(self.frames):
            return
        tpf = self.tokens_per_frame
        index = torch.tensor([i * tpf + j for i in keep for j in range(tpf)], dtype=torch.long)
        for d in (self.k, self.v):
            for layer, t in d.items():
                d[layer] = t.index_select(2, index.to(t.device))
        self.frames = [self.frames[i] for i in keep]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v


class CausalAttention:
    """The state the self-attention processors of one DiT share (see the module docstring).

    :param attention: the platform's ``attention`` kernel.
    :param cached_attention: the platform's ``cached_attention`` kernel.
    """

    def __init__(self, attention: Callable, cached_attention: Callable) -> None:
        self.attention = attention
        self.cached_attention = cached_attention
        self.mode: str | None = None
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cache: KVCache | None = None
        self.write = False
        self.mask: torch.Tensor | None = None
        self._new_frames: list[int] = []

    @contextlib.contextmanager
    def chunk(self, dit: Any, cache: KVCache, start: int, latents: torch.Tensor,
              write: bool) -> Iterator[None]:
        """Run ``dit`` on the chunk ``latents`` ``(B, C, n, H, W)`` starting at latent frame
        ``start``, attending to ``cache``; with ``write`` (the pass of the clean chunk at t = 0)
        its keys/values join the cache.

        Every self-attention uses the ``cached_attention`` op: the chunk's queries over the
        cached keys/values of the earlier chunks plus the chunk's own. RoPE is given the chunk's
        frame positions (offset by ``start``) instead of positions from 0, and the cache stores
        keys after RoPE (as Self-Forcing's ``CausalWanSelfAttention`` does), so a cached frame
        keeps the position it was generated at.

        :raises RuntimeError: if the chunk is not where the cache ends (chunks run in order).
        """
        n, height, width = latents.shape[2:]
        p_t, p_h, p_w = dit.config.patch_size
        if self.cache is not None or self.mode is not None:
            raise RuntimeError("CausalAttention.chunk is not re-entrant")
        if start != cache.end:
            raise RuntimeError(f"chunk at frame {start} does not follow the cache, whose next "
                               f"frame is {cache.end}")
        cache.trim(start + n)
        cache.tokens_per_frame = (height // p_h) * (width // p_w)
        # RoPE of frames [start, start + n): the model's own rotary table over start + n frames,
        # of which the chunk's tokens are the last n * tokens_per_frame.
        probe = torch.empty((1, 1, start + n, height, width), device="meta")
        cos, sin = dit.rope(probe)
        skip = start // p_t * cache.tokens_per_frame
        # fresh tensors, not views: a compiled DiT guards on a view's offset (one graph per start)
        self.rotary = (cos[:, skip:].clone(), sin[:, skip:].clone())
        self.mode, self.cache, self.write = "chunk", cache, write
        try:
            yield
            if write:
                cache.frames.extend(range(start, start + n))
                cache.end = start + n
                cache.peak_bytes = max(cache.peak_bytes, cache.nbytes())
        finally:
            self.mode, self.cache, self.write, self.rotary = None, None, False, None

    @contextlib.contextmanager
    def masked(self, mask: torch.Tensor) -> Iterator[None]:
        """Every self-attention uses the ``attention`` op with ``mask`` (bool, True = attend,
        ``(L, L)`` over the whole token sequence)."""
        self.mode, self.mask = "mask", mask[None, None]
        try:
            yield
        finally:
            self.mode, self.mask = None, None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        """The SDPA call of self-attention layer ``layer`` (``(B, heads, L, D)`` tensors)."""
        if self.mode == "chunk":
            cache = self.cache
            out = self.cached_attention(q, k, v, cache.k.get(layer), cache.v.get(layer), scale=scale)
            if self.write:
                cache.append(layer, k.detach(), v.detach())
            return out
        if self.mode == "mask":
            return self.attention(q, k, v, attn_mask=self.mask.to(q.device), scale=scale)
        return self.attention(q, k, v, attn_mask=attn_mask, scale=scale)


class CausalSelfAttnProcessor(RoutedAttnProcessor):
    """A self-attention layer's processor: diffusers' own processor, with its SDPA call sent to
    :meth:`CausalAttention.attend` and, inside a chunk, the chunk's RoPE positions."""

    def __init__(self, inner: Any, layer: int, state: CausalAttention) -> None:
        super().__init__(inner, self._attend)
        self.layer = layer
        self.state = state

    def _attend(self, q, k, v, attn_mask=None, scale=None):  # per layer, cache length or mode
        return self.state.attend(self.layer, q, k, v, attn_mask, scale)

    # eager under torch.compile like every routed processor (:func:`_causal_class`): the cache
    # bookkeeping (per layer, cache length, mode) never enters a graph
    def __call__(self, attn_module, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs):
        if self.state.mode == "chunk":
            rotary_emb = self.state.rotary
        return super().__call__(attn_module, hidden_states, encoder_hidden_states, attention_mask,
                                rotary_emb, **kwargs)


@functools.cache
def _causal_class(untraced: bool) -> type:
    """:class:`CausalSelfAttnProcessor`, or where torch.compile is in use in this process its
    subclass excluded from tracing (as :func:`flowseam.attention.routed_processor` decides)."""
    if not untraced:
        return CausalSelfAttnProcessor
    return type("CompiledCausalSelfAttnProcessor", (CausalSelfAttnProcessor,),
                {"__call__": torch.compiler.disable(CausalSelfAttnProcessor.__call__)})


def route_causal_attention(model: Any, attention: Callable, cached_attention: Callable) -> CausalAttention:
    """Install the causal processors on a diffusers ``WanTransformer3DModel``: ``attn1`` of
    block ``i`` gets a :class:`CausalSelfAttnProcessor` for layer ``i``, every other attention
    the plain route to ``attention``.

    :returns: the shared :class:`CausalAttention` (also found later by :func:`causal_state`).
    :raises ValueError: if the model has no ``blocks.<i>.attn1`` self-attention.
    """
    original = dict(model.attn_processors)
    state = CausalAttention(attention, cached_attention)
    processors = {}
    for name, proc in original.items():
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "blocks" and parts[2] == "attn1":
            processors[name] = _causal_class(compiling())(proc, int(parts[1]), state)
        else:
            processors[name] = routed_processor(proc, attention)
    if not any(isinstance(p, CausalSelfAttnProcessor) for p in processors.values()):
        raise InvalidInputError(
            f"{type(model).__name__} has no blocks.<i>.attn1 self-attention to make "
            "causal; the wan_causal loop drives WanTransformer3DModel")
    model.set_attention_backend("native")
    model.set_attn_processor(processors)
    return state


def causal_state(model: Any) -> CausalAttention:
    """The :class:`CausalAttention` of a DiT routed by :func:`route_causal_attention` (also of a
    ``copy.deepcopy`` of it, e.g. a trainer's policy copy, which has its own).

    :raises ValueError: if ``model``'s attention is not routed causally.
    """
    for proc in model.attn_processors.values():
        if isinstance(proc, CausalSelfAttnProcessor):
            return proc.state
    raise InvalidInputError(
        f"{type(model).__name__}'s self-attention is not routed for the causal loop "
        "(flowseam.causal_attention.route_causal_attention)")


def block_causal_mask(chunks: list[tuple[int, int]], tokens_per_frame: int,
                      window: Window) -> torch.Tensor:
    """The mask of a full recompute over the chunks ``[(start, frames), ...]`` (in order, from
    frame 0): ``(L, L)`` bool, True where a query token may attend a key token — a key frame
    of an earlier chunk or of the query's own chunk, within the window. Equal to what the KV
    cache holds for each chunk (the rule of :class:`Window`)."""
    frame_end = []
    for start, n in chunks:
        frame_end += [start + n] * n
    frames = len(frame_end)
    allowed = torch.tensor([[window.visible(kf, frame_end[qf]) for kf in range(frames)]
                            for qf in range(frames)], dtype=torch.bool)
    return allowed.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


__all__ = ["CausalAttention", "CausalSelfAttnProcessor", "KVCache", "Window", "block_causal_mask",
           "causal_state", "route_causal_attention"]
