"""Why is the paged attention slower inside an engine iteration than in isolation? (H200 diagnosis)

Builds the step benchmark's engine (synthetic S-token context, CUDA graphs), then times the verify
attention on the engine's own caches and captured metadata: (a) one layer replayed alone, (b) all
attention layers in sequence, (c) each layer after a bandwidth-heavy copy (what the MoE does
between attention layers), and (d) the whole iteration, while ``nvidia-smi`` samples clocks and
power.

    python benchmarks/attention_insitu.py --context 1040000 --out insitu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

import wmtp
from wmtp.bench.step import _spec
from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools
from wmtp.engine.config import EngineConfig
from wmtp.engine.engine import Engine


def events_ms(fn, reps: int = 20) -> float:
    """Mean GPU time of ``fn`` over ``reps`` calls (CUDA events around each call)."""
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        total += s.elapsed_time(e)
    return total / reps


def main() -> None:
    from wmtp.kernels.paged_attention import paged_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--mode", default="native")
    ap.add_argument("--context", type=int, default=1_040_000)
    ap.add_argument("-d", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="also time launch configurations on the engine's metadata")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = wmtp.load_model(a.preset, device="cuda", dtype="bfloat16", backend="triton")
    spec = _spec(a.mode, a.d, 4032, 64)
    eng = Engine(model, spec, EngineConfig(max_model_len=a.context + 400, max_num_seqs=1, page_size=64))
    randomize_pools(eng)
    add_synthetic_request(eng, a.context, 300)
    force_acceptance(eng, min(3, spec.gamma))
    for _ in range(3):
        eng.step()
    meta = eng.graphs[1, eng.spec.gamma].ver_ctx.backend_cache["attention_meta"]
    layers = model.attention_layers()
    cfg = model.config
    q = torch.randn(a.d, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    scale = cfg.head_dim**-0.5
    res: dict[str, float] = {}
    res["one_layer_ms"] = events_ms(lambda: paged_attention(q, layers[0].k_cache, layers[0].v_cache, meta, scale))
    res["all_layers_per_layer_ms"] = events_ms(
        lambda: [paged_attention(q, l.k_cache, l.v_cache, meta, scale) for l in layers]) / len(layers)
    big = torch.empty(2**28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(big)
    copy_ms = events_ms(lambda: dst.copy_(big))
    inter = events_ms(lambda: [(dst.copy_(big), paged_attention(q, l.k_cache, l.v_cache, meta, scale)) for l in layers])
    res["copy_512mib_ms"] = copy_ms
    if a.sweep:  # launch configurations on the engine's own verify / draft-chain metadata
        import itertools

        metas = {"verify": (meta, a.d)}
        if spec.gamma > 1:
            metas["chain"] = (eng.graphs[1, eng.spec.gamma].chain_ctx[0].backend_cache["attention_meta"], 1)
        for name, (m, n) in metas.items():
            cache = layers[0] if name == "verify" else model.mtp_attention_layers()[0]
            qn = q[:n]
            for bn, nw, ns in itertools.product((32, 64), (4, 8), (2, 3)):
                res[f"{name}_bn{bn}_w{nw}_s{ns}_ms"] = events_ms(lambda: paged_attention(
                    qn, cache.k_cache, cache.v_cache, m, scale, block_n=bn, num_warps=nw, num_stages=ns))
    res["after_copy_per_layer_ms"] = (inter - len(layers) * copy_ms) / len(layers)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(40):
        eng.step()
    torch.cuda.synchronize()
    res["t_iter_ms"] = (time.perf_counter() - t0) / 40 * 1e3
    smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    res_all = {"meta": {"S": a.context, "mode": a.mode, "d": a.d, "num_splits": meta.num_splits, "max_keys": meta.max_keys},
               "times": res, "smi_during_steps": samples}
    print(json.dumps(res_all, indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(res_all, f, indent=1)


if __name__ == "__main__":
    main()
