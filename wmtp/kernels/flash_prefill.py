"""Prefill attention through FlashAttention-4 (``flash-attn-4``: the CuTe-DSL FlashAttention for
Hopper and Blackwell), reading K / V straight from the paged pool.

A prefill chunk asks for C queries at the end of S keys, causal. FlashAttention's varlen contract
(queries packed by ``cu_seqlens_q``, request b's keys the first ``seqused_k[b]`` of the pages its
``page_table`` row lists, the causal mask aligned to the bottom-right corner, GQA by head groups)
is exactly the engine's rule: the query at position p sees keys 0..p. Its sm90 kernel is FA3's
design (wgmma tiles, a TMA / warp-specialised producer, softmax overlapped with the next tile's
products); our Triton prefill kernel stays for everything it does not cover.

Used where ``flash_attn.cute`` imports (the optional ``flash`` extra), on compute capability 9+
(``WMTP_FLASH_PREFILL=0``: off) with 16-bit K / V, for a prefill-sized forward (``PREFILL_MIN_Q``,
the Triton kernel's own line) with neither the draft window nor the ring: the target's prefill (the
draft's prefill only writes K / V). The twin is ``TorchBackend.attention``: ``tests/test_flash_prefill.py`` checks the
call against a PyTorch implementation of the library's contract (CPU) and the library against the
twin (GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from wmtp.kernels.common import gpu_feature
from wmtp.kernels.paged_attention import PREFILL_MIN_Q
from wmtp.models.context import ForwardContext, PagedSlots


@functools.cache
def _varlen() -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def library_version(device: torch.device | None = None) -> str | None:
    """The installed flash-attn-4's version, or None where it does not import (or, with ``device``,
    where ``applies`` would not take it there whatever the forward)."""
    if _varlen() is None or (device is not None and not gpu_feature(device, (9, 0), "WMTP_FLASH_PREFILL")):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class FlashMeta:
    """One forward's varlen metadata (device int32), shared by every attention layer."""

    cu_seqlens_q: torch.Tensor  # [B + 1] first row of each request's queries, then the total
    seqused_k: torch.Tensor  # [B] keys each request's last query sees (its start + its queries)
    page_table: torch.Tensor  # [B, max_pages]
    page_size: int
    max_q: int
    max_k: int

    @classmethod
    def from_context(cls, ctx: ForwardContext, device: torch.device) -> "FlashMeta":
        used = [s + n for s, n in zip(ctx.q_starts, ctx.q_lens)]
        dev = torch.tensor([*ctx.token_offsets, *used], dtype=torch.int32).to(device, non_blocking=True)
        b = ctx.batch_size
        table = ctx.kv_slots.block_table.to(device=device, dtype=torch.int32)
        return cls(dev[: b + 1], dev[b + 1 :], table, ctx.kv_slots.page_size, max(ctx.q_lens), max(used))


def fits(ctx: ForwardContext, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the forward is one the library's call covers: a prefill-sized chunk over pages with no
    draft window, 16-bit queries and K / V alike, head_dim a multiple of 8 up to 256."""
    return (max(ctx.q_lens, default=0) > PREFILL_MIN_Q and isinstance(ctx.kv_slots, PagedSlots)
            and all(ctx.window(b) is None for b in range(ctx.batch_size))
            and q_dtype in (torch.bfloat16, torch.float16) and kv_dtype == q_dtype
            and head_dim % 8 == 0 and head_dim <= 256)


def applies(q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> bool:
    """Whether this forward's attention runs on FlashAttention-4: it ``fits``, on a GPU of compute
    capability 9+ where the library imports, unless ``WMTP_FLASH_PREFILL=0`` (the Triton kernel)."""
    return (fits(ctx, q.dtype, k_cache.dtype, q.shape[-1]) and gpu_feature(q.device, (9, 0), "WMTP_FLASH_PREFILL")
            and _varlen() is not None)


def flash_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlashMeta, scale: float,
                  attn: Callable | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] (requests packed as ``meta`` says) over the paged pool
    ``k_cache`` / ``v_cache`` [slots (+ 1 spare), KV heads, D], keys already written; [T, H, D].
    ``attn`` is ``flash_attn_varlen_func`` (a stand-in honouring its contract in tests)."""
    attn = attn or _varlen()
    if attn is None:
        raise RuntimeError("flash_prefill needs flash-attn-4 (pip install 'wmtp[flash]')")
    page = meta.page_size
    pages = k_cache.shape[0] // page  # the pool's spare slot past the last page is not a page
    k = k_cache[: pages * page].view(pages, page, *k_cache.shape[1:])
    v = v_cache[: pages * page].view(pages, page, *v_cache.shape[1:])
    out, _ = attn(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seqused_k, max_seqlen_q=meta.max_q,
                  max_seqlen_k=meta.max_k, page_table=meta.page_table, softmax_scale=scale, causal=True)
    return out
