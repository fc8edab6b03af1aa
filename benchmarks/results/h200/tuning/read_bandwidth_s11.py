"""Session 11: which streaming read reaches the H200's read bandwidth (4 GiB, CUDA events, median of 20)."""
import itertools, json, sys
import torch, triton, triton.language as tl
from wmtp.bench.floor import _median_seconds
from wmtp.kernels.stream import stream_xor

@triton.jit
def _staged(X, OUT, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(pid * BLOCK, n, step, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(X + offs, mask=offs < n, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))

@triton.jit
def _chunk(X, OUT, n, per, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid * per
    hi = tl.minimum(lo + per, n)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(X + offs, mask=offs < hi, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))

@triton.jit
def _unroll(X, OUT, n, BLOCK: tl.constexpr, U: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK * U
    acc = tl.zeros([U, BLOCK], tl.int32)
    rows = tl.arange(0, U)[:, None] * (tl.num_programs(0) * BLOCK)
    for start in range(pid * BLOCK, n, step):
        offs = start + rows + tl.arange(0, BLOCK)[None, :]
        acc ^= tl.load(X + offs, mask=offs < n, other=0)
    tl.store(OUT + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))

dev = torch.device("cuda")
n = 2**30
src = torch.zeros(4 * n, dtype=torch.uint8, device=dev)
words = src.view(torch.int32)
sms = torch.cuda.get_device_properties(dev).multi_processor_count
out = torch.empty(64 * sms, device=dev, dtype=torch.int32)
res = {}
def t(name, fn):
    try:
        res[name] = 4 * n / _median_seconds(fn, 20) / 1e12
    except Exception as e:
        res[name] = repr(e)[:120]
    print(f"{name}: {res[name]}", flush=True)
dst = torch.empty_like(src)
t("copy (read+write counted)", lambda: dst.copy_(src)); res["copy (read+write counted)"] *= 2
del dst
t("torch int32 sum", lambda: words.sum())
t("torch int32 amax", lambda: words.amax())
t("torch bf16 sum fp32", lambda: src.view(torch.bfloat16).sum(dtype=torch.float32))
for b, w, p in itertools.product((1024, 2048, 4096, 8192), (4, 8), (2, 4, 8, 16)):
    t(f"stream_xor b{b} w{w} p{p}", lambda: stream_xor(words, p * sms, b, w))
for b, w, p, s in itertools.product((1024, 4096), (4, 8), (4, 8), (2, 3, 4)):
    g = p * sms
    t(f"staged b{b} w{w} p{p} s{s}", lambda: _staged[(g,)](words, out, n, BLOCK=b, STAGES=s, num_warps=w))
for b, w, p, s in itertools.product((1024, 4096), (4, 8), (4, 8), (1, 3)):
    g = p * sms; per = -(-n // g)
    t(f"chunk b{b} w{w} p{p} s{s}", lambda: _chunk[(g,)](words, out, n, per, BLOCK=b, STAGES=s, num_warps=w))
for b, w, p, u in itertools.product((1024, 2048), (4, 8), (2, 4, 8), (2, 4)):
    g = p * sms
    t(f"unroll b{b} w{w} p{p} u{u}", lambda: _unroll[(g,)](words, out, n, BLOCK=b, U=u, num_warps=w))
json.dump(res, open(sys.argv[1], "w"), indent=1)
best = sorted((v, k) for k, v in res.items() if isinstance(v, float) and not k.startswith("copy"))[-8:]
print("best:", best)
