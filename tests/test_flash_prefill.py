"""Prefill attention through FlashAttention-4 (``wmtp.kernels.flash_prefill``) against the twin,
``TorchBackend.attention``. On the CPU the library is stood in for by a PyTorch implementation of
its varlen contract (packed queries, paged keys, a bottom-right causal mask, GQA by head groups), so
what is checked there is our call: the metadata, the page views over the pool's spare slot. On a
GPU with flash-attn-4 installed the library itself is compared, and the Triton backend is seen
routing a prefill chunk to it."""

from __future__ import annotations

import pytest
import torch

from tests.test_paged_attention import _case
from wmtp.kernels import flash_prefill
from wmtp.kernels.flash_prefill import FlashMeta
from wmtp.models.backend import TorchBackend, TritonBackend
from wmtp.models.context import ForwardContext, PagedSlots


def _varlen_contract(q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, softmax_scale,
                     causal):
    """``flash_attn_varlen_func`` over paged K / V as its docstring and asserts state, in fp32."""
    assert causal and all(t.dtype == torch.int32 for t in (cu_seqlens_q, seqused_k, page_table))
    B, (pages, page, kv_heads, dim), heads = page_table.shape[0], k.shape, q.shape[1]
    assert v.shape == k.shape and cu_seqlens_q.shape == (B + 1,) and seqused_k.shape == (B,) and q.shape[-1] == dim
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(page_table.max()) < pages
    out = torch.zeros_like(q)
    for b in range(B):
        lo, hi, n_k = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert hi - lo <= max_seqlen_q and n_k <= max_seqlen_k
        keys = k[page_table[b].long()].flatten(0, 1)[:n_k].repeat_interleave(heads // kv_heads, 1).float()
        vals = v[page_table[b].long()].flatten(0, 1)[:n_k].repeat_interleave(heads // kv_heads, 1).float()
        scores = torch.einsum("nhd,khd->hnk", q[lo:hi].float(), keys) * softmax_scale
        seen = torch.arange(n_k)[None, :] <= torch.arange(hi - lo)[:, None] + n_k - (hi - lo)  # bottom-right
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("hnk,khd->nhd", probs, vals).to(q.dtype)
    return out, None


def _spare_slot(t: torch.Tensor) -> torch.Tensor:
    """The pool's layout: one slot past the last page (where padded rows write)."""
    return torch.cat([t, torch.full_like(t[:1], float("nan"))])


@pytest.mark.parametrize("heads,kv_heads,q_lens,starts", [(4, 2, [70, 65], [0, 40]), (8, 1, [64], [100]),
                                                          (6, 2, [0, 80, 66], [5, 0, 17])])
def test_the_call_follows_the_librarys_contract(heads, kv_heads, q_lens, starts):
    q, k, v, k_cache, v_cache, ctx = _case(3, heads, kv_heads, 16, q_lens, starts, [None] * len(q_lens), ring=False)
    k_cache, v_cache = _spare_slot(k_cache), _spare_slot(v_cache)
    scale = 16**-0.5
    want = TorchBackend().attention(q, k, v, k_cache, v_cache, ctx, scale)  # also writes k, v
    got = flash_prefill.flash_prefill(q, k_cache, v_cache, FlashMeta.from_context(ctx, torch.device("cpu")), scale,
                                      attn=_varlen_contract)
    assert (got - want).abs().max().item() < 1e-5


def test_only_prefill_chunks_without_a_window_in_16_bits_take_the_library():
    from wmtp.engine.window import DraftWindow

    paged = lambda q_lens, windows=None: _case(0, 4, 2, 16, q_lens, [0] * len(q_lens),  # noqa: E731
                                               windows or [None] * len(q_lens), ring=False)[-1]
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert flash_prefill.fits(paged([80, 3]), bf16, bf16, 256)
    assert not flash_prefill.fits(paged([63, 3]), bf16, bf16, 256)  # decode / verify sizes
    assert not flash_prefill.fits(paged([80], [DraftWindow(sink=2, window=8)]), bf16, bf16, 256)  # the draft window
    ring = _case(0, 4, 2, 16, [80], [0], [DraftWindow(sink=2, window=8)], ring=True)[-1]
    assert not flash_prefill.fits(ring, bf16, bf16, 256)
    assert not flash_prefill.fits(paged([80]), bf16, fp8, 256)  # fp8 K / V: the Triton kernel's scales
    assert not flash_prefill.fits(paged([80]), torch.float32, torch.float32, 256)
    assert not flash_prefill.fits(paged([80]), bf16, bf16, 512)
    q, _, _, k_cache, _, ctx = _case(0, 4, 2, 16, [80], [0], [None], ring=False)
    assert not flash_prefill.applies(q.to(bf16), k_cache.to(bf16), ctx)  # CPU tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or flash_prefill.library_version() is None,
                    reason="needs CUDA and flash-attn-4")
@pytest.mark.parametrize("q_lens,starts,page", [([4096], [0], 64), ([1000, 3000], [5000, 70], 64), ([777], [1234], 16)])
def test_flash_attention_4_against_the_twin(q_lens, starts, page, monkeypatch):
    q, k, v, k_cache, v_cache, ctx = _case(1, 16, 2, 256, q_lens, starts, [None] * len(q_lens), ring=False, page=page,
                                           dtype=torch.bfloat16)
    k_cache, v_cache = _spare_slot(k_cache).nan_to_num(0.0), _spare_slot(v_cache).nan_to_num(0.0)
    scale = 256**-0.5
    gpu_ctx = ForwardContext(starts, q_lens, PagedSlots(ctx.kv_slots.block_table.cuda(), page), device="cuda")
    gpu = [t.cuda() for t in (q, k, v, k_cache, v_cache)]
    want = TorchBackend().attention(q, k, v, k_cache, v_cache, ctx, scale).float()
    calls, real = [], flash_prefill.flash_prefill
    monkeypatch.setattr(flash_prefill, "flash_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = TritonBackend().attention(*gpu, gpu_ctx, scale)
    assert calls, "a prefill chunk without a window took the Triton kernel"
    # bf16 inputs, fp32 accumulation in both; outputs are convex mixes of unit-scale values
    assert (got.float().cpu() - want).abs().max().item() < 2e-2
