"""One quantized decode kernel at a model's shape, launched 4 times, for Nsight Compute to profile
the last (``--launch-skip 3 --launch-count 1``; CONTRIBUTING.md has the sections):

    ncu --kernel-name regex:_pair_hfma --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 benchmarks/ncu_kernel.py nemotron_up

nemotron_up / nemotron_down: Nemotron-3-Super's NVFP4 latent experts at 8 tokens x 22 of 512
(``relu2_gemv`` [2688, 1024], ``expert_gemv`` [1024, 2688]); q35_swiglu: the 35B's NVFP4 SwiGLU
experts with the shared expert at 7 tokens x 8 of 256; fp8_in_proj: Nemotron-3-Super's Mamba
in_proj [18560, 4096] in per-tensor FP8 (``skinny_linear``); nvfp4_in_proj: the 35B's GDN in_proj
[12352, 2048] in NVFP4 (``skinny_linear``). The linears take ``--rows`` token rows (1: a draft step's;
8: a verify's at d = 7)."""

from __future__ import annotations

import argparse

import torch

from wmtp.kernels.linear import skinny_linear
from wmtp.kernels.moe import expert_gemv, relu2_gemv, route_topk, swiglu_gemv_with_shared
from wmtp.quant import FORMATS, FP8Tensor, QuantFormat, QuantWeight

DEV, DT = "cuda", torch.bfloat16


def quantized(fmt: QuantFormat, *shape: int) -> QuantWeight:
    """Random weights of ``shape`` in ``fmt``, experts quantized 16 at a time (tune_moe.py's)."""
    lead, (n, k) = shape[:-2], shape[-2:]
    chunks = [(min(16, lead[0] - e),) for e in range(0, lead[0], 16)] if lead else [()]
    parts = [fmt.to_model(fmt.quantize(torch.randn(*c, n, k, device=DEV, dtype=DT) * k ** -0.5), n) for c in chunks]
    return QuantWeight(fmt, {s: torch.cat([p[s] for p in parts]) for s in parts[0]}, k)


def launch(case: str, rows: int):
    torch.manual_seed(0)
    nv = FORMATS["nvfp4"]()
    if case.startswith("nemotron"):
        T, E, H, inter, k = 8, 512, 1024, 2688, 22
        x = torch.randn(T, H, device=DEV, dtype=DT)
        idx = route_topk(torch.randn(T, E, device=DEV), k, True)[1].view(-1)
        if case == "nemotron_up":
            up = quantized(nv, E, inter, H)
            return lambda: relu2_gemv(x, up, idx, k)
        down, h = quantized(nv, E, H, inter), torch.randn(T * k, inter, device=DEV, dtype=DT)
        return lambda: expert_gemv("down", h, down, idx)
    if case == "q35_swiglu":
        T, E, H, inter, k = 7, 256, 2048, 512, 8
        x = torch.randn(T, H, device=DEV, dtype=DT)
        idx = route_topk(torch.randn(T, E, device=DEV), k, True)[1].view(-1)
        gate_up, sg, su = quantized(nv, E, 2 * inter, H), quantized(nv, inter, H), quantized(nv, inter, H)
        gate, up = gate_up.rows(slice(0, inter)), gate_up.rows(slice(inter, 2 * inter))
        return lambda: swiglu_gemv_with_shared(x, gate, up, idx, k, sg, su)
    n, k, fmt = (18560, 4096, FP8Tensor()) if case == "fp8_in_proj" else (12352, 2048, nv)
    w, x = quantized(fmt, n, k), torch.randn(rows, k, device=DEV, dtype=DT)
    return lambda: skinny_linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=("nemotron_up", "nemotron_down", "q35_swiglu", "fp8_in_proj", "nvfp4_in_proj"))
    ap.add_argument("--rows", type=int, default=1, help="token rows of the linears' input")
    a = ap.parse_args()
    fn = launch(a.case, a.rows)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
