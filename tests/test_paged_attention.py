"""The Triton paged / ring / windowed attention kernel against its PyTorch twin (TorchBackend.attention).

On the CPU this runs in Triton's interpreter (tests/conftest.py), at tiny sizes; on a GPU the same
tests run the compiled kernel. Cases cover GQA groups that are not powers of two, q_len 1..d
(decode, verify, draft) and prefill chunks, pages, the ring, per-request windows and key splits.
"""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")

from wmtp.engine.window import DraftWindow  # noqa: E402
from wmtp.kernels.paged_attention import (  # noqa: E402
    MERGE_MAX_BLOCK_S, PREFILL_MIN_Q, AttentionMeta, paged_attention, store_kv)
from wmtp.models.backend import TorchBackend  # noqa: E402
from wmtp.models.context import ForwardContext, PagedSlots, RingSlots  # noqa: E402
from wmtp.quant import quantize_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, heads: int, kv_heads: int, dim: int, q_lens: list[int], starts: list[int],
          windows: list[DraftWindow | None], ring: bool, page: int = 8, d: int = 4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    if ring:
        win = next(w for w in windows if w is not None)
        size = win.ring_size(d)
        slots = RingSlots(torch.arange(B) * size + 3, win, d)  # offset bases: addressing must add them
        n_slots = B * size + 3
    else:
        need = [-(-(s + n) // page) for s, n in zip(starts, q_lens)]
        n_pages = sum(need) + 5
        perm = torch.randperm(n_pages, generator=gen).tolist()  # scattered pages
        rows, k = [], 0
        for n in need:
            rows.append(perm[k : k + n] + [0] * (max(need) - n))
            k += n
        slots = PagedSlots(torch.tensor(rows), page)
        n_slots = n_pages * page
    ctx = ForwardContext(starts, q_lens, slots, windows=windows, device="cpu")
    k_cache = torch.randn(n_slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, kv_heads, dim, generator=gen).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T, heads, dim, generator=gen).to(dtype)
    k = torch.randn(T, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(T, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, ctx


def _fp8(case, kv_scale):
    """``case`` with fp8 caches holding its random K / V times 300 quantized with ``kv_scale``, the
    new rows k, v times 300 too (many saturate: |x| / scale > 448) and q / 300 (logits as before)."""
    q, k, v, k_cache, v_cache, ctx = case
    k_cache, v_cache = (quantize_kv(c * 300, s, torch.float8_e4m3fn) for c, s in zip((k_cache, v_cache), kv_scale))
    return q / 300, k * 300, v * 300, k_cache, v_cache, ctx


def _compare(case, splits=None, atol=2e-5, gate=None, kv_scale=(1.0, 1.0), **launch):
    q, k, v, k_cache, v_cache, ctx = case
    scale = q.shape[-1] ** -0.5
    want = TorchBackend().attention(q, k, v, k_cache, v_cache, ctx, scale, gate, kv_scale)  # also writes k, v
    if gate is not None:
        launch["gate"] = gate.to(DEVICE)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    ctx.device = DEVICE
    if isinstance(ctx.kv_slots, RingSlots):
        ctx.kv_slots = RingSlots(dev(ctx.kv_slots.base), ctx.kv_slots.window, ctx.kv_slots.num_draft_tokens)
    else:
        ctx.kv_slots = PagedSlots(dev(ctx.kv_slots.block_table), ctx.kv_slots.page_size)
    meta = AttentionMeta.from_context(ctx, torch.device(DEVICE))
    got = paged_attention(dev(q), dev(k_cache), dev(v_cache), meta, scale, num_splits=splits, kv_scale=kv_scale,
                          **launch)
    err = (got.float().cpu() - want.float()).abs().max().item()
    assert err < atol, f"max |triton - torch| = {err}"
    return err


W = DraftWindow(sink=4, window=16)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_and_verify_paged(heads, kv_heads, splits):
    """Target decode/verify: q_len 1..5 per request over scattered pages, no window."""
    case = _case(0, heads, kv_heads, 16, q_lens=[1, 5, 3], starts=[40, 7, 90], windows=[None] * 3, ring=False)
    _compare(case, splits)


@pytest.mark.parametrize("q_lens", [[1, 5], [PREFILL_MIN_Q + 6, 3]])
@pytest.mark.parametrize("splits", [1, 3])
def test_output_gate_in_the_attention_launch(splits, q_lens):
    """Qwen3-Next's ``o * sigmoid(gate)`` applied where the output is written (the merge, or the
    single-split store), the gate a strided per-head view of the query projection; past
    PREFILL_MIN_Q queries (prefill chunks) after the kernel, rounded the same."""
    case = _case(2, 4, 2, 16, q_lens=q_lens, starts=[40, 7], windows=[None] * 2, ring=False)
    T = case[0].shape[0]
    qg = torch.randn(T, 4, 32, generator=torch.Generator().manual_seed(9))  # per head [query | gate]
    gate = qg.chunk(2, dim=-1)[1]
    assert not gate.is_contiguous()
    _compare(case, splits, gate=gate)
    q, _, _, k_cache, v_cache, ctx = case
    with pytest.raises(ValueError, match="paged_attention: gate"):
        paged_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), AttentionMeta.from_context(ctx, q.device),
                        1.0, gate=gate[:, :2].to(DEVICE))


def test_prefill_chunk_fp32_head_dim_256():
    """A prefill-sized launch (more than PREFILL_MIN_Q queries of a request) at head_dim 256 in
    fp32 keeps the decode tile (the bf16 prefill tile's fp32 K / V blocks overflow shared memory on
    the H200); batched with a short request. bf16: test_bf16_real_head_dims_gpu."""
    case = _case(4, 16, 2, 256, q_lens=[PREFILL_MIN_Q + 6, 2], starts=[30, 9], windows=[None] * 2, ring=False)
    _compare(case, atol=1e-4)


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter only: fp32 K / V blocks of this tile exceed the GPU's "
                    "shared memory (the engine never launches it in fp32); the GPU runs it in bf16 in "
                    "test_bf16_real_head_dims_gpu")
@pytest.mark.parametrize("page", [16, 64])
def test_prefill_tile_fp32(page):
    """The bf16 prefill tile's launch ([128, 256] rows over 64-key blocks, 8 warps) forced in fp32
    (no shared-memory limit under the interpreter), over pages of 64 keys (one page a key block:
    the engine's layout) and 16; the arithmetic is the bf16 launch's."""
    case = _case(7, 16, 2, 256, q_lens=[PREFILL_MIN_Q + 6, 2], starts=[100, 9], windows=[None] * 2, ring=False,
                 page=page)
    _compare(case, atol=1e-4, max_rows=128, block_n=64, num_warps=8, num_stages=2)


@pytest.mark.parametrize("heads,q_len,page", [(16, 9, 8), (16, 9, 64), (32, 7, 8), (32, 5, 64)])
def test_wide_verify_reads_keys_once(heads, q_len, page, monkeypatch):
    """Verify rows past 64 (next_pow2(q_len) x GQA group: d = 9 at 16 q / 2 KV heads, d = 5..8 at
    32 / 2) run as one 128-row query block per request and KV head, not two that each read every
    key; the result is the twin's (general loop over pages of 8, whole 64-key tiles)."""
    import wmtp.kernels.paged_attention as pa

    grids, kernel = [], pa._attn_split_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(pa, "_attn_split_kernel", Spy())
    case = _case(7, heads, 2, 16, q_lens=[q_len, 1], starts=[150, 60], windows=[None, None], ring=False, page=page)
    _compare(case, splits=2)
    assert grids[0][:2] == (2, 2)  # (requests x query blocks, KV heads): one block each


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 4, 1), (32, 8, 3)])
def test_launch_overrides_keep_the_result(block_n, num_warps, num_stages):
    """The tuning knobs change tiling only: the split boundaries follow BLOCK_N, the numbers do not."""
    case = _case(0, 8, 2, 32, q_lens=[7, 1], starts=[100, 33], windows=[None] * 2, ring=False)
    _compare(case, 3, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


@pytest.mark.parametrize("page,block_n,splits", [(32, 16, 1), (32, 32, 3), (64, 16, None)])
def test_contiguous_tiles_inside_pages(page, block_n, splits):
    """Unwindowed paged attention with pages a multiple of BLOCK_N takes the contiguous-tile path
    (unmasked whole tiles, masked tail): keys spanning many scattered pages, q_len 1..7, splits."""
    case = _case(4, 8, 2, 32, q_lens=[7, 1, 4], starts=[150, 97, 5], windows=[None] * 3, ring=False, page=page)
    _compare(case, splits, block_n=block_n)


@pytest.mark.parametrize("dim", [8, 80])
def test_head_dims_that_are_not_powers_of_two(dim):
    """Real checkpoints have head_dim 64, 80, 96, 112, 128, 256 (and toy ones 8): the kernel pads
    to a power of 2 >= 16 with masks. Paged over whole pages (the contiguous path) with splits
    (the merge), a windowed ring, and the gated single-split store."""
    case = _case(11, 4, 2, dim, q_lens=[3, 1], starts=[70, 20], windows=[None] * 2, ring=False, page=16)
    _compare(case, 3, block_n=16)
    case = _case(12, 4, 2, dim, q_lens=[1, 4], starts=[30, 50], windows=[W] * 2, ring=True)
    _compare(case, 2)
    case = _case(13, 4, 2, dim, q_lens=[2], starts=[9], windows=[None], ring=False)
    gate = torch.randn(2, 4, dim, generator=torch.Generator().manual_seed(1))
    _compare(case, 1, gate=gate)


@pytest.mark.parametrize("splits", [1, 4])
def test_windowed_draft_over_ring(splits):
    """Draft steps and extend: the window rule and the ring slot map, per request."""
    case = _case(1, 4, 2, 32, q_lens=[1, 4, 1, 2], starts=[3, 30, 77, 19], windows=[W] * 4, ring=True)
    _compare(case, splits)


@pytest.mark.parametrize("splits", [40, MERGE_MAX_BLOCK_S + 44])
def test_many_splits_merge(splits):
    """The merge over tens of splits in one load round, and over more than one round's worth
    (MERGE_MAX_BLOCK_S): 4,503 keys over 16-key tiles put keys in 282 of the 300 splits (the rest,
    and most of the short request's, are empty)."""
    case = _case(5, 4, 2, 32, q_lens=[3, 1], starts=[4500, 700], windows=[None] * 2, ring=False, page=16)
    _compare(case, splits, block_n=16)


@pytest.mark.parametrize("splits", [1, 3])
def test_rows_that_see_no_key_of_a_tile_yet(splits):
    """No sink and a short window under many queries: within one program some rows see keys of a
    tile while others have seen none so far (running max still -inf); the update of the rows that
    see keys must leave the others' sums untouched (no -inf - -inf)."""
    win = DraftWindow(sink=0, window=4)
    case = _case(8, 4, 2, 16, q_lens=[40], starts=[40], windows=[win], ring=False, page=4)
    _compare(case, splits, block_n=16)


def test_mixed_windows_in_one_paged_forward():
    """window_min_context: some requests of one forward use the window, others read every key."""
    case = _case(2, 6, 3, 16, q_lens=[2, 3, 1], starts=[50, 10, 64], windows=[W, None, W], ring=False, page=4)
    _compare(case, splits=2)


@pytest.mark.parametrize("windowed", [False, True])
def test_prefill_chunk(windowed):
    """Chunked prefill: a long q block (several query tiles) after earlier chunks."""
    win = [W, W] if windowed else [None, None]
    case = _case(3, 4, 2, 16, q_lens=[37, 20], starts=[25, 0], windows=win, ring=False)
    _compare(case, splits=2)


def test_random_cases():
    rng = random.Random(7)
    for seed in range(6):
        B = rng.randint(1, 3)
        lens = [rng.randint(1, 9) for _ in range(B)]
        starts = [rng.randint(0, 70) for _ in range(B)]
        win = DraftWindow(rng.randint(0, 5), rng.randint(1, 20))
        ring = rng.random() < 0.5
        wins = [win] * B if ring else [win if rng.random() < 0.5 else None for _ in range(B)]
        case = _case(seed, 4, 2, 16, lens, starts, wins, ring, page=rng.choice([1, 4, 16]), d=max(lens))
        _compare(case, splits=rng.choice([None, 1, 2, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_put(dtype):
    """One launch writes K and V rows (k a strided row view, v contiguous) at scattered slots,
    casting fp32 activations to the cache dtype; other slots stay untouched."""
    g = torch.Generator().manual_seed(5)
    T, kv, D = 6, 2, 16
    k = torch.randn(T, kv, 2 * D, generator=g)[..., :D].to(DEVICE)
    v = torch.randn(T, kv, D, generator=g).to(DEVICE)
    slots = torch.tensor([9, 0, 31, 4, 17, 22], device=DEVICE)
    caches = [torch.randn(40, kv, D, generator=g).to(DEVICE, dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    TorchBackend().store_kv(k, v, *want, slots)
    store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    store_kv(k[:0], v[:0], *caches, slots[:0])  # no tokens: nothing written, no launch
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(ValueError, match="slots"):
        store_kv(k, v, *caches, slots[:3])


FP8_SCALES = (0.37, 1.6)  # per-layer (k, v) scales, neither a power of two


@pytest.mark.parametrize("path", ["paged", "contiguous", "ring", "prefill"])
def test_fp8_kv_cache(path):
    """fp8 e4m3 K / V widened in registers with the scales applied (k's folded into the softmax
    scale, v's into the output) against the twin's ``code * scale``: decode / verify over scattered
    pages (the general loop, with splits), whole 64-key tiles (the contiguous path), the windowed
    draft over its ring, and a prefill chunk. Outputs are mixes of values up to ~700: fp32 rounding
    of ~1e-7 relative."""
    win = DraftWindow(sink=4, window=16)
    make = {
        "paged": lambda: _case(1, 6, 2, 16, q_lens=[1, 5, 3], starts=[40, 7, 90], windows=[None] * 3, ring=False),
        "contiguous": lambda: _case(4, 8, 2, 32, q_lens=[7, 1], starts=[150, 97], windows=[None] * 2, ring=False,
                                    page=64),
        "ring": lambda: _case(3, 4, 2, 16, q_lens=[1, 4], starts=[60, 33], windows=[win] * 2, ring=True),
        "prefill": lambda: _case(2, 4, 2, 16, q_lens=[PREFILL_MIN_Q + 6, 3], starts=[30, 9], windows=[None] * 2,
                                 ring=False),
    }[path]
    for splits in (1, 3):
        c = _fp8(make(), FP8_SCALES)  # a fresh case: _compare moves its context to the device
        _compare(c, splits, atol=5e-4, kv_scale=FP8_SCALES, **({"block_n": 64} if path == "contiguous" else {}))


def test_store_kv_fp8_matches_the_twin():
    """Into fp8 caches, the kernel writes what ``quant.quantize_kv`` does: times 1 / the layer's
    scale, saturated at ±448 (some rows here exceed it), rounded to nearest even — bit for bit on a
    GPU. Triton's interpreter emulates the fp8 cast with ties rounded away from zero and no carry
    into the exponent, so on the CPU codes may differ by one step (1/8 relative) at such values."""
    g = torch.Generator().manual_seed(6)
    T, kv, D = 6, 2, 16
    k = (torch.randn(T, kv, D, generator=g) * 200).to(DEVICE, torch.bfloat16)
    v = (torch.randn(T, kv, D, generator=g) * 900).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([9, 0, 31, 4, 17, 22], device=DEVICE)
    caches = [torch.zeros(40, kv, D, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(2)]
    want = [c.clone() for c in caches]
    TorchBackend().store_kv(k, v, *want, slots, FP8_SCALES)
    store_kv(k, v, *caches, slots, FP8_SCALES)
    for got, ref in zip(caches, want):
        if DEVICE == "cuda":
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
        else:
            g32, r32 = got.float().cpu(), ref.float().cpu()
            assert ((g32 - r32).abs() <= r32.abs() / 8).all()
            assert (g32 == r32).float().mean() > 0.9
    assert want[1].float().abs().max() == 448  # saturated, not NaN
    assert not want[0].float().isnan().any()


def test_meta_rejects_two_windows():
    ctx = ForwardContext([0, 0], [1, 1], PagedSlots(torch.zeros(2, 1, dtype=torch.long), 8),
                         windows=[DraftWindow(4, 16), DraftWindow(2, 16)])
    with pytest.raises(ValueError, match="one draft window"):
        AttentionMeta.from_context(ctx, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [128, 256])
def test_bf16_real_head_dims_gpu(dim):
    """The 35B shape: 16 q heads, 2 KV heads, head_dim 256 (and 128), bf16 in, fp32 accumulate:
    verify / decode over pages of 16 (the general loop) and 64 (whole 64-key tiles, the contiguous
    path's verify launch), a prefill chunk (the [128, 256] prefill tile at head_dim 256), the draft ring."""
    for page in (16, 64):
        case = _case(4, 16, 2, dim, q_lens=[7, 1], starts=[5000, 300], windows=[None, None], ring=False, page=page,
                     dtype=torch.bfloat16)
        _compare(case, atol=2e-2)
    for q_lens in ([9, 1], [9, 9]):  # the wide verify tile (16 query rows x the group of 8)
        case = _case(7, 16, 2, dim, q_lens=q_lens, starts=[5000, 300], windows=[None, None], ring=False, page=64,
                     dtype=torch.bfloat16)
        _compare(case, atol=2e-2)
    for page in (16, 64):
        case = _case(6, 16, 2, dim, q_lens=[PREFILL_MIN_Q + 70, 2], starts=[700, 9], windows=[None, None],
                     ring=False, page=page, dtype=torch.bfloat16)
        _compare(case, atol=2e-2)
    case = _case(5, 16, 2, dim, q_lens=[1, 7], starts=[9000, 4200], windows=[DraftWindow(64, 4032)] * 2, ring=True,
                 d=7, dtype=torch.bfloat16)
    _compare(case, atol=2e-2)
    # fp8 caches (K / V of magnitude ~300, scales ~1): the widened tiles in bf16 arithmetic
    for page in (16, 64):
        for q_lens, starts in (([7, 1], [5000, 300]), ([PREFILL_MIN_Q + 70, 2], [700, 9])):
            case = _case(8, 16, 2, dim, q_lens=q_lens, starts=starts, windows=[None, None], ring=False, page=page,
                         dtype=torch.bfloat16)
            _compare(_fp8(case, FP8_SCALES), atol=3.0, kv_scale=FP8_SCALES)


@pytest.mark.whole_tiles
@pytest.mark.parametrize("preset,mode", [("tiny-llama", "windowed"), ("tiny-qwen3.5-moe", "native"),
                                         ("tiny-nemotron-h", "windowed")])
def test_engine_greedy_identical_with_triton_backend(preset, mode):
    """The whole engine on the Triton backend (prefill chunks, draft window, ring, verify) emits the
    same greedy tokens as on the reference backend."""
    from tests.helpers import tiny_model
    from wmtp import LLM, SamplingParams, SpecConfig

    spec = SpecConfig(mode=mode, num_draft_tokens=3, window=8, sink=2)
    prompts = [[5, 9, 3] * 6, [7] * 13]  # longer than sink + W, small: the interpreter is slow
    outs = []
    for backend in ("torch", "triton"):  # the same weights (seed) on both
        llm = LLM(tiny_model(preset, DEVICE, backend), spec=spec, max_model_len=64, max_num_seqs=2, prefill_chunk=16)
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))])
    assert outs[0] == outs[1]
