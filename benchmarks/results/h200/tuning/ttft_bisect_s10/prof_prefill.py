"""Kernel-time breakdown of one real chunked prefill (131,072 tokens, windowed), any revision."""
import argparse, sys, time
import torch
import wmtp
from wmtp.bench.step import _prefill_seconds, _spec

out = sys.argv[1]
a = argparse.Namespace(page_size=64, chunk=8192)
model = wmtp.load_model("qwen3.6-35b-a3b", device="cuda", dtype="bfloat16", backend="triton")
prompt = torch.randint(1, model.config.vocab_size, (131072,), generator=torch.Generator().manual_seed(0)).tolist()
spec = _spec("windowed", 7, 4032, 64)
_prefill_seconds(model, spec, a, prompt[:16385])
t = _prefill_seconds(model, spec, a, prompt)
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as p:
    tp = _prefill_seconds(model, spec, a, prompt)
with open(out, "w") as f:
    f.write(f"# TTFT windowed 131072: {t:.3f} s unprofiled, {tp:.3f} s profiled\n")
    f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
print(open(out).read()[:6000])
