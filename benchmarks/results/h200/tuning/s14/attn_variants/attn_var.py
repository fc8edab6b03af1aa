"""Session 14: production attention kernel variants (text edits of paged_attention.py) timed at q7 / q1
over 1.04M keys: P1 page_size constexpr; P2 no tail loop under CONTIG (timing only); P3 both."""
import importlib.util, json, os, re, sys
import torch, triton, triton.testing
sys.path.insert(0, os.getcwd())
from wmtp.models.context import ForwardContext, PagedSlots

SRC = open("wmtp/kernels/paged_attention.py").read()


def variant(name, const_page, no_tail):
    s = SRC
    if const_page:
        s = s.replace("scale_log2e, page_size, sink, window, ring_mod,\n        GROUP", "scale_log2e, page_size: tl.constexpr, sink, window, ring_mod,\n        GROUP")
        assert "page_size: tl.constexpr" in s
    if no_tail:
        a = s.index("        for j0 in range(full_end, hi, BLOCK_N):")
        b = s.index("        tok = tok_off + qi")
        body = s[a:b]
        s = s[:a] + "        if not CONTIG:\n" + "".join("    " + l if l.strip() else l for l in body.splitlines(True)) + s[b:]
    path = f"/tmp/pa_{name}.py"
    open(path, "w").write(s)
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def main():
    out = os.environ.get("OUT", ".")
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, page, D, H, HKV = 1_040_000, 64, 256, 16, 2
    n_pages = -(-S // page)
    pool = torch.randn(10, 2, n_pages * page, HKV, D, device=dev, dtype=dt)
    kc, vc = pool[5, 0], pool[5, 1]
    table = torch.randperm(n_pages, device=dev).to(torch.int32)[None]
    kv_bytes = 2 * S * HKV * D * 2
    res = {}
    mods = {n: variant(n, c, t) for n, c, t in (("P0", 0, 0), ("P1", 1, 0), ("P2", 0, 1), ("P3", 1, 1))}
    for q_len, cfgs in ((7, ({"block_n": 32, "num_stages": 4}, {"block_n": 32, "num_stages": 3}, {"block_n": 64, "num_stages": 3})),
                        (1, ({"block_n": 32, "num_stages": 3}, {"block_n": 64, "num_stages": 3}))):
        q = torch.randn(q_len, H, D, device=dev, dtype=dt)
        for name, m in mods.items():
            meta = m.AttentionMeta.from_context(ForwardContext([S - q_len], [q_len], PagedSlots(table, page), device=dev), dev)
            for cfg in cfgs:
                fn = lambda: m.paged_attention(q, kc, vc, meta, D**-0.5, **cfg)
                fn()
                ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                ks = list(m._attn_split_kernel.device_caches[0][0].values())
                k = ks[-1]
                res[f"q{q_len} {name} {cfg}"] = ms
                print(f"q{q_len} {name} bn{cfg['block_n']} st{cfg['num_stages']}: {ms:.4f} ms {kv_bytes/ms/1e9:.2f} TB/s "
                      f"regs {k.n_regs} spills {k.n_spills}", flush=True)
    json.dump(res, open(f"{out}/attn_var.json", "w"), indent=1)


main()
