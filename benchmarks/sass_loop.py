"""Instructions a weight byte in the K loop of the quantized decode kernels, read from their Hopper
(sm_90a) SASS without a GPU: each case of ``tests/hopper_compile.py`` is compiled as the engine's
launches specialize it, disassembled (Triton's ``cuobjdump``), and its longest loop (the body of
its largest backward branch) counted by opcode. At decode sizes these kernels should be weight reads;
at the H200's 4.8 TB/s an SM must take in about 18 bytes a clock while it issues at most 4 warp
instructions, so a loop that spends more than about 7 instructions a thread per byte each thread
reads cannot reach the bandwidth floor whatever its memory pipeline does. A static bound, not a
timing: ``benchmarks/tune_linear.py`` measures.

    TRITON_INTERPRET=0 python benchmarks/sass_loop.py --out sass_loop.json [--cases skinny]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

from tests import hopper_compile

ISSUE_BOUND = 4 / (4.8e12 / 132 / 1.98e9) * 32  # thread instructions a byte at 4 warp instructions a clock


def loop_bytes(name: str, cx: dict) -> float | None:
    """Weight bytes one iteration of the case's K loop reads (program-wide), where the case's tile says."""
    per_value = 0.5 if cx.get("FORMAT") == 1 else 1.0
    if name.startswith("skinny_linear"):
        return cx["BLOCK_N"] * cx["BLOCK_K"] * per_value
    if name.startswith("pair_gemv"):  # SwiGLU reads gate and up in one loop (with MMA, a loop each)
        return (2 if cx["ACT"] == 0 and not cx["MMA"] else 1) * cx["BLOCK_N"] * cx["BLOCK_K"] * per_value
    return None


def sass(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def hottest_loop(text: str) -> list[str]:
    """The instructions of the largest backward-branch body."""
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    at = {a: i for i, (a, _) in enumerate(code)}
    best: list[str] = []
    for i, (a, ins) in enumerate(code):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [x for _, x in code[at[int(m.group(1), 16)]:i + 1]]
            best = body if len(body) > len(best) else best
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="skinny_linear,pair_gemv,down_combine", help="case name prefixes")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sass_loop: unset TRITON_INTERPRET (interpreted kernels are not compiled)")
    rows = []
    for name, case in hopper_compile.cases().items():
        if not name.startswith(tuple(a.cases.split(","))):
            continue
        launch = {"num_warps": 4, **(case[3] if len(case) > 3 else {})}
        loop = hottest_loop(sass(hopper_compile.build(*case)))
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in loop)
        nbytes = loop_bytes(name, case[2])
        per_byte = None if nbytes is None else len(loop) / (nbytes / (32 * launch["num_warps"]))
        rows.append({"case": name, "loop_instructions": len(loop), "threads": 32 * launch["num_warps"],
                     "loop_weight_bytes": nbytes, "instructions_per_byte": per_byte, "opcodes": dict(ops.most_common())})
        print(f"{name:44s} loop {len(loop):5d}" + ("" if per_byte is None else f"  {per_byte:5.2f} a byte"), flush=True)
    with open(a.out, "w") as f:
        json.dump({"kind": "sass_loop", "target": "sm_90a", "issue_bound_instructions_per_byte": ISSUE_BOUND,
                   "command": "python benchmarks/sass_loop.py --cases " + a.cases, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
