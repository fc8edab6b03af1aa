"""Chat prompts through the checkpoint's own chat template (jinja2, sandboxed as transformers does)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from wmtp.server.protocol import APIError
from wmtp.tokenizer import TextTokenizer


def find_chat_template(tokenizer: TextTokenizer | None, model_dir: str | Path | None) -> str | None:
    """The template transformers would use: ``chat_template`` in tokenizer_config.json (the entry named
    "default" when it is a list), else ``chat_template.jinja`` next to it (newer checkpoints)."""
    t = tokenizer.chat_template if tokenizer is not None else None
    if isinstance(t, list):
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    if t is None and model_dir is not None and (Path(model_dir) / "chat_template.jinja").is_file():
        t = (Path(model_dir) / "chat_template.jinja").read_text()
    return t


def render_chat(template: str, messages: list[dict[str, str]], special: dict[str, Any]) -> str:
    """The prompt text for ``messages`` with the assistant turn opened (``add_generation_prompt``).
    ``special`` supplies ``bos_token`` / ``eos_token`` as tokenizer_config.json spells them.
    A template that refuses the conversation (``raise_exception``) or fails on it is a 400 on ``messages``."""
    try:
        return compile_template(template).render(messages=messages, add_generation_prompt=True, **special)
    except Exception as e:  # templates are arbitrary code: any failure on these messages is the client's 400
        raise APIError(400, f"messages: the model's chat template rejected them: {e}", "messages") from None


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` strings from tokenizer_config.json (plain or ``{"content": ...}``)."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = config.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        out[key] = v or ""
    return out


@lru_cache(maxsize=4)
def compile_template(template: str) -> Any:
    """A jinja2 template in transformers' sandbox, with its ``raise_exception`` and ``tojson``."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
