"""What a DiT computes from the text alone is kept once per loop run, compactly and exactly.

A diffusers ``WanTransformer3DModel`` built as diffusers' own Wan tests build theirs
(``tests/pipelines/wan/test_wan.py``'s ``get_dummy_components``), its cross-attention keys and
values reused (:mod:`flowseam.step_constants`): every step's output equals the same DiT run
outside the reuse scope bit for bit, and the text padding's repeated rows are kept once.
"""

from __future__ import annotations

import pytest
import torch

from flowseam import step_constants
from flowseam.models.wan import WanT2V


@pytest.fixture(scope="module")
def dit():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    step_constants.install(model, WanT2V.STEP_CONSTANTS)
    return model


def _text(lengths: list[int], padded: int = 40) -> torch.Tensor:
    """Prompt embeddings as Wan's pipeline pads them: each prompt's tokens, then zeros."""
    text = torch.zeros(len(lengths), padded, 32)
    for row, n in enumerate(lengths):
        text[row, :n] = torch.randn(n, 32)
    return text


def test_reused_values_are_exact_and_the_padding_is_kept_once(dit, monkeypatch):
    torch.manual_seed(1)
    text = _text([4, 7])  # a CFG batch: a 4-token and a 7-token prompt
    latents = torch.randn(2, 16, 2, 8, 8)
    steps = [torch.full((2,), t) for t in (900.0, 500.0, 100.0)]
    with torch.no_grad():
        expected = [dit(latents, t, text, return_dict=False)[0] for t in steps]
    to_k = {id(m) for n, m in dit.named_modules() if n.endswith("attn2.to_k")}
    calls = []
    linear = torch.nn.Linear.forward  # what runs when a module computes (hooks run either way)
    monkeypatch.setattr(torch.nn.Linear, "forward",
                        lambda self, x: calls.append(id(self) in to_k) or linear(self, x))
    with torch.no_grad(), step_constants.reuse_across_steps():
        got = [dit(latents, t, text, return_dict=False)[0] for t in steps]
        kept = dict(step_constants._LOCAL.outputs)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert sum(calls) == 2  # one per block, at the first step only
    # 7 tokens, then one row for the 33 alike padding rows: 8 of 40 rows kept (hand count)
    names = {id(m): n for n, m in dit.named_modules()}
    rows = {names[k].rsplit(".", 2)[-2] + "." + names[k].rsplit(".", 1)[-1]: v[2].head.shape
            for k, v in kept.items()}
    assert rows["attn2.to_k"] == rows["attn2.to_v"] == rows["attn2.norm_k"] == (2, 8, 24)
    assert rows["condition_embedder.text_embedder"] == (2, 8, 24)


def test_inputs_that_differ_in_the_padding_are_recomputed(dit):
    torch.manual_seed(2)
    text = _text([3, 3])
    latents = torch.randn(2, 16, 2, 8, 8)
    t = torch.full((2,), 500.0)
    other = text.clone()
    other[1, -1, 0] = 1e-3  # one padding value: the rows no longer repeat to the end
    with torch.no_grad():
        expected = dit(latents, t, other, return_dict=False)[0]
        with step_constants.reuse_across_steps():
            dit(latents, t, text, return_dict=False)
            got = dit(latents, t, other, return_dict=False)[0]
            kept = step_constants._LOCAL.outputs
            assert all(v[2].shape[-2] == 40 for v in kept.values() if torch.is_tensor(v[2]))
    assert torch.equal(got, expected)
    assert not torch.equal(expected, dit(latents, t, text, return_dict=False)[0])


def test_the_same_bits_in_another_layout_are_recomputed(dit, monkeypatch):
    """A kept input matches a contiguous tensor of its bits, not the same values laid out
    otherwise (another layout may take another kernel path: ``at::linear`` on a contiguous
    3-d input fuses the bias into one GEMM)."""
    to_k = dit.blocks[0].attn2.to_k
    calls = []
    linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward",
                        lambda self, x: calls.append(1) or linear(self, x))
    torch.manual_seed(3)
    text = torch.zeros(2, 40, 24)
    text[:, :5] = torch.randn(2, 5, 24)
    strided = text.transpose(0, 1).contiguous().transpose(0, 1)  # same values, (24, 48, 1)
    assert torch.equal(strided, text) and not strided.is_contiguous()
    with torch.no_grad(), step_constants.reuse_across_steps():
        to_k(text)
        to_k(text.clone())  # a copy of the same bits, contiguous: reused
        assert len(calls) == 1
        got = to_k(strided)
        assert len(calls) == 2
    assert torch.equal(got, linear(to_k, strided))
