"""What an fp8 KV cache does to a model's numbers: the target logits of one sequence scored over fp8
K / V against the model-dtype cache (``TargetLM.score``: a chunked prefill, then decode steps, so
every position reads K / V back from the cache), with the layers' own (k_scale, v_scale) and with
scales calibrated on the same prompt (amax / 448 per layer)."""

from __future__ import annotations

import torch

from wmtp.models.base import TargetLM
from wmtp.quant import kv_cache_dtype


def fp8_logit_error(model: TargetLM, ids: list[int], decode_steps: int = 8) -> dict:
    """max and mean |Δlogits| of fp8 against model-dtype K / V over ``ids`` (the last
    ``decode_steps`` tokens fed one at a time), the span of the reference logits, and how often the
    argmax differs."""
    n = len(ids)
    steps = min(decode_steps, n - 1)
    pieces = [n - steps] + [1] * steps
    ref = model.score(ids, pieces)
    got = model.score(ids, pieces, kv_dtype=kv_cache_dtype("fp8_e4m3", model.embed_weight.dtype))
    diff = (got - ref).abs()
    return {"tokens": n, "decode_steps": steps, "max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "logit_span": (ref.max() - ref.min()).item(),
            "argmax_changed": int((got.argmax(-1) != ref.argmax(-1)).sum())}


@torch.no_grad()
def calibrate_kv_scales(model: TargetLM, ids: list[int]) -> list[tuple[float, float]]:
    """Per target attention layer, (k_scale, v_scale) = amax / 448 of its K and V over ``ids`` (one
    model-dtype prefill): what a calibrating exporter such as ModelOpt writes. Sets them on the layers."""
    from wmtp.quant import E4M3_MAX

    with model.private_cache(1, len(ids)) as cache:
        model(torch.tensor(ids, device=model.embed_weight.device), cache.context([0], [len(ids)]))
        scales = [(max(a.k_cache.abs().max().item(), 1e-6) / E4M3_MAX, max(a.v_cache.abs().max().item(), 1e-6) / E4M3_MAX)
                  for a in model.attention_layers()]
    for a, (k, v) in zip(model.attention_layers(), scales):
        a.k_scale, a.v_scale = k, v
    return scales


def _ids(model: TargetLM, source: str, tokens: int, corpus: str, seed: int) -> tuple[list[int], str]:
    """A prompt of ``tokens`` ids: the corpus's text through the checkpoint's tokenizer, else random ids."""
    from pathlib import Path

    from wmtp.tokenizer import TextTokenizer

    tok = TextTokenizer.maybe_load(source) if Path(source).is_dir() else None
    if tok is not None:
        from wmtp.workloads.corpora import load_corpus

        ids: list[int] = []
        for _, text in load_corpus(corpus):
            ids += tok.encode(text)
            if len(ids) >= tokens:
                return ids[:tokens], corpus
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.config.vocab_size, (tokens,), generator=gen).tolist(), "random ids"


def run_kv_logits(a) -> int:
    import json
    from pathlib import Path

    import wmtp
    from wmtp.bench.step import _meta

    rows = []
    for source in a.models.split(","):
        model = wmtp.load_model(source, device=a.device, dtype=a.dtype, backend=a.backend)
        ids, text = _ids(model, source, a.tokens, a.corpus, a.seed)
        loaded = any(layer.kv_scale_loaded for layer in model.attention_layers())
        for scales in ("checkpoint" if loaded else "1.0", "calibrated"):
            if scales == "calibrated":  # the target layers' (the MTP layer keeps its own)
                calibrate_kv_scales(model, ids)
            row = {"model": source, "dtype": str(model.embed_weight.dtype).removeprefix("torch."), "text": text,
                   "scales": scales, **fp8_logit_error(model, ids, a.decode_steps)}
            rows.append(row)
            print(f"[{source}, scales {scales}] fp8 vs {row['dtype']} KV over {row['tokens']} tokens ({text}): max "
                  f"|Δlogit| {row['max_abs']:.4g}, mean {row['mean_abs']:.3g} (logit span {row['logit_span']:.3g}); "
                  f"argmax changed at {row['argmax_changed']} of {row['tokens']} positions", flush=True)
        del model
    a.preset = a.models
    result = {"kind": "kv_logits", "schema": 1, "meta": {**_meta(a, False), "dtype": a.dtype or "the model's"},
              "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


def add_args(sub) -> None:
    help = "max |Δlogits| of an fp8 KV cache against the model-dtype one, per model"
    s = sub.add_parser("kv-logits", help=help, description=help)
    s.add_argument("--models", required=True, help="comma-separated presets or checkpoint directories")
    s.add_argument("--tokens", type=int, default=512)
    s.add_argument("--decode-steps", type=int, default=8, help="the last tokens fed one at a time")
    s.add_argument("--corpus", default="pg_essays", help="text for checkpoints with a tokenizer (else random ids)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default=None, help="default: the model's")
    s.add_argument("--backend", default="auto", help="torch | triton | auto (triton on CUDA)")
    s.add_argument("--out", required=True, help="JSON results file")
