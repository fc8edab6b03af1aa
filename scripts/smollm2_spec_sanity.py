"""Sanity run of the trained SmolLM2 MTP head inside the engine (CPU): the head file beside the converted
checkpoint loads through ``wmtp.load_model``; greedy native / windowed speculation emits exactly the dense
tokens; AL > 1. Also one short RULER workload per family (chat-wrapped, 2048 tokens), scored.

    PYTHONPATH=. python scripts/smollm2_spec_sanity.py --model /work/models/smollm2-135m \
        --head benchmarks/results/acceptance/smollm2_mtp_head/mtp.safetensors

Writes benchmarks/results/acceptance/smollm2_spec_sanity.json. This is a correctness/sanity check at
short context, NOT the 8K acceptance measurement (that one runs on the GPU later).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "<|im_start|>user\nWrite a short paragraph about why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList the first ten prime numbers, separated by commas.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins in the fifteenth century, when",
]


def with_head(model_dir: Path, head: Path, tmp: Path) -> Path:
    """A checkpoint directory = the converted model (symlinked) + the head as mtp.safetensors."""
    for f in model_dir.iterdir():
        if f.name != "mtp.safetensors":
            (tmp / f.name).symlink_to(f.resolve())
    shutil.copy(head, tmp / "mtp.safetensors")
    return tmp


def run_mode(llm_dir: Path, mode: str, prompts: list, max_tokens: int, window: int, sink: int,
             max_len: int) -> list[dict]:
    import wmtp
    from wmtp.engine.sampling import SamplingParams

    d = 1 if mode == "dense" else 4
    spec = wmtp.SpecConfig(mode=mode, num_draft_tokens=d, window=window, sink=sink)
    llm = wmtp.LLM(str(llm_dir), spec=spec, max_model_len=max_len, max_num_seqs=1)
    outs = []
    for p in prompts:
        t0 = time.time()
        (o,) = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        m = o.metrics
        outs.append({"tokens": o.token_ids, "text": o.text, "seconds": time.time() - t0,
                     "acceptance_length": m.get("acceptance_length"), "hist": m.get("acceptance_histogram")})
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/models/smollm2-135m")
    ap.add_argument("--head", default="benchmarks/results/acceptance/smollm2_mtp_head/mtp.safetensors")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload-tokens", type=int, default=2048)
    ap.add_argument("--tasks", nargs="*", default=None, help="workload tasks (default: all six)")
    ap.add_argument("--out", default="benchmarks/results/acceptance/smollm2_spec_sanity.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import wmtp
    from wmtp.workloads import TASKS, make_workload, score

    res: dict = {"command": "PYTHONPATH=. python scripts/smollm2_spec_sanity.py", "device": "CPU, 1 thread"}
    with tempfile.TemporaryDirectory() as tmp:
        d = with_head(Path(a.model), Path(a.head), Path(tmp))
        m = wmtp.load_model(str(d))
        assert m.mtp is not None and m.config.num_nextn_predict_layers == 1, "head not picked up"
        res["head_loaded"] = type(m.mtp).__name__
        del m
        workloads = [make_workload(t, a.workload_tokens, a.model, seed=0, chat=True) for t in (a.tasks or TASKS)]
        prompts = PROMPTS + [w["token_ids"] for w in workloads]
        # windowed with a 128-token window + 16 sinks: exercises the window on the 2K-token workloads
        max_len = a.workload_tokens + a.max_tokens + 16
        runs = {mode: run_mode(d, mode, prompts, a.max_tokens, 128, 16, max_len)
                for mode in ("dense", "native", "windowed")}
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": p if isinstance(p, str) else f"{workloads[i - len(PROMPTS)]['task']} "
               f"({a.workload_tokens} tokens, chat)", "dense_text": runs["dense"][i]["text"]}
        for mode in ("native", "windowed"):
            r = runs[mode][i]
            row[mode] = {"identical_to_dense": r["tokens"] == runs["dense"][i]["tokens"],
                         "acceptance_length": r["acceptance_length"], "hist": r["hist"],
                         "seconds": round(r["seconds"], 2)}
        row["dense_seconds"] = round(runs["dense"][i]["seconds"], 2)
        if i >= len(PROMPTS):
            w = workloads[i - len(PROMPTS)]
            row["answers"] = w["answers"]
            row["score"] = {mode: score(w["task"], runs[mode][i]["text"], w["answers"]) for mode in runs}
        rows.append(row)
    res["runs"] = rows
    for mode in ("native", "windowed"):
        hist = [sum(x) for x in zip(*[r[mode]["hist"] for r in rows])]
        from wmtp.engine.metrics import acceptance_length, alphas_from_histogram

        res[f"{mode}_all_identical_to_dense"] = all(r[mode]["identical_to_dense"] for r in rows)
        res[f"{mode}_pooled"] = {"hist": hist, "acceptance_length": acceptance_length(hist),
                                 "alphas": [None if a != a else a for a in alphas_from_histogram(hist)]}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(f"{str(r['prompt'])[:50]!r:55s} native AL {r['native']['acceptance_length']:.2f} "
              f"same={r['native']['identical_to_dense']}  windowed AL {r['windowed']['acceptance_length']:.2f} "
              f"same={r['windowed']['identical_to_dense']}  score={r.get('score')}")
    for mode in ("native", "windowed"):
        print(mode, res[f"{mode}_pooled"], "all identical:", res[f"{mode}_all_identical_to_dense"])


if __name__ == "__main__":
    main()
