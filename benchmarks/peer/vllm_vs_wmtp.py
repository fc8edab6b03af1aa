"""wmtp vs vLLM 0.26.0 on one GPU, on the same prompts in the same run (issue 26).

Per engine and mode: TTFT, decode T_iter (time per verify step = decode time / steps) and TPOT at
B = 1 for each ``--contexts`` S, plus system tok/s at B = ``--batch`` for ``--batch-context``.
Prompts are random token ids (seeded, identical for both engines); random weights accept almost
nothing, so every row is at natural acceptance (AL ~ 1) and says its AL.

- vLLM: ``LLM(load_format="dummy")`` on an HF config of the wmtp preset's shape (Qwen3.5-MoE, the
  ``Qwen3_5MoeForConditionalGeneration`` vLLM registers, text only), YaRN x4 / 1M positions through
  ``hf_overrides``, CUDA graphs on (``enforce_eager=False``), its default attention and GDN backends.
  Modes ``dense`` (no speculation) and ``mtp`` (``method="mtp"``, ``num_speculative_tokens = d - 1``).
  TTFT and decode time come from vLLM's own per-request stats; steps and AL from its
  spec-decode counters (``vllm:spec_decode_num_drafts`` / ``_num_accepted_tokens``).
- wmtp: the same shape, random weights, ``Engine`` as ``wmtp bench ttft`` drives it (prefill chunk
  8192); modes ``dense`` / ``native`` / ``windowed`` at d.

Each engine runs in its own subprocess (vLLM: one per mode, one model load each; wmtp: one load,
an Engine per mode), so GPU memory is freed in between. Every finished row is written at once to
``--state`` (``<engine>_<mode>.json``); the parent merges them into ``--out`` after each child, so a
run cut short by its deadline keeps what it measured, and calls made one after another (the same
``--state``) add up. ``--merge FILES`` merges such files (from several calls) offline.

On the GPU machine, after ``benchmarks/peer/install_wheels.sh`` (the commands: benchmarks/peer/README.md):
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
  python3 benchmarks/peer/vllm_vs_wmtp.py --engines vllm --vllm-modes mtp --contexts 131072,262144 --out $OUT/peer.json
``--smoke``: the same at 4 decoder layers and short contexts (a quick end-to-end check);
``--background``: go on past the call (``wait.sh`` collects); ``--dry-run``: write the vLLM config
and print every engine's arguments; ``--device cpu``: the wmtp half on the host (tiny presets).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere: wmtp is the repo's package
    sys.path.insert(0, str(ROOT))

VLLM_VERSION = "0.26.0"
KIND = "peer"
# log lines of a vLLM child that name the kernels it picked; copied into the JSON's meta
VLLM_LOG_KEYS = ("attention backend", "GDN prefill", "MoE backend", "FlashInfer", "cudagraph", "CUDA graph",
                 "max_num_batched_tokens", "Chunked prefill", "prefix caching", "KV cache", "torch.compile",
                 "Loading weights took", "Model loading took", "init engine")


# ---- the model shape: one dict (the wmtp preset's) for both engines ---------------------------


def shape(preset: str, layers: int | None = None) -> dict[str, Any]:
    """The preset's HF config dict (wmtp's source of truth), with ``layers`` decoder layers if given
    (the smoke run: same widths, fewer layers, so kernels and shapes are the real ones)."""
    import copy

    from wmtp.presets import PRESETS

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}")
    cfg = copy.deepcopy(PRESETS[preset])
    if cfg.get("model_type") not in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise SystemExit(f"preset {preset!r} is not a Qwen3.5-MoE shape (vLLM's side needs one)")
    if "quantization_config" in cfg:
        raise SystemExit(f"preset {preset!r} is quantized; the vLLM peer run compares bf16 weights")
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def vllm_hf_config(text: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, hf_overrides) for vLLM, in the checkpoint layout of the public Qwen3.6-35B-A3B
    release (``Qwen3_5MoeForConditionalGeneration``: ``text_config`` + ``vision_config``,
    interleaved M-RoPE sections), with the preset's YaRN scaling (factor 4 over the native 262,144
    positions) and 1,048,576 max positions given as ``hf_overrides``, the way the release's model
    card extends the context to 1M.

    config.json carries the same YaRN fields: vLLM 0.26 applies dict ``hf_overrides`` to the target
    model only (``SpeculativeConfig.compose_draft_hf_overrides``), so the MTP drafter, built from
    config.json, would otherwise keep the native rope with a 262,144-entry table and a 262,144
    max_model_len, while every context of this run but the first is longer than that."""
    rope = dict(text["rope_parameters"])
    rope_type = rope.get("rope_type", "default")
    rope.update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    t = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "rope_parameters", "dtype")}
    t.update(model_type="qwen3_5_moe_text", rope_parameters=rope, dtype=text.get("dtype", "bfloat16"))
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": t,
        # the release's vision tower shape; never built (language_model_only)
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                          "num_heads": 16, "out_hidden_size": text["hidden_size"], "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                          "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "dtype": text.get("dtype", "bfloat16"),
    }
    overrides: dict[str, Any] = {}
    if rope_type == "yarn":
        overrides = {"text_config": {"rope_parameters": rope,
                                     "max_position_embeddings": text["max_position_embeddings"]}}
    return config, overrides


def write_vllm_model_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ---- prompts: identical token ids for both engines --------------------------------------------


def prompt(vocab: int, S: int, index: int = 0) -> list[int]:
    """S random token ids in [1, vocab): request ``index`` of a batch, seeded by (S, index) alone."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * index + S)
    return torch.randint(1, vocab, (S,), generator=gen).tolist()


# ---- the measurement plan ---------------------------------------------------------------------


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows a child measures, cheapest first (a deadline then cuts the expensive ones)."""
    rows = [{"B": 1, "S": S, "max_tokens": a.max_tokens} for S in sorted(a.contexts) if S <= a.batch_from_largest]
    if a.batch > 1 and a.batch_context:
        rows.append({"B": a.batch, "S": a.batch_context, "max_tokens": a.batch_max_tokens})
    rows += [{"B": 1, "S": S, "max_tokens": a.max_tokens} for S in sorted(a.contexts) if S > a.batch_from_largest]
    return rows


def longest(a: argparse.Namespace) -> int:
    """The longest request: prompt + generated tokens + the verify tokens a last step may hold."""
    n = max([S + a.max_tokens for S in a.contexts]
            + ([a.batch_context + a.batch_max_tokens] if a.batch > 1 and a.batch_context else []))
    return n + a.d + 8


def model_len(a: argparse.Namespace) -> int:
    """max_model_len of both engines: ``--max-model-len``, else the preset's max positions (1,048,576
    with YaRN x4), whatever this call's contexts, so calls that split the contexts run the same
    engines (block tables, graphs, compile caches)."""
    n = a.max_model_len or shape(a.preset, a.layers)["max_position_embeddings"]
    if longest(a) > n:
        raise SystemExit(f"the longest request ({longest(a)} tokens) exceeds max_model_len {n}")
    return n


def warmup_tokens(a: argparse.Namespace) -> int:
    """Covers full and partial prefill chunks of both engines (16384: vLLM's default batch on H200)."""
    return min(max(a.contexts), 2 * 16384 + 1)


# ---- timing: per-step token events → decode time, steps, the B > 1 window ---------------------


def batch_window(events: list[tuple[float, str, int, bool]], batch: int) -> dict[str, Any]:
    """System throughput while all ``batch`` requests decode together: from the step at which the
    last one got its first token to the step at which the first one finished. ``events`` are
    (time, request, new tokens, finished) per request per engine step, in order. Returns the window
    (seconds), tokens and steps inside it, system and per-user tok/s, T_iter and AL (tokens per
    request per step)."""
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    for t, rid, n, done in events:
        if n and rid not in first:
            first[rid] = t
        if done and rid not in finish:
            finish[rid] = t
    if len(first) < batch or not finish:
        return {"window_s": None, "window_tokens": 0, "window_steps": 0, "system_tok_s": None,
                "per_user_tok_s": None, "t_iter_s": None, "al": None}
    t0, t1 = max(first.values()), min(finish.values())
    inside = [(t, n) for t, rid, n, _ in events if t0 < t <= t1]
    tokens = sum(n for _, n in inside)
    steps = len({t for t, _ in inside})
    span = t1 - t0
    ok = span > 0 and steps > 0
    return {"window_s": span, "window_tokens": tokens, "window_steps": steps,
            "system_tok_s": tokens / span if ok else None, "per_user_tok_s": tokens / span / batch if ok else None,
            "t_iter_s": span / steps if ok else None, "al": tokens / (steps * batch) if ok else None}


def cell(row: dict[str, Any]) -> tuple:
    return row["engine"], row["mode"], row["d"], row["S"], row["B"]


def earlier_rows(path: Path) -> list[dict[str, Any]]:
    """Rows an earlier call left in this child's state file (the same ``--state``): kept, so calls
    measuring different contexts of one mode add up; a re-measured cell replaces its old row."""
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, json.JSONDecodeError, KeyError):
        return []


def keep_row(state: dict[str, Any], row: dict[str, Any]) -> None:
    state["rows"] = [r for r in state["rows"] if cell(r) != cell(row)] + [row]


def _row(engine: str, mode: str, d: int, S: int, B: int, **fields: Any) -> dict[str, Any]:
    """A result row: list-valued fields hold one value per run (SCHEMA.md); here one run."""
    row: dict[str, Any] = {"engine": engine, "mode": mode, "d": d, "S": S, "B": B}
    for k, v in fields.items():
        row[k] = [v] if k.endswith("_s") or k in ("al", "system_tok_s", "per_user_tok_s") else v
    return row


# ---- vLLM --------------------------------------------------------------------------------------


def vllm_kwargs(a: argparse.Namespace, mode: str, model_dir: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """Every argument the run gives ``vllm.LLM``; ``VLLM_FLAGS_WHY`` says why each is set."""
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "language_model_only": True,
        "hf_overrides": overrides,
        "dtype": "bfloat16",
        "enforce_eager": False,
        "max_model_len": model_len(a),
        "max_num_seqs": max(a.batch, 1),
        "disable_log_stats": False,
        "seed": 0,
    }
    if mode == "mtp":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": a.d - 1}
    if a.vllm_gdn_prefill != "auto":
        kw["gdn_prefill_backend"] = a.vllm_gdn_prefill
    elif not cutedsl_available():
        # vLLM's SM90 default (FlashInfer's CuTe-DSL kernel) cannot run without the cutlass package
        # and would fail at the first prefill: its Triton/FLA kernel instead, and the JSON says so
        kw["gdn_prefill_backend"] = "triton"
    if a.vllm_gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = a.vllm_gpu_memory_utilization
    return kw


def cutedsl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("quack") is not None


VLLM_FLAGS_WHY = {
    "load_format": "dummy: random weights, no checkpoint (the GPU machine has none)",
    "skip_tokenizer_init": "prompts are token ids; the machine has no tokenizer files and no hub",
    "language_model_only": "text-only run: the vision tower of the multimodal architecture is not built "
                           "(vLLM registers Qwen3.5-MoE only as Qwen3_5MoeForConditionalGeneration)",
    "hf_overrides": "YaRN factor 4 over the native 262,144 positions and 1,048,576 max positions (config.json "
                    "carries them too: vLLM applies dict overrides to the target only, and the MTP drafter is built "
                    "from config.json)",
    "dtype": "bfloat16, as wmtp",
    "enforce_eager": "False (the default): torch.compile and CUDA graphs",
    "max_model_len": "the preset's 1,048,576 positions (YaRN x4), in every call; KV for one such request fits",
    "max_num_seqs": "the largest batch the run submits: bounds the CUDA-graph capture sizes (startup time); "
                    "no effect on kernels at B <= max_num_seqs",
    "disable_log_stats": "False: per-request timestamps and the spec-decode counters the rows come from",
    "seed": "0",
    "speculative_config": "method mtp, num_speculative_tokens = d - 1 (d verify tokens, as wmtp's d)",
    "gdn_prefill_backend": "only with --vllm-gdn-prefill, or triton where the CuTe-DSL wheels are absent "
                           "(--vllm-no-cutedsl): vLLM's SM90 default is FlashInfer's CuTe-DSL kernel",
    "gpu_memory_utilization": "only when --vllm-gpu-memory-utilization is given (default: vLLM's 0.92)",
}


def _counters(llm) -> dict[str, float]:
    """vLLM's Prometheus counters (summed over labels), by name."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value") and isinstance(m.value, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _vllm_drive(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list, list, dict]:
    """Submit ``prompts`` together, step the engine to the end; returns (events, final outputs,
    counter deltas). Events: (wall time, request, new tokens, finished) per output per step."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    before = _counters(llm)
    names = {}
    for i, p in enumerate(prompts):
        rid = engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, params)
        names[rid] = f"{tag}{i}"
    events, final = [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            rid = names.get(o.request_id, o.request_id)
            events.append((t, rid, len(o.outputs[0].token_ids), bool(o.finished)))
            if o.finished:
                final[rid] = o
    after = _counters(llm)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return events, [final[f"{tag}{i}"] for i in range(len(prompts))], delta


def _vllm_b1(llm, mode: str, a: argparse.Namespace, S: int, vocab: int) -> dict[str, Any]:
    events, (out,), delta = _vllm_drive(llm, [prompt(vocab, S)], a.max_tokens, "s")
    st = out.metrics  # RequestStateStats: vLLM's own timestamps
    generated = sum(n for _, _, n, _ in events)
    decode = st.last_token_ts - st.first_token_ts  # engine-core clock, first to last token
    # engine steps after the first token, as the frontend saw them (one output per step at B = 1)
    step_events = sum(1 for _, _, n, _ in events if n) - 1
    drafts = int(delta.get("vllm:spec_decode_num_drafts", 0))
    if mode == "mtp":
        steps, source = (drafts, "vllm:spec_decode_num_drafts") if drafts else (step_events, "output steps")
    else:
        steps, source = generated - 1, "generated - 1"
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    wall_first = next(t for t, _, n, _ in events if n)
    row = _row("vllm", mode, a.d if mode == "mtp" else 1, S, 1,
               ttft_s=st.first_token_latency, t_iter_s=decode / steps if steps else None,
               tpot_s=decode / (generated - 1) if generated > 1 else None,
               al=(generated - 1) / steps if steps else None,
               decode_s=decode, steps=steps, steps_from=source, step_events=step_events, generated=generated,
               wall_decode_s=events[-1][0] - wall_first)
    if mode == "mtp":
        row.update(spec_drafts=drafts, spec_draft_tokens=int(delta.get("vllm:spec_decode_num_draft_tokens", 0)),
                   spec_accepted_tokens=int(accepted), al_spec=[1.0 + accepted / drafts] if drafts else [None])
    return row


def _vllm_batch(llm, mode: str, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = [prompt(vocab, a.batch_context, i) for i in range(a.batch)]
    events, outs, delta = _vllm_drive(llm, prompts, a.batch_max_tokens, "b")
    w = batch_window(events, a.batch)
    row = _row("vllm", mode, a.d if mode == "mtp" else 1, a.batch_context, a.batch,
               system_tok_s=w.pop("system_tok_s"), per_user_tok_s=w.pop("per_user_tok_s"),
               t_iter_s=w.pop("t_iter_s"), al=w.pop("al"),
               ttft_s=statistics.median(o.metrics.first_token_latency for o in outs), **w)
    row["ttft_median_s"] = row.pop("ttft_s")
    if mode == "mtp":
        row["spec_drafts"] = int(delta.get("vllm:spec_decode_num_drafts", 0))
        row["spec_accepted_tokens"] = int(delta.get("vllm:spec_decode_num_accepted_tokens", 0))
    return row


def vllm_resolved(vc) -> dict[str, Any]:
    """What vLLM made of the arguments (its defaults included), from its VllmConfig."""
    sc, cc, comp = vc.scheduler_config, vc.cache_config, vc.compilation_config
    return {
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_seqs": sc.max_num_seqs,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "async_scheduling": getattr(sc, "async_scheduling", None),
        "enable_prefix_caching": cc.enable_prefix_caching,
        "mamba_cache_mode": getattr(cc, "mamba_cache_mode", None),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "num_gpu_blocks": cc.num_gpu_blocks,
        "gpu_memory_utilization": cc.gpu_memory_utilization,
        "compilation_mode": str(comp.mode),
        "cudagraph_mode": str(comp.cudagraph_mode),
        "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes or []),
        "max_model_len": vc.model_config.max_model_len,
        "dtype": str(vc.model_config.dtype).removeprefix("torch."),
        "rope_parameters": dict(vc.model_config.hf_text_config.rope_parameters or {}),
        "speculative": None if vc.speculative_config is None else {
            "method": vc.speculative_config.method,
            "num_speculative_tokens": vc.speculative_config.num_speculative_tokens,
            "draft_architectures": list(vc.speculative_config.draft_model_config.architectures or []),
            "draft_max_model_len": vc.speculative_config.draft_model_config.max_model_len},
    }


def child_vllm(a: argparse.Namespace, mode: str) -> int:
    text = shape(a.preset, a.layers)
    config, overrides = vllm_hf_config(text)
    model_dir = write_vllm_model_dir(Path(a.state) / f"vllm_model_{a.preset}{'_L%d' % a.layers if a.layers else ''}",
                                     config)
    kw = vllm_kwargs(a, mode, model_dir, overrides)
    import vllm
    from vllm import LLM

    t0 = time.perf_counter()
    # CuTe DSL parses sys.argv in the engine-core process (where `-d 7` reads as its `-diagnostic`)
    sys.argv = sys.argv[:1]
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    resolved = {**vllm_resolved(llm.llm_engine.vllm_config), "startup_s": startup,
                "cutedsl_available": cutedsl_available()}
    vocab = text["vocab_size"]
    t0 = time.perf_counter()
    _vllm_drive(llm, [prompt(vocab, warmup_tokens(a), 99)], 8, "w")  # one-time JIT / autotune
    if a.batch > 1 and a.batch_context:
        _vllm_drive(llm, [prompt(vocab, 64, 100 + i) for i in range(a.batch)], 8, "w")
    resolved["warmup_s"] = time.perf_counter() - t0
    out = Path(a.state) / f"vllm_{mode}.json"
    state = {"engine": "vllm", "mode": mode, "version": vllm.__version__, "kwargs": _jsonable(kw),
             "resolved": resolved, "rows": earlier_rows(out)}
    out.write_text(json.dumps(state, indent=1))
    for r in plan(a):
        t0 = time.perf_counter()
        row = _vllm_batch(llm, mode, a, vocab) if r["B"] > 1 else _vllm_b1(llm, mode, a, r["S"], vocab)
        row["measure_wall_s"] = [time.perf_counter() - t0]
        keep_row(state, row)
        out.write_text(json.dumps(state, indent=1))
        print(f"[vllm {mode}] {_describe(row)}", flush=True)
    return 0


# ---- wmtp --------------------------------------------------------------------------------------


def wmtp_engine_config(a: argparse.Namespace):
    from wmtp.engine.config import EngineConfig

    # pools for the worst of this call's plan and one request of max_model_len, so that every call
    # runs the same engine
    need = max(model_len(a), a.batch * (a.batch_context + a.batch_max_tokens + a.d + 8) if a.batch > 1 else 0)
    pages = -(-need // a.page_size) + max(a.batch, 1)  # + one partial page per request
    return EngineConfig(max_model_len=model_len(a), max_num_seqs=max(a.batch, 1), page_size=a.page_size,
                        num_kv_pages=pages, prefill_chunk=a.chunk, decode_graphs=a.decode_graphs)


def _wmtp_drive(eng, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """Like ``_vllm_drive``: events per emitted output per step; returns (events, requests)."""
    from wmtp.engine.sampling import SamplingParams

    rids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    events = []
    while eng.has_unfinished():
        outs = eng.step()
        t = time.perf_counter()
        for o in outs:
            events.append((t, str(o.request_id), len(o.new_token_ids), o.finished))
    eng._drain()
    return events, [eng.requests[r] for r in rids]


def _wmtp_b1(eng, mode: str, a: argparse.Namespace, S: int, vocab: int) -> dict[str, Any]:
    from wmtp.engine.metrics import acceptance_length

    _, (req,) = _wmtp_drive(eng, [prompt(vocab, S)], a.max_tokens)
    m = req.metrics
    steps = sum(m.hist)
    decode = m.finish_time - m.first_token_time
    return _row("wmtp", mode, eng.spec.verify_tokens, S, 1, ttft_s=m.ttft,
                t_iter_s=decode / steps if steps else None, tpot_s=m.tpot, al=acceptance_length(m.hist),
                decode_s=decode, steps=steps, generated=m.num_generated,
                t_iter_median_s=statistics.median(m.t_iter) if m.t_iter else None,
                acceptance_histogram=list(m.hist))


def _wmtp_synthetic_b1(eng, mode: str, a: argparse.Namespace, S: int) -> dict[str, Any]:
    """Decode after a SYNTHETIC context of S tokens (random KV and states, no prefill: wmtp's
    ``bench step`` context), at natural acceptance (nothing forced); no TTFT."""
    from wmtp.bench.synthetic import add_synthetic_request, randomize_pools
    from wmtp.engine.metrics import acceptance_length

    randomize_pools(eng)
    req = add_synthetic_request(eng, S, a.max_tokens)
    while eng.has_unfinished():
        eng.step()
    eng._drain()
    m = req.metrics
    steps = sum(m.hist)
    decode = m.finish_time - m.first_token_time
    row = _row("wmtp", mode, eng.spec.verify_tokens, S, 1, ttft_s=None,
               t_iter_s=decode / steps if steps else None, tpot_s=m.tpot, al=acceptance_length(m.hist),
               decode_s=decode, steps=steps, generated=m.num_generated,
               t_iter_median_s=statistics.median(m.t_iter) if m.t_iter else None,
               acceptance_histogram=list(m.hist))
    row["synthetic"] = True
    return row


def _wmtp_batch(eng, mode: str, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    if a.wmtp_synthetic_batch:
        return _wmtp_synthetic_batch(eng, mode, a)
    prompts = [prompt(vocab, a.batch_context, i) for i in range(a.batch)]
    events, reqs = _wmtp_drive(eng, prompts, a.batch_max_tokens)
    w = batch_window(events, a.batch)
    row = _row("wmtp", mode, eng.spec.verify_tokens, a.batch_context, a.batch,
               system_tok_s=w.pop("system_tok_s"), per_user_tok_s=w.pop("per_user_tok_s"),
               t_iter_s=w.pop("t_iter_s"), al=w.pop("al"), **w)
    row["ttft_median_s"] = [statistics.median(r.metrics.ttft for r in reqs)]
    return row


def _wmtp_synthetic_batch(eng, mode: str, a: argparse.Namespace) -> dict[str, Any]:
    """B requests that each already hold a SYNTHETIC context of the batch context (wmtp's batch
    sweep's context): all decode from the first step; the same window rule as a real batch."""
    from wmtp.bench.synthetic import add_synthetic_request, randomize_pools

    randomize_pools(eng)
    reqs = [add_synthetic_request(eng, a.batch_context, a.batch_max_tokens, seed=i) for i in range(a.batch)]
    t0 = time.perf_counter()
    events = [(t0, str(r.id), 1, False) for r in reqs]  # each holds its first token already
    while eng.has_unfinished():
        outs = eng.step()
        t = time.perf_counter()
        events += [(t, str(o.request_id), len(o.new_token_ids), o.finished) for o in outs]
    eng._drain()
    w = batch_window(events, a.batch)
    row = _row("wmtp", mode, eng.spec.verify_tokens, a.batch_context, a.batch,
               system_tok_s=w.pop("system_tok_s"), per_user_tok_s=w.pop("per_user_tok_s"),
               t_iter_s=w.pop("t_iter_s"), al=w.pop("al"), **w)
    row["synthetic"] = True
    return row


def child_wmtp(a: argparse.Namespace, modes: list[str]) -> int:
    import torch

    from wmtp.bench.step import _spec, release_pools, revision
    from wmtp.config import ModelConfig
    from wmtp.engine.engine import Engine
    from wmtp.models.backend import default_backend
    from wmtp.models.loader import build_model, init_random_, resolve_dtype

    text = shape(a.preset, a.layers)
    cfg = ModelConfig.from_dict(text)
    backend = default_backend(a.device)
    dtype = resolve_dtype("bfloat16" if a.device == "cuda" else None, cfg.torch_dtype)
    t0 = time.perf_counter()
    model = init_random_(build_model(cfg, a.device, dtype, backend), 0)
    load = time.perf_counter() - t0
    vocab = cfg.vocab_size
    eng_cfg = wmtp_engine_config(a)
    from wmtp.kernels.gdn import fla_available

    gdn = ("flash-linear-attention chunked" if a.device == "cuda" and fla_available(torch.device("cuda"))
           else "PyTorch reference")
    for mode in modes:
        spec = _spec(mode, a.d, a.window, a.sink)
        t0 = time.perf_counter()
        eng = Engine(model, spec, eng_cfg)
        _wmtp_drive(eng, [prompt(vocab, warmup_tokens(a), 99)], 8)  # Triton compiles, fla autotunes
        if a.batch > 1 and a.batch_context:
            _wmtp_drive(eng, [prompt(vocab, 64, 100 + i) for i in range(a.batch)], 8)  # the B-row's graphs
        resolved = {"model_build_s": load, "engine_and_warmup_s": time.perf_counter() - t0, "backend": backend,
                    "dtype": str(dtype).removeprefix("torch."), "prefill_chunk": eng_cfg.prefill_chunk,
                    "page_size": eng_cfg.page_size, "num_kv_pages": eng_cfg.num_kv_pages,
                    "decode_graphs": eng_cfg.decode_graphs, "compiled_steps": eng.compiled_steps,
                    "window": a.window if mode == "windowed" else None, "sink": a.sink if mode == "windowed" else None,
                    "gdn_prefill": gdn, "commit": revision()}
        out = Path(a.state) / f"wmtp_{mode}.json"
        state = {"engine": "wmtp", "mode": mode, "version": __import__("wmtp").__version__, "resolved": resolved,
                 "rows": earlier_rows(out)}
        out.write_text(json.dumps(state, indent=1))
        for r in plan(a):
            t0 = time.perf_counter()
            if r["B"] > 1:
                row = _wmtp_batch(eng, mode, a, vocab)
            elif a.wmtp_synthetic_from and r["S"] >= a.wmtp_synthetic_from:
                row = _wmtp_synthetic_b1(eng, mode, a, r["S"])
            else:
                row = _wmtp_b1(eng, mode, a, r["S"], vocab)
            row["measure_wall_s"] = [time.perf_counter() - t0]
            keep_row(state, row)
            out.write_text(json.dumps(state, indent=1))
            print(f"[wmtp {mode}] {_describe(row)}", flush=True)
        state["resolved"]["compiled_steps"] = eng.compiled_steps
        out.write_text(json.dumps(state, indent=1))
        del eng
        release_pools(model)
    return 0


# ---- the parent: children, deadline, merge ----------------------------------------------------


def _describe(row: dict[str, Any]) -> str:
    def ms(k: str) -> str:
        v = row.get(k)
        v = v[0] if isinstance(v, list) else v
        return "–" if v is None else f"{v * 1e3:.2f} ms"

    al = row.get("al", [None])[0]
    head = f"S={row['S']} B={row['B']} d={row['d']}: "
    if row["B"] > 1:
        st = row.get("system_tok_s", [None])[0]
        return head + f"system {st or float('nan'):.1f} tok/s, T_iter {ms('t_iter_s')}, AL {al or float('nan'):.3f}"
    ttft = row.get("ttft_s", [None])[0]
    return head + (f"TTFT {ttft:.2f} s, " if ttft is not None else "TTFT – (synthetic), ") + \
        f"T_iter {ms('t_iter_s')}, TPOT {ms('tpot_s')}, AL {al or float('nan'):.3f}"


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _hardware() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        if out:
            return f"{len(out)}x {out[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    import platform

    return f"CPU ({platform.machine()})"


def _child_argv(a: argparse.Namespace, child: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", child]
    for k in ("preset", "state", "max_tokens", "max_model_len", "batch", "batch_context", "batch_max_tokens", "d",
              "window", "sink", "page_size", "chunk", "decode_graphs", "device", "vllm_gdn_prefill", "layers",
              "vllm_gpu_memory_utilization", "wmtp_synthetic_from", "batch_from_largest"):
        v = getattr(a, k)
        if v is not None:
            argv += ["-d" if k == "d" else f"--{k.replace('_', '-')}", str(v)]
    argv += ["--contexts", ",".join(map(str, a.contexts))]
    if a.wmtp_synthetic_batch:
        argv.append("--wmtp-synthetic-batch")
    return argv


def child_env(base: dict[str, str], no_cutedsl: bool = False) -> dict[str, str]:
    """The children's environment: unbuffered; offline (no hub, no usage reports: the GPU machine
    reaches no network); and the CuTe-DSL package dir of a ``--target`` install on the path (its
    wheel adds it with a .pth file, which a PYTHONPATH entry does not run), or, ``no_cutedsl``,
    off it (vLLM then runs as installed without the cutlass package)."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                 ("DO_NOT_TRACK", "1")):
        env.setdefault(k, v)
    dsl = lambda p: Path(p).name == "dsl_packages"  # noqa: E731
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not (no_cutedsl and dsl(p))]
    extra = [] if no_cutedsl else [str(Path(p) / "nvidia_cutlass_dsl" / "dsl_packages") for p in parts
                                   if (Path(p) / "nvidia_cutlass_dsl" / "dsl_packages").is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(parts + [e for e in extra if e not in parts] + [str(ROOT)])
    return env


def run_child(a: argparse.Namespace, child: str, deadline: float) -> dict[str, Any]:
    """One child in its own process group (vLLM starts an engine-core process of its own), its
    output echoed and kept; killed as a group at the deadline. Returns its status."""
    left = deadline - time.monotonic()
    log_path = Path(a.state) / f"log_{child.replace(':', '_').replace(',', '_')}.txt"
    if left < 30:
        print(f"== {child}: skipped, {left:.0f} s left before the deadline", flush=True)
        return {"child": child, "status": "skipped (deadline)", "seconds": 0, "log_lines": []}
    print(f"== {child} (up to {left:.0f} s)", flush=True)
    env = child_env(os.environ, a.vllm_no_cutedsl)
    t0 = time.monotonic()
    keep: list[str] = []
    with open(log_path, "w") as log:
        p = subprocess.Popen(_child_argv(a, child), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True, bufsize=1)
        status = "ok"
        try:
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            while True:
                if time.monotonic() > deadline:
                    status = "killed at the deadline"
                    break
                if sel.select(timeout=5):
                    line = p.stdout.readline()
                    if not line:
                        break
                    log.write(line)
                    if not a.quiet or line.startswith("["):
                        sys.stdout.write(line)
                    if any(k in line for k in VLLM_LOG_KEYS) and len(keep) < 60:
                        keep.append(line.strip()[-300:])
                elif p.poll() is not None:
                    break
        finally:
            try:
                os.killpg(p.pid, signal.SIGTERM)  # the child's own group: its engine core too
                time.sleep(3)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = p.wait()
    if status == "ok" and rc != 0:
        status = f"exit {rc}"
    print(f"== {child}: {status} after {time.monotonic() - t0:.0f} s (log {log_path})", flush=True)
    return {"child": child, "status": status, "seconds": time.monotonic() - t0, "log_lines": keep}


def merge(parts: list[dict[str, Any]], a: argparse.Namespace, children: list[dict[str, Any]]) -> dict[str, Any]:
    """One results object from the children's state files (and earlier calls' results files)."""
    rows, engines = [], {}
    for part in parts:
        if part.get("kind") == KIND:  # an earlier merged file
            rows += part["rows"]
            for name, e in part["meta"].get("engines", {}).items():
                engines.setdefault(name, {}).setdefault("modes", {}).update(e.get("modes", {}))
                for k, v in e.items():
                    if k != "modes":
                        engines[name].setdefault(k, v)
            children = part["meta"].get("children", []) + children
            continue
        e = engines.setdefault(part["engine"], {"version": part.get("version"), "modes": {}})
        e["modes"][part["mode"]] = {k: part[k] for k in ("kwargs", "resolved") if k in part}
        rows += part["rows"]
    # later measurements of the same cell replace earlier ones
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells[cell(r)] = r
    order = {"vllm": 0, "wmtp": 1}
    rows = sorted(cells.values(), key=lambda r: (r["B"], r["S"], order.get(r["engine"], 9), r["d"], r["mode"]))
    if "vllm" in engines:
        engines["vllm"]["flags_why"] = VLLM_FLAGS_WHY
        engines["vllm"]["defaults_kept"] = (
            "attention backend (FlashAttention 3 on Hopper), GDN prefill kernel (FlashInfer's on SM90 unless "
            "--vllm-gdn-prefill), MoE kernels, chunked prefill at max_num_batched_tokens, prefix caching, async "
            "scheduling, cudagraph_mode, gpu_memory_utilization (0.92) and sampling all as vLLM picks them; "
            "greedy sampling, ignore_eos")
    if "wmtp" in engines:
        engines["wmtp"]["settings"] = (f"Engine (wmtp bench ttft's loop): prefill_chunk {a.chunk}, page_size "
                                       f"{a.page_size}, decode graphs {a.decode_graphs}, windowed W={a.window} "
                                       f"sink={a.sink}; greedy, ignore_eos")
    meta = {
        "hardware": _hardware(),
        "model": a.preset + (f" ({a.layers} layers)" if a.layers else ""),
        "dtype": "bfloat16" if a.device == "cuda" else "preset",
        "synthetic": any(r.get("synthetic") for r in rows),
        "runs": 1,
        "command": "python3 benchmarks/peer/vllm_vs_wmtp.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "prompts": "random token ids in [1, vocab), seeded by (S, request index): identical for both engines",
        "acceptance": "natural (random weights): AL ~ 1 in every speculative row; compare rows at their AL",
        "t_iter": "decode time / steps: time from the first to the last token over the verify steps in between "
                  "(vLLM: its per-request engine-core timestamps, steps from vllm:spec_decode_num_drafts; "
                  "wmtp: its request metrics). TPOT = decode time / (generated - 1). B > 1: system tok/s over "
                  "the window in which all requests decode (last first token to first finish)",
        "engines": engines,
        "children": children,
    }
    commits = sorted({m["resolved"]["commit"] for m in engines.get("wmtp", {}).get("modes", {}).values()
                      if m.get("resolved", {}).get("commit")})
    if commits:  # the wmtp code the rows ran (the children record it; vLLM's version is in engines)
        meta["commit"] = ",".join(commits)
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    if not rows:
        meta["notes"] = "no rows: see children[].status and their logs"
    return {"kind": KIND, "schema": 1, "meta": meta, "rows": rows}


def write(obj: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_jsonable(obj), indent=1))
    print(f"wrote {path} ({len(obj['rows'])} rows)", flush=True)


def state_parts(state: str) -> list[dict[str, Any]]:
    parts = []
    for f in sorted([*Path(state).glob("vllm_*.json"), *Path(state).glob("wmtp_*.json")]):
        try:
            parts.append(json.loads(f.read_text()))
        except json.JSONDecodeError:
            print(f"skipping {f}: not valid JSON (a child killed while writing it?)", flush=True)
    return parts


def dry_run(a: argparse.Namespace) -> int:
    text = shape(a.preset, a.layers)
    config, overrides = vllm_hf_config(text)
    model_dir = write_vllm_model_dir(Path(a.state) / f"vllm_model_{a.preset}{'_L%d' % a.layers if a.layers else ''}",
                                     config)
    print(f"vLLM config: {model_dir / 'config.json'}; CuTe DSL (cutlass, quack) importable here: "
          f"{cutedsl_available()} (without it the GDN prefill goes to triton)")
    for mode in a.vllm_modes:
        print(f"vLLM {mode}: LLM(**{json.dumps(vllm_kwargs(a, mode, model_dir, overrides))})")
    ec = wmtp_engine_config(a)
    print(f"wmtp modes {a.wmtp_modes}: {ec}")
    print("rows per child:", json.dumps(plan(a)))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results JSON (default: STATE/peer.json)")
    p.add_argument("--state", default="/tmp/peer_state", help="per-child results, logs and the vLLM config dir")
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--contexts", type=ints, default=[131072, 262144, 1040000], help="S of the B = 1 rows")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per B = 1 request")
    p.add_argument("--batch", type=int, default=8, help="B of the throughput row (1: none)")
    p.add_argument("--batch-context", type=int, default=131072)
    p.add_argument("--batch-max-tokens", type=int, default=512,
                   help="per request: the early requests decode while the last ones prefill, so the window "
                        "where all decode needs room")
    p.add_argument("--batch-from-largest", type=int, default=262144,
                   help="B = 1 contexts above this run after the batch row (the expensive ones last)")
    p.add_argument("--engines", type=names, default=["vllm", "wmtp"], help="which, in this order")
    p.add_argument("--vllm-modes", type=names, default=["dense", "mtp"])
    p.add_argument("--wmtp-modes", type=names, default=["dense", "native", "windowed"])
    p.add_argument("-d", type=int, default=7, help="verify tokens per step (vLLM: num_speculative_tokens = d - 1)")
    p.add_argument("--window", type=int, default=4032)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8192, help="wmtp prefill chunk (wmtp bench ttft's)")
    p.add_argument("--decode-graphs", default="auto")
    p.add_argument("--wmtp-synthetic-from", type=int, default=None,
                   help="B = 1 contexts >= this: wmtp decodes after a synthetic context (no prefill, no TTFT)")
    p.add_argument("--wmtp-synthetic-batch", action="store_true",
                   help="the B > 1 row of wmtp decodes after synthetic contexts (no prefill of B prompts)")
    p.add_argument("--vllm-gdn-prefill", default="auto", choices=["auto", "triton", "flashinfer"],
                   help="auto: vLLM's own choice (FlashInfer's CuTe-DSL kernel on SM90)")
    p.add_argument("--vllm-no-cutedsl", action="store_true",
                   help="run vLLM without the cutedsl wheel group (cutlass, quack) on the path: its GDN prefill "
                        "then on Triton/FLA, its MoE router GEMM on the next tier")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=None)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--max-model-len", type=int, default=None, help="both engines (default: the preset's max positions)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the wmtp half only (tiny presets)")
    p.add_argument("--deadline", type=float, default=540, help="seconds for the whole run; children are cut there")
    p.add_argument("--child-timeout", type=float, default=900,
                   help="seconds for one child (engine and mode), so that a hung one cannot take the whole run")
    p.add_argument("--smoke", action="store_true",
                   help="a quick end-to-end check: 4 decoder layers of the preset, S = 4096 and 16384, "
                        "B = 8 at 2048, 16 tokens")
    p.add_argument("--dry-run", action="store_true", help="write the vLLM config, print the arguments; load nothing")
    p.add_argument("--merge", nargs="+", default=None, metavar="FILE", help="merge results / state files into --out")
    p.add_argument("--quiet", action="store_true", help="echo only the children's result lines")
    p.add_argument("--background", action="store_true",
                   help="return at once and go on in a new session (longer than one device call); "
                        "benchmarks/peer/wait.sh STATE waits for it and copies the results to $OUT")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.layers = a.layers or 4
        a.contexts, a.max_tokens = [4096, 16384], 16
        a.batch_context, a.batch_max_tokens = 2048, 64
    if set(a.engines) - {"vllm", "wmtp"}:
        p.error(f"--engines: vllm and/or wmtp, not {a.engines}")
    if a.device == "cpu":
        a.engines = [e for e in a.engines if e != "vllm"]
    if "mtp" in a.vllm_modes or set(a.wmtp_modes) - {"dense"}:
        if a.d < 2:
            p.error("-d must be >= 2 for the speculative modes")
    unknown = (set(a.vllm_modes) - {"dense", "mtp"}) | (set(a.wmtp_modes) - {"dense", "native", "windowed"})
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    a.out = a.out or str(Path(a.state) / "peer.json")
    return a


def detach(state: Path) -> None:
    """Go on in a new session (a device call's processes end with it, a new session's do not):
    the caller returns at once with the pid in STATE/run.pid; output goes to STATE/run.log.
    benchmarks/peer/wait.sh waits for it in later calls."""
    pid = os.fork()
    if pid:
        (state / "run.pid").write_text(str(pid))
        print(f"running in the background as pid {pid}: log {state / 'run.log'}; wait with "
              f"bash benchmarks/peer/wait.sh {state}", flush=True)
        os._exit(0)
    os.setsid()
    log = os.open(state / "run.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    Path(a.state).mkdir(parents=True, exist_ok=True)
    if a.child:
        engine, _, modes = a.child.partition(":")
        return child_vllm(a, modes) if engine == "vllm" else child_wmtp(a, modes.split(","))
    if a.dry_run:
        return dry_run(a)
    if a.merge:
        write(merge([json.loads(Path(f).read_text()) for f in a.merge], a, []), a.out)
        return 0
    if a.background:
        detach(Path(a.state))
    deadline = time.monotonic() + a.deadline
    children = []
    jobs = []  # in --engines order
    for e in a.engines:
        if e == "vllm":
            jobs += [f"vllm:{m}" for m in a.vllm_modes]
        elif a.wmtp_modes:
            jobs.append("wmtp:" + ",".join(a.wmtp_modes))
    for job in jobs:
        children.append(run_child(a, job, min(deadline, time.monotonic() + a.child_timeout)))
        write(merge(state_parts(a.state), a, children), a.out)  # after each child: a cut run keeps its rows
    return 0 if all(c["status"] == "ok" for c in children) else 1


if __name__ == "__main__":
    sys.exit(main())
