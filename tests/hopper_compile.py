"""The decode kernels over quantized weights, and the paged attention kernel, compiled for Hopper
(sm_90) without a GPU: Triton's front end, its LLVM lowering and ptxas (``test_kernels_compile_sm90``
runs this module in a process of its own, since the CPU test session's Triton interprets kernels
instead of compiling them).

    python -m tests.hopper_compile      # JSON: case -> null, or why it failed
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import tempfile
import traceback

QUANT_FORMATS = {"nvfp4": (1, "*u8", "*fp8e4nv"), "fp8": (2, "*fp8e4nv", "*fp32")}  # code, weight, group scale
CVT = [("nvfp4", True), ("nvfp4", False), ("fp8", False)]  # (format, e2m1 through e4m3)


def _ints(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


# the skinny linear's arguments but W / S (the format's)
LINEAR_TYPES = {"X": "*bf16", "R": "*fp32", "BIAS": "*bf16", "ADD": "*bf16", "OUT": "*bf16",
                "PART": "*fp32", "COUNT": "*i32",
                **dict.fromkeys(("T", "N", "K", "stride_xt", "stride_wn", "stride_sn", "stride_at", "stride_ot", "K_SPLIT"),
                                "i32")}


def cases() -> dict[str, tuple]:
    """name -> (``module:kernel``, argument types by name, constexprs[, launch options])."""
    out = {}
    from wmtp.kernels.linear import quant_tiles

    # at the tiles the engine launches the 35B's projections with (2048 and 12352 outputs)
    for (fmt, cvt), splits, n in itertools.product(CVT, (1, 4), (2048, 12352)):
        code, w, s = QUANT_FORMATS[fmt]
        tiles = quant_tiles(7, n, 2048, code)  # a verify's (one row of NVFP4 takes the FMA path)
        out[f"skinny_linear-{fmt}-cvt{int(cvt)}-splits{splits}-n{n}"] = (
            "wmtp.kernels.linear:_skinny_linear_kernel",
            {**LINEAR_TYPES, "W": w, "S": s},
            # the epilogue's ReLU² and residual sum (Nemotron-H's ReLU² and latent MoE projections) at 2048 outputs
            dict(FORMAT=code, HAS_BIAS=True, RELU2=n == 2048, HAS_ADD=n == 2048, SPLITS=splits, WIDEN=False, PREC="tf32",
                 T_P=16, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, CVT=cvt, GEMV=False, PDL=True),
            {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    # a 16-bit weight through the same split_dot (the linears that stay in the checkpoint's dtype)
    out["skinny_linear-bf16"] = ("wmtp.kernels.linear:_skinny_linear_kernel", {**LINEAR_TYPES, "W": "*bf16", "S": "*bf16"},
                                 dict(FORMAT=0, HAS_BIAS=False, RELU2=False, HAS_ADD=False, SPLITS=4, WIDEN=False,
                                      PREC="tf32", T_P=16, BLOCK_N=32, BLOCK_K=256, CVT=False, GEMV=False, PDL=True),
                                 {"num_warps": 4})
    # a router's fp32 logits from bf16 x and weight (fp32_linear: the bf16 dot, fp32 sums and output)
    out["skinny_linear-fp32-out"] = ("wmtp.kernels.linear:_skinny_linear_kernel",
                                     {**LINEAR_TYPES, "W": "*bf16", "S": "*bf16", "BIAS": "*fp32", "ADD": "*fp32",
                                      "OUT": "*fp32"},
                                     dict(FORMAT=0, HAS_BIAS=False, RELU2=False, HAS_ADD=False, SPLITS=8, WIDEN=False,
                                          PREC="tf32", T_P=16, BLOCK_N=16, BLOCK_K=128, CVT=False, GEMV=False, PDL=True),
                                     {"num_warps": 4})
    # the one-row FMA path (LinearTiles.gemv): NVFP4's default (4 warps), FP8's up to 4096 outputs (32 x 128, 8 warps)
    for (fmt, cvt), (bn, bk) in itertools.product(CVT, ((8, 256), (16, 256), (32, 128))):
        code, w, s = QUANT_FORMATS[fmt]
        out[f"skinny_linear_gemv-{fmt}-cvt{int(cvt)}-{bn}x{bk}"] = (
            "wmtp.kernels.linear:_skinny_linear_kernel",
            {**LINEAR_TYPES, "W": w, "S": s},
            dict(FORMAT=code, HAS_BIAS=False, RELU2=bn == 32, HAS_ADD=bn == 32, SPLITS=4, WIDEN=False, PREC="tf32",
                 T_P=1, BLOCK_N=bn, BLOCK_K=min(bk, 128) if fmt == "fp8" else bk, CVT=cvt, GEMV=True, PDL=True),
            {"num_warps": 8 if fmt == "fp8" else 4})
    from wmtp.kernels.moe import down_combine_tiles, pair_tiles

    # the MoE kernels at the tiles the engine launches them with (a token's, a verify's)
    for (fmt, cvt), act, big in itertools.product(CVT, ("swiglu", "relu2", "linear"), (False, True)):
        code, w, s = QUANT_FORMATS[fmt]
        # at the 35B's K (2048); the 122B's SwiGLU token tile (K 3072) is the verify's
        (bn, bk), warps, fma = pair_tiles(code, ("swiglu", "relu2", "linear").index(act), big, 2048)
        out[f"pair_gemv-{fmt}-cvt{int(cvt)}-{act}-{'verify' if big else 'token'}"] = (
            "wmtp.kernels.moe:_swiglu_gemv_kernel",
            {"X": "*bf16", "WG": w, "WU": w, "CG": s, "CU": s, "RG": "*fp32", "RU": "*fp32", "IDX": "*i64", "SG": w,
             "SU": w, "SCG": s, "SCU": s, "SRG": "*fp32", "SRU": "*fp32", "OUT": "*bf16",
             **_ints("P", "N", "NS", "K", "stride_we", "stride_wn", "stride_ce", "stride_cn", "stride_re", "stride_sn",
                     "stride_scn")},
            dict(TOP_K=8, FORMAT=code, ACT=("swiglu", "relu2", "linear").index(act), BLOCK_N=bn, BLOCK_K=bk, CVT=cvt,
                 FMA=fma, PDL=True), {"num_warps": warps})
        if act == "swiglu":  # tune_moe's other form (FMA or dots) at the same tiles
            case = out[f"pair_gemv-{fmt}-cvt{int(cvt)}-swiglu-{'verify' if big else 'token'}"]
            out[f"pair_gemv_other-{fmt}-cvt{int(cvt)}-{'verify' if big else 'token'}"] = (
                case[0], case[1], {**case[2], "FMA": not fma}, case[3])
    # the f16x2 form (NVFP4, bf16 x) at its default tiles, each activation, masked or not
    from wmtp.kernels.moe import hfma_tiles

    for act, masked in (("swiglu", True), ("relu2", False), ("linear", True)):
        a = ("swiglu", "relu2", "linear").index(act)
        (bn, bk), warps = hfma_tiles(a, True, 1024)
        out[f"pair_hfma-{act}-masked{int(masked)}"] = (
            "wmtp.kernels.moe:_pair_hfma_kernel",
            {"XW": "*i64", "XINV": "*fp32", "WG": "*i64", "WU": "*i64", "CG": "*fp8e4nv", "CU": "*fp8e4nv", "RG": "*fp32",
             "RU": "*fp32", "IDX": "*i64", "SG": "*i64", "SU": "*i64", "SCG": "*fp8e4nv", "SCU": "*fp8e4nv",
             "SRG": "*fp32", "SRU": "*fp32", "OUT": "*bf16",
             **_ints("P", "N", "NS", "K", "stride_we", "stride_wn", "stride_ce", "stride_cn", "stride_re", "stride_sn",
                     "stride_scn", "XS0")},
            dict(TOP_K=8, ACT=a, BLOCK_N=bn, BLOCK_K=bk, MASKED=masked, CVT=True, PDL=True),
            {"num_warps": warps, "num_stages": 1})
    # at the 35B's K (512) and the 122B's (1024), where their tiles differ
    for (fmt, cvt), shared, tokens, k in itertools.product(CVT, (False, True), (1, 7), (512, 1024)):
        code, w, s = QUANT_FORMATS[fmt]
        (bn, bk), warps = down_combine_tiles(code, tokens, 8, k)
        if k > 512 and ((bn, bk), warps) == down_combine_tiles(code, tokens, 8, 512):
            continue
        out[f"down_combine-{fmt}-cvt{int(cvt)}-shared{int(shared)}-tokens{tokens}-k{k}"] = (
            "wmtp.kernels.moe:_down_combine_kernel",
            {"H": "*bf16", "W": w, "C": s, "R": "*fp32", "IDX": "*i64", "TW": "*fp32", "HS": "*bf16", "WS": w, "CS": s,
             "RS": "*fp32", "SL": "*fp32", "OUT": "*bf16",
             **_ints("N", "K", "KS", "stride_we", "stride_wn", "stride_ce", "stride_cn", "stride_re", "stride_ws",
                     "stride_cs")},
            dict(TOP_K=8, TOP_K_P=8, SHARED=shared, FORMAT=code, BLOCK_N=bn, BLOCK_K=bk, CVT=cvt, PDL=True),
            {"num_warps": warps})
    # the paged attention kernel at the launch configurations paged_attention picks (module docstring
    # there): compiled, spills allowed (its [64, 256] fp32 accumulator spills at 4 warps and still
    # reads keys at the bandwidth floor)
    attn = {"Q": "*bf16", "Out": "*bf16", "OPart": "*fp32", "MPart": "*fp32", "LPart": "*fp32", "Gate": "*bf16",
            "q_start_ptr": "*i32", "q_len_ptr": "*i32", "tok_off_ptr": "*i32", "win_ptr": "*i32", "table_ptr": "*i32",
            "scale_log2e": "fp32", "v_scale": "fp32",
            **_ints("table_stride", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ot", "stride_oh",
                    "stride_gt", "stride_gh", "stride_ps", "stride_pt", "stride_ph", "num_q_blocks", "num_splits",
                    "page_size", "sink", "window", "ring_mod")}
    shape = dict(GROUP=8, GROUP_P=8, D=256, BLOCK_D=256, RING=False, IEEE=False, GATED=False, KV8=False, PDL=True)
    for name, kv, c, warps, stages in (
            ("verify", "*bf16", dict(BLOCK_Q=8, BLOCK_N=64, CONTIG=True, SPLIT=True), 4, 3),
            ("wide_verify", "*bf16", dict(BLOCK_Q=16, BLOCK_N=32, CONTIG=True, SPLIT=True), 8, 3),
            ("prefill", "*bf16", dict(BLOCK_Q=16, BLOCK_N=64, CONTIG=True, SPLIT=False, GATED=True), 8, 2),
            ("kv_fp8", "*fp8e4nv", dict(BLOCK_Q=8, BLOCK_N=32, CONTIG=True, SPLIT=True, KV8=True), 4, 4),
            ("ring", "*bf16", dict(BLOCK_Q=8, BLOCK_N=32, CONTIG=False, SPLIT=True, RING=True), 4, 2),
            ("windowed_pages", "*bf16", dict(BLOCK_Q=8, BLOCK_N=32, CONTIG=False, SPLIT=True), 4, 2)):
        out[f"paged_attention-{name}"] = ("wmtp.kernels.paged_attention:_attn_split_kernel", {**attn, "K": kv, "V": kv},
                                          {**shape, **c}, {"num_warps": warps, "num_stages": stages, "spills": True})
    # the norms at prefill's rows a program (norm._rows): GDN's gated norm over 128 channels, q / k norm + RoPE
    # over the 35B's 256-channel heads (64 of them rotary)
    from wmtp.kernels.norm import _rows

    norm = {"X": "*bf16", "W": "*bf16", "Z": "*bf16", "RES": "*bf16", "SUM_OUT": "*bf16", "OUT": "*bf16", "eps": "fp32",
            **_ints("N", "D", "W_GROUPS", "z_n1", "z_n2", "z_s0", "z_s1", "z_s2")}
    out["rms_norm-gated-prefill"] = ("wmtp.kernels.norm:_rms_norm_kernel", norm,
                                     dict(OFFSET=False, GATED=1, RESIDUAL=False, BLOCK_D=128,
                                          ROWS=_rows(8192 * 32, 128), PDL=True))
    rope = {"X": "*bf16", "W": "*bf16", "OUT": "*bf16", "X2": "*bf16", "W2": "*bf16", "OUT2": "*bf16", "COS": "*bf16",
            "SIN": "*bf16", "eps": "fp32", **_ints("stride_xt", "stride_xh", "stride_x2t", "stride_x2h", "stride_ct",
                                                   "H", "H2", "T", "D", "HALF")}
    out["norm_rope-prefill"] = ("wmtp.kernels.norm:_norm_rope_kernel", rope,
                                dict(NORM=True, OFFSET=True, BLOCK_D=256, BLOCK_R=32, BLOCK_P=32,
                                     ROWS=_rows(8192 * 18, 256), PDL=True))
    # SwiGLU's silu(gate) * up over the grouped experts' rows (bf16), as act_mul launches it
    out["act_mul-silu"] = ("wmtp.kernels.act_mul:_act_mul_kernel",
                           {"A": "*bf16", "B": "*bf16", "OUT": "*bf16", **_ints("R", "C", "stride_a", "stride_b")},
                           dict(ACT=0, ROWS=4, BLOCK=512, PDL=True))
    # routing: the 35B's softmax top-8 of 256 with the shared gate, Nemotron-3-Super's sigmoid top-22 of 512
    route = {"LOGITS": "*fp32", "W_OUT": "*fp32", "I_OUT": "*i32", "X": "*bf16", "SG": "*bf16", "SG_OUT": "*fp32",
             "BIAS": "*fp32", "E": "i32", "HID": "i32", "scale": "fp32"}
    for name, top_k, k_p, e, sigmoid in (("softmax8of256", 8, 8, 256, False), ("sigmoid22of512", 22, 32, 512, True)):
        out[f"route_topk-{name}"] = ("wmtp.kernels.moe:_route_topk_kernel", route,
                                     dict(TOP_K=top_k, K_P=k_p, NORM=True, SHARED=not sigmoid,
                                          SIGMOID=sigmoid, BLOCK_E=e, BLOCK_H=1024, PDL=True))
    return out


def _spill_bytes(ptx: str) -> int:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True,
                             check=True).stderr
    finally:
        os.unlink(f.name)
    return int(re.search(r"(\d+) bytes spill stores", err).group(1))


# integer arguments the engine's shapes make multiples of 16 (hidden sizes of 2048 and more), which
# Triton's launcher then specializes as such, as it does every 16-byte-aligned pointer
ALIGNED_INTS = ("N", "K", "NS", "KS", "K_SPLIT")


def build(kernel: str, types: dict[str, str], constexprs: dict, launch: dict | None = None):
    """The sm_90 ``CompiledKernel`` of a case (``launch``: num_warps / num_stages, 4 / 3 by default),
    its pointers, strides and ``ALIGNED_INTS`` specialized as 16-divisible as at the engine's launches."""
    launch = {"num_warps": 4, "num_stages": 3, **(launch or {})}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    missing = [a for a in fn.arg_names if a not in types and a not in constexprs]
    if missing:
        raise ValueError(f"{kernel}: no type for {missing}")
    sig = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in constexprs and (
        types[a].startswith("*") or types[a] == "i32" and (a.startswith("stride") or a in ALIGNED_INTS))}
    return compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})


def compile_case(kernel: str, types: dict[str, str], constexprs: dict, launch: dict | None = None) -> str | None:
    """None where the kernel compiles to an sm_90 cubin without register spills (``launch``: as
    ``build``'s, and ``spills`` True where spills are allowed), else why not."""
    try:
        k = build(kernel, types, constexprs, launch)
    except Exception as e:  # the compiler's own message is the result
        return "".join(traceback.format_exception_only(type(e), e))[-4000:]
    spills = _spill_bytes(k.asm["ptx"])
    return f"{spills} bytes of register spills" if spills and not (launch or {}).get("spills") else None


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("hopper_compile: unset TRITON_INTERPRET (interpreted kernels are not compiled)")
    print(json.dumps({name: compile_case(*case) for name, case in cases().items()}))


if __name__ == "__main__":
    main()
