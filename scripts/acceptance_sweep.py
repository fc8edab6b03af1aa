"""On CPU: real acceptance of SmolLM2-135M + its trained MTP head at 8K context, native vs
windowed, with each prompt prefilled ONCE and forked into every speculative config
(``wmtp.bench.acceptance``).

    PYTHONPATH=. python scripts/acceptance_sweep.py run --tasks niah_single vt --seeds 0
    PYTHONPATH=. python scripts/acceptance_sweep.py falsifier --window 512 --seeds 0 1
    PYTHONPATH=. python scripts/acceptance_sweep.py spotcheck
    PYTHONPATH=. python scripts/acceptance_sweep.py vocab --cache /work/cache/accept_vocab

``run`` / ``falsifier`` write one raw record per prompt to ``--cache`` (resumable: a prompt whose
record exists is skipped); ``scripts/acceptance_assemble.py`` turns the records into schema JSON.
Per prompt (chat-wrapped RULER workload, ``--tokens`` long): one prefill; dense greedy (the output-
diff reference); every config of ``grid()`` decoding ``--gen`` tokens greedily with ignore_eos (so
every config sees the same number of iterations; histograms up to the first EOS are kept too); the
decision-invariance / attention-mass probe on the prompt's last ``--probe-slots`` slots.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from wmtp.bench.acceptance import ForkRun, PrefillSnapshot, run_fork, take_snapshot
from wmtp.engine.config import SpecConfig
from wmtp.engine.sampling import SamplingParams
from wmtp.engine.window import DraftWindow

MODEL = "/work/models/smollm2-135m"
HEAD = "benchmarks/results/acceptance/smollm2_mtp_head/mtp.safetensors"
TASKS = ["niah_single", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
EOS = 2  # <|im_end|>
PROBE_WINDOWS = [(16, 128), (16, 512), (16, 2048)]


def grid() -> dict[str, SpecConfig]:
    """The configs every prompt is decoded under (dense is run separately as the reference): native
    for d in {3, 5, 7} and windowed for every sink in {4, 16, 64} x W in {128, ..., 2048} x d in
    {3, 5, 7} (the full grid). Records made with an earlier, smaller grid are completed in place."""
    specs = {f"native-d{d}": SpecConfig(mode="native", num_draft_tokens=d) for d in (3, 5, 7)}
    for d in (3, 5, 7):
        for s in (4, 16, 64):
            for w in (128, 256, 512, 1024, 2048):
                specs[f"w{w}-s{s}-d{d}"] = SpecConfig(mode="windowed", num_draft_tokens=d, window=w, sink=s)
    return specs


def load(model_dir: str, head: str):
    import wmtp
    from scripts.smollm2_spec_sanity import with_head

    d = with_head(Path(model_dir), Path(head), Path(tempfile.mkdtemp()))
    model = wmtp.load_model(str(d))
    assert model.mtp is not None, "head not picked up"
    return model


def to_eos_hist(run: ForkRun, n_prompt: int, gamma: int) -> list[int]:
    """H[n] over the iterations a run stopping at the first EOS would have made (those starting at or
    before the EOS position): ignore_eos only appends iterations after it."""
    end = n_prompt + (run.tokens.index(EOS) if EOS in run.tokens else len(run.tokens))
    hist = [0] * (gamma + 1)
    for it in run.trace:
        if it.context <= end:
            hist[it.accepted] += 1
    return hist


def config_record(spec: SpecConfig, run: ForkRun, n_prompt: int) -> dict:
    return {"mode": spec.mode, "d": spec.num_draft_tokens, "sink": spec.sink if spec.mode == "windowed" else None,
            "W": spec.window if spec.mode == "windowed" else None, "tokens": run.tokens, "hist": run.hist,
            "hist_to_eos": to_eos_hist(run, n_prompt, spec.gamma),
            "trace": [[it.context, it.accepted] for it in run.trace], "seconds": round(run.seconds, 2)}


def probe_rows(model, snap: PrefillSnapshot, slots: int) -> list[dict]:
    from wmtp.analysis.probes import window_probes_from_hidden

    n = len(snap.prompt)
    windows = [DraftWindow(sink=s, window=w) for s, w in PROBE_WINDOWS]
    res = window_probes_from_hidden(model, snap.prompt, snap.hidden, windows, first=n - 1 - slots)
    return [r.summary() for r in res]


def decode_configs(model, snap: PrefillSnapshot, specs: dict[str, SpecConfig], params: SamplingParams,
                   rec: dict, path: Path) -> None:
    """Decode every config into ``rec["configs"]``, saving the record after each (resumable)."""
    n = len(snap.prompt)
    for name, spec in specs.items():
        run = run_fork(model, snap, spec, params)
        rec["configs"][name] = config_record(spec, run, n)
        path.write_text(json.dumps(rec))
        print(f"  {name:16s} AL {1 + sum(k * h for k, h in enumerate(run.hist)) / max(sum(run.hist), 1):.3f} "
              f"H {run.hist} {run.seconds:.1f}s", flush=True)


def process(model, name: str, workload: dict, specs: dict[str, SpecConfig], a: argparse.Namespace,
            ignore_eos: bool) -> None:
    """One prompt: prefill once, decode dense and every config of ``specs`` not yet in its record."""
    path = Path(a.cache) / f"{name}.json"
    rec = json.loads(path.read_text()) if path.exists() else None
    todo = {k: s for k, s in specs.items() if rec is None or k not in rec["configs"]}
    if not todo:
        print(f"{name}: cached", flush=True)
        return
    t0 = time.perf_counter()
    snap = take_snapshot(model, workload["token_ids"], prefill_chunk=a.prefill_chunk)
    prefill_s = time.perf_counter() - t0
    print(f"{name}: prefill {prefill_s:.0f}s, {len(todo)} configs to run", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=a.gen, ignore_eos=ignore_eos)
    if rec is None:
        dense = run_fork(model, snap, SpecConfig(mode="dense", num_draft_tokens=1), params)
        rec = {"name": name, "task": workload["task"], "seed": workload["seed"], "n_prompt": len(snap.prompt),
               "answers": workload["answers"], "needles": workload["needles"], "prefill_s": round(prefill_s, 1),
               "gen": a.gen, "ignore_eos": ignore_eos,
               "dense": {"tokens": dense.tokens, "seconds": round(dense.seconds, 2)}, "configs": {}}
        if a.probe_slots:
            rec["probes"] = probe_rows(model, snap, a.probe_slots)
    path.parent.mkdir(parents=True, exist_ok=True)
    decode_configs(model, snap, todo, params, rec, path)
    rec["total_s"] = round(rec.get("total_s", 0) + time.perf_counter() - t0, 1)
    path.write_text(json.dumps(rec))
    print(f"{name}: done in {time.perf_counter() - t0:.0f}s", flush=True)


def cmd_run(a: argparse.Namespace) -> None:
    from wmtp.workloads import make_workload

    model = load(a.model, a.head)
    specs = grid()
    for seed in a.seeds:
        for task in a.tasks:
            w = make_workload(task, a.tokens, a.model, seed=seed, chat=True)
            process(model, f"{task}-s{seed}-{a.tokens}", w, specs, a, ignore_eos=True)


def cmd_falsifier(a: argparse.Namespace) -> None:
    """niah_single with its needle ``--window`` + 50 tokens before the end (outside a window of W, far
    from the sink): native vs windowed(W) vs windowed(2W, needle inside), decoding until EOS."""
    from wmtp.workloads import make_workload

    model = load(a.model, a.head)
    w_out, w_in = a.window, 2 * a.window
    specs = {"native-d7": SpecConfig(mode="native", num_draft_tokens=7)}
    for w in (w_out, w_in):
        specs[f"w{w}-s16-d7"] = SpecConfig(mode="windowed", num_draft_tokens=7, window=w, sink=16)
    for seed in a.seeds:
        wl = make_workload("niah_single", a.tokens, a.model, seed=seed, chat=True, needle_offsets=[a.window + 50])
        process(model, f"falsifier-W{a.window}-s{seed}-{a.tokens}", wl, specs, a, ignore_eos=False)


def cmd_spotcheck(a: argparse.Namespace) -> None:
    """Forked runs == fresh engine runs on SmolLM2 (a short chat workload, windowed and native)."""
    from wmtp.bench.acceptance import TracingEngine
    from wmtp.engine.config import EngineConfig
    from wmtp.workloads import make_workload

    model = load(a.model, a.head)
    w = make_workload("vt", a.tokens, a.model, seed=0, chat=True)
    prompt = w["token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=a.gen, ignore_eos=True)
    snap = take_snapshot(model, prompt, prefill_chunk=a.prefill_chunk)
    rows = []
    for name, spec in {"native-d5": SpecConfig(mode="native", num_draft_tokens=5),
                       "w128-s16-d5": SpecConfig(mode="windowed", num_draft_tokens=5, window=128, sink=16),
                       "w128-s16-d5-pool": SpecConfig(mode="windowed", num_draft_tokens=5, window=128, sink=16,
                                                      ring=False)}.items():
        fork = run_fork(model, snap, spec, params, prefill_chunk=a.prefill_chunk)
        eng = TracingEngine(model, spec, EngineConfig(max_model_len=len(prompt) + a.gen, max_num_seqs=1,
                                                      prefill_chunk=a.prefill_chunk))
        req = eng.requests[eng.add_request(prompt, params)]
        while eng.has_unfinished():
            eng.step()
        fresh = (req.tokens[len(prompt):], list(req.metrics.hist), eng.trace[req.id])
        rows.append({"config": name, "tokens_equal": fork.tokens == fresh[0], "hist_fork": fork.hist,
                     "hist_fresh": fresh[1], "trace_equal": fork.trace == fresh[2]})
        print(rows[-1], flush=True)
    out = Path("benchmarks/results/acceptance/fork_spotcheck.json")
    out.write_text(json.dumps({"what": "fork of a prefill snapshot vs a fresh engine, SmolLM2-135M + head, vt "
                               f"chat workload of {a.tokens} tokens, greedy {a.gen} tokens, CPU fp32",
                               "command": f"PYTHONPATH=. python scripts/acceptance_sweep.py spotcheck --tokens "
                               f"{a.tokens} --gen {a.gen}", "rows": rows}, indent=1) + "\n")


VOCAB_SIZES = (4096, 8192, 16384)


def vocab_grid(rank_file: str) -> dict[str, SpecConfig]:
    """Windowed W = 512, sink 16, d = 3 over the full vocabulary and over the K most frequent tokens
    of ``rank_file`` for each K of ``VOCAB_SIZES`` (at d = 3 every acceptance count is reached; no
    iteration of the grid ever accepted 3 drafts)."""
    base = dict(mode="windowed", num_draft_tokens=3, window=512, sink=16)
    specs = {"w512-s16-d3-full": SpecConfig(**base)}
    for k in VOCAB_SIZES:
        specs[f"w512-s16-d3-V{k}"] = SpecConfig(**base, draft_vocab=rank_file, draft_vocab_size=k)
    return specs


def cmd_vocab(a: argparse.Namespace) -> None:
    """The acceptance cost of a pruned draft vocabulary: every task's prompt decoded under
    ``vocab_grid`` (the rank file counts the head's training corpora, ``--rank-file``), then
    ``benchmarks/results/acceptance/draft_vocab.json``: pooled AL and α_1, α_2 (Wilson 95%) and the
    per-prompt AL difference to the full vocabulary (95% t interval)."""
    from wmtp.analysis.stats import alpha_intervals, mean_ci
    from wmtp.engine.metrics import acceptance_length
    from wmtp.workloads import make_workload

    model = load(a.model, a.head)
    specs = vocab_grid(a.rank_file)
    names = []
    for seed in a.seeds:
        for task in a.tasks:
            w = make_workload(task, a.tokens, a.model, seed=seed, chat=True)
            names.append(f"{task}-s{seed}-{a.tokens}")
            process(model, names[-1], w, specs, a, ignore_eos=True)
    recs = [json.loads((Path(a.cache) / f"{n}.json").read_text()) for n in names]
    full = [acceptance_length(r["configs"]["w512-s16-d3-full"]["hist"]) for r in recs]
    rows = []
    for name, spec in specs.items():
        hists = [r["configs"][name]["hist"] for r in recs]
        pooled = [sum(col) for col in zip(*hists)]
        diff = mean_ci([acceptance_length(h) - f for h, f in zip(hists, full)])
        same = sum(r["configs"][name]["tokens"] == r["dense"]["tokens"] for r in recs)
        rows.append({"config": name, "draft_vocab_size": spec.draft_vocab_size, "iterations": sum(pooled),
                     "al_pooled": acceptance_length(pooled),
                     "alphas": [[x.alpha, x.lo, x.hi, x.k, x.n] for x in alpha_intervals(pooled)[:2]],
                     "al_minus_full": [diff.mean, diff.lo, diff.hi], "outputs_equal_dense": f"{same}/{len(recs)}"})
        print(rows[-1], flush=True)
    rank = json.loads(Path(a.rank_file).read_text())
    out = Path("benchmarks/results/acceptance/draft_vocab.json")
    out.write_text(json.dumps({
        "what": "SmolLM2-135M + its MTP head, windowed W=512 sink=16 d=3, greedy, a pruned draft vocabulary of the "
                "K most frequent tokens against the full 49,152: pooled AL, alpha_1..2 [alpha, lo, hi, k, n] (Wilson "
                "95%), mean per-prompt AL(K) - AL(full) with 95% t CI; outputs must equal dense's",
        "prompts": f"{len(recs)} chat-wrapped RULER prompts of {a.tokens} tokens ({', '.join(a.tasks)}; seeds "
                   f"{a.seeds}), {a.gen} tokens each with ignore_eos, CPU fp32",
        "ranking": {"file": a.rank_file, "source": rank.get("source"), "tokens_counted": rank.get("tokens_counted")},
        "command": f"PYTHONPATH=. python scripts/acceptance_sweep.py vocab --rank-file {a.rank_file}",
        "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["run", "falsifier", "spotcheck", "vocab"])
    ap.add_argument("--rank-file", default="benchmarks/results/acceptance/draft_vocab_rank.json",
                    help="vocab: the draft-vocab rank file (wmtp draft-vocab)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--tasks", nargs="*", default=TASKS)
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens (8000 + gen <= SmolLM2's 8192)")
    ap.add_argument("--gen", type=int, default=40)
    ap.add_argument("--window", type=int, default=512, help="falsifier: W (needle at W + 50 from the end)")
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--probe-slots", type=int, default=512)
    ap.add_argument("--cache", default="/work/cache/accept")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    {"run": cmd_run, "falsifier": cmd_falsifier, "spotcheck": cmd_spotcheck, "vocab": cmd_vocab}[a.cmd](a)


if __name__ == "__main__":
    main()
