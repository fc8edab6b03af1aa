"""The decode kernels over quantized weights compiled for Hopper (sm_90) without a GPU: Triton's
front end, its LLVM lowering and ptxas (``test_kernels_compile_sm90`` runs this module in a process
of its own, since the CPU test session's Triton interprets kernels instead of compiling them).

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


def cases() -> dict[str, tuple[str, dict[str, str], dict]]:
    """name -> (``module:kernel``, argument types by name, constexprs)."""
    out = {}
    for (fmt, cvt), splits in itertools.product(CVT, (1, 4)):
        code, w, s = QUANT_FORMATS[fmt]
        out[f"skinny_linear-{fmt}-cvt{int(cvt)}-splits{splits}"] = (
            "wmtp.kernels.linear:_skinny_linear_kernel",
            {"X": "*bf16", "W": w, "S": s, "R": "*fp32", "BIAS": "*bf16", "OUT": "*bf16", "PART": "*fp32",
             "COUNT": "*i32", **_ints("T", "N", "K", "stride_xt", "stride_wn", "stride_sn", "stride_ot", "K_SPLIT")},
            dict(FORMAT=code, HAS_BIAS=True, SPLITS=splits, WIDEN=False, PREC="tf32", T_P=16, BLOCK_N=64, BLOCK_K=128,
                 CVT=cvt, PDL=True))
    for (fmt, cvt), act in itertools.product(CVT, ("swiglu", "relu2", "linear")):
        code, w, s = QUANT_FORMATS[fmt]
        out[f"pair_gemv-{fmt}-cvt{int(cvt)}-{act}"] = (
            "wmtp.kernels.moe:_swiglu_gemv_kernel",
            {"X": "*bf16", "WG": w, "WU": w, "CG": s, "CU": s, "RG": "*fp32", "RU": "*fp32", "IDX": "*i64", "SG": w,
             "SU": w, "SCG": s, "SCU": s, "SRG": "*fp32", "SRU": "*fp32", "OUT": "*bf16",
             **_ints("P", "N", "NS", "K", "stride_we", "stride_wn", "stride_ce", "stride_cn", "stride_re", "stride_sn",
                     "stride_scn")},
            dict(TOP_K=8, FORMAT=code, ACT=("swiglu", "relu2", "linear").index(act), BLOCK_N=16, BLOCK_K=128, CVT=cvt,
                 PDL=True))
    for (fmt, cvt), shared in itertools.product(CVT, (False, True)):
        code, w, s = QUANT_FORMATS[fmt]
        out[f"down_combine-{fmt}-cvt{int(cvt)}-shared{int(shared)}"] = (
            "wmtp.kernels.moe:_down_combine_kernel",
            {"H": "*bf16", "W": w, "C": s, "R": "*fp32", "IDX": "*i64", "TW": "*fp32", "HS": "*bf16", "WS": w, "CS": s,
             "RS": "*fp32", "SL": "*fp32", "OUT": "*bf16",
             **_ints("N", "K", "KS", "stride_we", "stride_wn", "stride_ce", "stride_cn", "stride_re", "stride_ws",
                     "stride_cs")},
            dict(TOP_K=8, TOP_K_P=8, SHARED=shared, FORMAT=code, BLOCK_N=4, BLOCK_K=256, CVT=cvt, PDL=True))
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


def compile_case(kernel: str, types: dict[str, str], constexprs: dict) -> str | None:
    """None where the kernel compiles to an sm_90 cubin without register spills, else why not."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    missing = [a for a in fn.arg_names if a not in types and a not in constexprs]
    if missing:
        return f"no type for {missing}"
    sig = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    try:
        k = compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4, "num_stages": 3})
    except Exception as e:  # the compiler's own message is the result
        return "".join(traceback.format_exception_only(type(e), e))[-4000:]
    spills = _spill_bytes(k.asm["ptx"])
    return f"{spills} bytes of register spills" if spills else None


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("hopper_compile: unset TRITON_INTERPRET (interpreted kernels are not compiled)")
    print(json.dumps({name: compile_case(*case) for name, case in cases().items()}))


if __name__ == "__main__":
    main()
