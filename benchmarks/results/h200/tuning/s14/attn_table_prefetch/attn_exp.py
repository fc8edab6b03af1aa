"""Session 14 experiment: why the q7 verify attention runs ~4.1 TB/s against q1's ~4.5.
(1) production kernel q7 at max_rows 64 vs 32 (two q blocks sharing K/V through L2), q1 reference;
(2) a stripped full-tile loop (no masks, contiguous pages) with pointer loads vs TMA descriptor loads;
(3) registers / spills of the production q7 kernel."""
import json, os, sys, math
import torch, triton, triton.language as tl, triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path.insert(0, os.getcwd())
from wmtp.kernels.paged_attention import AttentionMeta, paged_attention, _attn_split_kernel
from wmtp.models.context import ForwardContext, PagedSlots


@triton.jit
def _exp_kernel(Q, K, V, kd, vd, OPart, n_keys, num_splits, stride_kt, stride_kh, scale_log2e,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, TMA: tl.constexpr, Q_LEN: tl.constexpr):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP_P
    head = kvh * GROUP + rows % GROUP_P
    row_ok = (qi < Q_LEN) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, D)
    q = tl.load(Q + qi[:, None] * (GROUP * 2 * D) + head[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    kps = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * kps
    hi = tl.minimum(n_keys, lo + kps) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    tile = tl.arange(0, BLOCK_N)[:, None] * stride_kt + dims[None, :]
    for j0 in range(lo, hi, BLOCK_N):
        if TMA:
            k = kd.load([j0, kvh * D])
            v = vd.load([j0, kvh * D])
        else:
            base = j0.to(tl.int64) * stride_kt + kvh * stride_kh
            k = tl.load(K + base + tile)
            v = tl.load(V + base + tile)
        s = tl.dot(q, tl.trans(k)) * scale_log2e
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    base = ((split * 2 + kvh) * BLOCK_M + rows) * D
    tl.store(OPart + base[:, None] + dims[None, :], out)


def main():
    out = os.environ.get("OUT", ".")
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, page, D, H, HKV = 1_040_000, 64, 256, 16, 2
    n_pages = -(-S // page)
    pool = torch.randn(10, 2, n_pages * page, HKV, D, device=dev, dtype=dt)
    kc, vc = pool[5, 0], pool[5, 1]
    table = torch.arange(n_pages, device=dev, dtype=torch.int32)[None]
    kv_bytes = 2 * S * HKV * D * 2
    res = {"S": S, "kv_bytes": kv_bytes}
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200)
    for q_len in (1, 7):
        q = torch.randn(q_len, H, D, device=dev, dtype=dt)
        meta = AttentionMeta.from_context(ForwardContext([S - q_len], [q_len], PagedSlots(table, page), device=dev), dev)
        for cfg in ([{}] if q_len == 1 else [{}, {"max_rows": 32}, {"max_rows": 32, "block_n": 64},
                                            {"max_rows": 32, "num_stages": 3}, {"max_rows": 32, "block_n": 64, "num_stages": 3},
                                            {"num_stages": 3}, {"num_stages": 4}]):
            fn = lambda: paged_attention(q, kc, vc, meta, D**-0.5, **cfg)
            fn()
            ms = bench(fn)
            res[f"prod_q{q_len}_{json.dumps(cfg)}"] = ms
            print(f"prod q{q_len} {cfg}: {ms:.4f} ms {kv_bytes/ms/1e9:.2f} TB/s", flush=True)
    # registers of the production q7 kernel (last compiled specialisations)
    try:
        for key, k in list(_attn_split_kernel.device_caches[0][0].items())[:8]:
            print("regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared, str(key)[-120:], flush=True)
    except Exception as e:
        print("regs: n/a", repr(e)[:200])
    # stripped loop: pointer vs TMA
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    q = torch.randn(7, H, D, device=dev, dtype=dt)
    k2, v2 = kc.view(kc.shape[0], HKV * D), vc.view(vc.shape[0], HKV * D)
    splits = 132
    for bn in (32, 64):
        kd = TensorDescriptor.from_tensor(k2, [bn, D])
        vd = TensorDescriptor.from_tensor(v2, [bn, D])
        o = {}
        for tma in (False, True):
            for st in (2, 3, 4):
                op = torch.empty(splits, 2, 64, D, device=dev, dtype=torch.float32)
                fn = lambda: _exp_kernel[(1, 2, splits)](q, kc, vc, kd, vd, op, S, splits, kc.stride(0), kc.stride(1),
                                                          D**-0.5 * 1.4427, GROUP=8, GROUP_P=8, BLOCK_Q=8, BLOCK_N=bn, D=D,
                                                          TMA=tma, Q_LEN=7, num_warps=4, num_stages=st)
                try:
                    fn()
                    ms = bench(fn)
                    o[(tma, st)] = op.clone()
                    res[f"strip_bn{bn}_tma{int(tma)}_st{st}"] = ms
                    print(f"strip bn{bn} tma={tma} stages={st}: {ms:.4f} ms {kv_bytes/ms/1e9:.2f} TB/s", flush=True)
                except Exception as e:
                    print(f"strip bn{bn} tma={tma} stages={st}: {type(e).__name__} {str(e)[:300]}", flush=True)
        if (False, 2) in o and (True, 2) in o:
            print("strip max diff ptr vs tma", (o[(False, 2)] - o[(True, 2)]).abs().max().item(), flush=True)
    json.dump(res, open(f"{out}/attn_exp.json", "w"), indent=1)


main()
