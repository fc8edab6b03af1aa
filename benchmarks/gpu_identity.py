"""Greedy token identity of dense / native / windowed on the GPU (Triton backend), tiny models; also
native and windowed with the prefix cache, a second pass over the same prompts resuming from it.

fp32 must give zero differing tokens; bf16 is reported (rounding differs between the target's
batched verify and plain decoding, so near-ties can flip). Writes a JSON table.

    python benchmarks/gpu_identity.py --out benchmarks/results/h200/gpu_identity.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import wmtp
from wmtp import LLM, SamplingParams, SpecConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--page-size", type=int, default=64, help="KV page (64: the attention's contiguous path)")
    ap.add_argument("--presets",
                    default="tiny-qwen3.5-moe,tiny-qwen3-next,tiny-llama,tiny-nemotron-h,tiny-nemotron-h-nvfp4",
                    help="comma-separated tiny presets (float weights but quantized presets'; tiny-qwen3.5-moe also as "
                         "nvfp4 and fp8)")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.choice([5, 40, 120, 300]))] for _ in range(a.prompts)]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    from wmtp.bench.step import revision

    meta = {"hardware": torch.cuda.get_device_name(), "backend": "triton", "window": 32, "sink": 4, "d": 5,
            "page_size": a.page_size, "commit": revision(), "command": "python benchmarks/gpu_identity.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items())}
    rows = []
    presets = a.presets.split(",")
    cases = [(p, None) for p in presets]
    cases += [("tiny-qwen3.5-moe", q) for q in ("nvfp4", "fp8") if "tiny-qwen3.5-moe" in presets]  # quantized weights
    for preset, quant in cases:
        for dtype in ("float32", "bfloat16"):
            model = wmtp.load_model(preset, device="cuda", dtype=dtype, backend="triton", quantize=quant)
            outs, compiled, cached = {}, {}, {}
            for mode, ring, cache in (("dense", True, False), ("native", True, False), ("windowed", True, False),
                                      ("windowed", False, False), ("native", True, True), ("windowed", True, True)):
                spec = SpecConfig(mode=mode, num_draft_tokens=1 if mode == "dense" else 5, window=32, sink=4, ring=ring)
                llm = LLM(model, spec=spec, max_model_len=512, max_num_seqs=8, page_size=a.page_size, prefill_chunk=64,
                          prefix_cache=cache, prefix_snapshot_interval=1)
                name = f"{mode}{'' if ring else '-noring'}{'+prefix-cache' if cache else ''}"
                if cache:  # a first pass fills the cache; the second resumes each prompt from its snapshots
                    llm.generate(prompts, params)
                outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
                compiled[name] = llm.engine.compiled_steps
                cached[name] = llm.engine.prefix.stats()["hit_tokens"] if cache else 0
            ref = outs["dense"]
            for name, got in outs.items():
                diff = sum(x != y for g, r in zip(got, ref) for x, y in zip(g, r))
                rows.append({"preset": preset, "quantize": quant, "dtype": dtype, "mode": name, "differing_tokens": diff,
                             "tokens": sum(map(len, ref)), "compiled_steps": compiled[name],
                             "cached_prompt_tokens": cached[name]})
                print(f"{preset:18s} {quant or '':5s} {dtype:9s} {name:17s} differing tokens vs dense: {diff} / {sum(map(len, ref))}")
            with open(a.out, "w") as f:  # after every model: a run cut short by a time limit keeps what it did
                json.dump({"kind": "gpu_identity", "meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
