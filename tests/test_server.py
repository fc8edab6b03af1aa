"""The OpenAI-compatible server, live on 127.0.0.1 with a tiny checkpoint: parity with offline greedy
``LLM.generate`` (streaming and not, completions and chat), stop strings and stop tokens, metrics,
4xx naming the field for bad input, prompt disconnect handling, and a bounded load test."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from openai import OpenAI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from wmtp import LLM, SamplingParams, SpecConfig  # noqa: E402
from wmtp.cli import main as cli_main  # noqa: E402
from wmtp.server.app import checkpoint_eos_ids, create_app  # noqa: E402
from wmtp.server.detok import IncrementalDetokenizer, StopStrings  # noqa: E402
from wmtp.tokenizer import TextTokenizer  # noqa: E402

MODEL = "tiny"
SPEC = SpecConfig(mode="windowed", num_draft_tokens=4, window=16, sink=4)
MAX_MODEL_LEN = 256
PROMPTS = ["The quick brown fox", "Once upon a time there was a river", "def main(): return 0"]
SYSTEM, USER = "You are terse.", "Count to three."


@dataclass
class Live:
    base: str
    app: object
    llm: LLM

    @property
    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("server") / "tiny"
    assert cli_main(["make-checkpoint", "--preset", "tiny-qwen3.5-moe", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def offline(ckpt) -> LLM:
    """A separate engine on the same checkpoint: the reference the server must reproduce."""
    return LLM(str(ckpt), spec=SPEC, max_model_len=MAX_MODEL_LEN, max_num_seqs=1)


@pytest.fixture(scope="session")
def live(ckpt):
    llm = LLM(str(ckpt), spec=SPEC, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    app = create_app(llm.engine, llm.tokenizer, MODEL, chat_template=llm.tokenizer.chat_template,
                     eos_token_ids=checkpoint_eos_ids(ckpt, llm.tokenizer))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", app, llm)
    server.should_exit = True
    thread.join(10)


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def memory_used(base: str) -> dict[str, float]:
    return {dict(labels)["pool"]: v for (name, labels), v in scrape(base).items() if name == "wmtp_memory_used"}


def wait_memory_empty(base: str, timeout: float = 3.0) -> float:
    """Seconds until every pool is back to 0 (fails after ``timeout``)."""
    t0 = time.monotonic()
    while any(memory_used(base).values()):
        assert time.monotonic() - t0 < timeout, f"memory still held: {memory_used(base)}"
        time.sleep(0.02)
    return time.monotonic() - t0


def chatml(system: str, user: str) -> str:
    """The tiny checkpoint's ChatML template, written out by hand (independent of the server's jinja)."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def greedy(offline: LLM, prompt, max_tokens: int, **kw):
    return offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]


# ---- parity with offline greedy generation -------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS + [[5, 17, 42, 99, 3]])
def test_completions_equal_offline_greedy(live, offline, prompt):
    ref = greedy(offline, prompt, 12)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    full = live.client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.token_ids == ref.token_ids and choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids) and full.usage.completion_tokens == len(ref.token_ids)

    chunks = list(live.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert [t for c in body for t in c.choices[0].token_ids] == ref.token_ids
    assert "".join(c.choices[0].text for c in body) == ref.text
    assert body[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_equals_offline_greedy_through_the_template(live, offline):
    prompt_ids = offline.tokenizer.encode(chatml(SYSTEM, USER))
    ref = greedy(offline, prompt_ids, 10)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": USER}]}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    full = live.client.chat.completions.create(**kw)
    assert full.prompt_token_ids == prompt_ids
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text and full.choices[0].token_ids == ref.token_ids
    assert full.usage.prompt_tokens == len(prompt_ids)

    chunks = list(live.client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == ref.token_ids
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_sse_wire_format_ends_with_done(live):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_stop_string_and_stop_token(live, offline):
    aborts, stops = finished(live.base, "abort"), finished(live.base, "stop")
    ref = greedy(offline, PROMPTS[1], 16, ignore_eos=True)
    stop = next(ref.text[i : i + 2] for i in range(2, len(ref.text) - 2) if "\ufffd" not in ref.text[i : i + 2])
    want = ref.text[: ref.text.find(stop)]
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop, "never-there"],
              extra_body={"ignore_eos": True})
    full = live.client.completions.create(**kw)
    assert full.choices[0].text == want and full.choices[0].finish_reason == "stop"
    streamed = list(live.client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"

    tok = ref.token_ids[3]
    want_ids = ref.token_ids[: ref.token_ids.index(tok) + 1]
    extra = {"ignore_eos": True, "stop_token_ids": [tok], "return_token_ids": True}
    out = live.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body=extra)
    assert out.choices[0].token_ids == want_ids and out.choices[0].finish_reason == "stop"
    wait_memory_empty(live.base)
    assert finished(live.base, "abort") == aborts and finished(live.base, "stop") == stops + 3


def test_seeded_sampling_is_reproducible_and_metrics_add_up(live):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    a, b = (live.client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    m = scrape(live.base)
    hist = [m[("wmtp_spec_iterations_total", (("accepted", str(n)),))] for n in range(SPEC.gamma + 1)]
    assert sum(hist) > 0 and hist[1:] != [0] * SPEC.gamma, "sampling on the tiny model should accept some drafts"
    al = 1 + sum(n * h for n, h in enumerate(hist)) / sum(hist)
    assert m[("wmtp_acceptance_length", ())] == pytest.approx(al)
    alpha1 = sum(hist[1:]) / sum(hist)
    assert m[("wmtp_acceptance_alpha", (("j", "1"),))] == pytest.approx(alpha1)
    assert m[("wmtp_draft_tokens_accepted_total", ())] == sum(n * h for n, h in enumerate(hist))
    assert m[("wmtp_time_to_first_token_seconds_count", ())] >= 2
    assert m[("wmtp_memory_capacity", (("pool", "draft_ring"),))] == 8  # one ring per sequence slot
    assert m[("wmtp_spec_info", (("mode", "windowed"), ("num_draft_tokens", "4"), ("ring", "true"),
                                 ("sink", "4"), ("window", "16")))] == 1


def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == [MODEL]
    assert httpx.get(f"{live.base}/health").json() == {"status": "ok"}


# ---- bad input: 4xx naming the field -------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MSGS = [{"role": "user", "content": "hi"}]
BAD = [
    (C, b"{bad json", 400, None, "not valid JSON"),
    (C, b"[1, 2]", 400, None, "JSON object"),
    (C, {"prompt": "hi"}, 400, "model", "required"),
    (C, {"model": MODEL}, 400, "prompt", "required"),
    (C, {**GOOD, "model": "gpt-4"}, 404, "model", "not served"),
    (C, {**GOOD, "frobnicate": 1}, 400, "frobnicate", "unknown"),
    (C, {**GOOD, "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
    (C, {**GOOD, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    (C, {**GOOD, "max_tokens": 10**12}, 400, "max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    (C, {**GOOD, "max_tokens": "8"}, 400, "max_tokens", "integer"),
    (C, {**GOOD, "prompt": list(range(1, 301))}, 400, "prompt", f"max_model_len={MAX_MODEL_LEN}"),
    (C, {**GOOD, "prompt": [1, 99999]}, 400, "prompt", "vocab_size"),
    (C, {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    (C, {**GOOD, "prompt": ["a", "b"]}, 400, "prompt", "batched"),
    (C, {**GOOD, "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    (C, {**GOOD, "temperature": "hot"}, 400, "temperature", "number"),
    (C, {**GOOD, "top_p": 0}, 400, "top_p", "greater than 0"),
    (C, {**GOOD, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    (C, {**GOOD, "top_k": -5}, 400, "top_k", "greater than or equal to -1"),
    (C, {**GOOD, "seed": -1}, 400, "seed", "greater than or equal to 0"),
    (C, {**GOOD, "n": 2}, 400, "n", "not supported"),
    (C, {**GOOD, "logprobs": 1}, 400, "logprobs", "not supported"),
    (C, {**GOOD, "best_of": 3}, 400, "best_of", "not supported"),
    (C, {**GOOD, "echo": True}, 400, "echo", "not supported"),
    (C, {**GOOD, "suffix": "x"}, 400, "suffix", "not supported"),
    (C, {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    (C, {**GOOD, "logit_bias": {"1": 5}}, 400, "logit_bias", "not supported"),
    (C, {**GOOD, "stop": ""}, 400, "stop", "at least 1 character"),
    (C, {**GOOD, "stop_token_ids": [-1]}, 400, "stop_token_ids.0", "greater than or equal to 0"),
    (C, {**GOOD, "stream": "yes"}, 400, "stream", "boolean"),
    (C, {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream is true"),
    (CH, {"model": MODEL}, 400, "messages", "required"),
    (CH, {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    (CH, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "system"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     400, "messages.0.content.0.type", "'text'"),
    (CH, {"model": MODEL, "messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools", "unknown"),
    (CH, {"model": MODEL, "messages": MSGS, "logprobs": True}, 400, "logprobs", "not supported"),
    (CH, {"model": MODEL, "messages": MSGS, "max_tokens": 3, "max_completion_tokens": 4}, 400,
     "max_completion_tokens", "disagree"),
    (CH, {"model": MODEL, "messages": MSGS, "max_completion_tokens": 10**9}, 400, "max_completion_tokens",
     f"max_model_len={MAX_MODEL_LEN}"),
]


@pytest.mark.parametrize("path,body,status,param,text", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_4xx_naming_the_field(live, path, body, status, param, text):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{live.base}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and text in err["message"]
    if param is not None:
        assert err["message"].startswith(param)


def test_unknown_route_and_method_are_openai_shaped(live):
    r = httpx.get(f"{live.base}/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    assert httpx.get(f"{live.base}/v1/completions").status_code == 405


def test_chat_without_template_and_text_without_tokenizer_are_400(offline):
    async def post(app, path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)

    no_template = create_app(offline.engine, offline.tokenizer, MODEL, chat_template=None)
    r = asyncio.run(post(no_template, CH, {"model": MODEL, "messages": MSGS}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no chat template" in r.json()["error"]["message"]
    no_tokenizer = create_app(offline.engine, None, MODEL)
    r = asyncio.run(post(no_tokenizer, C, GOOD))
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_a_preset_serves_text_prompts_with_the_built_in_tokenizer(ckpt):
    """``serve --preset`` / ``LLM(preset)``: random weights come with the small tokenizer that
    make-checkpoint writes (the same ids), so a text prompt and a chat are answered, not refused."""
    llm = LLM("tiny-qwen3.5-moe", spec=SPEC, max_model_len=64, max_num_seqs=1)
    text = "The quick brown fox, 2048 and 4032."
    assert llm.tokenizer.encode(text) == TextTokenizer(ckpt).encode(text)
    app = create_app(llm.engine, llm.tokenizer, MODEL, chat_template=llm.tokenizer.chat_template,
                     eos_token_ids=checkpoint_eos_ids(None, llm.tokenizer))

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json={"model": MODEL, **body, "max_tokens": 3, "temperature": 0})
                    for path, body in ((C, {"prompt": text}), (CH, {"messages": MSGS}))]

    async def served():
        async with app.router.lifespan_context(app):  # starts the engine thread
            return await both()

    for r in asyncio.run(served()):
        assert r.status_code == 200, r.text


def test_pending_limit_is_429_and_the_waiter_still_completes(offline, monkeypatch):
    """The engine thread is held inside the first request's add_request, so the first request stays
    pending and the second finds the limit of 1 reached; released, the first completes normally."""
    app = create_app(offline.engine, offline.tokenizer, MODEL, max_pending=1)
    runner = app.state.server.runner
    release, add = threading.Event(), offline.engine.add_request

    def held_add(prompt, params):
        release.wait(10)
        return add(prompt, params)

    monkeypatch.setattr(offline.engine, "add_request", held_add)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = asyncio.ensure_future(c.post(C, json=GOOD))
            while runner.pending == 0:
                await asyncio.sleep(0.001)
            second = await c.post(C, json=GOOD)
            release.set()
            return await first, second

    runner.start()
    try:
        first, second = asyncio.run(scenario())
    finally:
        runner.stop()
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_pending_requests"
    assert first.status_code == 200 and runner.pending == 0


def test_engine_failure_is_500_then_503_and_unhealthy(offline, monkeypatch):
    """A bug inside engine.step() must fail the requests in flight, not hang them, and say so on /health."""
    app = create_app(offline.engine, offline.tokenizer, MODEL)
    runner = app.state.server.runner

    def broken_step():
        raise RuntimeError("injected")

    monkeypatch.setattr(offline.engine, "step", broken_step)
    before = set(offline.engine.requests)  # LLM.generate keeps its finished requests

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(C, json=GOOD), await c.post(C, json=GOOD), await c.get("/health")]

    runner.start()
    try:
        first, second, health = asyncio.run(scenario())
    finally:
        runner.stop()
    assert first.status_code == 500 and "injected" in first.json()["error"]["message"]
    assert second.status_code == 503 and health.status_code == 503
    assert set(offline.engine.requests) == before and not any(offline.engine.memory.usage().values())


# ---- disconnects ---------------------------------------------------------------------------------
def finished(base: str, reason: str) -> float:
    return scrape(base).get(("wmtp_requests_finished_total", (("finish_reason", reason),)), 0.0)


def test_client_dropping_a_stream_frees_its_memory_at_once(live):
    aborts = finished(live.base, "abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert any(memory_used(live.base).values())
    # leaving the block closes the connection mid-stream (200 tokens take seconds on this model)
    assert wait_memory_empty(live.base) < 1.0
    assert finished(live.base, "abort") == aborts + 1
    assert httpx.get(f"{live.base}/health").status_code == 200


def test_client_timing_out_on_a_plain_request_frees_its_memory(live):
    aborts = finished(live.base, "abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.base}/v1/completions", json=body, timeout=0.3)
    assert wait_memory_empty(live.base) < 1.0
    assert finished(live.base, "abort") == aborts + 1


# ---- load ----------------------------------------------------------------------------------------
MALFORMED = [
    (C, b'{"model": "tiny", "prompt": '),
    (C, json.dumps({**GOOD, "max_tokens": -4}).encode()),
    (C, json.dumps({**GOOD, "max_tokens": 10**9}).encode()),
    (C, json.dumps({**GOOD, "n": 3}).encode()),
    (C, json.dumps({**GOOD, "model": "nope"}).encode()),
    (CH, json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode()),
    (CH, json.dumps({"model": MODEL, "messages": MSGS, "temperature": -2}).encode()),
    (CH, json.dumps({"model": MODEL, "messages": MSGS, "functions": []}).encode()),
]


def test_load_200_requests_16_concurrent_10pct_malformed(live):
    rng = random.Random(0)
    jobs = []
    for i in range(200):
        if i % 10 == 3:
            jobs.append(("bad", *MALFORMED[i // 10 % len(MALFORMED)]))
            continue
        chat, stream = rng.random() < 0.5, rng.random() < 0.5
        body = {"model": MODEL, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.8]), "stream": stream}
        body.update({"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]} if chat else
                    {"prompt": rng.choice(PROMPTS), "return_token_ids": True})
        jobs.append(("good", CH if chat else C, json.dumps(body).encode()))

    async def one(client, sem, kind, path, content):
        async with sem:
            r = await client.post(path, content=content, headers={"content-type": "application/json"})
            return kind, path, content, r.status_code, r.text

    async def run_all():
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=live.base, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, sem, *j) for j in jobs))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    assert not [r for r in results if r[3] >= 500], "5xx answers"
    for kind, path, content, status, text in results:
        if kind == "bad":
            assert 400 <= status < 500 and json.loads(text)["error"]["message"], text
            continue
        assert status == 200, text
        body = json.loads(content)
        if body["stream"]:
            events = [e[6:] for e in text.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            out = json.loads(text)
            assert out["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= out["usage"]["completion_tokens"] <= body["max_tokens"]
    assert wait_memory_empty(live.base) < 1.0
    m = scrape(live.base)
    assert m[("wmtp_requests_running", ())] == 0 and m[("wmtp_requests_waiting", ())] == 0
    assert not [k for k, v in m.items() if k[0] == "wmtp_http_requests_total" and dict(k[1])["code"][0] == "5" and v]
    assert httpx.get(f"{live.base}/health").status_code == 200
    assert live.llm.engine.requests == {}  # the server keeps no finished request (engine thread is idle)
    print(f"load: 200 requests in {elapsed:.1f} s")


def test_wmtp_serve_command_end_to_end(ckpt, tmp_path):
    """``wmtp serve`` as a user runs it: template and end tokens found in the checkpoint directory."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cmd = [sys.executable, "-m", "wmtp.cli", "serve", "--model", str(ckpt), "--window", "16", "--sink", "4",
           "--max-model-len", "128", "--port", str(port), "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
        assert "serving 'tiny' (windowed, d=4)" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


# ---- pieces --------------------------------------------------------------------------------------
def test_checkpoint_eos_ids_reads_generation_config(ckpt, tmp_path):
    tok = TextTokenizer(ckpt)
    assert checkpoint_eos_ids(ckpt, tok) == (0,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert checkpoint_eos_ids(tmp_path, tok) == (0, 2)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_detokenizer_equals_full_decode(ckpt, data):
    tok = _tokenizer(ckpt)
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(st.integers(0, 511), min_size=1, max_size=40))
    else:  # valid UTF-8 text (multi-byte characters): no delta may contain a broken character
        ids = tok.encode(data.draw(st.text(alphabet="ab é€😀\n中", min_size=1, max_size=30)))
    d = IncrementalDetokenizer(tok)
    pieces, i = [], 0
    while i < len(ids):
        k = data.draw(st.integers(1, 4))
        pieces.append(d.push(ids[i : i + k]))
        i += k
    pieces.append(d.flush())
    full = tok.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                  max_size=3), cuts=st.lists(st.integers(0, 30)))
def test_stop_strings_do_not_depend_on_chunking(text, stops, cuts):
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    want = text[: min(hits)[1]] if hits else text
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    s, out, hit = StopStrings(stops), [], False
    for a, b in zip(bounds, bounds[1:] or [len(text)]):
        piece, hit = s.push(text[a:b], final=b == len(text))
        out.append(piece)
        if hit:
            break
    assert "".join(out) == want and hit == bool(hits)


_TOKENIZERS: dict[Path, TextTokenizer] = {}


def _tokenizer(ckpt: Path) -> TextTokenizer:
    return _TOKENIZERS.setdefault(ckpt, TextTokenizer(ckpt))
