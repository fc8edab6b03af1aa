"""Stage 1 of the SmolLM2 MTP-head recipe: tokenise the corpora, run the frozen target once, and cache
what self-distillation needs (outside the repo; ~0.3 GB for the default recipe).

Per 512-token chunk x_0..x_{T-1} it stores: the tokens, the target's final-norm hidden states h_t
(fp16; what the engine feeds the head, DESIGN §2) and the target's top-K next-token log-probs at
every position (the distillation target; K = 16 covers > 0.9 of the probability mass on this text).

Data recipe (deterministic for a seed): corpora ``pg_essays`` and ``shakespeare`` (wmtp.workloads.
corpora), every 8th document held out (``split_docs``); each split is one token stream per corpus
(documents joined by a blank line) cut into non-overlapping chunks; all pg_essays train chunks, and the
same number of shakespeare train chunks drawn with ``random.Random(seed)``; held-out: the first
``heldout_chunks`` chunks of each corpus's held-out stream.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from wmtp.workloads.corpora import load_corpus, split_docs

TOPK = 16


def token_stream(tok, docs: list[tuple[str, str]]) -> list[int]:
    ids: list[int] = []
    for _, text in docs:
        ids += tok.encode(text + "\n\n")
    return ids


def chunks(ids: list[int], seq_len: int) -> list[list[int]]:
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def recipe(tok, seq_len: int, seed: int, heldout_chunks: int, max_train_chunks: int) -> dict:
    """Token chunks for train / heldout, with their corpus names (see module doc)."""
    rng = random.Random(seed)
    out: dict = {"train": [], "train_src": [], "heldout": [], "heldout_src": []}
    per_corpus = {}
    for name in ("pg_essays", "shakespeare"):
        train_docs, held_docs = split_docs(load_corpus(name))
        per_corpus[name] = (chunks(token_stream(tok, train_docs), seq_len),
                            chunks(token_stream(tok, held_docs), seq_len)[:heldout_chunks])
    n = min(len(per_corpus["pg_essays"][0]), max_train_chunks // 2)
    for name, (train, held) in per_corpus.items():
        picked = train[:n] if name == "pg_essays" else rng.sample(train, n)
        out["train"] += picked
        out["train_src"] += [name] * len(picked)
        out["heldout"] += held
        out["heldout_src"] += [name] * len(held)
    return out


@torch.no_grad()
def run_target(model, chunk_list: list[list[int]], log_every: int = 20) -> dict[str, torch.Tensor]:
    """Hidden states (fp16) and top-K log-probs for each chunk, one chunk at a time."""
    t0 = time.time()
    hs, tk_ids, tk_lp = [], [], []
    for i, ids in enumerate(chunk_list):
        with model.private_cache(1, len(ids)) as cache:
            h = model(torch.tensor(ids), cache.context([0], [len(ids)]))
        lp = torch.log_softmax(model.compute_logits(h).float(), dim=-1)
        v, j = lp.topk(TOPK, dim=-1)
        hs.append(h.half())
        tk_ids.append(j.int())
        tk_lp.append(v.half())
        if (i + 1) % log_every == 0:
            rate = (i + 1) * len(ids) / (time.time() - t0)
            print(f"  target {i + 1}/{len(chunk_list)} chunks, {rate:.0f} tok/s", flush=True)
    return {"tokens": torch.tensor(chunk_list, dtype=torch.int32), "hidden": torch.stack(hs),
            "topk_ids": torch.stack(tk_ids), "topk_logprobs": torch.stack(tk_lp)}


def build_cache(model_dir: str, cache_dir: Path, seq_len: int, seed: int, heldout_chunks: int,
                max_train_chunks: int) -> dict:
    """Compute (or reuse) the cached tensors; returns {'train': {...}, 'heldout': {...}, 'recipe': {...}}."""
    import wmtp
    from wmtp.tokenizer import TextTokenizer

    f = cache_dir / f"smollm2_L{seq_len}_s{seed}_h{heldout_chunks}_m{max_train_chunks}.pt"
    if f.exists():
        return torch.load(f)
    tok = TextTokenizer(model_dir)
    r = recipe(tok, seq_len, seed, heldout_chunks, max_train_chunks)
    model = wmtp.load_model(model_dir, dtype="float32")
    t0 = time.time()
    data = {"heldout": run_target(model, r["heldout"]), "train": run_target(model, r["train"])}
    data["recipe"] = {"seq_len": seq_len, "seed": seed, "train_src": r["train_src"], "heldout_src": r["heldout_src"],
                      "target_seconds": time.time() - t0, "topk": TOPK}
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, f)
    return data


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/models/smollm2-135m")
    ap.add_argument("--cache", default="/work/cache/mtp_data")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-chunks", type=int, default=12)
    ap.add_argument("--max-train-chunks", type=int, default=440)
    a = ap.parse_args()
    torch.set_num_threads(1)
    d = build_cache(a.model, Path(a.cache), a.seq_len, a.seed, a.heldout_chunks, a.max_train_chunks)
    print({k: tuple(v["tokens"].shape) for k, v in d.items() if k != "recipe"}, d["recipe"]["target_seconds"])
