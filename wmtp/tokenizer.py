"""Tokenizers: read ``tokenizer.json`` from a checkpoint, or build a small byte-level BPE for
random-weight checkpoints so the demo prints text. Built on HF ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Original text written for this project (no third-party corpus): enough variety for a few
# hundred BPE merges.
_CORPUS = """
Speculative decoding lets a small draft propose several tokens that the large target model then
checks in one forward pass. The target accepts the longest correct prefix and adds one token of its
own, so the output is exactly what the target alone would have produced. A model with a built-in
multi-token prediction head drafts for itself: the head reads the target's last hidden state and
the embedding of the next token, runs one decoder layer, and predicts the token after that.
At a million tokens of context the draft head reads its whole key-value cache at every step, and
the draft becomes slow. A windowed draft attends only to the first few sink tokens and to the most
recent window of tokens. The target still verifies with full attention, so nothing is lost, and the
draft keeps its keys in a small ring of slots per request instead of a full-length pool.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4032.
Questions and answers, lists and tables, code and prose: def main(): return 0. x = y + 1; if a < b.
Once upon a time there was a river that ran past a mill, and the miller counted every sack of
flour twice, because a number written once can be wrong, and a number checked is a number known.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tiny(vocab_size: int):
    """A byte-level BPE of at most ``vocab_size`` tokens (specials first: ids 0, 1, 2), trained on
    the text above (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    size = min(vocab_size, 1024)
    if size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer (needs >= 259)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


TINY_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "model_max_length": 1048576,
    "chat_template": CHAT_TEMPLATE,
}


def build_tiny_tokenizer(vocab_size: int, out_dir: str | Path) -> Path:
    """Write the small byte-level BPE (``_train_tiny``) as tokenizer.json + tokenizer_config.json
    (with a ChatML template) into ``out_dir``."""
    tok = _train_tiny(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    return out


class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the checkpoint's chat template (if any)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        self._set(Tokenizer.from_file(str(path / "tokenizer.json")),
                  json.loads(cfg_file.read_text()) if cfg_file.exists() else {})

    def _set(self, tok, config: dict) -> None:
        self.tok, self.config = tok, config
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.tok.token_to_id(eos) if eos else None

    @classmethod
    def maybe_load(cls, path: str | Path | None) -> "TextTokenizer | None":
        return cls(path) if path is not None and (Path(path) / "tokenizer.json").exists() else None

    @classmethod
    def builtin(cls, vocab_size: int) -> "TextTokenizer":
        """The small tokenizer ``make-checkpoint`` writes, built in memory (a preset's random weights
        have no checkpoint directory)."""
        self = cls.__new__(cls)
        self._set(_train_tiny(vocab_size), dict(TINY_CONFIG))
        return self

    @classmethod
    def for_model(cls, model: str, vocab_size: int) -> "TextTokenizer | None":
        """A checkpoint directory's tokenizer (None if it has none); a preset's built-in one."""
        if Path(model).is_dir():
            return cls.maybe_load(model)
        return cls.builtin(vocab_size) if vocab_size >= 256 + len(SPECIAL_TOKENS) else None

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
