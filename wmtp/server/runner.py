"""The engine loop: ONE background thread owns the Engine (which is not thread-safe).

Handlers (on the asyncio event loop) never touch the engine. They put commands (add / abort) on a
thread-safe queue and read their request's output from a per-request ``asyncio.Queue`` that the
engine thread fills through ``loop.call_soon_threadsafe``.

Invariants:
- The thread blocks on the command queue while the engine has nothing to do (no spinning), and
  between steps drains every pending command, so an abort waits at most one engine step.
- Commands are applied in submission order, so an abort always follows its add.
- A request leaves ``engine.requests`` (and frees its memory) as soon as it finishes or is aborted;
  the server never accumulates finished requests.
- Each request's stream yields ``Delta``s in order and ends with one whose ``finished`` is True,
  unless the request is aborted (its consumer is gone) or the engine fails (the stream raises).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams
from wmtp.errors import WmtpError
from wmtp.server.metrics import ServerMetrics
from wmtp.server.protocol import APIError

log = logging.getLogger("wmtp.server")


@dataclass
class Delta:
    """Tokens one engine step emitted for a request; ``metrics`` (RequestMetrics.to_dict()) on the last."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict[str, Any] | None = None


class EngineFailed(RuntimeError):
    """The engine raised something other than a ``WmtpError``: a bug, not bad input. Every in-flight
    request gets it, and the runner refuses new ones (503) until the server is restarted."""


class RequestStream:
    """One submitted request as seen from the event loop: an async iterator of ``Delta``s.

    ``close()`` is idempotent; closing a stream that has not finished aborts the request in the engine.
    """

    def __init__(self, runner: EngineRunner, prompt: list[int], params: SamplingParams) -> None:
        self.runner, self.prompt, self.params = runner, prompt, params
        self.loop = asyncio.get_running_loop()
        self.admitted: asyncio.Future[int] = self.loop.create_future()
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.rid: int | None = None  # written by the engine thread only
        self.finished = False
        self.closed = False
        self.close_reason = "abort"

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self, reason: str = "abort") -> None:
        """``reason``: what the metrics record if this aborts the request ("stop" at a stop string)."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.runner.pending -= 1
        if not self.finished:
            self.runner.commands.put(("abort", self))

    # ---- called from the engine thread -----------------------------------------------------------
    def post(self, item: Delta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def post_admission(self, rid: int | None, error: BaseException | None) -> None:
        def settle() -> None:
            if self.admitted.done():  # the handler was cancelled while waiting
                return
            if error is None:
                self.admitted.set_result(rid)
            else:
                self.admitted.set_exception(error)

        self.loop.call_soon_threadsafe(settle)


class EngineRunner:
    """Owns the engine thread. ``submit`` is called on the event loop; everything else that touches
    the engine runs on the thread. ``max_pending`` bounds requests submitted and not yet closed
    (running + waiting for memory); beyond it ``submit`` refuses with 429."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_pending: int) -> None:
        self.engine, self.metrics, self.max_pending = engine, metrics, max_pending
        self.commands: queue.Queue[tuple[str, RequestStream | None]] = queue.Queue()
        self.active: dict[int, RequestStream] = {}  # engine thread only
        self.pending = 0  # event loop only
        self.failure: str | None = None
        self.thread: threading.Thread | None = None

    # ---- event-loop side -----------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.failure is None

    async def submit(self, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request and wait until the engine accepted it (its ``WmtpError``s, e.g.
        ``CapacityError``, are raised here). The caller must ``close()`` the returned stream."""
        if not self.healthy:
            why = f"the engine failed and needs a restart: {self.failure}" if self.failure else "engine not running"
            raise APIError(503, why, type="server_error")
        if self.pending >= self.max_pending:
            raise APIError(429, f"server is at its limit of {self.max_pending} pending requests; retry later",
                           type="server_overloaded", code="too_many_pending_requests")
        stream = RequestStream(self, prompt, params)
        self.pending += 1
        self.commands.put(("add", stream))
        try:
            await stream.admitted
        except BaseException:  # refused (the abort is then a no-op) or the handler was cancelled
            stream.close()
            raise
        return stream

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="wmtp-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.commands.put(("stop", None))
            self.thread.join()
            self.thread = None

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        self.metrics.snapshot(self.engine)
        while True:
            idle = self.failure is not None or not self.engine.has_unfinished()
            for cmd, stream in self._drain(block=idle):
                if cmd == "stop":
                    return
                self._guarded(partial(self._add if cmd == "add" else self._abort, stream), stream)
            if self.failure is None and self.engine.has_unfinished():
                self._guarded(self._step)
            self.metrics.snapshot(self.engine)

    def _guarded(self, work: Callable[[], None], stream: RequestStream | None = None) -> None:
        """Run one unit of engine work; an exception there is a bug: fail the requests in flight (and
        ``stream``, if it was still waiting for admission) rather than leave their handlers waiting,
        and keep the thread alive to refuse later adds."""
        try:
            work()
        except Exception as e:
            self._fail_all(e)
            if stream is not None:
                stream.post_admission(None, EngineFailed(self.failure))  # ignored once admitted

    def _drain(self, block: bool) -> list[tuple[str, RequestStream | None]]:
        cmds = [self.commands.get()] if block else []
        while True:
            try:
                cmds.append(self.commands.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, stream: RequestStream) -> None:
        if self.failure is not None:
            stream.post_admission(None, EngineFailed(self.failure))
            return
        try:
            rid = self.engine.add_request(stream.prompt, stream.params)
        except WmtpError as e:  # bad input (e.g. CapacityError): the handler answers 4xx
            stream.post_admission(None, e)
            return
        stream.rid = rid
        self.active[rid] = stream
        self.metrics.prompt_tokens.inc(len(stream.prompt))
        stream.post_admission(rid, None)

    def _abort(self, stream: RequestStream) -> None:
        if stream.rid in self.active:
            self.engine.abort(stream.rid)
            self._retire(stream.rid, stream.close_reason)

    def _step(self) -> None:
        for out in self.engine.step():
            stream = self.active[out.request_id]  # every engine request was added by this runner
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            metrics = self._retire(out.request_id) if out.finished else None
            stream.post(Delta(list(out.new_token_ids), out.finished, out.finish_reason, metrics))

    def _retire(self, rid: int, reason: str | None = None) -> dict[str, Any]:
        """Forget a finished or aborted request (its memory is already released) and record it under
        ``reason`` (default: the engine's finish reason)."""
        del self.active[rid]
        req = self.engine.requests.pop(rid)
        m = req.metrics.to_dict()
        self.metrics.observe_finished(m, reason or req.finish_reason)
        return m

    def _fail_all(self, e: Exception) -> None:
        """Every in-flight stream gets ``EngineFailed`` first (nobody may hang), then the engine is asked
        to release their memory (best effort: it just failed)."""
        log.exception("engine failed; refusing new requests until restart")
        self.failure = f"{type(e).__name__}: {e}"
        streams, self.active = self.active, {}
        for stream in streams.values():
            stream.post(EngineFailed(self.failure))
        for rid in streams:
            self.engine.abort(rid)
            self.engine.requests.pop(rid, None)
