"""lm_head [248320, 2048] bf16 at 1 and 8 rows: cuBLAS (F.linear) vs skinny_linear tiles; cold (3 copies
rotated, 3 GB). CUDA-event medians of 30."""
import json, sys
import torch, torch.nn.functional as F
from wmtp.kernels.linear import LinearTiles, skinny_linear
dev = torch.device("cuda")
V, H = 248320, 2048
ws = [torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
nbytes = V * H * 2
def med(fn):
    ts = []
    for i in range(33):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(ws[i % 3]); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    ts = sorted(ts[3:]); return ts[len(ts) // 2]
res = {}
for rows in (1, 8):
    x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    t = med(lambda w: F.linear(x, w)); res[f"cublas_r{rows}"] = t
    print(f"rows {rows} cublas {t*1e6:.1f} us {nbytes/t/1e12:.2f} TB/s", flush=True)
    for bn, bk, warps, st in ((64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 4),
                              (32, 256, 4, 3), (128, 256, 8, 3), (256, 128, 8, 3)):
        tiles = LinearTiles(bn, bk, 1, warps, st)
        try:
            err = (skinny_linear(x, ws[0], tiles=tiles).float() - ref).abs().max().item()
            t = med(lambda w: skinny_linear(x, w, tiles=tiles))
        except Exception as e:  # noqa: BLE001
            print("fail", tiles, type(e).__name__, str(e)[:100]); continue
        res[f"skinny_r{rows}_{bn}x{bk}_w{warps}_s{st}"] = t
        print(f"rows {rows} skinny {bn}x{bk} w{warps} s{st}: {t*1e6:.1f} us {nbytes/t/1e12:.2f} TB/s err {err:.3g}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
