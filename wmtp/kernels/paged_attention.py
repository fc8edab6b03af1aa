"""Triton attention over paged or ring-addressed KV, with the draft window rule (DESIGN §3, §4).

One kernel family serves every attention in the engine: target prefill chunks, decode, verify
(q_len 1..d), and the MTP draft (native over its full-length pool, windowed over its ring). Its
PyTorch twin is ``TorchBackend.attention``; ``tests/test_paged_attention.py`` compares them, on the
CPU under ``TRITON_INTERPRET=1`` too.

Design (flash-decoding):
- A program owns (request, block of ``BLOCK_Q`` queries, KV head, split). The GQA group of q heads
  sharing a KV head is packed into the rows of one tile (rows = BLOCK_Q x GROUP), so each K/V tile
  is loaded once per group and q_len = 1 still gives a tensor-core-sized tile.
- Keys are enumerated as a *virtual* range: under a window, ``[0, sink_end)`` are the sink and the
  rest map to ``recent_start + j``; without one, ``j`` is the position. Positions, page / ring slots
  and the mask are computed in the kernel from scalars (sink, W, ring modulus, page size), so no
  per-iteration O(S) index list exists anywhere.
- The virtual range is cut into splits so one request over 1M keys fills the GPU; a second kernel
  merges the splits' (max, sum, unnormalised output) exactly.
- Without a window over paged KV (target decode / verify, native draft) a ``BLOCK_N`` tile of keys
  lies inside one page: its address is one scalar (the page, loaded a tile ahead) plus a
  loop-invariant offset tile, and the tiles every query sees whole skip the masks. The tail tiles
  (the causal edge, the split's end) keep that addressing and add the masks; the general loop
  (per-key positions and slots: windows, the ring) is not compiled into this path at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wmtp.kernels.act_mul import SIGMOID, act_mul
from wmtp.kernels.common import launch_splits, pdl
from wmtp.models.context import ForwardContext, PagedSlots, RingSlots
from wmtp.quant import is_fp8

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


@dataclass
class AttentionMeta:
    """Per-forward metadata the kernel reads (tensors on the KV device; ints on the host)."""

    q_start: torch.Tensor  # [B] int32 position of each request's first query
    q_len: torch.Tensor  # [B] int32
    tok_off: torch.Tensor  # [B] int32 first row of each request in the flat q
    windowed: torch.Tensor  # [B] int32 1 = apply the draft window
    table: torch.Tensor  # [B, max_pages] int32 page table (paged) or [B, 1] ring base (ring)
    page_size: int
    ring: bool
    sink: int
    window: int
    ring_mod: int
    max_q_len: int
    max_keys: int  # upper bound of any program's virtual key count (host-side, no sync)
    num_splits: int | None = None  # fixed split count (CUDA graphs); None = chosen per call from max_keys
    may_window: bool = True  # False: no request of this forward applies the window (enables the contiguous path)

    @classmethod
    def from_context(cls, ctx: ForwardContext, device: torch.device) -> "AttentionMeta":
        wins = [ctx.window(b) for b in range(ctx.batch_size)]
        active = {(w.sink, w.window) for w in wins if w is not None}
        if len(active) > 1:
            raise ValueError(f"one forward must use one draft window; got {sorted(active)}")
        sink, window = next(iter(active)) if active else (0, 1)
        slots = ctx.kv_slots
        if isinstance(slots, RingSlots):
            table, page, ring, mod = slots.base.view(-1, 1), 1, True, slots.window.window + slots.num_draft_tokens
        elif isinstance(slots, PagedSlots):
            table, page, ring, mod = slots.block_table, slots.page_size, False, 1
        else:
            raise TypeError(f"unsupported kv_slots {type(slots).__name__}")
        keys = [
            (s + n) if w is None else min(w.sink, max(s - w.window + 1, 0)) + min(s + n, w.window + n)
            for s, n, w in zip(ctx.q_starts, ctx.q_lens, wins)
        ]
        q_start, q_len, tok_off = ctx.device_lens
        windowed = torch.tensor([w is not None for w in wins], dtype=torch.int32).to(device, non_blocking=True)
        return cls(q_start, q_len, tok_off, windowed, table.to(device=device, dtype=torch.int32), page, ring,
                   sink, window, mod, max(ctx.q_lens), max(keys), may_window=bool(active))


if triton is not None:
    from wmtp.kernels.common import wait_prior

    @triton.jit
    def _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2e, MASKED: tl.constexpr, IEEE: tl.constexpr,
                      KV8: tl.constexpr):
        """One online-softmax update with a [BLOCK_N, D] tile of keys and values. Unmasked tiles
        (every query sees every key) skip the mask and the all-masked-row guard. fp8 K / V (``KV8``)
        widen to q's dtype in registers (fp16 or fp32: exact, every e4m3 value is one); their scales
        are applied outside (k's folded into ``scale_log2e``, v's to the output)."""
        if KV8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2e
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _dims_ok(mask, d_ok, PAD: tl.constexpr):
        """``mask`` [rows, 1] and, for a padded head dim only, its [1, BLOCK_D] bound: at a power-of-2
        head dim loads and stores compile exactly as they would without padding."""
        m = mask
        if PAD:
            m = mask & d_ok[None, :]
        return m

    @triton.jit
    def _gated(out, gate):
        """``out * sigmoid(gate)`` rounded as the reference's ops are (each to the output dtype)."""
        o = out.to(gate.dtype).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype).to(tl.float32)
        return o * s

    @triton.jit
    def _attn_split_kernel(
        Q, K, V, Out, OPart, MPart, LPart, Gate,
        q_start_ptr, q_len_ptr, tok_off_ptr, win_ptr, table_ptr, table_stride,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_gt, stride_gh,
        stride_ps, stride_pt, stride_ph,
        num_q_blocks, num_splits, scale_log2e, v_scale, page_size, sink, window, ring_mod,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, RING: tl.constexpr, CONTIG: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
        GATED: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_prior(PDL)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // num_q_blocks
        qb = pid % num_q_blocks
        # metadata may arrive as int64 (the graphs' staging buffers); positions fit in int32, and
        # int64 index math over a [64, 256] tile costs registers (1.6x slower at 1M keys, H200)
        q_len = tl.load(q_len_ptr + b).to(tl.int32)
        if qb * BLOCK_Q >= q_len:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int32)
        tok_off = tl.load(tok_off_ptr + b).to(tl.int32)
        win_flag = tl.load(win_ptr + b).to(tl.int32)  # 0 / 1; scalar arithmetic below (no tl.where on scalars)
        windowed = win_flag != 0

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P  # the group is padded to a power of 2
        rows = tl.arange(0, BLOCK_M)
        qi = qb * BLOCK_Q + rows // GROUP_P
        head = kvh * GROUP + rows % GROUP_P
        row_ok = (qi < q_len) & (rows % GROUP_P < GROUP)
        q_pos = q_start + qi
        # head dims padded to a power of 2 (80, 96, 112, ...): the padding loads zeros, which add
        # nothing to q.k, and its output columns are never stored
        PAD_D: tl.constexpr = BLOCK_D != D
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < D
        q = tl.load(Q + (tok_off + qi)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=_dims_ok(row_ok[:, None], d_ok, PAD_D), other=0.0)
        if KV8 and not IEEE:
            # fp8 tiles widen to fp16, which Hopper converts e4m3 to in one instruction (bf16 takes
            # two more); q and p follow (bf16 q is exact in fp16's wider mantissa at its magnitudes)
            q = q.to(tl.float16)

        # virtual key range of this query block (see module docstring)
        q_first = q_start + qb * BLOCK_Q
        q_last = tl.minimum(q_start + q_len - 1, q_first + BLOCK_Q - 1)
        recent = win_flag * tl.maximum(q_first - window + 1, 0)
        sink_end = win_flag * tl.minimum(sink, recent)
        n_keys = sink_end + q_last - recent + 1
        # each program balances its own keys over the splits (the grid's split count is fixed by
        # the host, e.g. at graph capture, while the context grows)
        keys_per_split = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        lo = split * keys_per_split
        hi = tl.minimum(n_keys, lo + keys_per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if CONTIG:
            # whole tiles at or before the first query: position = j, one page per tile, no masks
            full_end = lo + tl.maximum(tl.minimum(hi, q_first + 1) - lo, 0) // BLOCK_N * BLOCK_N
            tile = tl.arange(0, BLOCK_N)[:, None] * stride_kt + dims[None, :]
            # each tile's page is loaded one tile ahead: a lookup feeding the same tile's K / V
            # addresses stalls the pipelined loads (b586c5c)
            tile_page = tl.load(table_ptr + b * table_stride + lo // page_size, mask=lo < full_end, other=0).to(tl.int32)
            for j0 in range(lo, full_end, BLOCK_N):
                base = (tile_page * page_size + j0 % page_size).to(tl.int64) * stride_kt + kvh * stride_kh
                nxt = j0 + BLOCK_N
                tile_page = tl.load(table_ptr + b * table_stride + nxt // page_size, mask=nxt < full_end, other=0).to(tl.int32)
                if PAD_D:
                    k = tl.load(K + base + tile, mask=d_ok[None, :], other=0.0)
                    v = tl.load(V + base + tile, mask=d_ok[None, :], other=0.0)
                else:
                    k = tl.load(K + base + tile)
                    v = tl.load(V + base + tile)
                m_i, l_i, acc = _softmax_step(q, k, v, True, m_i, l_i, acc, scale_log2e, MASKED=False, IEEE=IEEE, KV8=KV8)
            # the tail (the causal edge, the split's end) still has one page per tile: the same scalar
            # addressing with masks. The general loop's [BLOCK_N, D] int64 addresses, compiled beside
            # the main loop, cost it registers: 7 queries over 1.04M keys ran 0.55 ms with them,
            # 0.50 without (64-key tiles, H200; 257b301)
            for j0 in range(full_end, hi, BLOCK_N):
                base = (tl.load(table_ptr + b * table_stride + j0 // page_size).to(tl.int32) * page_size
                        + j0 % page_size).to(tl.int64) * stride_kt + kvh * stride_kh
                j = j0 + tl.arange(0, BLOCK_N)
                k_ok = j < hi
                k = tl.load(K + base + tile, mask=_dims_ok(k_ok[:, None], d_ok, PAD_D), other=0.0)
                v = tl.load(V + base + tile, mask=_dims_ok(k_ok[:, None], d_ok, PAD_D), other=0.0)
                visible = (j[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
                m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2e, MASKED=True, IEEE=IEEE, KV8=KV8)
        else:
            for j0 in range(lo, hi, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                k_ok = j < hi
                pos = tl.where(j < sink_end, j, recent + j - sink_end)
                if RING:
                    slot = tl.load(table_ptr + b * table_stride).to(tl.int32) + tl.where(pos < sink, pos, sink + (pos - sink) % ring_mod)
                else:
                    page = tl.load(table_ptr + b * table_stride + pos // page_size, mask=k_ok, other=0).to(tl.int32)
                    slot = page * page_size + pos % page_size
                slot = slot.to(tl.int64)
                kv_ok = _dims_ok(k_ok[:, None], d_ok, PAD_D)
                k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + dims[None, :], mask=kv_ok, other=0.0)
                v = tl.load(V + slot[:, None] * stride_kt + kvh * stride_kh + dims[None, :], mask=kv_ok, other=0.0)
                visible = (pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
                visible &= (~windowed) | (pos[None, :] < sink) | (pos[None, :] > q_pos[:, None] - window)
                m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2e, MASKED=True, IEEE=IEEE, KV8=KV8)

        if KV8:
            acc = acc * v_scale
        tok = tok_off + qi
        if SPLIT:
            base = split * stride_ps + tok * stride_pt + head * stride_ph
            tl.store(OPart + base[:, None] + dims[None, :], acc, mask=_dims_ok(row_ok[:, None], d_ok, PAD_D))
            tl.store(MPart + base // D, m_i, mask=row_ok)
            tl.store(LPart + base // D, l_i, mask=row_ok)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            out_ok = _dims_ok(row_ok[:, None], d_ok, PAD_D)
            if GATED:
                out = _gated(out, tl.load(Gate + tok[:, None] * stride_gt + head[:, None] * stride_gh + dims[None, :],
                                          mask=out_ok, other=0.0))
            tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     out.to(Out.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _merge_splits_kernel(OPart, MPart, LPart, Out, Gate, num_splits, rows, stride_ot, stride_oh, stride_gt,
                             stride_gh, H, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                             GATED: tl.constexpr, PDL: tl.constexpr):
        """One program per (token, head) row and block of head dims; splits are walked in blocks
        of BLOCK_S (two passes: the global max, then the rescaled sums). The host makes BLOCK_S
        cover every split when it can (one load round per pass: the loop is a chain of dependent
        loads) and narrows BLOCK_D to keep the [BLOCK_S, BLOCK_D] tile small."""
        wait_prior(PDL)
        r = tl.program_id(0)
        db = tl.program_id(1)
        tok = r // H
        head = r % H
        PAD_D: tl.constexpr = D % BLOCK_D != 0  # a padded head dim: its last block is partial
        dims = db * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = dims < D
        m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            sp = s0 + tl.arange(0, BLOCK_S)
            m_max = tl.maximum(m_max, tl.load(MPart + sp * rows + r, mask=sp < num_splits, other=float("-inf")))
        m = tl.max(m_max, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        denom = tl.zeros([BLOCK_S], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            sp = s0 + tl.arange(0, BLOCK_S)
            m_sp = tl.load(MPart + sp * rows + r, mask=sp < num_splits, other=float("-inf"))
            ok = m_sp != float("-inf")  # empty splits (short contexts under a fixed grid) are not read
            w = tl.where(ok, tl.exp2(m_sp - m), 0.0)
            denom += w * tl.load(LPart + sp * rows + r, mask=ok, other=0.0)
            o = tl.load(OPart + (sp[:, None] * rows + r) * D + dims[None, :],
                        mask=_dims_ok(ok[:, None], d_ok, PAD_D), other=0.0)
            acc += tl.sum(o * w[:, None], 0)
        total = tl.sum(denom, 0)
        out = acc / tl.where(total == 0.0, 1.0, total)
        if PAD_D:
            if GATED:
                out = _gated(out, tl.load(Gate + tok * stride_gt + head * stride_gh + dims, mask=d_ok, other=0.0))
            tl.store(Out + tok * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty), mask=d_ok)
        else:
            if GATED:
                out = _gated(out, tl.load(Gate + tok * stride_gt + head * stride_gh + dims))
            tl.store(Out + tok * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty))


if triton is not None:

    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, SLOTS, stride_kt, stride_vt, stride_ct, N, k_inv, v_inv,
                         BLOCK: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr):
        """Program (token, k or v): one token's [kv_heads * D] row into its cache slot; into an fp8
        cache as ``quant.quantize_kv`` writes it (times 1 / its scale, saturated, rounded)."""
        wait_prior(PDL)
        t = tl.program_id(0)
        which = tl.program_id(1)
        slot = tl.load(SLOTS + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, N, BLOCK):
            c = c0 + cols
            if which == 0:
                x = tl.load(K + t * stride_kt + c, mask=c < N)
                if KV8:
                    x = tl.clamp(x.to(tl.float32) * k_inv, -448.0, 448.0)
                tl.store(KC + slot * stride_ct + c, x.to(KC.dtype.element_ty), mask=c < N)
            else:
                x = tl.load(V + t * stride_vt + c, mask=c < N)
                if KV8:
                    x = tl.clamp(x.to(tl.float32) * v_inv, -448.0, 448.0)
                tl.store(VC + slot * stride_ct + c, x.to(VC.dtype.element_ty), mask=c < N)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """``k_cache[slots] = k; v_cache[slots] = v`` in one launch (fp8 caches: quantized with
    ``kv_scale``, as ``TorchBackend.store_kv``). k, v [T, kv_heads, D] (rows may be strided, each row
    contiguous); caches [slots, kv_heads, D] of one dtype and layout."""
    T = k.shape[0]
    if (v.shape != k.shape or k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape
            or v_cache.stride() != k_cache.stride() or slots.shape != (T,)):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, slots {tuple(slots.shape)} disagree")
    if T == 0:
        return
    kv8 = is_fp8(k_cache.dtype)
    if not kv8 and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):  # e.g. fp32 activations, bf16 cache
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k, v = (x if x[0].is_contiguous() else x.contiguous() for x in (k, v))
    if not k_cache[0].is_contiguous():
        raise ValueError(f"store_kv: cache rows must be contiguous (strides {k_cache.stride()})")
    N = k.shape[1] * k.shape[2]
    _store_kv_kernel[(T, 2)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0), N,
                             1.0 / kv_scale[0], 1.0 / kv_scale[1], BLOCK=min(1024, triton.next_power_of_2(N)),
                             KV8=kv8, **pdl(k.device))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# Launches with more than this many queries per request are prefill chunks: compute-bound, they take
# FlashAttention-style tiles, and the output gate after the kernel (its load in the unsplit epilogue
# slowed the prefill main loop by 10% on the H200: 4.05 vs 3.67 s of attention in a 131,072-token
# prefill); decode / verify keep it fused.
PREFILL_MIN_Q = 64

# The split merge's tile: up to MERGE_MAX_BLOCK_S splits per load round (a 1.04M-key verify runs 132)
# over MERGE_TILE // BLOCK_S head dims, i.e. at most 8192 fp32 values (32 KB) a program.
MERGE_MAX_BLOCK_S = 256
MERGE_TILE = 8192


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_rows: int | None = None,
    gate: torch.Tensor | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Attention of q [T, H, D] over the cached keys (already written). Returns [T, H, D], times
    ``sigmoid(gate)`` when ``gate`` [T, H, D] (any strides with a unit last one: Qwen3-Next's output
    gate, a view into the query projection) is given, rounded as ``o * torch.sigmoid(gate)``.
    fp8 caches read ``code * kv_scale`` (``quant.dequantize_kv``).

    ``num_splits`` (default: about two programs per SM) cuts each request's keys;
    ``block_n`` / ``num_warps`` / ``num_stages`` / ``max_rows`` (query rows x GQA group per tile)
    override the launch configuration (``benchmarks/tune_attention.py``).
    """
    if triton is None:
        raise RuntimeError("paged_attention needs triton (pip install 'wmtp[gpu]' or triton==3.6.0)")
    T, H, D = q.shape
    n_kv = k_cache.shape[1]
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"paged_attention: gate {tuple(gate.shape)} must match q {tuple(q.shape)} with unit stride on D")
    prefill = meta.max_q_len > PREFILL_MIN_Q
    # 16- or 8-bit K / V only: fp32 tiles of this size overflow shared memory
    prefill_tile = prefill and D >= 256 and k_cache.element_size() <= 2 and D & (D - 1) == 0
    if gate is not None and prefill:
        return act_mul(gate, paged_attention(q, k_cache, v_cache, meta, scale, num_splits, block_n, num_warps,
                                             num_stages, max_rows, kv_scale=kv_scale), SIGMOID)
    if H % n_kv:
        raise ValueError(f"paged_attention: heads {H} must be a multiple of kv heads {n_kv}")
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs >= 16 along K
    group = H // n_kv
    group_p = triton.next_power_of_2(group)
    # decode / verify rows past one 64-row tile (next_pow2(q_len) x group: d > 8 at 16 q / 2 KV heads,
    # d > 4 at 32 / 2) take one 128-row tile: two 64-row query blocks would each read every K / V tile
    # (fp32 K / V at head_dim 256 excepted: such tiles overflow shared memory)
    wide_verify = (not prefill and triton.next_power_of_2(meta.max_q_len) * group_p > 64
                   and (k_cache.element_size() <= 2 or block_d < 256))
    max_rows = max_rows or (128 if prefill_tile or wide_verify else 64)
    block_q = max(1, min(triton.next_power_of_2(meta.max_q_len), max(1, max_rows // group_p)))
    if block_q * group_p < 16:  # tl.dot needs >= 16 rows: pad the query block
        block_q = 16 // group_p
    num_q_blocks = math.ceil(meta.max_q_len / block_q)
    B = meta.q_len.shape[0]
    programs = B * num_q_blocks * n_kv
    big_tile = block_d >= 256 and block_q * group_p >= 64
    # no window and no ring: keys are positions, so tiles of whole pages take the contiguous path
    plain_pages = not meta.ring and not meta.may_window
    if (big_tile and block_n is None and not prefill and block_q * group_p > 64 and plain_pages
            and meta.page_size % 32 == 0 and k_cache.element_size() == 2):
        # a wide verify over whole pages: 32-key tiles, 8 warps, 3 stages (0.689 against 0.718 ms for the
        # prefill tile's launch, 9 queries x 8 heads over 1.04M keys; 0.702 against 0.737 at 7 x 16;
        # H200, tuning/tune_attention_rows*.json). A second 16-row tile over the same loads, or a
        # second query block, ran no faster (0.74 / 0.72 ms)
        block_n, num_warps, num_stages = 32, num_warps or 8, num_stages or 3
    elif big_tile and block_n is None and (prefill_tile or block_q * group_p > 64):
        # [128, 256] query rows over 64-key tiles, 8 warps: 21.1 against 24.2 ms for the [64, 256]
        # decode tile (8192 queries over 73,728 keys on the H200; benchmarks/tune_attention.py)
        block_n, num_warps, num_stages = 64, num_warps or 8, num_stages or 2
    elif big_tile and block_n is None and plain_pages and meta.page_size % 64 == 0 and k_cache.element_size() <= 2:
        # a [64, 256] fp32 accumulator over whole pages (16- or 8-bit K / V: three stages of 64-key
        # tiles fit in shared memory): 0.50 against 0.52 ms for 32-key tiles, 4 stages (7 verify queries
        # over 1.04M keys, H200; 257b301, 5cee913)
        # fp8 K / V: 32-key tiles, 4 stages (0.52 against 0.68 ms for 7 verify queries over 1.04M
        # keys, H200; benchmarks/tune_attention.py --kv-dtype fp8_e4m3)
        kv8 = is_fp8(k_cache.dtype)
        block_n, num_warps, num_stages = 32 if kv8 else 64, num_warps or 4, num_stages or (4 if kv8 else 3)
    elif big_tile and block_n is None:
        # the general path: 4 warps over 32-key tiles, 2 stages measured best on the H200 (0.78 vs
        # 1.02 ms for 7 verify queries over 1.04M keys; tune_attention / attention_insitu)
        block_n, num_warps, num_stages = 32, num_warps or 4, num_stages or 2
    block_n = block_n or 64
    num_warps = num_warps or (8 if block_q * group_p > 64 else None)  # the accumulator's registers, as at 64 rows
    max_splits = max(1, math.ceil(meta.max_keys / block_n))
    num_splits = num_splits or meta.num_splits
    if num_splits is None:
        # two programs per SM: at 1.04M keys 132 splits beat 264 (0.49 vs 0.50 ms decode, 0.55 vs
        # 0.58 ms verify of 8 queries; benchmarks/tune_attention.py) — half the partials to merge
        num_splits = launch_splits(min(max_splits, max(1, math.ceil(2 * _num_sms(q.device) / programs))))
    num_splits = max(1, min(num_splits, max_splits))
    out = torch.empty_like(q)
    gate_strides = gate.stride()[:2] if gate is not None else (0, 0)
    split = num_splits > 1
    contig = plain_pages and meta.page_size % block_n == 0
    if split:
        o_part = torch.empty(num_splits, T, H, D, device=q.device, dtype=torch.float32)
        m_part = torch.empty(num_splits, T, H, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # unused
    q = q.contiguous()
    kv8 = is_fp8(k_cache.dtype)
    if kv8 and v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must share a dtype")
    k_scale, v_scale = (float(kv_scale[0]), float(kv_scale[1])) if kv8 else (1.0, 1.0)
    _attn_split_kernel[(B * num_q_blocks, n_kv, num_splits)](
        q, k_cache, v_cache, out, o_part, m_part, l_part, out if gate is None else gate,
        meta.q_start, meta.q_len, meta.tok_off, meta.windowed, meta.table, meta.table.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        *gate_strides,
        T * H * D, H * D, D,
        num_q_blocks, num_splits, scale * k_scale * 1.4426950408889634, v_scale, meta.page_size, meta.sink, meta.window, meta.ring_mod,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n, D=D, BLOCK_D=block_d, RING=meta.ring,
        CONTIG=contig, SPLIT=split, IEEE=q.dtype == torch.float32, GATED=gate is not None, KV8=kv8, **pdl(q.device),
        num_warps=num_warps or 4,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if split:
        block_s = min(MERGE_MAX_BLOCK_S, triton.next_power_of_2(num_splits))
        merge_d = max(16, min(block_d, 64, MERGE_TILE // block_s))
        _merge_splits_kernel[(T * H, triton.cdiv(D, merge_d))](
            o_part, m_part, l_part, out, out if gate is None else gate, num_splits, T * H, out.stride(0),
            out.stride(1), *gate_strides, H,
            D=D, BLOCK_D=merge_d, BLOCK_S=block_s, GATED=gate is not None, **pdl(q.device),
        )
    return out
