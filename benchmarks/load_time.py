"""Time bringing up a preset with random weights directly on the GPU (issue: models, < 60 s for 35B bf16).

Usage: python benchmarks/load_time.py --preset qwen3.6-35b-a3b --out results.json
"""

import argparse
import json
import resource
import time

import torch

import wmtp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # CUDA context outside the timed region
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = wmtp.load_model(a.preset, device="cuda", dtype=a.dtype)
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    logits = model.score(list(range(1, 65)))
    torch.cuda.synchronize()
    t_score = time.perf_counter() - t0
    res = {
        "preset": a.preset, "dtype": a.dtype, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "params": n_params, "load_seconds": round(t_load, 2),
        "gpu_mem_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        # ru_maxrss is KiB on Linux: a CPU-staged 35B bf16 model would need ~65 GiB here
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "score_64_tokens_seconds_torch_backend": round(t_score, 2),
        "logits_finite": bool(torch.isfinite(logits).all()), "logits_std": float(logits.std()),
    }
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
