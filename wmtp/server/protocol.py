"""Request models for ``/v1/completions`` and ``/v1/chat/completions`` and the OpenAI error shape.

Invariants:
- Bodies are parsed as strict JSON (no ``"1"`` for 1, no NaN/Infinity) and unknown fields are refused.
- Every refusal is an ``APIError`` whose ``param`` names the offending field as a dotted path
  (``max_tokens``, ``messages.0.role``) and whose message repeats it.
- Options the engine does not implement (n > 1, logprobs, best_of, echo, suffix, penalties,
  logit_bias) are known fields that accept only their neutral value, so the error says
  "not supported" rather than "unknown field".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from wmtp.engine.sampling import SamplingParams

# Below this temperature the request is decoded greedily: logits / T would overflow to inf and make
# the sampling distribution NaN (which would fail the whole engine step, not just this request).
GREEDY_BELOW = 1e-5

# Known OpenAI options wmtp does not implement: the values that mean "off".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (False,),
    "suffix": (None,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "logit_bias": (None, {}),
}

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class BaseRequest(_Strict):
    """Fields shared by both endpoints. ``top_k``, ``stop_token_ids``, ``ignore_eos`` and
    ``return_token_ids`` are extensions (vLLM spellings); ``top_k`` -1 or 0 means off."""

    model: str
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    return_token_ids: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n", "presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        return _only_neutral(v, info.field_name)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check(self) -> None:
        """Cross-field rules (after field validation)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """Engine parameters. ``eos_token_ids`` (the tokenizer's / generation config's end tokens) stop
        the request too unless ``ignore_eos``; the engine adds the model config's own."""
        stops = tuple(self.stop_token_ids) + (() if self.ignore_eos else eos_token_ids)
        return SamplingParams(
            temperature=0.0 if self.temperature < GREEDY_BELOW else self.temperature,
            top_k=max(self.top_k, 0), top_p=self.top_p, max_tokens=max_tokens,
            stop_token_ids=stops, ignore_eos=self.ignore_eos, seed=self.seed,
        )


class CompletionRequest(BaseRequest):
    prompt: str | list[TokenId]
    max_tokens: int = Field(16, ge=1)
    suffix: str | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v):
            raise ValueError("batched prompts (a list of strings or of token lists) are not supported: "
                             "send one request per prompt")
        return v

    @field_validator("suffix", "logprobs", "echo", "best_of")
    @classmethod
    def _neutral_completion(cls, v: Any, info: ValidationInfo) -> Any:
        return _only_neutral(v, info.field_name)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]  # no "tool": tool calls are not supported
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        """What the chat template sees: text parts joined into one string."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _neutral_chat(cls, v: Any, info: ValidationInfo) -> Any:
        return _only_neutral(v, info.field_name)

    def check(self) -> None:
        super().check()
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise APIError(400, f"max_completion_tokens={b} and max_tokens={a} disagree: give one of them",
                           "max_completion_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _only_neutral(v: Any, field: str) -> Any:
    allowed = NEUTRAL[field]
    if v not in allowed:
        shown = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{field}={v!r} is not supported by wmtp (only {shown})")
    return v


def parse(model: type[BaseRequest], body: bytes) -> BaseRequest:
    """Validate a raw JSON body into ``model``; raises ``APIError`` (400) naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    req.check()
    return req


def validation_error(e: ValidationError) -> APIError:
    """One 400 for a pydantic error: the most specific failure (the deepest location, which for a
    union such as ``prompt: str | list[int]`` is the branch that got furthest; among the deepest, a
    wrong value before a missing or unknown field, whatever order pydantic lists them in) names the
    field."""
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: (len(x["loc"]), x["type"] not in ("missing", "extra_forbidden")))
    param = _dotted(err["loc"])
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {msg}")
    if not param:
        return APIError(400, f"request body must be a JSON object ({msg})")
    if kind == "extra_forbidden":
        msg = "unknown or unsupported field"
    elif kind == "missing":
        msg = "required field is missing"
    top = param.split(".")[0]
    others = sorted({p.split(".")[0] for x in errors if (p := _dotted(x["loc"])) and p.split(".")[0] != top})
    also = f" (also invalid: {', '.join(others)})" if others else ""
    return APIError(400, f"{param}: {msg}{also}", param)


def _dotted(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'content', 'list[TextPart]', 0, 'type')`` -> ``messages.0.content.0.type``
    (union-branch tags such as ``list[TextPart]`` or ``constrained-str`` are pydantic's, not the
    client's, so they are dropped; field names never contain ``[`` or ``-``)."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or "-" in p or p in _TYPE_TAGS)))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
