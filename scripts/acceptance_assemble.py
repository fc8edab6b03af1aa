"""Schema JSON + plots from the raw per-prompt records of ``scripts/acceptance_sweep.py``.

    PYTHONPATH=. python scripts/acceptance_assemble.py [--cache /work/cache/accept]

Writes under benchmarks/results/acceptance/ (``wmtp report`` renders the kinds):
- ``acceptance_grid.json``   (acceptance) all configs, pooled over every sweep prompt (runs = prompts),
                             grouped as "d=…, sink=…" with native at the same d in every group;
- ``acceptance_by_task.json`` (acceptance) per task: native vs windowed sink 16 at d = 7;
- ``acceptance_to_eos.json`` (acceptance) the same, counting only iterations up to the first EOS;
- ``falsifier_acceptance.json`` (acceptance) iterations that start inside the answer, needle just
                             outside the window;
- ``output_diff.json``       (output_diff) dense vs every config, every prompt;
- ``probe.json``             (probe) decision invariance and attention mass on each prompt's tail;
- ``accuracy.json``, ``falsifier.json``, ``paired_al.json`` (no kind: README tables) and
  ``dose_response.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wmtp.analysis.diff import DiffCell, diff_tokens
from wmtp.analysis.report import write_results
from wmtp.analysis.stats import alpha_intervals, mean_ci
from wmtp.engine.metrics import acceptance_length

OUT = Path("benchmarks/results/acceptance")
META = {"hardware": "CPU (1 thread of a shared 2-core VM)", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized) "
        "+ trained MTP head B", "dtype": "float32", "synthetic": False}
D7_WINDOWS = (128, 512, 2048)  # the by-task profiles: both ends and the middle of W


def load_records(cache: Path) -> tuple[list[dict], list[dict]]:
    recs = [json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))]
    return ([r for r in recs if not r["name"].startswith("falsifier")],
            [r for r in recs if r["name"].startswith("falsifier")])


def row(task: str, c: dict, hists: list[list[int]]) -> dict:
    return {"task": task, "mode": c["mode"], "sink": c["sink"], "W": c["W"], "d": c["d"], "hists": hists,
            "al": [acceptance_length(h) for h in hists]}


def grid_groups(recs: list[dict]) -> list[tuple[str, list[str]]]:
    """("d=…, sink=…", config names: native at that d first, then W ascending)."""
    cfgs = recs[0]["configs"]
    groups: dict[tuple[int, int], list[str]] = {}
    for name, c in cfgs.items():
        if c["mode"] == "windowed":
            groups.setdefault((c["d"], c["sink"]), []).append(name)
    out = []
    for (d, s), names in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        out.append((f"all tasks, d={d}, sink={s}", [f"native-d{d}"] + sorted(names, key=lambda n: cfgs[n]["W"])))
    return out


def write_acceptance(recs: list[dict], cmd: str) -> None:
    cfgs = recs[0]["configs"]
    rows = [row(label, cfgs[n], [r["configs"][n]["hist"] for r in recs]) for label, names in grid_groups(recs)
            for n in names]
    note = (f"{len(recs)} prompts (chat-wrapped RULER, {recs[0]['n_prompt']} tokens), greedy, {recs[0]['gen']} "
            "tokens each with ignore_eos; runs = prompts")
    write_results(OUT / "acceptance_grid.json", "acceptance", rows, {**META, "runs": len(recs), "command": cmd,
                                                                     "notes": note})
    d7 = ["native-d7"] + [f"w{w}-s16-d7" for w in D7_WINDOWS]
    for key, fname in (("hist", "acceptance_by_task.json"), ("hist_to_eos", "acceptance_to_eos.json")):
        by_task = [row(r["task"], r["configs"][n], [r["configs"][n][key]]) for r in recs for n in d7]
        what = "up to the first EOS only" if key == "hist_to_eos" else "all generated tokens (ignore_eos)"
        write_results(OUT / fname, "acceptance", by_task, {**META, "runs": 1, "command": cmd,
                                                           "notes": f"one prompt per task (seed 0); {what}"})


def write_paired(recs: list[dict]) -> None:
    """Per config: pooled AL and α_1..3 with Wilson CIs, and the paired per-prompt AL difference to native."""
    out = []
    for name, c in recs[0]["configs"].items():
        hists = [r["configs"][name]["hist"] for r in recs]
        nat = [acceptance_length(r["configs"][f"native-d{c['d']}"]["hist"]) for r in recs]
        pooled = [sum(col) for col in zip(*hists)]
        diff = mean_ci([acceptance_length(h) - b for h, b in zip(hists, nat)])
        out.append({"config": name, **{k: c[k] for k in ("mode", "d", "sink", "W")}, "iterations": sum(pooled),
                    "al_pooled": acceptance_length(pooled),
                    "alphas": [[a.alpha, a.lo, a.hi, a.k, a.n] for a in alpha_intervals(pooled)[:3]],
                    "al_minus_native": [diff.mean, diff.lo, diff.hi]})
    (OUT / "paired_al.json").write_text(json.dumps({"what": "pooled AL, α_1..3 [alpha, lo, hi, k, n] (Wilson 95%), "
                                                    "mean per-prompt AL(config) − AL(native, same d) with 95% t CI",
                                                    "rows": out}, indent=1) + "\n")


def diff_cells(recs: list[dict]) -> list[dict]:
    cells = []
    for r in recs:
        ref = r["dense"]["tokens"]
        for name, c in r["configs"].items():
            n, first = diff_tokens(ref, c["tokens"])
            cells.append(DiffCell("dense", name, r["name"], n, first, len(ref), len(c["tokens"])).to_dict())
    return cells


def text_to_eos(tok, tokens: list[int]) -> str:
    return tok.decode(tokens[: tokens.index(2)] if 2 in tokens else tokens)


def accuracy(recs: list[dict], tok) -> list[dict]:
    from wmtp.workloads import score

    out = []
    for r in recs:
        outputs = {"dense": r["dense"]["tokens"], **{n: c["tokens"] for n, c in r["configs"].items()}}
        scores = {n: score(r["task"], text_to_eos(tok, t), r["answers"]) for n, t in outputs.items()}
        out.append({"prompt": r["name"], "task": r["task"], "answers": r["answers"],
                    "dense_text": text_to_eos(tok, r["dense"]["tokens"]), "score_dense": scores["dense"],
                    "identical_across_modes": len(set(scores.values())) == 1, "scores": scores})
    return out


def answer_token_span(tok, tokens: list[int], answer: str) -> tuple[int, int] | None:
    """[first, last+1) indices of the generated tokens that spell the first occurrence of ``answer``."""
    ends = [len(tok.decode(tokens[: i + 1])) for i in range(len(tokens))]
    text = tok.decode(tokens)
    at = text.find(answer)
    if at < 0:
        return None
    first = next(i for i, e in enumerate(ends) if e > at)
    last = next(i for i, e in enumerate(ends) if e >= at + len(answer))
    return first, last + 1


def falsifier(recs: list[dict], tok, cmd: str) -> None:
    """Answer tokens emitted as accepted drafts, and the histogram of iterations starting inside the answer."""
    rows, acc_rows = [], {}
    for r in recs:
        n, toks = r["n_prompt"], r["dense"]["tokens"]
        span = answer_token_span(tok, toks, r["answers"][0])
        entry = {"prompt": r["name"], "needle_offset": r["needles"][0]["offset_from_end"],
                 "output": text_to_eos(tok, toks), "answer": r["answers"][0], "answer_tokens": span, "configs": {}}
        for name, c in r["configs"].items():
            accepted = {ctx + i for ctx, a in c["trace"] for i in range(a)}  # positions emitted as accepted drafts
            inside = [0] * c["d"]
            if span:
                pos = range(n + span[0], n + span[1])
                for ctx, a in c["trace"]:
                    if ctx in pos:
                        inside[a] += 1
            entry["configs"][name] = {"W": c["W"], "answer_tokens_accepted": sum(n + i in accepted for i in range(*span))
                                      if span else None, "hist_inside_answer": inside, "hist": c["hist"],
                                      "same_tokens_as_dense": c["tokens"] == toks}
            acc_rows.setdefault(name, (c, []))[1].append(inside)
        rows.append(entry)
    (OUT / "falsifier.json").write_text(json.dumps({"what": "niah_single, needle W+50 tokens before the end of an "
                                                    "8000-token prompt; per config: answer tokens emitted as accepted "
                                                    "drafts, H[n] of iterations starting inside the answer",
                                                    "command": cmd, "rows": rows}, indent=1) + "\n")
    write_results(OUT / "falsifier_acceptance.json", "acceptance",
                  [row("needle outside W (answer iterations)", c, h) for c, h in acc_rows.values()],
                  {**META, "runs": len(recs), "command": cmd,
                   "notes": "only iterations whose first draft position lies inside the answer's tokens"})


def plot_dose(rep_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = {3: "#2ca02c", 5: "#ff7f0e", 7: "#1f77b4"}
    styles = {4: ":", 16: "-", 64: "--"}
    for d in (3, 5, 7):
        nat = next(r for r in rep_rows if r["config"] == f"native-d{d}")
        for s in (4, 16, 64):
            pts = sorted((r for r in rep_rows if r["d"] == d and r["sink"] == s), key=lambda r: r["W"])
            if not pts:
                continue
            ws = [r["W"] for r in pts]
            lab = f"d={d}, sink={s}"
            axes[0].errorbar(ws, [r["al_minus_native"][0] for r in pts],
                             yerr=[[r["al_minus_native"][0] - r["al_minus_native"][1] for r in pts],
                                   [r["al_minus_native"][2] - r["al_minus_native"][0] for r in pts]],
                             color=colours[d], ls=styles[s], marker="o", ms=3, capsize=2, label=lab)
            a1 = [r["alphas"][0] for r in pts]
            axes[1].errorbar(ws, [a[0] for a in a1], yerr=[[a[0] - a[1] for a in a1], [a[2] - a[0] for a in a1]],
                             color=colours[d], ls=styles[s], marker="o", ms=3, capsize=2, label=lab)
        a = nat["alphas"][0]
        axes[1].axhspan(a[1], a[2], color=colours[d], alpha=0.08)
        axes[1].axhline(a[0], color=colours[d], lw=0.8, alpha=0.6)
    axes[0].axhline(0, color="k", lw=0.8)
    axes[0].set_ylabel("AL(windowed) − AL(native), mean over prompts ± 95% CI")
    axes[1].set_ylabel("α_1 pooled, Wilson 95% (bands: native)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft window W (tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M + MTP head, 8K chat RULER prompts, CPU fp32: window dose-response", fontsize=9)
    fig.savefig(OUT / "dose_response.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="/work/cache/accept")
    ap.add_argument("--model", default="/work/models/smollm2-135m")
    a = ap.parse_args()
    from wmtp.tokenizer import TextTokenizer

    tok = TextTokenizer.maybe_load(a.model)
    recs, fals = load_records(Path(a.cache))
    cmd = "PYTHONPATH=. python scripts/acceptance_sweep.py run --seeds 0 && python scripts/acceptance_assemble.py"
    if recs:
        write_acceptance(recs, cmd)
        write_paired(recs)
        plot_dose(json.loads((OUT / "paired_al.json").read_text())["rows"])
    fcmd = "PYTHONPATH=. python scripts/acceptance_sweep.py falsifier --window 512 --seeds 0 --gen 24"
    if fals:
        falsifier(fals, tok, fcmd)
    all_recs = recs + fals
    probes = [{"task": r["name"], "S": r["n_prompt"], **p} for r in all_recs for p in r.get("probes", [])]
    write_results(OUT / "probe.json", "probe", probes, {**META, "runs": 1, "command": cmd + "; " + fcmd,
                                                        "notes": "first draft step, teacher-forced on the last "
                                                        "512 prompt slots"})
    write_results(OUT / "output_diff.json", "output_diff", diff_cells(all_recs),
                  {**META, "runs": 1, "command": cmd + "; " + fcmd})
    (OUT / "accuracy.json").write_text(json.dumps({"what": "RULER string_match_all on the text up to the first EOS, "
                                                   "per prompt and config", "rows": accuracy(all_recs, tok)},
                                                  indent=1) + "\n")


if __name__ == "__main__":
    main()
