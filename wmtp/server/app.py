"""The FastAPI app: OpenAI-compatible completions and chat (streaming or not), models, health, metrics.

``create_app`` takes an already-built Engine; the app starts the engine thread on startup and stops it
on shutdown. Handlers validate everything before a request reaches the engine, so bad input is a 4xx
naming the field and never an engine failure; a request whose client disconnects is aborted at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wmtp.engine.engine import Engine
from wmtp.engine.memory import CapacityError
from wmtp.errors import WmtpError
from wmtp.server.chat import compile_template, render_chat, special_tokens
from wmtp.server.detok import IncrementalDetokenizer, StopStrings, TokenIdText
from wmtp.server.metrics import ServerMetrics
from wmtp.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, BaseRequest, parse
from wmtp.server.runner import Delta, EngineFailed, EngineRunner, RequestStream
from wmtp.tokenizer import TextTokenizer

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's code for "client closed the request": never sent, only counted


def create_app(engine: Engine, tokenizer: TextTokenizer | None, model_name: str, *,
               chat_template: str | None = None, eos_token_ids: Sequence[int] = (),
               max_pending: int = 256) -> FastAPI:
    """An app serving ``engine`` as ``model_name``. ``eos_token_ids`` end every request (unless
    ``ignore_eos``) on top of the model config's own; a template is compiled now so a broken one fails
    at startup. ``app.state.server`` holds the runner and metrics (tests read them)."""
    if chat_template is not None:
        compile_template(chat_template)
    metrics = ServerMetrics(engine)
    server = _Server(engine, tokenizer, model_name, chat_template, tuple(eos_token_ids),
                     EngineRunner(engine, metrics, max_pending), metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.runner.start()
        try:
            yield
        finally:
            server.runner.stop()

    app = FastAPI(title="wmtp", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_CountAnswers, metrics=metrics)
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def checkpoint_eos_ids(model_dir: str | Path | None, tokenizer: TextTokenizer | None) -> tuple[int, ...]:
    """End-of-turn tokens a checkpoint declares beyond config.json: the tokenizer's ``eos_token`` and
    generation_config.json's ``eos_token_id`` (chat models end assistant turns with e.g. <|im_end|>)."""
    ids = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        ids += [t for t in eos or [] if isinstance(t, int)]
    return tuple(dict.fromkeys(ids))  # unique, in order


# ---- state and request handling --------------------------------------------------------------------
@dataclass
class _Server:
    engine: Engine
    tokenizer: TextTokenizer | None
    model_name: str
    chat_template: str | None
    eos_ids: tuple[int, ...]
    runner: EngineRunner
    metrics: ServerMetrics

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.special = special_tokens(self.tokenizer.config) if self.tokenizer is not None else {}

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model: {name!r} is not served here; available: [{self.model_name!r}]",
                           "model", code="model_not_found")

    def encode(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{field}: this model has no tokenizer (tokenizer.json): "
                                    "send the prompt as a list of token ids", field)
            prompt = self.tokenizer.encode(prompt)
        if not prompt:
            raise APIError(400, f"{field}: the prompt is empty (no tokens)", field)
        return prompt

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.chat_template is None:
            raise APIError(400, f"messages: model {self.model_name!r} has no chat template (no chat_template in "
                                "tokenizer_config.json, no chat_template.jinja): use /v1/completions", "messages")
        text = render_chat(self.chat_template, [m.as_template_input() for m in req.messages], self.special)
        return self.encode(text, "messages")

    async def submit(self, req: BaseRequest, prompt: list[int], max_tokens: int,
                     fields: tuple[str, str]) -> RequestStream:
        """Hand the request to the engine thread; engine refusals become 400s naming the field
        (``fields`` = the prompt's and max_tokens' names in this endpoint)."""
        prompt_field, max_field = fields
        params = req.sampling_params(max_tokens, self.eos_ids)
        try:
            return await self.runner.submit(prompt, params)
        except CapacityError as e:
            field = prompt_field if len(prompt) >= self.engine.eng.max_model_len else max_field
            raise APIError(400, f"{field}: {e}", field, code="context_length_exceeded") from None
        except WmtpError as e:
            raise APIError(400, f"{prompt_field}: {e}", prompt_field) from None

    def text_output(self, req: BaseRequest) -> TextOutput:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else TokenIdText()
        return TextOutput(detok, StopStrings(req.stop_strings))


class TextOutput:
    """Token deltas -> text deltas for one request (detokeniser, then stop strings)."""

    def __init__(self, detok: IncrementalDetokenizer | TokenIdText, stops: StopStrings) -> None:
        self.detok, self.stops = detok, stops
        self.num_tokens = 0

    def feed(self, delta: Delta) -> tuple[str, str | None]:
        """(text to emit, finish reason once the request is over: engine's, or "stop" at a stop string)."""
        self.num_tokens += len(delta.token_ids)
        text = self.detok.push(delta.token_ids) + (self.detok.flush() if delta.finished else "")
        out, hit = self.stops.push(text, final=delta.finished)
        if hit:
            return out, "stop"
        return out, delta.finish_reason if delta.finished else None


async def _pieces(stream: RequestStream, out: TextOutput) -> AsyncIterator[tuple[str, list[int], str | None]]:
    """(text, token ids, finish reason or None) per engine delta, ending at the first finish reason.
    A stop string ends the request early: it is aborted in the engine at once."""
    async for delta in stream:
        text, reason = out.feed(delta)
        if reason is not None and not delta.finished:
            stream.close(reason)
        yield text, delta.token_ids, reason
        if reason is not None:
            return


# ---- response bodies ---------------------------------------------------------------------------
@dataclass
class _Reply:
    """Shapes OpenAI bodies for one request; ``chat`` picks chat.completion vs text_completion."""

    server: _Server
    req: BaseRequest
    prompt: list[int]
    chat: bool

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def usage(self, completion_tokens: int) -> dict[str, int]:
        n = len(self.prompt)
        return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_name,
                "choices": choices}

    def _choice(self, key: str, value: str | dict[str, str], ids: list[int], reason: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, key: value, "logprobs": None, "finish_reason": reason}
        if self.req.return_token_ids:
            body["token_ids"] = ids
        return body

    def full(self, text: str, ids: list[int], reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = self._choice("message", {"role": "assistant", "content": text}, ids, reason)
        else:
            choice = self._choice("text", text, ids, reason)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = self.usage(len(ids))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt
        return body

    def chunk(self, text: str, ids: list[int], reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or role else {}  # the last chunk's delta may be empty
            if role:
                delta["role"] = "assistant"
            choice = self._choice("delta", delta, ids, reason)
        else:
            choice = self._choice("text", text, ids, reason)
        body = self._envelope(self._chunk_object, [choice])
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self._chunk_object, [])
        body["usage"] = self.usage(completion_tokens)
        return body


def _event(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _respond(request: Request, server: _Server, reply: _Reply, max_tokens: int,
                   fields: tuple[str, str]) -> Response:
    stream = await server.submit(reply.req, reply.prompt, max_tokens, fields)
    out = server.text_output(reply.req)
    if reply.req.stream:
        return _ClosingStream(_sse(reply, stream, out), on_close=stream.close, media_type="text/event-stream")
    try:
        return await _until_disconnect(request, _complete(reply, stream, out))
    finally:
        stream.close()


async def _complete(reply: _Reply, stream: RequestStream, out: TextOutput) -> Response:
    texts: list[str] = []
    ids: list[int] = []
    reason = None
    async for text, new_ids, reason in _pieces(stream, out):  # the last piece carries the finish reason
        texts.append(text)
        ids += new_ids
    return JSONResponse(reply.full("".join(texts), ids, reason))


async def _sse(reply: _Reply, stream: RequestStream, out: TextOutput) -> AsyncIterator[str]:
    """OpenAI's SSE stream: one chunk per engine delta that has text (or token ids, when asked for them),
    the finish reason on the last, an optional usage chunk, then ``[DONE]``."""
    if reply.chat:
        yield _event(reply.chunk("", [], None, role=True))
    try:
        async for text, ids, reason in _pieces(stream, out):
            if text or reason is not None or (reply.req.return_token_ids and ids):
                yield _event(reply.chunk(text, ids, reason))
    except EngineFailed as e:
        yield _event(APIError(500, f"the engine failed: {e}", type="server_error").body())
    else:
        if reply.req.include_usage:
            yield _event(reply.usage_chunk(out.num_tokens))
    yield _event("[DONE]")


class _ClosingStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` when it ends, however it ends: normally, on a
    client disconnect (Starlette cancels the body iterator) or before the iterator ever started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled, and the caller's
    ``stream.close()`` aborts the request): a long non-streaming request whose client timed out must
    not keep its memory."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()  # no-op on a finished task
    if task in done:
        return task.result()
    return Response(status_code=CLIENT_CLOSED)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- routes, errors, accounting ----------------------------------------------------------------
def _add_routes(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await request.body())
        server.check_model(req.model)
        prompt = server.encode(req.prompt, "prompt")
        reply = _Reply(server, req, prompt, chat=False)
        return await _respond(request, server, reply, req.max_tokens, ("prompt", "max_tokens"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        prompt = server.chat_prompt(req)
        # OpenAI's default: as many tokens as the context has left
        max_tokens = req.requested_max_tokens or max(server.engine.eng.max_model_len - len(prompt), 1)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        reply = _Reply(server, req, prompt, chat=True)
        return await _respond(request, server, reply, max_tokens, ("messages", max_field))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "wmtp",
                "max_model_len": server.engine.eng.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if server.runner.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": server.runner.failure or "engine thread not running"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:  # unknown route, wrong method
        body = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body()
        return JSONResponse(body, e.status_code, headers=e.headers)

    @app.exception_handler(WmtpError)
    async def wmtp_error(_: Request, e: WmtpError) -> Response:  # any other refusal by wmtp: bad input
        return JSONResponse(APIError(400, str(e)).body(), 400)

    @app.exception_handler(EngineFailed)
    async def engine_failed(_: Request, e: EngineFailed) -> Response:
        return JSONResponse(APIError(500, f"the engine failed: {e}", type="server_error").body(), 500)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> Response:
        body = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body()
        return JSONResponse(body, 500)


class _CountAnswers:
    """ASGI middleware counting answers by route and status (plain ASGI: Starlette's BaseHTTPMiddleware
    would buffer streams and hide client disconnects)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # nothing sent: the app raised, and ServerErrorMiddleware (outside us) answers 500
            code = status[0] if status else 500
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http.labels(route, str(code)).inc()
