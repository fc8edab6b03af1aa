"""Triton RMSNorm: plain (``w * norm(x)``), Qwen3-Next offset (``norm(x) * (1 + w)``), the GDN
gated form (``w * norm(x) * silu(z)``) and Mamba2's (``w * norm_g(x * silu(z))`` per group), one
program per row at decode sizes (several in prefill: ``_rows``), fp32 statistics; and the attention
heads' prologue ``norm_rope``: the per-head q / k RMSNorm and the partial rotary embedding in one
launch (in PyTorch that is ~14 elementwise kernels per tensor: casts, slices, multiplies, a cat).

At decode sizes each norm is a handful of tiny elementwise kernels in PyTorch (cast, square,
mean, rsqrt, multiplies); one launch instead matters once the step is replayed from a CUDA graph.
The twins are ``TorchBackend.rms_norm`` / ``norm_rope``, ``torch_gdn.gated_rms_norm`` and
``torch_mamba2.gated_group_rms_norm`` (same cast
points, so bf16 results round the same way); ``tests/test_norm_kernel.py`` compares them.
"""

from __future__ import annotations

import torch

from wmtp.kernels.common import launch_tile, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from wmtp.kernels.common import wait_prior

    @triton.jit
    def _rms_row(x, W, OUT, cols, D, eps, OFFSET: tl.constexpr, w_row):
        """Rows ``x`` [R, BLOCK_D] (fp32, masked lanes 0) RMS-normed and weighted by ``W[w_row +
        cols]`` (``w_row`` [R, 1] or 0), rounded as the reference rounds for an output of OUT's
        dtype; returned in fp32."""
        h = x * tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        w = tl.load(W + w_row + cols[None, :], mask=cols[None, :] < D, other=0.0).to(tl.float32)
        if OFFSET:
            return h * (1.0 + w)
        # the reference casts the norm to the input dtype before the weight multiply
        return (h.to(OUT.dtype.element_ty).to(tl.float32) * w).to(W.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(X, W, Z, RES, SUM_OUT, OUT, N, D, W_GROUPS, eps, z_n1, z_n2, z_s0, z_s1, z_s2,
                         OFFSET: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr):
        """Rows ``pid * ROWS ..`` of the N x D input (``_rows``: on a GPU one at decode sizes), row r
        weighted by W's group ``r % W_GROUPS`` of D. GATED: 0 none, 1 ``norm(x) * silu(z)`` (GDN),
        2 ``norm(x * silu(z))`` (Mamba2's gate before the norm)."""
        wait_prior(PDL)
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_D)
        ok = (row < N) & (cols[None, :] < D)
        at = row * D + cols[None, :]
        x = tl.load(X + at, mask=ok, other=0.0)
        if RESIDUAL:  # x + residual, rounded to the activation dtype as the reference's add is
            x = x + tl.load(RES + at, mask=ok, other=0.0)
            tl.store(SUM_OUT + at, x, mask=ok)
        x = x.to(tl.float32)
        if GATED != 0:
            # gate row = (i0, i1, i2) of a [n0, n1, n2, D] strided view (e.g. z inside the fused projection)
            z_row = Z + (row // (z_n1 * z_n2)) * z_s0 + (row // z_n2 % z_n1) * z_s1 + (row % z_n2) * z_s2
            z = tl.load(z_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            gate = z / (1.0 + tl.exp(-z))
            if GATED == 2:
                x = x * gate
        y = _rms_row(x, W, OUT, cols, D, eps, OFFSET, (row % W_GROUPS) * D)
        if GATED == 1:
            y = y * gate
        tl.store(OUT + at, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _embed_norm_cat_kernel(IDS, E, HID, WE, WH, OUT, D, stride_ids, eps, OFFSET: tl.constexpr,
                               BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)  # 0: the token's embedding row, 1: its hidden state
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        row = tl.where(part == 0, E + tl.load(IDS + t * stride_ids) * D, HID + t * D)
        x = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        y = tl.reshape(_rms_row(x, tl.where(part == 0, WE, WH), OUT, cols, D, eps, OFFSET, 0), (BLOCK_D,))
        tl.store(OUT + (2 * t + part) * D + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _normed(X, W, idx, ok, rstd, NORM: tl.constexpr, OFFSET: tl.constexpr):
        """Channels ``idx`` [1, C] of the heads at row pointers X, W [R, 1], RMS-normed with
        ``rstd`` [R, 1] (when NORM), rounded to X's dtype as the reference's norm output is;
        returned in fp32 [R, C]."""
        x = tl.load(X + idx, mask=ok, other=0.0)
        if not NORM:
            return x.to(tl.float32)
        h = x.to(tl.float32) * rstd
        w = tl.load(W + idx, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            y = h * (1.0 + w)
        else:
            y = (h.to(X.dtype.element_ty).to(tl.float32) * w).to(W.dtype.element_ty)
        return y.to(X.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _norm_rope_kernel(X, W, OUT, X2, W2, OUT2, COS, SIN, stride_xt, stride_xh, stride_x2t, stride_x2h, stride_ct,
                          H, H2, T, D, HALF, eps, NORM: tl.constexpr, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        """Rows (token, head) ``pid * ROWS ..`` of X's T x H heads, then of X2's T x H2 (the second
        tensor of the launch: k after q, with its own strides and norm weight; H2 = 0 for one
        tensor). ``_rows``: on a GPU one head a program at decode sizes."""
        wait_prior(PDL)
        pid = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
        live = pid < T * (H + H2)
        second = pid >= T * H
        p = tl.where(second, pid - T * H, pid)
        heads = tl.where(second, H2, H)
        t = (p // heads).to(tl.int64)
        h = p % heads
        x_row = tl.where(second, X2 + t * stride_x2t + h * stride_x2h, X + t * stride_xt + h * stride_xh)
        w = tl.where(second, W2, W)
        out_row = tl.where(second, OUT2, OUT) + p.to(tl.int64) * D
        rstd = tl.zeros((ROWS, 1), dtype=tl.float32)
        if NORM:
            cols = tl.arange(0, BLOCK_D)[None, :]
            x = tl.load(x_row + cols, mask=live & (cols < D), other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        # rotate_half over the first 2*HALF channels: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        i = tl.arange(0, BLOCK_R)[None, :]
        ok = live & (i < HALF)
        x1 = _normed(x_row, w, i, ok, rstd, NORM, OFFSET)
        x2 = _normed(x_row, w, i + HALF, ok, rstd, NORM, OFFSET)
        c = tl.load(COS + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        tl.store(out_row + i, (x1 * c - x2 * s).to(dt), mask=ok)
        tl.store(out_row + i + HALF, (x2 * c + x1 * s).to(dt), mask=ok)
        for r0 in range(2 * HALF, D, BLOCK_P):  # channels past the rotary part pass through (normed)
            j = r0 + tl.arange(0, BLOCK_P)[None, :]
            pas = live & (j < D)
            tl.store(out_row + j, _normed(x_row, w, j, pas, rstd, NORM, OFFSET).to(dt), mask=pas)


# Past this many rows a launch is a prefill chunk's: a GPU program takes rows of up to 1024 elements
# together (GDN's gated norm has a row per token and head, 128 channels: one a program left 262,144
# programs of 128 threads for 8,192 tokens; 4096 elements a program spilled registers); below it every
# row is a program of its own, the shortest latency at decode sizes.
PREFILL_ROWS = 16384


def _rows(n: int, block_d: int) -> int:
    """Rows a program for a launch over ``n`` rows of ``block_d`` channels (``launch_tile``'s GPU tile)."""
    return launch_tile(1 if n < PREFILL_ROWS else max(1, min(64, 1024 // block_d)), n, cap=64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` [..., D]. ``gate`` (the gated GDN form): x's shape, or
    for x [T, G * R, D] a [T, G, R, D] view with any strides (z read in place from the fused
    projection, no copy)."""
    D = x.shape[-1]
    gate_ok = gate is None or gate.shape == x.shape or (
        gate.dim() == 4 and x.dim() == 3 and gate.shape[0] == x.shape[0] and gate.shape[1] * gate.shape[2] == x.shape[1]
        and gate.shape[3] == D)
    if weight.shape != (D,) or not gate_ok or (gate is not None and gate.stride(-1) != 1):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"gate {None if gate is None else tuple(gate.shape)} disagree")
    x2 = x.reshape(-1, D).contiguous()
    out = torch.empty_like(x2)
    if gate is None:
        z, zn, zs = x2, (1, 1), (D, 0, 0)
    else:
        z = gate if gate.dim() == 4 else gate.reshape(-1, D)
        z = z if z.dim() == 4 else z.view(-1, 1, 1, D) if z.is_contiguous() else z.contiguous().view(-1, 1, 1, D)
        zn, zs = z.shape[1:3], z.stride()[:3]
    if x2.shape[0]:
        rows = _rows(x2.shape[0], triton.next_power_of_2(D))
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, z, x2, x2, out, x2.shape[0], D, 1, eps, *zn, *zs, OFFSET=offset, GATED=int(gate is not None),
            RESIDUAL=False, BLOCK_D=triton.next_power_of_2(D), ROWS=rows, **pdl(x.device))
    return out.view(x.shape)


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """Mamba2's output norm (``torch_mamba2.gated_group_rms_norm``, its twin): ``weight *
    rmsnorm_g(y * silu(z))`` over groups of ``group_size`` channels, in one launch; y [T, C]
    contiguous, z [T, C] with unit-strided rows (a slice of the fused in-projection is fine)."""
    T, C = y.shape
    if z.shape != y.shape or weight.shape != (C,) or C % group_size or z.stride(-1) != 1:
        raise ValueError(f"gated_group_rms_norm: y {tuple(y.shape)}, z {tuple(z.shape)} (unit stride on the last "
                         f"dim), weight {tuple(weight.shape)} and group_size {group_size} disagree")
    G = C // group_size
    y2 = y.contiguous()
    out = torch.empty_like(y2)
    if T:
        rows = _rows(T * G, triton.next_power_of_2(group_size))
        _rms_norm_kernel[(triton.cdiv(T * G, rows),)](
            y2, weight, z, y2, y2, out, T * G, group_size, G, eps, G, 1, z.stride(0), group_size, 0, OFFSET=False,
            GATED=2, RESIDUAL=False, BLOCK_D=triton.next_power_of_2(group_size), ROWS=rows, **pdl(y.device))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``rms_norm(s)`` in one launch; returns (normed, s)."""
    D = x.shape[-1]
    if weight.shape != (D,) or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)} disagree")
    x2, r2 = x.reshape(-1, D).contiguous(), residual.reshape(-1, D).contiguous()
    out, summed = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        rows = _rows(x2.shape[0], triton.next_power_of_2(D))
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, x2, r2, summed, out, x2.shape[0], D, 1, eps, 1, 1, D, 0, 0, OFFSET=offset, GATED=0,
            RESIDUAL=True, BLOCK_D=triton.next_power_of_2(D), ROWS=rows, **pdl(x.device))
    return out.view(x.shape), summed.view(x.shape)


def embed_norm_cat(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                   w_h: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """``cat(rms_norm(embed[ids], w_e), rms_norm(hidden, w_h))`` [T, 2D] in one launch: the MTP
    layer's fc input (an embedding lookup, two norms and a cat in PyTorch). ids [T] (int);
    embed [V, D]; hidden [T, D]; w_e, w_h [D]. ids may be strided (a column of an output buffer)."""
    T, D = hidden.shape
    if ids.shape != (T,) or embed.dim() != 2 or embed.shape[1] != D or w_e.shape != (D,) or w_h.shape != (D,) \
            or embed.dtype != hidden.dtype:
        raise ValueError(f"embed_norm_cat: ids {tuple(ids.shape)}, embed {tuple(embed.shape)} {embed.dtype}, hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype}, w_e {tuple(w_e.shape)}, w_h {tuple(w_h.shape)} disagree")
    out = torch.empty(T, 2 * D, device=hidden.device, dtype=hidden.dtype)
    if T:
        _embed_norm_cat_kernel[(T, 2)](ids, embed.contiguous(), hidden.contiguous(), w_e, w_h, out, D, ids.stride(0),
                                       eps, OFFSET=offset, BLOCK_D=triton.next_power_of_2(D), **pdl(hidden.device))
    return out


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float,
              offset: bool = False) -> torch.Tensor:
    """Per-head RMSNorm (when ``weight`` [D] is given) then rotate_half RoPE of the first
    ``rot_dim = cos.shape[-1]`` channels. x [T, heads, D] (any strides with a unit last one, e.g.
    a view into a fused projection); cos, sin [T, rot_dim]. Returns a new contiguous [T, heads, D]."""
    return _norm_rope_launch(((x, weight),), cos, sin, eps, offset)[0]


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_rope`` of q and of k (each with its own norm weight, both or neither given; same
    head_dim and dtype) in one launch."""
    if (q_weight is None) != (k_weight is None) or q.dtype != k.dtype or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must share "
                         "head_dim and dtype, and have norm weights both or neither")
    return _norm_rope_launch(((q, q_weight), (k, k_weight)), cos, sin, eps, offset)


def _norm_rope_launch(parts, cos: torch.Tensor, sin: torch.Tensor, eps: float, offset: bool) -> tuple[torch.Tensor, ...]:
    """Checks each (x, weight) of ``parts`` (one or two) and launches ``_norm_rope_kernel`` over them."""
    outs = []
    for x, weight in parts:
        if x.dim() != 3 or x.stride(-1) != 1:
            raise ValueError(f"norm_rope: x {tuple(x.shape)} must be [T, heads, D] with unit stride on D")
        T, H, D = x.shape
        rot = cos.shape[-1]
        if (cos.shape != (T, rot) or sin.shape != cos.shape or rot % 2 or not 0 < rot <= D
                or cos.stride() != sin.stride()):
            raise ValueError(f"norm_rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [{T}, rot_dim] "
                             f"(same strides) with an even rot_dim <= head_dim {D}")
        if weight is not None and weight.shape != (D,):
            raise ValueError(f"norm_rope: weight {tuple(weight.shape)} must be [{D}]")
        outs.append(torch.empty(T, H, D, device=x.device, dtype=x.dtype))
    (x, w), (x2, w2) = parts[0], parts[-1]
    out, out2 = outs[0], outs[-1]
    T, H, D = x.shape
    H2 = x2.shape[1] if len(parts) == 2 else 0
    if T:
        cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
        rot = cos.shape[-1]
        rows = _rows(T * (H + H2), triton.next_power_of_2(D))
        _norm_rope_kernel[(triton.cdiv(T * (H + H2), rows),)](
            x, x if w is None else w, out, x2, x2 if w2 is None else w2, out2, cos, sin, x.stride(0), x.stride(1),
            x2.stride(0), x2.stride(1), cos.stride(0), H, H2, T, D, rot // 2, eps, NORM=w is not None, OFFSET=offset,
            BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(rot // 2),
            BLOCK_P=launch_tile(triton.next_power_of_2(rot // 2), D - rot), ROWS=rows, **pdl(x.device))
    return tuple(outs)
