"""``wmtp`` command line. Each sub-command lives in a small function; imports stay inside them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from wmtp.errors import WmtpError

Setup = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Setup, Run]] = {}


def register(name: str, help: str, setup: Setup, run: Run) -> None:
    COMMANDS[name] = (help, setup, run)


def _read_text(flag: str, path: str) -> str:
    """A text file named on the command line; one that cannot be read as UTF-8 text is a WmtpError
    naming the flag and the path."""
    from pathlib import Path

    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise WmtpError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}") from None


def _make_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, help="preset name (see `wmtp presets`)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the random weights are made (cuda for big presets)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--expert-layout", choices=["per_expert", "packed"], default="per_expert")
    p.add_argument("--quantize", choices=["nvfp4", "fp8"], default=None,
                   help="weights as ModelOpt NVFP4 or block FP8 (round to nearest), named as the public releases")
    p.add_argument("--max-shard-gb", type=float, default=4.0)


def make_checkpoint(a: argparse.Namespace) -> int:
    import wmtp
    from wmtp.models.loader import save_checkpoint
    from wmtp.tokenizer import build_tiny_tokenizer

    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, seed=a.seed, quantize=a.quantize)
    out = save_checkpoint(model, a.out, expert_layout=a.expert_layout, max_shard_bytes=int(a.max_shard_gb * 2**30))
    build_tiny_tokenizer(model.config.vocab_size, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.preset} ({n / 1e6:.1f}M parameters, seed {a.seed}) to {out}")
    return 0


register("make-checkpoint", "write a random-weight checkpoint of a preset in exact HF layout",
         _make_checkpoint_args, make_checkpoint)


def presets(a: argparse.Namespace) -> int:
    from wmtp.presets import PRESETS, preset_config

    for name in PRESETS:
        c = preset_config(name)
        n_full = len(c.full_attention_layers)
        quant = PRESETS[name].get("quantization_config")
        weights = "bf16/fp32" if quant is None else quant.get("quant_algo", quant.get("quant_method")).lower()
        print(f"{name:24s} {c.model_type:17s} layers={c.num_layers} (full attention {n_full}) hidden={c.hidden_size} "
              f"experts={c.num_experts} mtp_layers={c.num_nextn_predict_layers} weights={weights}")
    return 0


register("presets", "list the built-in model-shape presets", lambda p: None, presets)


def _score_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", help="preset name (random weights)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)


def score(a: argparse.Namespace) -> int:
    """Perplexity of a text under the target (full-sequence forward, no cache)."""
    import math

    import torch

    import wmtp
    from wmtp.tokenizer import TextTokenizer

    model = wmtp.load_model(a.model or a.preset, device=a.device, dtype=a.dtype)
    tok = TextTokenizer.for_model(a.model or a.preset, model.config.vocab_size)
    ids = tok.encode(a.prompt) if tok else [int(x) for x in a.prompt.split()]
    if len(ids) < 2:
        raise WmtpError(f"--prompt must give at least 2 tokens (got {len(ids)})")
    logp = torch.log_softmax(model.score(ids)[:-1].float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None]).mean().item()
    print(f"{len(ids)} tokens, mean NLL {nll:.4f}, perplexity {math.exp(nll):.2f}")
    return 0


register("score", "perplexity of a text under the target model", _score_args, score)


def _draft_vocab_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", help="preset name (random weights, the built-in small tokenizer)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--corpus", nargs="+", metavar="FILE|NAME", help="text files or built-in corpora (wmtp.workloads: "
                      "pg_essays, shakespeare) whose tokens are counted with the model's tokenizer")
    what.add_argument("--generate", type=int, metavar="N", help="count the target's own greedy continuations of N "
                      "random prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt (--generate)")
    p.add_argument("--size", type=int, required=True, help="K: the ranking's length (SpecConfig.draft_vocab_size "
                   "may keep fewer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="the rank file (JSON) for SpecConfig.draft_vocab")


def draft_vocab(a: argparse.Namespace) -> int:
    import random

    import wmtp
    from wmtp.engine.draft_vocab import count_tokens, write_rank_file
    from wmtp.tokenizer import TextTokenizer

    name = a.model or a.preset
    model = wmtp.load_model(name, device=a.device, seed=a.seed) if a.preset else wmtp.load_model(name, device=a.device)
    vocab = model.config.vocab_size
    if not 0 < a.size <= vocab:
        raise WmtpError(f"--size {a.size} must be in [1, {vocab}] (the vocabulary)")
    if a.corpus:
        tok = TextTokenizer.for_model(name, vocab)
        if tok is None:
            raise WmtpError(f"{name}: no tokenizer to count --corpus with")
        from wmtp.workloads.corpora import CORPORA, load_corpus

        texts = [text for c in a.corpus for text in ([d for _, d in load_corpus(c)] if c in CORPORA
                                                      else [_read_text("--corpus", c)])]
        counts = count_tokens(tok.encode(t) for t in texts)
        source = {"corpus": list(a.corpus), "documents": len(texts), "model": name}
    else:
        rng = random.Random(a.seed)
        prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(a.generate)]
        llm = wmtp.LLM(model, spec=wmtp.SpecConfig(mode="dense", num_draft_tokens=1),
                       max_model_len=16 + a.max_tokens, max_num_seqs=min(8, a.generate))
        outs = llm.generate(prompts, wmtp.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))
        counts = count_tokens(o.token_ids for o in outs)
        source = {"generated": {"prompts": a.generate, "tokens_each": a.max_tokens, "seed": a.seed, "greedy": True},
                  "model": name}
    out = write_rank_file(a.out, counts, a.size, source)
    print(f"{sum(counts.values())} tokens counted, {len(counts)} distinct; the {min(a.size, len(counts))} most "
          f"frequent written to {out}")
    return 0


register("draft-vocab", "rank tokens by frequency for a pruned draft vocabulary (SpecConfig.draft_vocab)",
         _draft_vocab_args, draft_vocab)


def _spec_args(p: argparse.ArgumentParser) -> None:
    """The speculation options of ``generate`` and ``serve`` (``SpecConfig``'s fields)."""
    p.add_argument("--mode", choices=["dense", "native", "windowed"], default="windowed")
    p.add_argument("--num-draft-tokens", "-d", type=_depth, default=4,
                   help="d = γ + 1 verify tokens, or 'auto': each iteration's depth chosen up to --max-draft-tokens")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="d_max of --num-draft-tokens auto (default 8)")
    p.add_argument("--window", type=int, default=4032)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--no-ring", action="store_true", help="keep the full-length draft pool in windowed mode")
    p.add_argument("--draft-vocab", default=None, help="rank file (wmtp draft-vocab): draft over its tokens only")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="the rank file's first K tokens")
    kv_cache_dtype_arg(p)


def kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    from wmtp.quant import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="K / V of the target and the draft: the model's dtype (auto) or fp8 e4m3 with the "
                        "checkpoint's per-layer k_scale / v_scale (else 1.0)")


def _depth(text: str) -> int | str:
    """``--num-draft-tokens``: an int or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an int >= 1, or 'auto'") from None


def _tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (--device cuda: one GPU each)")


def _spec(a: argparse.Namespace):
    from wmtp.engine.config import SpecConfig

    return SpecConfig(mode=a.mode, num_draft_tokens=a.num_draft_tokens if a.mode != "dense" else 1,
                      max_draft_tokens=a.max_draft_tokens, window=a.window, sink=a.sink, ring=not a.no_ring, draft_vocab=a.draft_vocab,
                      draft_vocab_size=a.draft_vocab_size)


def _generate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", help="preset name (random weights, the built-in small tokenizer)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="prompt text (or space-separated token ids without a tokenizer)")
    text.add_argument("--prompt-file", help="file holding the prompt")
    _spec_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt + max_tokens")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--backend", default="auto", help="torch | triton | auto (triton on CUDA)")
    _tp_arg(p)


def generate(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from wmtp.engine.config import EngineConfig
    from wmtp.engine.engine import Engine
    from wmtp.engine.sampling import SamplingParams
    import wmtp
    from wmtp.tokenizer import TextTokenizer

    from wmtp.models.backend import default_backend

    prompt = _read_text("--prompt-file", a.prompt_file) if a.prompt_file else a.prompt
    backend = default_backend(a.device) if a.backend == "auto" else a.backend
    name, tp = a.model or a.preset, a.tensor_parallel_size
    if tp == 1:
        model = wmtp.load_model(name, device=a.device, dtype=a.dtype, backend=backend)
        vocab = model.config.vocab_size
    else:  # the ranks load their shards when the engine starts
        from wmtp.engine.distributed import check_tensor_parallel

        vocab = check_tensor_parallel(name, tp, a.device).vocab_size
    tok = TextTokenizer.for_model(name, vocab)
    if tok is not None:
        ids = tok.encode(prompt)
    else:
        try:
            ids = [int(x) for x in prompt.split()]
        except ValueError:
            raise WmtpError("this checkpoint has no tokenizer.json: give --prompt as space-separated token ids") from None
    spec = _spec(a)
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_tokens=a.max_tokens,
                            seed=a.seed, ignore_eos=a.ignore_eos)
    eng_cfg = EngineConfig(max_model_len=a.max_model_len or len(ids) + a.max_tokens, max_num_seqs=1,
                           prefill_chunk=a.prefill_chunk, kv_cache_dtype=a.kv_cache_dtype)
    if tp == 1:
        eng = Engine(model, spec, eng_cfg)
    else:
        from wmtp.engine.distributed import TPEngine

        eng = TPEngine.start(tp, name, spec, eng_cfg, a.device, a.dtype, backend=backend)
    rid = eng.add_request(ids, params)
    req = eng.requests[rid]
    bar = tqdm(total=len(ids), desc="prefill", unit="tok", disable=len(ids) < 4 * a.prefill_chunk)
    while eng.has_unfinished():
        eng.step()
        bar.n = req.prefilled
        bar.refresh()
    bar.close()
    out = req.tokens[len(ids):]
    print(tok.decode(out) if tok else " ".join(map(str, out)))
    m = req.metrics.to_dict()
    mem = eng.memory.bytes_report()
    draft = mem["draft_ring"] if spec.uses_ring else mem["draft_pool"]
    tpot = f"{m['tpot'] * 1e3:.1f} ms" if m["tpot"] else "n/a"
    print(f"[{a.mode}] {len(out)} tokens | AL {m['acceptance_length']:.2f} | TTFT {m['ttft'] * 1e3:.0f} ms | "
          f"TPOT {tpot} | draft KV {draft / 2**20:.2f} MiB ({'ring' if spec.uses_ring else 'pool'}) | "
          f"target KV {mem['target_kv'] / 2**20:.2f} MiB" + (f" (each of {tp} ranks)" if tp > 1 else ""))
    return 0


register("generate", "generate text with dense / native / windowed MTP speculative decoding", _generate_args, generate)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from wmtp.bench.step import add_args
    from wmtp.bench.sweeps import add_sweep_args

    add_sweep_args(add_args(p))


def bench(a: argparse.Namespace) -> int:
    from wmtp.bench import step, sweeps

    return step.run(a) if a.bench in ("step", "ttft", "depth-replay", "multiturn", "kv-logits") else sweeps.run(a)


register("bench", "benchmarks: decode-step cost per mode, TTFT, and the sweeps (synthetic context, forced "
         "acceptance)", _bench_args, bench)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from wmtp.engine.config import EngineConfig

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", help="preset name (random weights, the built-in small tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: directory name)")
    _spec_args(p)
    p.add_argument("--max-model-len", type=int, default=4096, help="prompt + max_tokens limit per request")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests running at once")
    p.add_argument("--page-size", type=int, default=64,
                   help="KV page in tokens (multiples of 64 take the GPU attention's fast path)")
    p.add_argument("--num-kv-pages", type=int, default=None, help="default: max_num_seqs full-length requests")
    p.add_argument("--kv-memory-gb", type=float, default=None, help="size the KV pools from a byte budget instead")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep prompt pages for later requests with the same prefix")
    p.add_argument("--prefix-snapshot-interval", type=int, default=EngineConfig.prefix_snapshot_interval,
                   help="pages between recurrent-state / draft snapshots of a long prefill (resume points)")
    p.add_argument("--prefix-snapshots", type=int, default=None, help="snapshot slots (default: 4 per sequence slot)")
    p.add_argument("--max-pending-requests", type=int, default=256, help="running + queued; beyond it: 429")
    p.add_argument("--chat-template", default=None, help="jinja file overriding the checkpoint's chat template")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0, help="random weights of a --preset")
    _tp_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _serve_engine_args(a: argparse.Namespace) -> dict:
    """``serve``'s engine settings for ``LLM`` (prefix caching on unless ``--no-prefix-cache``)."""
    kv_bytes = int(a.kv_memory_gb * 2**30) if a.kv_memory_gb is not None else None
    return dict(max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, page_size=a.page_size,
                num_kv_pages=a.num_kv_pages, kv_memory_bytes=kv_bytes, prefill_chunk=a.prefill_chunk,
                prefix_cache=not a.no_prefix_cache, prefix_snapshot_interval=a.prefix_snapshot_interval,
                prefix_snapshots=a.prefix_snapshots, tensor_parallel_size=a.tensor_parallel_size,
                kv_cache_dtype=a.kv_cache_dtype)


def serve(a: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server (needs the `serve` extra)."""
    from pathlib import Path

    try:
        import uvicorn

        from wmtp.server.app import checkpoint_eos_ids, create_app
        from wmtp.server.chat import find_chat_template
    except ImportError as e:
        raise WmtpError(f"wmtp serve needs the serve extra (pip install 'wmtp[serve]'): {e}") from None
    from wmtp.engine.llm import LLM

    if a.max_pending_requests < 1:
        raise WmtpError(f"--max-pending-requests={a.max_pending_requests} must be >= 1")
    spec = _spec(a)
    given = _read_text("--chat-template", a.chat_template) if a.chat_template else None  # before the model loads
    llm = LLM(a.model or a.preset, spec=spec, device=a.device, dtype=a.dtype, seed=a.seed, **_serve_engine_args(a))
    template = given if given is not None else find_chat_template(llm.tokenizer, a.model)
    name = a.served_model_name or (Path(a.model).resolve().name if a.model else a.preset)
    app = create_app(llm.engine, llm.tokenizer, name, chat_template=template,
                     eos_token_ids=checkpoint_eos_ids(a.model, llm.tokenizer), max_pending=a.max_pending_requests)
    mem = llm.memory_report()
    print(f"serving {name!r} ({a.mode}, d={'auto<=' if spec.adaptive else ''}{spec.num_draft_tokens}) on http://{a.host}:{a.port}/v1 | "
          f"target KV {mem['target_kv'] / 2**20:.1f} MiB, draft {'ring' if spec.uses_ring else 'pool'} "
          f"{(mem['draft_ring'] + mem['draft_pool']) / 2**20:.2f} MiB | prefix cache "
          f"{'off' if a.no_prefix_cache else 'on'} (snapshots {mem['prefix_snapshots'] / 2**20:.1f} MiB)", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    return 0


register("serve", "OpenAI-compatible HTTP server (completions, chat, /metrics) over the engine", _serve_args, serve)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="directory of results JSON (see wmtp/analysis/SCHEMA.md)")
    p.add_argument("--out", default=None, help="markdown file to write (default: RESULTS_DIR/REPORT.md); PNGs go next to it")
    p.add_argument("--all", action="store_true", help="also the files in archive/ folders (superseded results)")


def report(a: argparse.Namespace) -> int:
    from wmtp.analysis.report import build_report

    rep = build_report(a.results_dir, a.out, include_archive=a.all)
    print(f"wrote {len(rep.lines)} lines and {len(rep.pngs)} plots next to {a.out or a.results_dir + '/REPORT.md'}")
    for w in rep.warnings:
        print(f"warning: {w}")
    return 0


register("report", "markdown report with tables and plots from benchmark results JSON", _report_args, report)


def _workload_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = actions.add_parser("make", help="write one seeded RULER-style prompt of an exact token length (JSON)")
    m.add_argument("--task", required=True, help="niah_single | niah_multivalue | niah_multiquery | vt | cwe | fwe")
    m.add_argument("--tokens", type=int, required=True, help="exact prompt length in tokens")
    m.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json (e.g. the checkpoint)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True, help="output JSON file")
    m.add_argument("--needle-offset", type=int, action="append", default=None,
                   help="niah/vt: tokens from a needle's first token to the prompt end (once per needle)")
    m.add_argument("--depth", type=float, action="append", default=None,
                   help="niah/vt: needle depth in [0, 1] (once per needle); default RULER's random depths")
    m.add_argument("--corpus", default=None, help="niah haystack: pg_essays (default) | shakespeare")
    m.add_argument("--chat", action="store_true", help="wrap in the tokenizer's chat template")


def workload(a: argparse.Namespace) -> int:
    from wmtp.workloads import make_workload, write_workload

    opts: dict = {"chat": a.chat} if a.chat else {}
    if a.needle_offset is not None:
        opts["needle_offsets"] = a.needle_offset
    if a.depth is not None:
        opts["depths"] = a.depth
    if a.corpus is not None:
        opts["corpus"] = a.corpus
    rec = make_workload(a.task, a.tokens, a.tokenizer, a.seed, **opts)
    write_workload(rec, a.out)
    where = ", ".join(f"needle at -{n['offset_from_end']}" for n in rec["needles"])
    print(f"wrote {a.task} ({rec['tokens']} tokens, seed {a.seed}, answers {rec['answers']}"
          f"{'; ' + where if where else ''}) to {a.out}")
    return 0


register("workload", "synthetic long-context workloads (RULER niah/vt/cwe/fwe) of an exact token length",
         _workload_args, workload)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wmtp", description="Windowed-MTP inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, setup, _) in COMMANDS.items():
        setup(sub.add_parser(name, help=help, description=help))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # results files record the command
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command][2](args)
    except WmtpError as e:
        print(f"wmtp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
