"""Triton routed-expert GEMV for decode-sized batches (B·d tokens): no host sync, two launches.

At decode / verify / draft sizes each (token, chosen expert) pair is one matrix-vector product, so
the cost is reading the chosen experts' weights. The reference (``TorchBackend.moe``) loops over the
distinct experts with ``torch.unique`` (a host sync per layer) and suits large prefill batches; this
path handles the pairs directly: ``out[p] = W[idx[p]] @ x[p]`` for every pair p, launched once for
gate_up and once for down. Its twin is the reference; ``tests/test_moe_kernel.py`` compares them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Above this many (token, expert) pairs the grouped reference (one GEMM per distinct expert) wins.
MAX_GEMV_PAIRS = 256

if triton is not None:

    @triton.jit
    def _expert_gemv_kernel(X, W, IDX, OUT, N, K, stride_we, stride_wn,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(IDX + p).to(tl.int64)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(W + e * stride_we + rows[:, None] * stride_wn + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xv = tl.load(X + p * K + ks, mask=k_ok, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xv[None, :].to(tl.float32), 1)
        tl.store(OUT + p * N + rows, acc.to(OUT.dtype.element_ty), mask=row_ok)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[p] = weight[idx[p]] @ x[p]``; x [P, K], weight [E, N, K], idx [P] -> [P, N]."""
    P, K = x.shape
    E, N, K2 = weight.shape
    if K2 != K or idx.shape != (P,):
        raise ValueError(f"expert_gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, idx {tuple(idx.shape)} disagree")
    out = torch.empty(P, N, device=x.device, dtype=x.dtype)
    if P == 0:
        return out
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_n = 32
    _expert_gemv_kernel[(P, triton.cdiv(N, block_n))](
        x.contiguous(), weight, idx.contiguous(), out, N, K, weight.stride(0), weight.stride(1),
        BLOCK_N=block_n, BLOCK_K=128,
    )
    return out


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: top-k weights (fp32, renormalised if ``norm_topk_prob``) and expert ids [N, k]."""
    probs = torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w, top_i


def routed_experts_gemv(x, router_weight, gate_up, down, top_k, norm_topk_prob) -> torch.Tensor:
    """Same contract as ``Backend.moe`` (softmax router, top-k, SwiGLU experts), pair by pair."""
    top_w, top_i = route(x, router_weight, top_k, norm_topk_prob)
    idx = top_i.flatten()
    pairs = x.repeat_interleave(top_k, dim=0)
    h = expert_gemv(pairs, gate_up, idx)
    inter = down.shape[-1]
    h = F.silu(h[:, :inter]) * h[:, inter:]
    y = expert_gemv(h, down, idx).view(x.shape[0], top_k, -1)
    return (y.float() * top_w[..., None]).sum(1).to(x.dtype)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM (CUTLASS) takes bf16 on CUDA GPUs of sm80+."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def routed_experts_grouped(x, router_weight, gate_up, down, top_k, norm_topk_prob) -> torch.Tensor:
    """Same contract as ``Backend.moe`` for many tokens (prefill, large batches): the (token, expert)
    pairs are sorted by expert and each expert's rows go through two grouped GEMMs. Expert offsets
    are counted on the device (no host sync, so it is graph-capturable too)."""
    top_w, top_i = route(x, router_weight, top_k, norm_topk_prob)
    n_exp, inter = gate_up.shape[0], down.shape[-1]
    flat = top_i.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_exp, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offs)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch.empty(flat.shape[0], x.shape[1], device=x.device, dtype=x.dtype)
    y[order] = F.grouped_mm(h, down.transpose(1, 2), offs=offs)
    return (y.view(x.shape[0], top_k, -1).float() * top_w[..., None]).sum(1).to(x.dtype)
