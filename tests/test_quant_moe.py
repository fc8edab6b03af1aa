"""The decode MoE kernels (``wmtp.kernels.moe``) over quantized experts against their twin, the
reference MoE (``TorchBackend.moe``) over the dequantized experts: NVFP4 and block FP8, 1 and 7
tokens, top-k not a power of two, with a shared expert (quantized, riding in the routed launches,
or float, through the linears) and without."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.common import SharedExpert  # noqa: E402
from wmtp.kernels.moe import down_combine, expert_gemv, moe_gemv, relu2_gemv, swiglu_gemv, swiglu_gemv_with_shared  # noqa: E402
from wmtp.kernels.quant_tiles import x_groups, x_groups_reference  # noqa: E402
from wmtp.models.backend import TorchBackend  # noqa: E402
from wmtp.quant import FP8Block, NVFP4, QuantWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, id="bf16")
FORMATS = [pytest.param(NVFP4(), id="nvfp4"), pytest.param(FP8Block(), id="fp8")]


def _experts(fmt, shapes: list[tuple[int, int]], e: int, seed: int) -> QuantWeight:
    """[E, sum of N, K] experts whose row blocks (gate, up) are quantized apart, as checkpoints hold them."""
    g = torch.Generator().manual_seed(seed)
    k = shapes[0][1]
    parts = [fmt.to_model(fmt.quantize(torch.randn(e, n, k, generator=g) * k**-0.5), n) for n, _ in shapes]
    dim = {s: (-1 if s in fmt.row_vectors else -2) for s in fmt.suffixes}
    return QuantWeight(fmt, {s: torch.cat([p[s] for p in parts], dim=dim[s]).to(DEVICE) for s in fmt.suffixes}, k)


def _linear(fmt, n: int, k: int, seed: int) -> QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    return QuantWeight(fmt, {s: v.to(DEVICE) for s, v in fmt.to_model(fmt.quantize(w), n).items()}, k)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: 1e-5 of the largest value (sums in another order); bf16: a few output roundings of the
    chain (the reference rounds the dequantized weight to bf16 too) and the interpreter's truncation."""
    rel = 1e-5 if want.dtype == torch.float32 else (2e-2 if DEVICE == "cuda" else 5e-2)
    return got.dtype == want.dtype and (got.float() - want.float()).abs().max().item() <= rel * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_and_down_combine_match_the_reference(fmt, dtype):
    E, H, inter, top_k, T = 6, 160, 48, 3, 5  # N not a multiple of the row tile; K over several steps
    gate_up = _experts(fmt, [(inter, H), (inter, H)], E, seed=1)
    down = _experts(fmt, [(H, inter)], E, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
    gate, up = gate_up.rows(slice(0, inter)), gate_up.rows(slice(inter, None))
    h = swiglu_gemv(x, gate, up, idx.view(-1), top_k, BLOCK_N=16, BLOCK_K=64)
    F = torch.nn.functional
    gu = torch.stack([F.linear(x[p // top_k], gate_up[int(e)].dequantize(dtype)) for p, e in enumerate(idx.view(-1))])
    want_h = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert _close(h, want_h)
    assert _close(swiglu_gemv(x, gate, up, idx.view(-1), top_k, BLOCK_N=16, BLOCK_K=64, FMA=True), want_h)
    top_w = torch.rand(T, top_k, generator=g).to(DEVICE)
    out = down_combine(want_h, down, idx, top_w, top_k, BLOCK_N=32, BLOCK_K=32)
    y = torch.stack([F.linear(want_h[p], down[int(e)].dequantize(dtype)) for p, e in enumerate(idx.view(-1))])
    want = (y.view(T, top_k, H).float() * top_w[..., None]).sum(1).to(dtype)
    assert _close(out, want)


@pytest.mark.parametrize("shared", ["quantized", "float", None])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_gemv_matches_the_reference_moe(fmt, tokens, shared):
    """The whole decode path (router GEMM, routing, routed experts, shared expert) against
    ``TorchBackend.moe`` over the same quantized weights."""
    E, H, inter, top_k = 8, 64, 32, 3
    gate_up = _experts(fmt, [(inter, H), (inter, H)], E, seed=4)
    down = _experts(fmt, [(H, inter)], E, seed=5)
    g = torch.Generator().manual_seed(tokens)
    router = (torch.randn(E, H, generator=g) * 0.5).to(DEVICE)
    sh = None
    if shared is not None:
        gate = (torch.randn(1, H, generator=g) * H**-0.5).to(DEVICE)
        if shared == "quantized":
            sh = SharedExpert(_linear(fmt, 32, H, 6), _linear(fmt, 32, H, 7), _linear(fmt, H, 32, 8), gate)
        else:
            sh = SharedExpert(*((torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE)
                                for n, k in ((24, H), (24, H), (H, 24))), gate)
    x = torch.randn(tokens, H, generator=g).to(DEVICE)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, True, sh)
    assert _close(moe_gemv(x, router, gate_up, down, top_k, True, sh), want)


def test_bad_experts_name_the_problem():
    w = _experts(NVFP4(), [(16, 32), (16, 32)], 2, seed=0)
    gate, up = w.rows(slice(0, 16)), w.rows(slice(16, None))
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"swiglu_gemv: weight \(2, 16, 32\) must be \[E, N, 48\]"):
        swiglu_gemv(torch.zeros(1, 48, device=DEVICE), gate, up, one, 1)
    with pytest.raises(ValueError, match=r"swiglu_gemv: idx \(2,\) must be \[1\]"):
        swiglu_gemv(torch.zeros(1, 32, device=DEVICE), gate, up, torch.zeros(2, dtype=torch.long, device=DEVICE), 1)
    with pytest.raises(ValueError, match="w_up .* must match w_gate"):
        swiglu_gemv(torch.zeros(1, 32, device=DEVICE), gate, _experts(FP8Block(), [(16, 32)], 2, seed=0), one, 1)
    with pytest.raises(ValueError, match="swiglu_gemv: HFMA=True needs NVFP4 weights .* got torch.float32 x"):
        swiglu_gemv(torch.zeros(1, 32, device=DEVICE), gate, up, one, 1, HFMA=True)
    with pytest.raises(ValueError, match="down_combine: h"):
        down_combine(torch.zeros(3, 32, device=DEVICE), w, torch.zeros(3, device=DEVICE), torch.zeros(3), 2)


@pytest.mark.parametrize("shared", ["one buffer", "apart", None])
def test_down_combine_by_pairs_matches_the_fused_kernel(shared):
    """``down_combine``'s pair-wise path (HFMA=True: every pair's row and the shared rows by the f16x2
    pair GEMV, then ``combine_sorted`` with the sigmoid-gated shared term) against the fused kernel
    (HFMA=False) and the reference; the shared rows read either as the routed rows' continuation in
    one buffer (as ``swiglu_gemv_with_shared`` returns them) or from a tensor apart."""
    fmt, E, H, inter, top_k, T = NVFP4(), 6, 80, 64, 3, 4
    dtype = torch.bfloat16
    down, down_s = _experts(fmt, [(H, inter)], E, seed=31), _linear(fmt, H, inter, 32)
    g = torch.Generator().manual_seed(33)
    buf = torch.randn((T * top_k + T) * inter, generator=g).to(DEVICE, dtype)
    h = buf[:T * top_k * inter].view(T * top_k, inter)
    h_s = buf[T * top_k * inter:].view(T, inter)
    if shared == "apart":
        h_s = h_s.clone()
    idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
    top_w = torch.rand(T, top_k, generator=g).to(DEVICE)
    logit = torch.randn(T, generator=g).to(DEVICE)
    sh = None if shared is None else (h_s, down_s, logit)
    F = torch.nn.functional
    want = torch.stack([sum(top_w[t, j] * F.linear(h[t * top_k + j], down[int(idx[t, j])].dequantize(dtype)).float()
                            for j in range(top_k)) for t in range(T)])
    if sh is not None:
        want = want + torch.sigmoid(logit)[:, None] * F.linear(h_s, down_s.dequantize(dtype)).float()
    got = down_combine(h, down, idx, top_w, top_k, sh, HFMA=True, BLOCK_N=16, BLOCK_K=32)
    fused = down_combine(h, down, idx, top_w, top_k, sh, HFMA=False)
    assert _close(got, want.to(dtype)) and _close(got, fused)
    with pytest.raises(ValueError, match=r"down_combine: HFMA=True needs NVFP4 weights .* shared h \(4, 32\)"):
        down_combine(h, down, idx, top_w, top_k, (h_s[:, :32], _linear(fmt, H, 32, 34), logit), HFMA=True)


@pytest.mark.parametrize("T, top_k, fmt, pairs", [(4, 7, NVFP4(), True), (1, 3, NVFP4(), True), (2, 3, FP8Block(), False)])
def test_down_combine_takes_pairs_where_the_f16x2_form_is(monkeypatch, T, top_k, fmt, pairs):
    """Where the f16x2 form is the default (forced here: the interpreter's is off), ``down_combine``
    goes by pairs over NVFP4 experts at a verify's rows and a token's, and keeps the fused kernel
    over FP8 ones; both agree with the reference."""
    import wmtp.kernels.moe as moe

    E, H, inter = 9, 48, 64
    down, down_s = _experts(fmt, [(H, inter)], E, seed=41), _linear(fmt, H, inter, 42)
    g = torch.Generator().manual_seed(43)
    h = torch.randn(T * top_k, inter, generator=g).to(DEVICE, torch.bfloat16)
    h_s = torch.randn(T, inter, generator=g).to(DEVICE, torch.bfloat16)
    idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
    top_w, logit = torch.rand(T, top_k, generator=g).to(DEVICE), torch.randn(T, generator=g).to(DEVICE)
    calls = []
    real = moe._down_pairs
    monkeypatch.setattr(moe, "hfma_default", lambda device: True)
    monkeypatch.setattr(moe, "_down_pairs", lambda *a: calls.append(a) or real(*a))
    got = down_combine(h, down, idx, top_w, top_k, (h_s, down_s, logit))
    assert bool(calls) == pairs
    F = torch.nn.functional
    want = torch.stack([sum(top_w[t, j] * F.linear(h[t * top_k + j], down[int(idx[t, j])].dequantize(torch.bfloat16)).float()
                            for j in range(top_k)) for t in range(T)])
    want = want + torch.sigmoid(logit)[:, None] * F.linear(h_s, down_s.dequantize(torch.bfloat16)).float()
    assert _close(got, want.to(torch.bfloat16))


def test_hfma_form_rows_beyond_fp16s_range():
    """x_groups scales each token row by a power of 2: rows of 1e6 (past fp16's 65504) and 1e-6
    (below its normals) come out of the f16x2 form as exact as a row of 1, each to its own size."""
    fmt, E, H, inter = NVFP4(), 3, 128, 40
    w = _experts(fmt, [(inter, H)], E, seed=27)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(28))
    x = (x * torch.tensor([[1e6], [1.0], [1e-6]])).to(DEVICE, torch.bfloat16)
    idx = torch.tensor([2, 0, 1], device=DEVICE)
    got = expert_gemv("expert_gemv", x, w, idx, HFMA=True, BLOCK_N=8, BLOCK_K=64)
    want = torch.stack([torch.nn.functional.linear(x[p], w[int(e)].dequantize(torch.bfloat16)) for p, e in enumerate(idx)])
    assert torch.isfinite(got).all()
    for r in range(3):
        assert _close(got[r], want[r]), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="cvt.rn.f16x2.e4m3x2 needs a CUDA device of compute capability 8.9+")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_e2m1_through_e4m3_equals_the_bit_placement(dtype, monkeypatch):
    """The NVFP4 tiles' decode through e4m3 conversion (``quant_tiles.e2m1_pairs``, on by default
    here) against the fp16 bit placement (``WMTP_E2M1_CVT=0``), to the bit, in the skinny linear
    kernel and both MoE GEMVs, over weights whose packed bytes take all 256 values (every pair of
    codes: signed zeros, the subnormal 0.5, 6)."""
    from wmtp.kernels.linear import LinearTiles, skinny_linear
    from wmtp.kernels.quant_tiles import e2m1_cvt

    assert e2m1_cvt(torch.device(DEVICE))["CVT"]
    fmt, E, H, inter, top_k, T = NVFP4(), 4, 64, 64, 2, 3
    gate_up = _experts(fmt, [(inter, H), (inter, H)], E, seed=9)
    down = _experts(fmt, [(H, inter)], E, seed=10)
    for w in (gate_up, down):
        codes = w.tensors["weight"]
        w.tensors["weight"] = (torch.arange(codes.numel(), device=DEVICE) * 37 % 256).to(torch.uint8).view_as(codes)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
    top_w = torch.rand(T, top_k, generator=g).to(DEVICE)
    gate, up = gate_up.rows(slice(0, inter)), gate_up.rows(slice(inter, None))

    def run():  # the fp32 forms (the f16x2 form needs the e4m3 decode: test_hfma_form_over_every_byte)
        h = swiglu_gemv(x, gate, up, idx.view(-1), top_k, BLOCK_N=16, BLOCK_K=64, HFMA=False)
        return (skinny_linear(x, gate_up[1], tiles=LinearTiles(16, 32, 1, 4)), h,
                down_combine(h, down, idx, top_w, top_k, BLOCK_N=32, BLOCK_K=32, HFMA=False))

    got = run()
    monkeypatch.setenv("WMTP_E2M1_CVT", "0")
    want = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert want[0].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_down_combine_with_a_quantized_shared_expert(fmt, dtype):
    """``down_combine``'s shared term (the shared expert's down projection times its sigmoid gate)
    over a quantized weight in the routed format, at a verify's tokens and at one."""
    E, H, inter, shared_inter, top_k = 6, 96, 48, 32, 3
    down = _experts(fmt, [(H, inter)], E, seed=9)
    down_s = _linear(fmt, H, shared_inter, 10)
    F = torch.nn.functional
    for T in (1, 5):
        g = torch.Generator().manual_seed(11 + T)
        h = torch.randn(T * top_k, inter, generator=g).to(DEVICE, dtype)
        h_s = torch.randn(T, shared_inter, generator=g).to(DEVICE, dtype)
        logit = torch.randn(T, generator=g).to(DEVICE)
        idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
        top_w = torch.rand(T, top_k, generator=g).to(DEVICE)
        out = down_combine(h, down, idx, top_w, top_k, shared=(h_s, down_s, logit))
        y = torch.stack([F.linear(h[p], down[int(e)].dequantize(dtype)) for p, e in enumerate(idx.view(-1))])
        routed = (y.view(T, top_k, H).float() * top_w[..., None]).sum(1)
        s = F.linear(h_s, down_s.dequantize(dtype)).float() * torch.sigmoid(logit.float())[:, None]
        assert _close(out, (routed + s).to(dtype)), T


@pytest.mark.parametrize("shape", [(3, 160), (2, 64), (1, 2688)])
def test_x_groups_matches_its_twin(shape):
    """``x_groups`` (the f16x2 form's inputs) against ``x_groups_reference``, word for word, over
    rows of very different magnitudes and an all-zero row; and its words times the inverse scale
    give back x in the documented order."""
    T, K = shape
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(T, K, generator=g) * torch.tensor([1e-3, 7.0, 3e4])[:T, None]).to(DEVICE, torch.bfloat16)
    if T > 1:
        x[1] = 0
    words, inv = x_groups(x)
    want_words, want_inv = x_groups_reference(x)
    assert torch.equal(words, want_words) and torch.equal(inv, want_inv)
    back = words.view(torch.float16).float().view(T, K // 32, 2, 2, 2, 4) * inv[:, None, None, None, None, None]
    order = back.permute(0, 1, 4, 3, 5, 2).reshape(T, K)  # parity, half, group, pair -> input order
    assert torch.equal(order, x.float())
    with pytest.raises(ValueError, match=r"x_groups: x \(1, 48\)"):
        x_groups(torch.zeros(1, 48, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize("act", ["swiglu", "relu2", "linear"])
def test_hfma_form_matches_the_reference(act):
    """The pair-wise GEMV's f16x2 form (NVFP4 experts, 16-bit x: ``_pair_hfma_kernel``) against the
    reference over the dequantized experts, with the K step dividing K and not, rows not a multiple
    of the row tile, and the shared expert's rows (of another width) in the same launch; and equal
    to the fp32 forms within bf16's rounding."""
    fmt, E, H, inter, top_k, T = NVFP4(), 5, 96, 40, 3, 4
    dtype = torch.bfloat16
    w = _experts(fmt, [(inter, H), (inter, H)], E, seed=21)
    gate, up = w.rows(slice(0, inter)), w.rows(slice(inter, None))
    g = torch.Generator().manual_seed(22)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, E, (T * top_k,), generator=g).to(DEVICE)
    F = torch.nn.functional
    lin = torch.stack([F.linear(x[p // top_k], w[int(e)].dequantize(dtype)) for p, e in enumerate(idx)])
    for tiles in ({"BLOCK_N": 16, "BLOCK_K": 64}, {"BLOCK_N": 8, "BLOCK_K": 32}):
        hfma = {"HFMA": True}
        if act == "swiglu":
            want = F.silu(lin[:, :inter]) * lin[:, inter:]
            sg, su = _linear(fmt, 24, H, 23), _linear(fmt, 24, H, 24)
            got, got_s = swiglu_gemv_with_shared(x, gate, up, idx, top_k, sg, su, **hfma, **tiles)
            want_s = F.silu(F.linear(x, sg.dequantize(dtype))) * F.linear(x, su.dequantize(dtype))
            assert _close(got_s, want_s)
            fp32 = swiglu_gemv(x, gate, up, idx, top_k, HFMA=False, **tiles)
        elif act == "relu2":
            want = torch.relu(lin[:, inter:]) ** 2
            got = relu2_gemv(x, up, idx, top_k, **hfma, **tiles)
            fp32 = relu2_gemv(x, up, idx, top_k, HFMA=False, **tiles)
        else:
            want = lin[:, inter:]
            xs = x.repeat_interleave(top_k, 0)
            got = expert_gemv("expert_gemv", xs, up, idx, **hfma, **tiles)
            fp32 = expert_gemv("expert_gemv", xs, up, idx, HFMA=False, **tiles)
        assert _close(got, want) and _close(got, fp32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="the f16x2 form decodes through cvt.rn.f16x2.e4m3x2 (compute capability 8.9+)")
def test_hfma_form_over_every_byte():
    """The f16x2 form on the GPU (inline PTX) against the reference, over weights whose packed bytes
    take all 256 values, and x spanning six orders of magnitude in a row (the fp16 scaling)."""
    fmt, E, H, inter, top_k, T = NVFP4(), 4, 256, 64, 2, 3
    w = _experts(fmt, [(inter, H)], E, seed=25)
    codes = w.tensors["weight"]
    w.tensors["weight"] = (torch.arange(codes.numel(), device=DEVICE) * 37 % 256).to(torch.uint8).view_as(codes)
    g = torch.Generator().manual_seed(26)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-3, 3, H)).to(DEVICE, torch.bfloat16)
    idx = torch.randint(0, E, (T * top_k,), generator=g).to(DEVICE)
    F = torch.nn.functional
    want = torch.stack([F.linear(x[p // top_k], w[int(e)].dequantize(torch.bfloat16)) for p, e in enumerate(idx)])
    got = expert_gemv("expert_gemv", x.repeat_interleave(top_k, 0), w, idx, HFMA=True)
    assert _close(got, want) and want.abs().max() > 0

