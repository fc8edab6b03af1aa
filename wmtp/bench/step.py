"""``wmtp bench step`` and ``wmtp bench ttft``: decode-step cost per mode at long context on one GPU.

``step``: SYNTHETIC context (random KV / states, no prefill) and FORCED acceptance, so a
random-weight model gives T_iter at any S and AL (on a GPU, or on the host with a tiny preset: the
floor then divides by the host's read bandwidth). Per mode: T_iter (median of N iterations, p10,
p90) as the engine runs by default, one iteration in flight (``t_iter``: the interval between
consecutive iterations' results), and with every step GPU-synchronised before and after
(``t_iter_sync``); the bytes floor over the HBM read bandwidth measured in the same run, T / floor, and
native / windowed; a kernel micro-benchmark (the paged decode kernel vs SDPA on contiguous KV of
the same key count; the draft attention per forward, windowed vs native); and admission: how many
requests of S tokens each mode's pools really admit, then one step with all of them.

``ttft``: a REAL chunked prefill of an N-token prompt (random token ids), TTFT native vs windowed
(whose draft prefill is sparsified, DESIGN §4). With ``--repeat-suffix K`` the engine caches
prefixes (DESIGN §12) and a second prompt follows the first: the same N - K tokens, then K others
(a second question about the same document); its TTFT is the cached one.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from wmtp.bench.gpu_state import describe_gpu_state, gpu_state
from wmtp.config import ModelConfig
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.memory import CapacityError, MemoryManager
from wmtp.models.parallel import TPGroup


def parse_mode(mode: str) -> tuple[str, int | None, str]:
    """A benchmark's mode label: ``dense | native | windowed``, then options after colons:
    ``V<K>`` a pruned draft vocabulary of K tokens, the first K ids (a cost measurement: which
    tokens does not change the bytes a step reads); ``kv-fp8`` an fp8 e4m3 KV cache. Returns
    (mode, K or None, EngineConfig.kv_cache_dtype)."""
    from wmtp.errors import WmtpError

    base, *opts = mode.split(":")
    vocab, kv = None, "auto"
    for o in opts:
        if o[:1] == "V" and o[1:].isdigit():
            vocab = int(o[1:])
        elif o == "kv-fp8":
            kv = "fp8_e4m3"
        else:
            raise WmtpError(f"mode {mode!r}: unknown option {o!r} (options: V<K>, kv-fp8)")
    return base, vocab, kv


def mode_labels(a: argparse.Namespace) -> list[str]:
    """``--modes``' labels, in order (empty items dropped)."""
    return [m for m in a.modes.split(",") if m]


def _spec(mode: str, d: int, window: int, sink: int) -> SpecConfig:
    """The SpecConfig of a mode label (``parse_mode``)."""
    base, k, _ = parse_mode(mode)
    return SpecConfig(mode=base, num_draft_tokens=d if base != "dense" else 1, window=window, sink=sink,
                      draft_vocab=None if k is None else tuple(range(k)))


def kv_dtype(mode: str) -> str:
    """The EngineConfig.kv_cache_dtype of a mode label (``parse_mode``)."""
    return parse_mode(mode)[2]


def release_pools(model) -> None:
    """Drop the pool tensors bound to the model (``MemoryManager.unbind``) so the next engine can
    allocate its own."""
    MemoryManager.unbind(model)
    gc.collect()
    torch.cuda.empty_cache()


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _sync_time(fn, device: torch.device | str = "cuda") -> float:
    """Wall time of ``fn()`` with the device idle before and after (CPU ops are synchronous)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def hardware_name(device: torch.device | str, count: int = 1) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"{count}x {torch.cuda.get_device_name(device)}"
    import platform

    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def time_mode(model, mode: str, a: argparse.Namespace, bandwidth: float) -> dict:
    from wmtp.bench.floor import ExpertCounter, step_bytes
    from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools

    spec = _spec(mode, a.d, a.window, a.sink)
    total_iters = 2 * (a.warmup + a.iters + 1) + 4
    max_tokens = total_iters * spec.verify_tokens + 8
    eng = Engine(model, spec, EngineConfig(max_model_len=a.context + max_tokens, max_num_seqs=1, page_size=a.page_size,
                                           decode_graphs=a.decode_graphs, kv_cache_dtype=kv_dtype(mode)))
    randomize_pools(eng)
    add_synthetic_request(eng, a.context, max_tokens)
    k = min(a.accept, spec.gamma)
    force_acceptance(eng, k)
    with eng.eager_iterations(), ExpertCounter(model) as counter:  # the counter syncs: not capturable
        for _ in range(3):
            eng.step()
    eng.overlap = False
    synced = [_sync_time(eng.step, eng.device) for _ in range(a.warmup + a.iters)][a.warmup:]
    eng.overlap = True
    overlapped = _overlapped_intervals(eng, a.warmup, a.iters)
    state = gpu_state(eng.device)  # right after the timed iterations, still under load's clocks
    elt = torch.empty(0, dtype=eng.dtype).element_size()
    sb = step_bytes(model, spec, a.context, counter.mean_distinct(), elt, eng.memory.kv_elt)
    floor = sb.total / bandwidth
    pools, compiled = eng.memory.bytes_report(), eng.compiled_steps
    build = sum(g.build_seconds for g in eng.graphs.values())
    del eng
    release_pools(model)
    row = {"mode": mode, "S": a.context, "d": spec.verify_tokens, "B": 1, "forced_accept": k,
           "compiled_steps": compiled, "graph_build_s": build}
    for key, times in (("t_iter", overlapped), ("t_iter_sync", synced)):
        med, q = statistics.median(times), deciles(times)
        row.update({f"{key}_s": [med], f"{key}_p10_s": [q[0]], f"{key}_p90_s": [q[-1]], f"{key}_over_floor": med / floor})
        print(f"[{mode:8s}] {key:11s} median {med * 1e3:8.2f} ms (p10 {q[0] * 1e3:.2f}, p90 {q[-1] * 1e3:.2f}, "
              f"n={len(times)}) | floor {floor * 1e3:.2f} ms ({sb.total / 2**30:.2f} GiB) | /floor {med / floor:.2f}",
              flush=True)
    if state:
        print(f"[{mode:8s}] GPU after the timed iterations: {describe_gpu_state(state)}", flush=True)
    row.update({"iterations": len(overlapped), "floor_s": floor, "floor_bytes": sb.total, "bytes": sb.to_dict(),
                "pool_bytes": pools, "gpu_state_after": state})
    return row


def _overlapped_intervals(eng: Engine, warmup: int, iters: int) -> list[float]:
    """The engine's default loop (each iteration launched before the previous one's results are
    read): seconds between consecutive ``step`` returns, each of which waited for one iteration's
    results on the GPU, after ``warmup`` steps."""
    for _ in range(warmup):
        eng.step()
    stamps = [time.perf_counter()]
    for _ in range(iters):
        eng.step()
        stamps.append(time.perf_counter())
    eng._drain()
    _sync(eng.device)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def kernel_shape(a: argparse.Namespace, cfg: ModelConfig) -> tuple[int, int, int]:
    """``--kernels``' attention shape (query heads, KV heads, head dim): the model's config ``cfg``
    where ``--heads`` / ``--kv-heads`` / ``--head-dim`` do not say otherwise. Checked before any timing."""
    from wmtp.errors import WmtpError

    given = {"--heads": a.heads, "--kv-heads": a.kv_heads, "--head-dim": a.head_dim}
    bad = [f"{k}={v}" for k, v in given.items() if v is not None and v < 1]
    if bad:
        raise WmtpError(f"wmtp bench step --kernels: {', '.join(bad)} must be at least 1")
    shape = (a.heads or cfg.num_heads, a.kv_heads or cfg.num_kv_heads, a.head_dim or cfg.head_dim)
    if shape[0] % shape[1]:
        raise WmtpError(f"wmtp bench step --kernels: {shape[0]} query heads are not a multiple of {shape[1]} KV heads "
                        "(--heads / --kv-heads, else the model's)")
    return shape


def kernel_bench(a: argparse.Namespace, device: torch.device, shape: tuple[int, int, int]) -> dict:
    """The paged decode kernel vs SDPA on contiguous KV (same keys), and the draft's attention per
    forward at S: windowed (ring) vs native (paged over S keys). bf16, at ``shape`` (``kernel_shape``)."""
    import triton.testing

    def bench(fn) -> float:
        """GPU time (ms) of ``fn`` replayed from a CUDA graph, so Python launch overhead is excluded
        (the engine's draft steps are meant to run from graphs too)."""
        fn()
        return triton.testing.do_bench_cudagraph(fn)

    from wmtp.engine.window import DraftWindow
    from wmtp.kernels.paged_attention import AttentionMeta, paged_attention
    from wmtp.models.context import ForwardContext, PagedSlots, RingSlots

    (H, KV, D), S, page = shape, a.context, a.page_size
    dt = torch.bfloat16
    n_pages = -(-S // page)
    k_cache = torch.randn(n_pages * page, KV, D, device=device, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(n_pages, device=device)[None]
    out = {}
    for q_len in (1, a.d):
        q = torch.randn(q_len, H, D, device=device, dtype=dt)
        ctx = ForwardContext([S - q_len], [q_len], PagedSlots(table, page), device=device)
        meta = AttentionMeta.from_context(ctx, device)
        out[f"paged_q{q_len}_ms"] = bench(lambda: paged_attention(q, k_cache, v_cache, meta, D**-0.5))
    # SDPA over the same S keys held contiguously (decode: one query sees all keys)
    kc = k_cache[: S].view(1, S, KV, D).transpose(1, 2)
    vc = v_cache[: S].view(1, S, KV, D).transpose(1, 2)
    q1 = torch.randn(1, H, 1, D, device=device, dtype=dt)
    out["sdpa_contiguous_q1_ms"] = bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True))
    out["paged_over_sdpa_speed"] = out["sdpa_contiguous_q1_ms"] / out["paged_q1_ms"]
    # the draft's attention per forward (one query): native reads S keys, windowed sink + W
    win = DraftWindow(a.sink, a.window)
    ring_k = torch.randn(win.ring_size(a.d), KV, D, device=device, dtype=dt)
    ring_v = torch.randn_like(ring_k)
    q = torch.randn(1, H, D, device=device, dtype=dt)
    ctx = ForwardContext([S - 1], [1], RingSlots(torch.zeros(1, dtype=torch.long, device=device), win, a.d),
                         windows=[win], device=device)
    meta = AttentionMeta.from_context(ctx, device)
    out["draft_attn_windowed_ms"] = bench(lambda: paged_attention(q, ring_k, ring_v, meta, D**-0.5))
    out["draft_attn_native_ms"] = out["paged_q1_ms"]
    out["draft_attn_windowed_over_native"] = out["draft_attn_windowed_ms"] / out["draft_attn_native_ms"]
    del k_cache, v_cache, kc, vc
    torch.cuda.empty_cache()
    print("kernels:", json.dumps({k: round(v, 4) for k, v in out.items()}), flush=True)
    return {"heads": H, "kv_heads": KV, "head_dim": D, **out}


def admission(model, mode: str, a: argparse.Namespace) -> dict:
    """Size the pools from the free memory, admit synthetic S-token requests until one does not
    fit (or ``--max-admit`` are in), then run one step with all of them."""
    from wmtp.bench.synthetic import add_synthetic_request, randomize_pools

    spec = _spec(mode, a.d, a.window, a.sink)
    free, _ = torch.cuda.mem_get_info()
    held = torch.cuda.memory_allocated()  # the weights and whatever else is alive: what the pools cannot have
    budget = free - int(a.reserve_gib * 2**30)
    eng = Engine(model, spec, EngineConfig(max_model_len=a.context + 64, max_num_seqs=a.max_admit,
                                           page_size=a.page_size, kv_memory_bytes=budget, kv_cache_dtype=kv_dtype(mode)))
    randomize_pools(eng)
    n = 0
    try:
        while n < a.max_admit:
            add_synthetic_request(eng, a.context, 32, seed=n)
            n += 1
    except (MemoryError, CapacityError):  # CapacityError: not even one fits the budget
        pass
    t = _sync_time(eng.step) if n else float("nan")
    mem = eng.memory.bytes_report()
    per_req = next(iter(eng.requests.values())).metrics.memory_bytes if n else {}
    del eng
    release_pools(model)
    after = torch.cuda.memory_allocated()  # above ``held``: what the engine left alive
    print(f"[{mode:8s}] admitted {n} requests of {a.context} tokens in {budget / 2**30:.1f} GiB (torch held "
          f"{held / 2**30:.1f} GiB besides, {after / 2**30:.1f} after); one step {t * 1e3:.1f} ms", flush=True)
    row = {"mode": mode, "S": a.context, "d": spec.verify_tokens, "max_admitted": n, "admit_cap": a.max_admit,
           "kv_budget_bytes": budget, "torch_allocated_bytes": held, "torch_allocated_after_bytes": after,
           "pools": mem, "per_request_bytes": per_req, "step_s": t}
    if after > held + 2**30:  # an engine's memory outlived it: what Python still reaches of it
        row["left_alive"] = largest_tensors(torch.device(a.device))
        print(f"[{mode:8s}] left alive: {row['left_alive']}", flush=True)
    return row


def largest_tensors(device: torch.device, most: int = 8) -> list[dict]:
    """The largest storages on ``device`` that the garbage collector reaches through a tensor (one
    entry a storage, with the shape of its tensor of the most elements: a view keeps its base
    reachable): memory torch counts as allocated that no storage listed here holds belongs to
    something Python does not see (a CUDA graph's private pool)."""
    gc.collect()
    seen: dict[int, torch.Tensor] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device == device:
            key = o.untyped_storage().data_ptr()
            if key not in seen or o.numel() > seen[key].numel():
                seen[key] = o
    out = [{"bytes": t.untyped_storage().nbytes(), "shape": list(t.shape), "dtype": str(t.dtype)} for t in seen.values()]
    return sorted(out, key=lambda e: -e["bytes"])[:most]


def revision() -> str:
    """The commit results come from: ``WMTP_COMMIT`` (a copy of the tree without ``.git``, as on the
    GPU machine, is told it), else git's HEAD with ``-dirty`` for uncommitted changes, else "unknown"."""
    import os
    import subprocess

    if os.environ.get("WMTP_COMMIT"):
        return os.environ["WMTP_COMMIT"]
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def deciles(times: list[float]) -> list[float]:
    """The 9 deciles of ``times``; a single time's 9 times over (one iteration has no spread)."""
    return statistics.quantiles(times, n=10) if len(times) > 1 else times * 9


def _dtype(model) -> str:
    return str(model.embed_weight.dtype).removeprefix("torch.")


def weights(model) -> str:
    """The format the model's linears and experts hold: nvfp4 / fp8, or its float dtype."""
    return model.quant.name if model.quant is not None else str(next(model.parameters()).dtype).split(".")[-1]


def _meta(a: argparse.Namespace, synthetic: bool, runs: int = 1) -> dict:
    argv = getattr(a, "argv", None) or sys.argv[1:]  # cli.main records its argv (tests call it in-process)
    tp = getattr(a, "tensor_parallel_size", 1)
    return {
        "hardware": hardware_name(getattr(a, "device", "cuda"), tp), "tensor_parallel_size": tp, "model": a.preset,
        "layers": getattr(a, "layers", None),  # None: the whole model; N: its first N layers
        "dtype": getattr(a, "dtype", None) or "bfloat16", "synthetic": synthetic, "runs": runs,
        "command": "wmtp " + " ".join(argv), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "commit": revision(),
    }


def earlier_run(out: Path, kind: str, settings: dict) -> dict | None:
    """The results of an earlier run of ``kind`` into ``out`` with the same ``settings`` (one measurement
    split over calls under a time limit: each writes its part, the last holds all), else None."""
    try:
        old = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return old if old.get("kind") == kind and old.get("meta", {}).get("settings") == settings else None


def merged_meta(meta: dict, earlier: dict | None) -> dict:
    """``meta`` of this run, naming the earlier runs whose rows the file keeps (command, commit, date)."""
    if earlier is None:
        return meta
    old = earlier["meta"]
    runs = old.get("earlier_runs", []) + [{k: old.get(k) for k in ("command", "commit", "date")}]
    return {**meta, "earlier_runs": runs}


def step_bandwidth(device: torch.device) -> dict:
    """The read bandwidth the step floors divide by (``floor.measure_bandwidth``), reported."""
    from wmtp.bench.floor import measure_bandwidth

    bw = measure_bandwidth(device)
    bw["gpu_state_after"] = gpu_state(device)
    print(f"read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s (the floor's; a copy runs "
          f"{bw['copy_bytes_per_s'] / 1e9:.1f} GB/s read + write)", flush=True)
    return bw


def run_step(a: argparse.Namespace, bw: dict | None = None, tp: TPGroup | None = None) -> int:
    """``tp``: this rank's group when every rank of one runs it (``_run_ranks``); ``bw``: the
    bandwidth measured already (then rank 0's device's, for every rank)."""
    import wmtp

    device = torch.device(a.device)
    bw = bw or step_bandwidth(device)
    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, backend=a.backend, tp=tp, layers=a.layers)
    shape = kernel_shape(a, model.config) if a.kernels else None
    modes = mode_labels(a)
    rows = [time_mode(model, m, a, bw["read_bytes_per_s"]) for m in modes]
    by = {r["mode"]: r for r in rows}
    summary = {}
    if "native" in by and "windowed" in by:
        summary["native_over_windowed"] = by["native"]["t_iter_s"][0] / by["windowed"]["t_iter_s"][0]
        summary["native_over_windowed_sync"] = by["native"]["t_iter_sync_s"][0] / by["windowed"]["t_iter_sync_s"][0]
        print(f"native / windowed T_iter = {summary['native_over_windowed']:.3f} "
              f"(synchronised {summary['native_over_windowed_sync']:.3f})", flush=True)
    for m in modes:  # a mode beside its fp8-KV twin: the speed-up, measured in this run
        if f"{m}:kv-fp8" in by:
            ratio = by[m]["t_iter_s"][0] / by[f"{m}:kv-fp8"]["t_iter_s"][0]
            summary.setdefault("kv_fp8_speedup", {})[m] = ratio
            print(f"T_iter {m} / {m}:kv-fp8 = {ratio:.3f}", flush=True)
    result = {"kind": "step" if rows else "kernels", "schema": 1,
              "meta": {**_meta(a, True), "dtype": _dtype(model), "weights": weights(model), "bandwidth": bw,
                       "backend": a.backend,
                       "decode_graphs": a.decode_graphs,
                       "forced_accept": a.accept,
                       "t_iter": "overlapped (engine default): interval between consecutive iterations' results; "
                                 "t_iter_sync: each step GPU-synchronised before and after"},
              "rows": rows, "summary": summary}

    def save() -> None:  # after each part: a later part that fails leaves the earlier ones written
        if tp is None or tp.rank == 0:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
            print(f"wrote {a.out}")

    save()
    if a.kernels:
        result["kernels"] = kernel_bench(a, device, shape)
        save()
    if a.admission:
        result["admission"] = [admission(model, m, a) for m in modes]
        save()
    return 0


def prefill_kinds() -> dict[str, tuple[type, ...]]:
    """The module kinds ``bench ttft --split`` times a prefill by (whole layers: the attention's
    projections are attention)."""
    from wmtp.models.layers import MLP, Attention, GatedDeltaNet, SparseMoE
    from wmtp.models.nemotron_h import LatentMoE, Mamba2Mixer, ReLU2MLP

    return {"attention": (Attention,), "recurrent": (GatedDeltaNet, Mamba2Mixer), "moe": (SparseMoE, LatentMoE),
            "mlp": (MLP, ReLU2MLP)}


def _prefill_seconds(model, mode: str, a: argparse.Namespace, prompts: list[list[int]],
                     prefix_cache: bool = False, split_into: dict[str, float] | None = None) -> list[tuple[float, int]]:
    """Per prompt, one after another in one engine of ``mode`` (a label, ``parse_mode``): (wall time
    from adding the request to its first token, a real chunked prefill; prompt tokens it took from
    the prefix cache). ``split_into``: filled with the first prompt's time inside each of
    ``prefill_kinds`` (target and draft head) and the ``rest`` (embedding, norms, heads, the engine)."""
    import contextlib

    from wmtp.bench.timing import ModuleTimes
    from wmtp.engine.sampling import SamplingParams

    eng = Engine(model, _spec(mode, a.d, a.window, a.sink),
                 EngineConfig(max_model_len=max(map(len, prompts)) + 16, max_num_seqs=1, page_size=a.page_size,
                              prefill_chunk=a.chunk, prefix_cache=prefix_cache,
                              prefix_snapshot_interval=a.snapshot_interval, kv_cache_dtype=kv_dtype(mode)))
    out = []
    for i, prompt in enumerate(prompts):
        times = ModuleTimes(model, prefill_kinds(), torch.device(a.device)) if split_into is not None and i == 0 else None
        _sync(a.device)
        t0 = time.perf_counter()
        with times or contextlib.nullcontext():
            rid = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while eng.requests[rid].metrics.first_token_time is None:
                eng.step()
            _sync(a.device)
        out.append((time.perf_counter() - t0, eng.requests[rid].metrics.cached_tokens))
        if times is not None:
            split_into.update(times.seconds())
            split_into["rest"] = out[-1][0] - sum(split_into.values())
        while eng.has_unfinished():  # its pages go to the prefix cache when it finishes
            eng.step()
    del eng
    release_pools(model)
    return out


def repeat_prompt(prompt: list[int], suffix: int, vocab_size: int) -> list[int]:
    """``prompt`` with its last ``suffix`` tokens replaced by others (seeded; none equal to the one replaced)."""
    from wmtp.errors import WmtpError

    if not 0 < suffix < len(prompt):
        raise WmtpError(f"--repeat-suffix={suffix} must be in [1, {len(prompt) - 1}] (--tokens={len(prompt)})")
    gen = torch.Generator().manual_seed(1)
    tail = torch.tensor(prompt[-suffix:])
    other = (tail + torch.randint(1, vocab_size - 1, (suffix,), generator=gen)) % vocab_size
    return prompt[:-suffix] + other.tolist()


#: what must match for a run's rows to join an earlier run's of other modes in one ``--out``
TTFT_SETTINGS = ("preset", "tokens", "chunk", "repeat_suffix", "snapshot_interval", "d", "window", "sink", "page_size",
                 "dtype", "tensor_parallel_size", "layers")


def run_ttft(a: argparse.Namespace, tp: TPGroup | None = None) -> int:
    """One prefill per mode (and the repeat with another suffix). Rows of other modes that an earlier
    run with the same settings wrote into ``--out`` are kept: the modes of a 1M-token prompt each
    take most of one call's time limit on the GPU machine."""
    import wmtp

    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, backend=a.backend, tp=tp, layers=a.layers)
    prompt = torch.randint(1, model.config.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    warm = min(a.tokens, 2 * a.chunk + 1)
    modes = mode_labels(a)
    from wmtp.kernels.flash_prefill import library_version

    fa4 = library_version(torch.device(a.device)) if a.backend == "triton" else None
    # modes measured with another prefill attention are not merged into these results
    settings = {**{k: getattr(a, k, None) for k in TTFT_SETTINGS},
                "prefill_attention": f"flash-attn-4 {fa4}" if fa4 else a.backend}  # flash_prefill.fits chunks
    earlier = earlier_run(Path(a.out), "ttft", settings)
    rows = [r for r in earlier["rows"] if r["mode"] not in modes] if earlier else []
    for mode in modes:
        # untimed first: Triton compiles and fla autotunes per shape class on first use, which
        # would otherwise land in whichever mode runs first; with the prefix cache as the timed run
        # has it, whose prefill chunks end at snapshot boundaries (shorter chunks than --chunk)
        _prefill_seconds(model, mode, a, [prompt[:warm]], bool(a.repeat_suffix))
        row = {"mode": mode, "tokens": a.tokens, "chunk": a.chunk, "warmup_tokens": warm}
        split = {} if a.split else None
        if a.repeat_suffix:
            (row["ttft_s"], _), (row["repeat_ttft_s"], row["repeat_cached_tokens"]) = _prefill_seconds(
                model, mode, a, [prompt, repeat_prompt(prompt, a.repeat_suffix, model.config.vocab_size)], True, split)
            row["repeat_suffix"] = a.repeat_suffix
        else:
            row["ttft_s"] = _prefill_seconds(model, mode, a, [prompt], split_into=split)[0][0]
        if split is not None:
            row["split_s"] = split
        rows.append(row)
        repeat = (f"; again with another {a.repeat_suffix}-token suffix: {row['repeat_ttft_s']:.2f} s "
                  f"({row['repeat_cached_tokens']} tokens cached)") if a.repeat_suffix else ""
        print(f"[{mode:8s}] TTFT of a {a.tokens}-token prompt: {row['ttft_s']:.2f} s{repeat}", flush=True)
    from wmtp.kernels.gdn import fla_available

    gdn = "flash-linear-attention chunked" if fla_available(torch.device(a.device)) else "PyTorch reference"
    meta = {**_meta(a, False), "weights": weights(model), "backend": a.backend, "gdn_prefill": gdn, "settings": settings}
    result = {"kind": "ttft", "schema": 1, "meta": merged_meta(meta, earlier), "rows": rows}
    if tp is None or tp.rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """The options every synthetic-context benchmark shares: window, pages, device, kernels, output."""
    s.add_argument("--window", type=int, default=4032)
    s.add_argument("--sink", type=int, default=64)
    s.add_argument("--page-size", type=int, default=64)
    s.add_argument("--device", default="auto", help="cuda | cpu | auto (cuda when there is one)")
    s.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, the preset's own on CPU")
    s.add_argument("--backend", default="auto", help="torch | triton | auto (triton on CUDA)")
    s.add_argument("--decode-graphs", default="auto", choices=["auto", "off"],
                   help="CUDA graphs for greedy decode iterations (auto: on with the triton backend)")
    s.add_argument("--out", required=True, help="JSON results file")


def add_args(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """``step``, ``ttft``, ``depth-replay``, ``multiturn`` and ``kv-logits``; returns the sub-parsers so the
    sweeps can add theirs."""
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, help in (("step", "T_iter per mode at S tokens (synthetic context, forced acceptance)"),
                       ("ttft", "TTFT of a real chunked prefill, per mode")):
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--preset", default="qwen3.6-35b-a3b")
        s.add_argument("--modes", default="dense,native,windowed",
                       help="comma-separated; mode:V<K> drafts over a pruned vocabulary of K tokens (cost only), "
                            "mode:kv-fp8 holds K / V in fp8 e4m3")
        s.add_argument("-d", type=int, default=7, help="num_draft_tokens")
        add_engine_args(s)
        s.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="shard the model over N ranks, one process (and GPU) each; rank 0 reports")
        add_layers_arg(s)
        if name == "step":
            s.add_argument("--context", type=int, default=1_040_000, help="S, synthetic")
            s.add_argument("--iters", type=int, default=60)
            s.add_argument("--warmup", type=int, default=5)
            s.add_argument("--accept", type=int, default=3, help="forced accepted drafts per iteration")
            s.add_argument("--kernels", action="store_true", help="also the attention micro-benchmarks")
            s.add_argument("--admission", action="store_true", help="also how many S-token requests fit")
            s.add_argument("--max-admit", type=int, default=16, help="admission: stop at this many requests")
            s.add_argument("--reserve-gib", type=float, default=16.0,
                           help="left free for activations and decode graphs (6 GiB ran out in the 1M batch sweep)")
            s.add_argument("--heads", type=int, help="--kernels: query heads (default: the model's)")
            s.add_argument("--kv-heads", type=int, help="--kernels: KV heads (default: the model's)")
            s.add_argument("--head-dim", type=int, help="--kernels: head dim (default: the model's)")
        else:
            s.add_argument("--tokens", type=int, default=131_072)
            s.add_argument("--chunk", type=int, default=8192)
            s.add_argument("--repeat-suffix", type=int, default=0, metavar="K",
                           help="then a second prompt: the first N - K tokens again and K others, with prefix "
                                "caching on (ttft_s is then the first request's with the cache on)")
            s.add_argument("--snapshot-interval", type=int, default=EngineConfig.prefix_snapshot_interval,
                           help="--repeat-suffix: pages between prefix snapshots")
            s.add_argument("--split", action="store_true",
                           help="also the prefill's time inside attention, recurrent (GDN / Mamba2), MoE and MLP "
                                "layers (CUDA events around each, in the timed run) and the rest")
    from wmtp.bench.depth import add_args as add_depth_args
    from wmtp.bench.kv_dtype import add_args as add_kv_logits_args
    from wmtp.bench.multiturn import add_args as add_multiturn_args

    add_depth_args(sub)
    add_multiturn_args(sub)
    add_kv_logits_args(sub)
    return sub


def check_bounds(at_least_one: dict[str, float], at_least_zero: dict[str, float]) -> None:
    """Options by their flag: a value below its bound raises WmtpError naming the flag."""
    from wmtp.errors import WmtpError

    for low, opts in ((1, at_least_one), (0, at_least_zero)):
        for opt, v in opts.items():
            if v < low:
                raise WmtpError(f"{opt}={v} must be >= {low}")


def check_layers(a: argparse.Namespace) -> None:
    """``--layers N``: a preset's (a checkpoint loads whole), N within its layer count; WmtpError
    naming the option, before anything loads or is timed."""
    if a.layers is None:
        return
    from wmtp.errors import WmtpError
    from wmtp.presets import PRESETS, preset_config

    if a.preset not in PRESETS:
        raise WmtpError(f"--layers={a.layers} applies to presets; {a.preset!r} is not one (a checkpoint loads whole)")
    n = preset_config(a.preset).num_layers
    if not 1 <= a.layers <= n:
        raise WmtpError(f"--layers={a.layers}: the model has {n} layers; keep between 1 and {n}")


def add_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="the preset's first N layers only: each costs what it does in the whole model, "
                        "for cost runs on a GPU the whole one does not fit (recorded in the results)")


def check_options(a: argparse.Namespace) -> None:
    """``step`` / ``ttft``'s options, before the model loads or anything is timed: counts and sizes
    in their bounds, and every mode label a SpecConfig and KV dtype (``parse_mode``, ``_spec``)."""
    from wmtp.errors import WmtpError

    counts = {"--page-size": a.page_size, "--window": a.window}
    check_layers(a)
    if a.bench == "step":
        check_bounds({**counts, "--context": a.context, "--iters": a.iters, "--max-admit": a.max_admit},
                     {"--warmup": a.warmup, "--accept": a.accept, "--sink": a.sink, "--reserve-gib": a.reserve_gib})
    else:
        check_bounds({**counts, "--tokens": a.tokens, "--chunk": a.chunk},
                     {"--repeat-suffix": a.repeat_suffix, "--sink": a.sink})
        if a.repeat_suffix >= a.tokens:  # (repeat_prompt's own condition, known before the model loads)
            raise WmtpError(f"--repeat-suffix={a.repeat_suffix} must be in [1, {a.tokens - 1}] (--tokens={a.tokens})")
    modes = mode_labels(a)
    if not modes and not (a.bench == "step" and a.kernels):  # (step --kernels alone: the kernels' file)
        raise WmtpError(f"--modes={a.modes!r}: name at least one mode")
    for m in modes:
        _spec(m, a.d, a.window, a.sink)


def run(a: argparse.Namespace) -> int:
    from wmtp.errors import WmtpError
    from wmtp.models.backend import default_backend

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = torch.device(a.device).type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise WmtpError(f"--device={a.device}: no CUDA device here (use --device cpu with a tiny preset)")
    # what times GPU kernels or queries GPU memory
    needs_gpu = [o for o in ("kernels", "admission") if getattr(a, o, False)]
    if needs_gpu and not on_gpu:
        raise WmtpError(f"wmtp bench {a.bench}: {', '.join(needs_gpu)} needs a CUDA device (--device={a.device})")
    a.backend = default_backend(a.device) if a.backend == "auto" else a.backend
    if a.dtype is None and on_gpu:
        a.dtype = "bfloat16"
    if a.bench == "depth-replay":
        from wmtp.bench.depth import run_depth_replay

        return run_depth_replay(a)
    if a.bench == "multiturn":
        from wmtp.bench.multiturn import run_multiturn

        return run_multiturn(a)
    if a.bench == "kv-logits":
        from wmtp.bench.kv_dtype import run_kv_logits

        return run_kv_logits(a)
    check_options(a)
    if a.tensor_parallel_size != 1:
        return _run_ranks(a)
    return run_step(a) if a.bench == "step" else run_ttft(a)


def _run_ranks(a: argparse.Namespace) -> int:
    """The benchmark on every rank of a tensor-parallel group (each its own engine over its shard,
    in lockstep); rank 0 measures the bandwidth once, prints and writes the results."""
    from wmtp.engine.distributed import Ranks, check_tensor_parallel
    from wmtp.errors import WmtpError

    if getattr(a, "admission", False):  # each rank would size its pools from its own free memory
        raise WmtpError("wmtp bench step --admission is not supported with --tensor-parallel-size > 1")
    check_tensor_parallel(a.preset, a.tensor_parallel_size, a.device)
    bw = step_bandwidth(torch.device(a.device)) if a.bench == "step" else None
    return Ranks.shared(a.tensor_parallel_size, a.device).call(_rank_run, a, bw)


def _rank_run(a: argparse.Namespace, bw: dict | None) -> int:
    import contextlib
    import copy
    import io

    from wmtp.engine.distributed import local_tp, rank_device

    tp = local_tp()
    a = copy.copy(a)
    a.device = rank_device(a.device, tp.rank)
    with contextlib.redirect_stdout(io.StringIO()) if tp.rank else contextlib.nullcontext():
        return run_step(a, bw, tp) if a.bench == "step" else run_ttft(a, tp)
