"""Profile engine iterations at long synthetic context (torch.profiler): where T_iter goes.
Decode iterations run eagerly here (``decode_graphs="off"``) so every kernel shows under its own
name; the GPU work is what the graphs replay. ``--prefill N`` profiles a real N-token chunked
prefill (TTFT) instead.

    python benchmarks/profile_step.py --modes native --context 1040000 --out prof.txt
    python benchmarks/profile_step.py --modes native,windowed --prefill 32768 --out prof_prefill.txt
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import wmtp
from wmtp.bench.step import _spec
from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools
from wmtp.engine.config import EngineConfig
from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--modes", default="dense,native")
    ap.add_argument("--context", type=int, default=1_040_000)
    ap.add_argument("-d", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=0, help="profile a real prefill of this many tokens")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = wmtp.load_model(a.preset, device="cuda", dtype="bfloat16", backend="triton")
    with open(a.out, "w") as f:
        for mode in a.modes.split(","):
            spec = _spec(mode, a.d, 4032, 64)
            length = max(a.context, a.prefill) + 200
            eng = Engine(model, spec, EngineConfig(max_model_len=length, max_num_seqs=1, page_size=64,
                                                   prefill_chunk=8192, decode_graphs="off"))
            if a.prefill:
                prompt = torch.randint(1, model.config.vocab_size, (a.prefill,)).tolist()
                eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                what = f"prefill of {a.prefill} tokens"
            else:
                randomize_pools(eng)
                add_synthetic_request(eng, a.context, 150)
                force_acceptance(eng, min(3, spec.gamma))
                for _ in range(3):
                    eng.step()
                what = "3 iterations"
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3 if not a.prefill else 10**9):
                    eng.step()
                    if not eng.has_unfinished():
                        break
                torch.cuda.synchronize()
            for key in ("self_cpu_time_total", "cuda_time_total"):
                f.write(f"==== {mode}: by {key} ({what})\n")
                f.write(prof.key_averages().table(sort_by=key, row_limit=25) + "\n")
            del eng
            from wmtp.bench.step import release_pools

            release_pools(model)


if __name__ == "__main__":
    main()
