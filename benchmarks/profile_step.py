"""Profile engine iterations at long synthetic context (torch.profiler): where T_iter goes.
Decode iterations run eagerly (``--graphs off``, the default) or replay their CUDA graphs
(``--graphs auto``: CUPTI still records every kernel inside the graphs). Besides torch's tables it
writes a per-iteration kernel summary: how many kernels, their summed time, the time the GPU was
busy, the span and the idle stretches over 5 us (host work between replays), so launch gaps, host
gaps and slow kernels can be told apart. ``--prefill N`` profiles a
real N-token chunked prefill (TTFT) instead.

    python benchmarks/profile_step.py --modes native --context 1040000 --out prof.txt
    python benchmarks/profile_step.py --modes native,windowed --prefill 32768 --out prof_prefill.txt
    python benchmarks/profile_step.py --modes windowed -d 3,4 --graphs auto --out prof_d34.txt  # a step in T_iter(d)
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import wmtp
from wmtp.bench.step import _spec, kv_dtype, parse_mode, release_pools
from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools
from wmtp.engine.config import EngineConfig
from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--modes", default="dense,native")
    ap.add_argument("--context", type=int, default=1_040_000)
    ap.add_argument("-d", default="7", help="draft depth; several comma-separated (3,4) profile each on one model "
                                            "load and write each kernel's change from one depth to the next")
    ap.add_argument("--prefill", type=int, default=0, help="profile a real prefill of this many tokens")
    ap.add_argument("--graphs", default="off", choices=("off", "auto"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--syncs", action="store_true",
                    help="--prefill: then one more prefill under torch.cuda.set_sync_debug_mode, listing where the "
                         "host waited on the stream (blocking copies, .item(), .tolist()) by Python stack")
    ap.add_argument("--timeline", help="also write every profiled kernel (name, start, duration in us) as JSON here")
    ap.add_argument("--device", default="cuda", help="cpu: the tiny presets under the Triton interpreter (no kernel "
                                                     "times: a check that the script runs)")
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N layers only (bench step's --layers)")
    ap.add_argument("--linears", action="store_true",
                    help="decode iterations: also the skinny linears by shape (N x K, rows, weight format) with "
                         "their time and read rate, the profiled launches matched in order to one eager "
                         "iteration's calls")
    a = ap.parse_args()
    depths = parse_depths(a.d)
    model = wmtp.load_model(a.preset, device=a.device, dtype="bfloat16", backend="triton", layers=a.layers)
    with open(a.out, "w") as f:
        for mode in a.modes.split(","):
            by_depth = {}
            for d in depths if parse_mode(mode)[0] != "dense" else depths[:1]:
                by_depth[d] = profile_mode(model, mode, d, a, f)
            for lo, hi in zip(depths, depths[1:]):
                if lo in by_depth and hi in by_depth:
                    f.write(f"==== {mode}: exclusive time per iteration by kernel, d = {lo} -> {hi}\n"
                            f"{depth_diff(by_depth[lo], by_depth[hi], lo, hi)}\n")


def parse_depths(spec: str) -> list[int]:
    """``-d``'s depths: one, or several comma-separated (each profiled, and each next to the one before)."""
    try:
        depths = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"profile_step: -d {spec!r} must be depths >= 1, comma-separated") from None
    if not depths or min(depths) < 1:
        raise SystemExit(f"profile_step: -d {spec!r} must be depths >= 1, comma-separated")
    return depths


def profile_mode(model, mode: str, d: int, a: argparse.Namespace, f) -> dict[str, float]:
    """Profile ``mode`` at depth d (a prefill with ``--prefill``), write its sections to f, and return
    the exclusive time per iteration (us) by kernel name."""
    spec = _spec(mode, d, 4032, 64)
    length = max(a.context, a.prefill) + 200
    eng = Engine(model, spec, EngineConfig(max_model_len=length, max_num_seqs=1, page_size=64, prefill_chunk=8192,
                                           decode_graphs=a.graphs, kv_cache_dtype=kv_dtype(mode)))
    calls = None
    if a.prefill:
        warm, prompt = torch.randint(1, model.config.vocab_size, (2, a.prefill)).tolist()
        # a first prefill outside the profile: JIT compiles and autotuning (flash-linear-attention's)
        # are not this prefill's kernels
        prefill(eng, warm)
        eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        what = f"prefill of {a.prefill} tokens"
    else:
        randomize_pools(eng)
        add_synthetic_request(eng, a.context, 150)
        force_acceptance(eng, min(3, spec.gamma))
        for _ in range(3):
            eng.step()
        calls = linear_calls(eng) if a.linears else None
        what = f"d = {spec.num_draft_tokens}, {a.iters} iterations, graphs {a.graphs}"
    if a.device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(a.iters if not a.prefill else 10**9):
            eng.step()
            if not eng.has_unfinished():
                break
        if a.device == "cuda":
            torch.cuda.synchronize()
    iters = 1 if a.prefill else a.iters
    summary = kernel_summary(prof, iters)
    print(f"{mode} ({what}): {summary['line']}", flush=True)
    if a.timeline:
        write_timeline(prof, a.timeline.replace(".json", f"_{mode}_d{d}.json"), f"{mode}, {what}")
    f.write(f"==== {mode}: kernels per iteration ({what})\n{summary['table']}\n")
    if calls is not None:
        f.write(f"==== {mode}: skinny linears by shape ({what})\n{linears_table(prof, calls, a.iters)}\n")
    for key in ("self_cpu_time_total", "cuda_time_total"):
        f.write(f"==== {mode}: by {key} ({what})\n")
        f.write(prof.key_averages().table(sort_by=key, row_limit=25) + "\n")
    if a.syncs and a.prefill:
        prompt = torch.randint(1, model.config.vocab_size, (a.prefill,)).tolist()
        f.write(f"==== {mode}: host waits by Python stack (another {what})\n{sync_sites(eng, prompt)}\n")
    del eng
    release_pools(model)
    return summary["by_kernel"]


def depth_diff(lo: dict[str, float], hi: dict[str, float], d_lo: int, d_hi: int) -> str:
    """Each kernel's exclusive time per iteration at the two depths and the change, largest change
    first: what a step in T_iter between them is made of."""
    names = sorted(set(lo) | set(hi), key=lambda n: -abs(hi.get(n, 0.0) - lo.get(n, 0.0)))
    total = sum(hi.values()) - sum(lo.values())
    return (f"  d = {d_lo} (ms)  d = {d_hi} (ms)   change (ms)\n"
            + "\n".join(f"{lo.get(n, 0.0) / 1e3:11.3f} {hi.get(n, 0.0) / 1e3:13.3f} {(hi.get(n, 0.0) - lo.get(n, 0.0)) / 1e3:+13.3f}  {n}"
                         for n in names[:25])
            + f"\n{'':25s} {total / 1e3:+13.3f}  all kernels")


def prefill(eng: Engine, prompt: list[int]) -> None:
    """``prompt``'s prefill (and its first token), to the end."""
    eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()


def sync_sites(eng: Engine, prompt: list[int]) -> str:
    """Run ``prompt``'s prefill with torch's sync debug mode warning at every synchronizing call; each
    distinct stack (wmtp's and its libraries' frames), most frequent first, with its count."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [fr for fr in traceback.extract_stack()[:-1]
                  if not any(x in fr.filename for x in ("/torch/", "warnings.py"))]
        sites["\n".join(f"        {fr.filename.split('site-packages/')[-1]}:{fr.lineno} {fr.line}"
                         for fr in frames[-8:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prefill(eng, prompt)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return f"{sum(sites.values())} synchronizing calls\n" + "\n".join(
        f"{c:5d}x\n{stack}" for stack, c in sites.most_common()) if sites else "none"


def linear_calls(eng: Engine) -> list[tuple[str, int]]:
    """The skinny linear kernel's launches in one eager iteration, in order: (shape label, bytes of
    the weight it reads). A launch takes up to ``MAX_ROWS`` rows, so a call of more makes several.
    The static iteration (what graphs replay) makes the same launches in the same order, but its
    draft-extend's take d rows where the eager one's take the a + 1 accepted."""
    import wmtp.kernels.linear as lin
    from wmtp.quant import QuantWeight

    calls, skinny = [], lin.skinny_linear

    def record(x, weight, *args, **kwargs):
        rows = x.numel() // x.shape[-1]
        quant = isinstance(weight, QuantWeight)
        fmt = weight.format.name if quant else str(weight.dtype).removeprefix("torch.")
        n, k = weight.shape
        nbytes = weight.format.weight_bytes(n, k) if quant else weight.numel() * weight.element_size()  # as the floor
        for lo in range(0, rows, lin.MAX_ROWS):
            calls.append((f"{n:>6} x {k:<6} {min(lin.MAX_ROWS, rows - lo):>2} rows {fmt}", nbytes))
        return skinny(x, weight, *args, **kwargs)

    lin.skinny_linear = record
    try:
        with eng.eager_iterations():
            eng.step()
    finally:
        lin.skinny_linear = skinny
    return calls


def linears_table(prof, calls: list[tuple[str, int]], iters: int) -> str:
    """The profiled ``_skinny_linear_kernel`` launches matched in order to ``calls`` (one iteration's),
    grouped by shape: launches and exclusive time per iteration, and the weight bytes read per
    exclusive second. Said so, and nothing matched, where the counts differ."""
    excl = [x for name, x in exclusive_times(_kernels(prof)) if name.startswith("_skinny_linear_kernel")]
    if len(excl) != iters * len(calls):
        return (f"{len(excl)} launches profiled over {iters} iterations against {len(calls)} in the eager iteration: "
                "not matched")
    groups: dict[str, list[float]] = {}
    for i, t in enumerate(excl):
        label, nbytes = calls[i % len(calls)]
        g = groups.setdefault(label, [0, 0.0, 0.0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + t, g[2] + nbytes
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return ("     excl   calls    MB/call   read GB/s  shape\n"
            + "\n".join(f"{t / iters / 1e3:6.3f} ms {c / iters:6.1f}x {b / c / 1e6:9.2f} {b / t / 1e3:10.0f}  {label}"
                         for label, (c, t, b) in rows))


def exclusive_times(kernels: list) -> list[tuple[str, float]]:
    """Each kernel's time past the end of everything launched before it (us): with PDL a kernel
    starts before its predecessor ends and waits for it, so its span overlaps the previous one's."""
    out, seen_end = [], kernels[0].time_range.start if kernels else 0.0
    for e in kernels:
        out.append((e.name, max(0.0, e.time_range.end - max(e.time_range.start, seen_end))))
        seen_end = max(seen_end, e.time_range.end)
    return out


def _kernels(prof) -> list:
    return sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start),
                  key=lambda e: e.time_range.start)


def write_timeline(prof, path: str, what: str) -> None:
    """Every kernel in launch order, so per-call costs (a verify's MoE vs a draft's) can be told apart."""
    import json

    rows = [(e.name[:90], round(e.time_range.start, 3), round(e.time_range.elapsed_us(), 3)) for e in _kernels(prof)]
    with open(path, "w") as f:
        json.dump({"what": what, "columns": ["name", "start_us", "dur_us"], "kernels": rows}, f)


def kernel_summary(prof, iters: int) -> dict:
    """Kernels per iteration: count, summed duration, busy time (union of intervals) and span (ms),
    plus the kernels grouped by name with their exclusive time (past every earlier kernel's end) and
    their summed spans, largest exclusive time first."""
    kernels = _kernels(prof)
    if not kernels:
        return {"line": "no kernels recorded", "table": "", "by_kernel": {}}
    busy, cur_lo, cur_hi = 0.0, kernels[0].time_range.start, kernels[0].time_range.end
    long_gaps = []  # idle stretches > 5 us: host work between replays (in-graph gaps are ~1 us)
    for e in kernels[1:]:
        if e.time_range.start > cur_hi:
            busy, cur_lo = busy + cur_hi - cur_lo, e.time_range.start
            if e.time_range.start - cur_hi > 5:
                long_gaps.append(e.time_range.start - cur_hi)
        cur_hi = max(cur_hi, e.time_range.end)
    busy += cur_hi - cur_lo
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    total = sum(e.time_range.elapsed_us() for e in kernels)
    # each kernel is also charged only its exclusive time (``exclusive_times``; the column sums to the busy time)
    groups: dict[str, list[float]] = {}
    for e, (_, x) in zip(kernels, exclusive_times(kernels)):
        g = groups.setdefault(e.name[:90], [0, 0.0, 0.0])
        g[0] += 1
        g[1] += e.time_range.elapsed_us()
        g[2] += x
    rows = sorted(groups.items(), key=lambda kv: -kv[1][2])
    table = ("     excl         span   calls   span/call\n"
             + "\n".join(f"{x / iters / 1e3:9.3f} ms {t / iters / 1e3:9.3f} ms {c / iters:7.1f}x {t / c:8.2f} us  {n}"
                         for n, (c, t, x) in rows[:40]))
    line = (f"{len(kernels) / iters:.0f} kernels/iter, kernel sum {total / iters / 1e3:.2f} ms, busy {busy / iters / 1e3:.2f} ms,"
            f" span {span / iters / 1e3:.2f} ms per iteration; idle > 5 us: {len(long_gaps) / iters:.1f}x,"
            f" {sum(long_gaps) / iters / 1e3:.3f} ms per iteration")
    return {"line": line, "table": table, "by_kernel": {n: x / iters for n, (_, _, x) in groups.items()}}


if __name__ == "__main__":
    main()
