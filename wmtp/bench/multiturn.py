"""``wmtp bench multiturn``: TTFT per turn of multi-turn conversations over one long document, served by
the OpenAI server (``/v1/completions``, streamed) to B users at once, with the prefix cache off and on.

Every user's first turn sends the document and a question; turn t sends the document, that user's
earlier questions and the server's answers, and a new question (random token ids, seeded by user and
turn, identical in both runs). TTFT is the client's time from sending a request to its first streamed
token. With the cache, a first turn resumes from the document another user's request prefilled
(page granular, from the deepest recurrent-state snapshot; the users' first requests arrive at once,
so all but one wait for that prefill), and turn t reuses turn t - 1's prompt. ``--cache off``
and ``--cache on`` may run apart (each under one call's time limit) into one file. The serve extra
(fastapi, uvicorn, httpx) must be installed where it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path

from wmtp.bench.step import _spec

#: what must match for two runs' rows to share one results file (``--cache off`` then ``--cache on``)
SETTINGS = ("preset", "mode", "d", "doc_tokens", "users", "turns", "question_tokens", "answer_tokens", "chunk",
            "window", "sink", "page_size", "dtype")
from wmtp.engine.config import EngineConfig
from wmtp.errors import WmtpError


def conversation_tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


class _Served:
    """The app on a free local port in a thread (uvicorn), stopped on exit."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise WmtpError("wmtp bench multiturn: the server did not start within 60 s")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def _turn(client, base: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, the answer's token ids)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, ids = None, []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise WmtpError(f"wmtp bench multiturn: the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids += got
    if ttft is None or len(ids) != max_tokens:
        raise WmtpError(f"wmtp bench multiturn: a turn streamed {len(ids)} of {max_tokens} tokens")
    return ttft, ids


async def _users(base: str, doc: list[int], a: argparse.Namespace, vocab: int) -> list[list[tuple[float, list[int]]]]:
    """(TTFT, answer) [user][turn] after one untimed warm-up request (kernel compiles, first allocations)
    whose tokens share nothing with the conversations; the users run concurrently, each turn after that
    user's previous one."""
    import httpx

    async def user(u: int, client) -> list[tuple[float, list[int]]]:
        history, out = list(doc), []
        for t in range(a.turns):
            history += conversation_tokens(vocab, a.question_tokens, 1000 * (u + 1) + t)
            ttft, answer = await _turn(client, base, history, a.answer_tokens)
            history += answer
            out.append((ttft, answer))
        return out

    async with httpx.AsyncClient(timeout=None) as client:
        await _turn(client, base, conversation_tokens(vocab, min(a.doc_tokens, 2 * a.chunk + 1), -1), a.answer_tokens)
        return list(await asyncio.gather(*(user(u, client) for u in range(a.users))))


def run_multiturn(a: argparse.Namespace) -> int:
    import wmtp
    from wmtp.bench.step import _meta, earlier_run, merged_meta, release_pools, weights
    from wmtp.engine.engine import Engine
    from wmtp.server.app import create_app

    if a.turns < 1 or a.users < 1 or a.question_tokens < 1 or a.answer_tokens < 1:
        raise WmtpError("--turns, --users, --question-tokens and --answer-tokens must each be >= 1")
    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, backend=a.backend)
    vocab = model.config.vocab_size
    doc = conversation_tokens(vocab, a.doc_tokens, 0)
    longest = a.doc_tokens + a.turns * (a.question_tokens + a.answer_tokens) + a.d + 8
    spec = _spec(a.mode, a.d, a.window, a.sink)
    settings = {k: getattr(a, k) for k in SETTINGS}
    earlier = None if a.cache == "both" else earlier_run(Path(a.out), "multiturn", settings)
    rows = [r for r in earlier["rows"] if r["prefix_cache"] != (a.cache == "on")] if earlier else []
    for cache in {"off": (False,), "on": (True,), "both": (False, True)}[a.cache]:
        eng = Engine(model, spec, EngineConfig(max_model_len=longest, max_num_seqs=a.users, page_size=a.page_size,
                                               prefill_chunk=a.chunk, prefix_cache=cache,
                                               decode_graphs=a.decode_graphs))
        dtype = str(eng.dtype).removeprefix("torch.")  # the activations', which the check below goes by
        with _Served(create_app(eng, None, "bench")) as base:
            turns = asyncio.run(_users(base, doc, a, vocab))
        ttft = [[x for x, _ in u] for u in turns]
        per_turn = [sum(u[t] for u in ttft) / a.users for t in range(a.turns)]
        rows.append({"mode": a.mode, "prefix_cache": cache, "users": a.users, "turns": a.turns,
                     "doc_tokens": a.doc_tokens, "ttft_s": ttft, "mean_ttft_s_per_turn": per_turn,
                     "answers": [[ids for _, ids in u] for u in turns],
                     "cached_tokens": eng.prefix.stats()["hit_tokens"] if cache else 0})
        print(f"[{a.mode} cache {'on ' if cache else 'off'}] mean TTFT per turn: "
              + " ".join(f"{x:.3f}" for x in per_turn) + " s")
        del eng
        release_pools(model)
    rows.sort(key=lambda r: r["prefix_cache"])  # off, then on
    if len(rows) == 2:
        rows[1]["divergence"] = first_divergence(rows[0]["answers"], rows[1]["answers"])
    meta = merged_meta({**_meta(a, False), "weights": weights(model), "backend": a.backend, "settings": settings,
                        "what": "client-side TTFT of streamed /v1/completions turns; B users concurrently, one document"},
                       earlier)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"kind": "multiturn", "schema": 1, "meta": meta, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return _check_answers(rows, dtype)


def first_divergence(off: list[list[list[int]]], on: list[list[list[int]]]) -> list[list[int] | None]:
    """Per user: ``[turn, token]`` of the first answer token that differs between the two runs, else None
    (every later turn's prompt holds the earlier answers, so one flip changes all that follows)."""
    out: list[list[int] | None] = []
    for user_off, user_on in zip(off, on):
        out.append(next(([t, i] for t, (x, y) in enumerate(zip(user_off, user_on))
                         for i, (p, q) in enumerate(zip(x, y)) if p != q), None))
    return out


def _check_answers(rows: list[dict], dtype: str) -> int:
    """Greedy answers must not change with the cache. In float32 a difference is an error; in a 16-bit
    dtype it is reported: a cached prompt is prefilled from another position (other chunk boundaries,
    batches of other sizes), whose rounding can flip a near-tie, as batched verification's can
    (``benchmarks/gpu_identity.py`` checks the cache in float32 on the GPU)."""
    flips = [(u, d) for u, d in enumerate(rows[-1].get("divergence") or []) if d is not None]
    if not flips:
        return 0
    what = "; ".join(f"user {u}: turn {t + 1}, token {i + 1}" for u, (t, i) in flips)
    msg = f"wmtp bench multiturn: the answers with the prefix cache differ from those without it ({what})"
    if dtype == "float32":
        raise WmtpError(msg)
    print(f"{msg}: reported, not an error, in {dtype} (float32 must match)")
    return 0


def add_args(sub: argparse._SubParsersAction) -> None:
    from wmtp.bench.step import add_engine_args

    help = "TTFT per turn of multi-turn conversations over one document through the server, cache off / on"
    s = sub.add_parser("multiturn", help=help, description=help)
    s.add_argument("--preset", default="qwen3.6-35b-a3b")
    s.add_argument("--mode", default="windowed", choices=["dense", "native", "windowed"])
    s.add_argument("-d", type=int, default=7, help="num_draft_tokens")
    s.add_argument("--doc-tokens", type=int, default=131_072)
    s.add_argument("--users", type=int, default=4)
    s.add_argument("--turns", type=int, default=8)
    s.add_argument("--question-tokens", type=int, default=64)
    s.add_argument("--answer-tokens", type=int, default=32)
    s.add_argument("--chunk", type=int, default=8192)
    s.add_argument("--cache", default="both", choices=["both", "off", "on"],
                   help="which runs; off / on alone merge with the other's row in --out when its settings match")
    add_engine_args(s)

