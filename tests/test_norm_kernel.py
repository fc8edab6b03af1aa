"""The Triton RMSNorm kernel (plain, offset, gated) against its twins in the reference backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.norm import (  # noqa: E402
    add_rms_norm, embed_norm_cat, gated_group_rms_norm, norm_rope, qk_norm_rope, rms_norm)
from wmtp.kernels.torch_gdn import gated_rms_norm  # noqa: E402
from wmtp.kernels import torch_mamba2  # noqa: E402
from wmtp.models.backend import TorchBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's CPU interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even), so the
# bf16 cases, whose cast points matter, run on the GPU only.
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 rounding)")])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 48), (1, 2048)])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_matches_reference(shape, offset, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.3 + (0 if offset else 1)).to(DEVICE, dtype)
    want = TorchBackend().rms_norm(x, w, 1e-6, offset)
    got = rms_norm(x, w, 1e-6, offset)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a couple of ulps (fp32 sums in another order)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_embed_norm_cat_matches_reference(offset, dtype):
    """The MTP fc input in one launch: the embedding rows of (strided) ids and the hidden states,
    each normed with its own weight, side by side."""
    g = torch.Generator().manual_seed(2)
    embed = (torch.randn(50, 96, generator=g) * 2).to(DEVICE, dtype)
    hidden = torch.randn(4, 96, generator=g).to(DEVICE, dtype)
    w_e, w_h = ((torch.randn(96, generator=g) * 0.3 + (0 if offset else 1)).to(DEVICE, dtype) for _ in range(2))
    ids = torch.tensor([[3, 0], [49, 0], [3, 0], [17, 0]], device=DEVICE)[:, 0]  # a strided column, a repeat
    want = TorchBackend().embed_norm_cat(ids, embed, hidden, w_e, w_h, 1e-6, offset)
    got = embed_norm_cat(ids, embed, hidden, w_e, w_h, 1e-6, offset)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (4, 192) and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    with pytest.raises(ValueError, match=r"embed_norm_cat: ids \(3,\)"):
        embed_norm_cat(ids[:3], embed, hidden, w_e, w_h, 1e-6, offset)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x, z = (torch.randn(7, 4, 128, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (torch.randn(128, generator=g) * 0.3 + 1).to(DEVICE, dtype)
    want = gated_rms_norm(x, z, w, 1e-6)
    got = rms_norm(x, w, 1e-6, gate=z)
    # bf16: an ulp flip of the rounded intermediate w * norm(x) is scaled by silu(z) (up to ~3x)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


def test_gated_rms_norm_reads_z_in_place():
    """The GDN gate read as a [T, G, R, D] view inside a fused projection (strided, no copy)."""
    g = torch.Generator().manual_seed(4)
    T, G, R, D = 3, 2, 3, 32
    fused = torch.randn(T, G, 5 * R * D, generator=g).to(DEVICE)  # other columns around z
    z = fused[..., 2 * R * D : 3 * R * D].view(T, G, R, D)
    x = torch.randn(T, G * R, D, generator=g).to(DEVICE)
    w = (torch.randn(D, generator=g) * 0.3 + 1).to(DEVICE)
    want = gated_rms_norm(x, z.reshape(T, G * R, D), w, 1e-6)
    assert (rms_norm(x, w, 1e-6, gate=z) - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert (TorchBackend().gated_rms_norm(x, z, w, 1e-6) - want).abs().max().item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_group_rms_norm_matches_reference(dtype):
    """Mamba2's output norm: the gate before the norm, statistics and weight per group, z read in
    place from a slice of the fused in-projection (rows strided)."""
    g = torch.Generator().manual_seed(5)
    T, G, GS = 5, 4, 48
    fused = torch.randn(T, 3 * G * GS, generator=g).to(DEVICE, dtype)
    z, y = fused[:, : G * GS], torch.randn(T, G * GS, generator=g).to(DEVICE, dtype)
    w = (torch.randn(G * GS, generator=g) * 0.3 + 1).to(DEVICE, dtype)
    want = torch_mamba2.gated_group_rms_norm(y, z, w, GS, 1e-5)
    got = gated_group_rms_norm(y, z, w, GS, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    with pytest.raises(ValueError, match=r"gated_group_rms_norm: y \(5, 192\), z \(5, 192\).*group_size 40"):
        gated_group_rms_norm(y, z, w, 40, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_matches_reference(offset, dtype):
    g = torch.Generator().manual_seed(2)
    x, r = ((torch.randn(6, 96, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    w = (torch.randn(96, generator=g) * 0.3 + (0 if offset else 1)).to(DEVICE, dtype)
    want_n, want_s = TorchBackend().add_rms_norm(x, r, w, 1e-6, offset)
    got_n, got_s = add_rms_norm(x, r, w, 1e-6, offset)
    assert torch.equal(got_s, want_s)  # the sum is rounded exactly as the reference's add
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got_n.float() - want_n.float()).abs().max().item() <= tol * want_n.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,rot,norm,offset", [(32, 8, True, True), (16, 16, True, False), (64, 16, False, False),
                                                 (48, 12, True, True)])
def test_norm_rope_matches_reference(dim, rot, norm, offset, dtype):
    """q/k prologue: per-head norm + partial rotate_half RoPE, from a strided view (the gated q
    half of a fused projection), against TorchBackend.norm_rope (rms_norm then apply_rotary)."""
    from wmtp.models.rope import RotaryEmbedding, normalize_rope_config

    g = torch.Generator().manual_seed(dim + rot)
    T, H = 5, 3
    fused = (torch.randn(T, H, 2 * dim, generator=g) * 2).to(DEVICE, dtype)
    x = fused[..., :dim]  # strides (H * 2D, 2D, 1)
    w = (torch.randn(dim, generator=g) * 0.3 + (0 if offset else 1)).to(DEVICE, dtype) if norm else None
    rope = RotaryEmbedding(normalize_rope_config({"rope_theta": 10000.0, "partial_rotary_factor": rot / dim}), dim,
                           4096).to(DEVICE)
    cos, sin = rope(torch.tensor([0, 3, 17, 100, 4095], device=DEVICE))
    want = TorchBackend().norm_rope(x, cos, sin, w, 1e-6, offset)
    got = norm_rope(x, cos, sin, w, 1e-6, offset)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot,norm,offset", [(8, True, True), (32, True, False), (16, False, False)])
def test_qk_norm_rope_matches_reference(rot, norm, offset, dtype):
    """q and k in one launch: q a strided view (the gated half of the fused projection) with 4 heads,
    k another view with 2 and its own weight; against TorchBackend.qk_norm_rope (two norm_ropes)."""
    from wmtp.models.rope import RotaryEmbedding, normalize_rope_config

    g = torch.Generator().manual_seed(rot)
    T, H, HK, D = 3, 4, 2, 32
    fused = (torch.randn(T, H * 2 * D + 2 * HK * D, generator=g) * 2).to(DEVICE, dtype)
    q = fused[:, :H * 2 * D].view(T, H, 2 * D)[..., :D]
    k = fused[:, H * 2 * D:H * 2 * D + HK * D].view(T, HK, D)
    wq, wk = ((torch.randn(D, generator=g) * 0.3 + (0 if offset else 1)).to(DEVICE, dtype) if norm else None
              for _ in range(2))
    rope = RotaryEmbedding(normalize_rope_config({"rope_theta": 10000.0, "partial_rotary_factor": rot / D}), D,
                           4096).to(DEVICE)
    cos, sin = rope(torch.tensor([7, 8, 4000], device=DEVICE))
    want = TorchBackend().qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, offset)
    got = qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, offset)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()
    if norm:  # each tensor took its own weight
        assert not torch.allclose(got[1], norm_rope(k, cos, sin, wq, 1e-6, offset))


def test_norm_rope_errors_name_the_tensors():
    x = torch.zeros(2, 3, 8, device=DEVICE)
    cos = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos"):
        norm_rope(x, cos[:, :3], cos[:, :3], None, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        norm_rope(x, cos, cos, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="x"):
        norm_rope(x[0], cos, cos, None, 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rope: q .* and k"):
        qk_norm_rope(x, torch.zeros(2, 1, 4, device=DEVICE), cos, cos, None, None, 1e-6)
    with pytest.raises(ValueError, match="both or neither"):
        qk_norm_rope(x, x, cos, cos, torch.ones(8, device=DEVICE), None, 1e-6)
    with pytest.raises(ValueError, match=r"norm_rope: weight \(4,\)"):
        qk_norm_rope(x, x, cos, cos, torch.ones(8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)


def test_shape_errors_name_the_tensors():
    with pytest.raises(ValueError, match="add_rms_norm"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 7), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-6)


def test_prefill_launches_take_several_rows_a_program(monkeypatch):
    """On a GPU (whole tiles off) a launch keeps a row a program below ``PREFILL_ROWS`` rows and
    takes rows of up to 1024 elements together past it: GDN's gated norm over 8,192 tokens x 32 heads
    of 128 channels 8, q / k heads of 256 channels 4, 2048-wide rows one; the arithmetic is the
    multi-row path these tests run."""
    import wmtp.kernels.common as common
    from wmtp.kernels.norm import PREFILL_ROWS, _rows

    monkeypatch.setattr(common, "_WHOLE_TILES", False)
    assert [_rows(n, d) for n, d in ((1, 128), (PREFILL_ROWS - 1, 128), (8192 * 32, 128), (8192 * 18, 256),
                                     (PREFILL_ROWS, 2048))] == [1, 1, 8, 4, 1]
