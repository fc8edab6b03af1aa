"""Prefix caching (DESIGN §12): a request served from the cache emits exactly what it emits without
it (greedy tokens, seeded samples, the draft's own logits) in every mode on a GDN and a Mamba2
target, resuming at periodic and end-of-prompt snapshots, while the first request runs and after it
finished; shared pages are never written; LRU eviction spares held pages and admission counts only
added pages; a seeded random mix of add / step / abort keeps the books (no page, draft page or
snapshot leaked or owned twice, no held node evicted) and the tokens; metrics, ``serve``'s flag, the
budget and bad settings. CPU, fp32, tiny models."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from tests.helpers import scramble_, tiny_model
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.memory import MemoryManager
from wmtp.engine.prefix_cache import PrefixCache
from wmtp.engine.sampling import SamplingParams
from wmtp.errors import ConfigError

SINK, W, PAGE, INTERVAL = 4, 16, 8, 4  # snapshots every 32 tokens; the window cuts at 64 (W < resume points)
MODES = [("dense", True), ("native", True), ("windowed", True), ("windowed", False)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def models():
    built: dict[str, torch.nn.Module] = {}

    def get(preset: str) -> torch.nn.Module:
        if preset not in built:
            built[preset] = scramble_(tiny_model(preset))  # outputs that depend on every state
        return built[preset]

    return get


def _engine(model, mode: str, ring: bool, cache: bool, **kw) -> Engine:
    spec = SpecConfig(mode=mode, num_draft_tokens=4 if mode != "dense" else 1, window=W, sink=SINK, ring=ring)
    eng = dict(max_model_len=256, max_num_seqs=4, page_size=PAGE, prefill_chunk=37, prefix_cache=cache,
               prefix_snapshot_interval=INTERVAL)
    return Engine(model, spec, EngineConfig(**{**eng, **kw}))


def _poison_fresh_memory(engine: Engine) -> None:
    """NaN the pages (target and draft) and the ring a request gets from the free lists, before any
    snapshot is restored into them: a resumed request reading a slot that neither its snapshot nor
    its own prefill filled turns its outputs NaN."""
    mem, admit = engine.memory, engine.memory.admit

    def slots(pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages, dtype=torch.long)[:, None] * PAGE + torch.arange(PAGE)).flatten()

    def poisoned(req_id, total_tokens, shared=([], [])):
        alloc = admit(req_id, total_tokens, shared)
        fresh = slots(alloc.pages[len(shared[0]):])
        for layer in engine.model.attention_layers():
            layer.k_cache[fresh] = layer.v_cache[fresh] = float("nan")
        if mem.draft_kv is not None:
            ring = mem.spec.ring_size
            mem.draft_kv[:, :, torch.arange(alloc.ring * ring, (alloc.ring + 1) * ring) if alloc.ring is not None
                         else slots(alloc.draft_pages[len(shared[1]):])] = float("nan")
        return alloc

    mem.admit = poisoned


def _forbid_writes_to_cached_pages(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every K/V store (target and draft) checks that no slot of a cached page is written (the
    backend is the shared model's: patched for this test only)."""
    backend, mem = engine.model.backend, engine.memory
    store = backend.store_kv
    draft_storage = None if mem.draft_kv is None else mem.draft_kv.untyped_storage().data_ptr()

    def checked(k, v, k_cache, v_cache, slots, *scales):
        draft = k_cache.untyped_storage().data_ptr() == draft_storage
        nodes = engine.prefix._index.values()
        pages = {n.draft_page for n in nodes} - {None} if draft else {n.page for n in nodes}
        written = {int(s) // PAGE for s in slots}
        assert not written & pages, f"a write into cached {'draft' if draft else 'target'} pages {written & pages}"
        return store(k, v, k_cache, v_cache, slots, *scales)

    monkeypatch.setattr(backend, "store_kv", checked)


def _scenario(engine: Engine) -> tuple[list[list[int]], list[tuple[int, int, torch.Tensor]], list[int]]:
    """A: a 90-token document + 30 tokens (snapshots at 32, 64, 96 and its end, 120); B: the document
    + another question while A prefills (resumes at 64); C (seeded sampling): 70 tokens of it + 3
    after both finished (resumes at 64, its window reaching back to 57: draft slots only A's
    snapshot holds); D: A's prompt and output + 2 (resumes at A's end of prompt, 120, its window
    reaching back to 116); E (seeded sampling) beside D. Returns every request's tokens, the
    draft's logits per (request, position) and the prompt tokens each took from the cache."""
    rng = random.Random(0)
    doc = _tokens(rng, 90)
    log, draft = [], engine._sample_draft

    def sample_draft(req, logits, pos):
        log.append((req.id, pos, logits[0].clone()))
        return draft(req, logits, pos)

    engine._sample_draft = sample_draft
    a = engine.add_request(doc + _tokens(rng, 30), GREEDY)
    for _ in range(3):
        engine.step()
    ids = [a, engine.add_request(doc + _tokens(rng, 17), GREEDY)]
    while engine.has_unfinished():
        engine.step()
    warm = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=3)
    hot = SamplingParams(temperature=1.1, top_k=50, max_tokens=10, ignore_eos=True, seed=4)
    ids.append(engine.add_request(doc[:70] + _tokens(rng, 3), warm))
    ids.append(engine.add_request(engine.requests[a].tokens + _tokens(rng, 2), GREEDY))
    ids.append(engine.add_request(doc[:50] + _tokens(rng, 40), hot))
    while engine.has_unfinished():
        engine.step()
    reqs = [engine.requests[i] for i in ids]
    return [r.tokens for r in reqs], log, [r.metrics.cached_tokens for r in reqs]


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-nemotron-h"])
@pytest.mark.parametrize("mode,ring", MODES)
def test_cached_run_is_exact(preset, mode, ring, models, monkeypatch):
    """Same greedy tokens, same seeded samples and the same draft logits with the cache as without."""
    _check_cached_run(models(preset), mode, ring, monkeypatch)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-nemotron-h"])
@pytest.mark.parametrize("mode,ring", [("native", True), ("windowed", True)])
def test_cached_run_is_exact_at_fp8_kv(preset, mode, ring, models, monkeypatch):
    """The same with fp8 K / V: cached pages, the draft page and the ring snapshot are fp8 bytes."""
    _check_cached_run(models(preset), mode, ring, monkeypatch, kv_cache_dtype="fp8_e4m3")


def _check_cached_run(model, mode: str, ring: bool, monkeypatch: pytest.MonkeyPatch, **kw) -> None:
    runs = []
    for cache in (False, True):
        engine = _engine(model, mode, ring, cache, **kw)
        _poison_fresh_memory(engine)
        if cache:
            _forbid_writes_to_cached_pages(engine, monkeypatch)
        runs.append((*_scenario(engine), engine.stats()["prefix_cache"]))
    (want, want_log, _, _), (got, got_log, cached, stats) = runs
    assert got == want
    assert cached == [0, 64, 64, 120, 32], cached  # periodic (64, 32) and end-of-prompt (120) resumes
    assert stats["hit_requests"] == 4 and stats["hit_tokens"] == sum(cached)
    # per request, in its own order (the cache changes how requests interleave, not what each drafts)
    assert sorted((r, p) for r, p, _ in got_log) == sorted((r, p) for r, p, _ in want_log)
    for rid in {r for r, _, _ in want_log}:
        for (_, p, x), (_, _, y) in zip(*([e for e in log if e[0] == rid] for log in (got_log, want_log))):
            assert torch.isfinite(x).all() and torch.allclose(x, y, atol=1e-4, rtol=1e-4), f"request {rid} position {p}"
    assert (mode == "dense") == (not got_log)


@pytest.mark.parametrize("preset,mode,ring", [("tiny-qwen3.5-moe", "windowed", True), ("tiny-nemotron-h", "native", True),
                                              ("tiny-llama", "dense", True)])
def test_requests_sent_together_prefill_their_document_once(preset, mode, ring, models):
    """Three users send one 90-token document with their own questions in the same step, and an
    unrelated prompt comes with them: the later two users wait until the first has prefilled past
    the snapshot at 64 (any page, 88, for the attention-only target) and resume there, with the
    tokens they get without the cache; the unrelated prompt waits behind them only in arrival order.
    With prefill chunks longer than the shared prefix nobody waits."""
    rng = random.Random(1)
    doc = _tokens(rng, 90)
    prompts = [doc + _tokens(rng, 20), doc + _tokens(rng, 9), _tokens(rng, 40), doc + _tokens(rng, 30)]
    runs = []
    for cache in (False, True):
        engine = _engine(models(preset), mode, ring, cache)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        engine.step()
        admitted = [engine.requests[i].status != engine.requests[i].status.WAITING for i in ids]
        while engine.has_unfinished():
            engine.step()
        runs.append(([engine.requests[i].tokens for i in ids], [engine.requests[i].metrics.cached_tokens for i in ids],
                     admitted))
    (want, _, together), (got, cached, first) = runs
    assert got == want
    resume = 88 if preset == "tiny-llama" else 64
    assert cached == [0, resume, 0, resume], cached
    assert together == [True] * 4 and first == [True, False, False, False]
    # a shared prefix shorter than one prefill chunk is computed again rather than waited for
    engine = _engine(models(preset), mode, ring, True, prefill_chunk=128)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    assert all(engine.requests[i].status != engine.requests[i].status.WAITING for i in ids)


def test_lru_eviction_spares_held_pages_and_admission_counts_added_pages(models):
    """12 pages of 8 tokens, an attention-only dense target (it resumes at any cached page). X, then
    Y leave 5 pages each in the cache; Z shares X's first 4 and is admitted with 2 free pages, the 2
    it adds, evicting nothing; V, arriving while Z runs, needs 3: the least recently used leaves go
    (X's last page, then Y's last two), never the pages Z holds; a request that eviction cannot make
    room for waits. Everything matches an engine without the cache."""
    model = models("tiny-llama")
    engine = _engine(model, "dense", True, True, max_model_len=64, max_num_seqs=2, num_kv_pages=12)
    rng = random.Random(1)
    x, y = _tokens(rng, 40), _tokens(rng, 40)
    params = SamplingParams(max_tokens=4, ignore_eos=True)  # 40 + 4 tokens (+1 verify): 6 pages
    for prompt in (x, y):
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
    assert engine.memory.pages.num_free == 2 and engine.prefix.stats()["cached_pages"] == 10
    z = engine.add_request(x[:32] + _tokens(rng, 8), params)
    engine.step()
    assert engine.requests[z].metrics.cached_tokens == 32 and engine.prefix.evicted_pages == 0
    v = engine.add_request(_tokens(rng, 16), params)  # 21 tokens: 3 pages
    engine.step()
    assert engine.requests[v].alloc is not None and engine.prefix.evicted_pages == 3
    assert len(engine.prefix._match(x + [1])) == 4 and len(engine.prefix._match(y)) == 3  # X's 5th, Y's 4th+5th
    big = engine.add_request(_tokens(rng, 50), SamplingParams(max_tokens=10, ignore_eos=True))  # 8 pages
    engine.step()
    assert engine.requests[big].alloc is None  # 0 free + 3 evictable: it waits for Z and V
    while engine.has_unfinished():
        engine.step()
    reference = _engine(model, "dense", True, False, max_model_len=64, max_num_seqs=2, num_kv_pages=12)
    for rid in (z, v, big):
        req = engine.requests[rid]
        ref = reference.add_request(req.prompt, req.params)
        while reference.has_unfinished():
            reference.step()
        assert req.tokens == reference.requests[ref].tokens
    use = engine.memory.usage()
    assert use["pages"] == engine.prefix.stats()["cached_pages"] and use["seqs"] == 0  # idle: the cache's pages


def test_server_metrics_export_the_prefix_cache(models):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from wmtp.server.metrics import ServerMetrics

    engine = _engine(models("tiny-llama"), "windowed", True, True)
    metrics = ServerMetrics(engine)
    prompt = list(range(1, 60))
    for p in (prompt, prompt[:40] + [7] * 9):
        engine.add_request(p, GREEDY)
        while engine.has_unfinished():
            engine.step()
    metrics.snapshot(engine)
    got = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_requests"] == 1 and stats["hit_tokens"] == 32 and stats["cached_pages"] == 8
    assert got["wmtp_prefix_cache_hit_tokens_total"] == 32 and got["wmtp_prefix_cache_hit_requests_total"] == 1
    assert got["wmtp_prefix_cache_pages"] == 8 and got["wmtp_prefix_cache_evicted_pages_total"] == 0
    assert got["wmtp_prefix_cache_snapshots"] == stats["snapshots"] > 0


def test_snapshots_are_counted_in_the_budget(models):
    """A snapshot holds the recurrent states, the last hidden state and the draft's ring (or its
    tail page); the byte budget pays for them before pages."""
    model = models("tiny-qwen3.5-moe")
    cfg, per_mode = model.config, {}
    for ring in (True, False):
        spec = SpecConfig(mode="windowed", num_draft_tokens=4, window=W, sink=SINK, ring=ring)
        base = dict(max_model_len=256, max_num_seqs=2, page_size=PAGE, kv_memory_bytes=2**24)
        off = MemoryManager(cfg, spec, EngineConfig(**base), torch.float32)
        on = MemoryManager(cfg, spec, EngineConfig(**base, prefix_cache=True, prefix_snapshots=5), torch.float32)
        draft = (SINK + W + 4 if ring else PAGE) * on.draft_slot_bytes
        assert on.snapshot_bytes == on.state_slot_bytes + cfg.hidden_size * 4 + draft
        assert on.bytes_report()["prefix_snapshots"] == 5 * on.snapshot_bytes
        per_page = on.target_page_bytes + (0 if ring else PAGE * on.draft_slot_bytes)
        assert off.sizes.num_pages - on.sizes.num_pages == pytest.approx(5 * on.snapshot_bytes / per_page, abs=1)
        per_mode[ring] = on.snapshot_bytes
    dense = MemoryManager(models("tiny-llama").config, SpecConfig(mode="dense", num_draft_tokens=1),
                          EngineConfig(prefix_cache=True), torch.float32)
    assert dense.snapshot_bytes == 0 and dense.sizes.num_snapshots == 0  # KV pages alone resume it
    none = MemoryManager(cfg, SpecConfig(), EngineConfig(prefix_cache=True, prefix_snapshots=0), torch.float32)
    assert PrefixCache(dense, dense.eng).enabled and not PrefixCache(none, none.eng).enabled  # no resume: no cache
    default = MemoryManager(cfg, SpecConfig(), EngineConfig(max_num_seqs=3, prefix_cache=True), torch.float32)
    assert default.sizes.num_snapshots == 12


def test_serve_caches_prefixes_unless_told_not_to():
    from wmtp.cli import _serve_engine_args, build_parser

    args = ["serve", "--preset", "tiny-llama"]
    on = _serve_engine_args(build_parser().parse_args(args))
    off = _serve_engine_args(build_parser().parse_args(args + ["--no-prefix-cache", "--prefix-snapshots", "3"]))
    assert on["prefix_cache"] is True and on["prefix_snapshot_interval"] == EngineConfig.prefix_snapshot_interval
    assert off["prefix_cache"] is False and off["prefix_snapshots"] == 3


@pytest.mark.parametrize("kwargs,field", [
    (dict(prefix_cache="yes"), "prefix_cache='yes'"),
    (dict(prefix_snapshot_interval=0), "prefix_snapshot_interval=0"),
    (dict(prefix_snapshots=-1), "prefix_snapshots=-1"),
])
def test_bad_prefix_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"EngineConfig.{field}"):
        EngineConfig(**kwargs)


def test_bench_ttft_repeat_reuses_the_document(models):
    """``wmtp bench ttft --repeat-suffix``'s measurement on the host: the second prompt shares all
    but its last K tokens and resumes from the deepest snapshot before them."""
    from wmtp.bench.step import _prefill_seconds, repeat_prompt

    a = argparse.Namespace(device="cpu", page_size=PAGE, chunk=32, snapshot_interval=INTERVAL, d=4, window=W, sink=SINK)
    prompt = list(range(1, 101))
    second = repeat_prompt(prompt, 10, 512)
    assert second[:90] == prompt[:90] and all(s != p for s, p in zip(second[90:], prompt[90:]))
    (_, first_cached), (_, cached) = _prefill_seconds(models("tiny-nemotron-h"), "windowed", a, [prompt, second], True)
    assert first_cached == 0 and cached == 64  # the periodic snapshot before the 90 shared tokens


def test_bench_ttft_runs_of_other_modes_join_one_file(tmp_path):
    """A 1M-token prefill per mode takes most of a GPU call's time limit, so ``--modes dense`` and
    ``--modes windowed`` into one ``--out`` leave one file with both rows; other settings start afresh."""
    import json

    from wmtp.cli import main as cli_main

    out = tmp_path / "ttft.json"
    args = ["bench", "ttft", "--preset", "tiny-qwen3.5-moe", "--device", "cpu", "--tokens", "100", "--chunk", "32",
            "--repeat-suffix", "10", "--snapshot-interval", "2", "--page-size", "16", "--window", "32", "--sink", "8", "-d", "3", "--out", str(out)]
    assert cli_main(args + ["--modes", "dense"]) == 0
    assert cli_main(args + ["--modes", "windowed,dense"]) == 0
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["rows"]] == ["windowed", "dense"]
    assert [r["command"] for r in res["meta"]["earlier_runs"]] == ["wmtp " + " ".join(args + ["--modes", "dense"])]
    assert all(r["repeat_cached_tokens"] == 64 and r["ttft_s"] > 0 for r in res["rows"])  # the snapshot before 90
    assert cli_main(args[:-2] + ["--out", str(out), "--modes", "native", "--tokens", "90"]) == 0
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["rows"]] == ["native"] and "earlier_runs" not in res["meta"]


def _check_books(engine: Engine) -> None:
    """The prefix cache's books after any operation: target pages (and draft pages, and snapshot
    slots) are each exactly one of free, a cache node's or one running request's own; every node a
    running request holds is still indexed (never evicted) and out of the LRU; refs and children
    counts are what the chains and the tree say; the LRU holds exactly the unheld nodes."""
    mem, pc = engine.memory, engine.prefix
    nodes = list(pc._index.values())
    assert sorted(mem.held) == sorted(r.id for r in engine.running) == sorted(pc._chains)
    for kind, free_list, node_unit in (("pages", mem.pages, lambda n: n.page),
                                       ("draft_pages", mem.draft_pages, lambda n: n.draft_page)):
        free = set(free_list._free)
        cached = {node_unit(n) for n in nodes} - {None}
        assert len(free) == free_list.num_free and len(cached) == sum(node_unit(n) is not None for n in nodes)
        private: set[int] = set()
        for rid, (alloc, _) in mem.held.items():
            units = set(getattr(alloc, kind))
            held = {node_unit(n) for n in pc._chains[rid]} - {None}
            assert units & cached <= held, f"request {rid} reads {kind} of nodes it does not hold"
            assert not (units - cached) & private, f"{kind} of two requests"
            private |= units - cached
        assert not (free & cached or free & private), kind
        assert len(free) + len(cached) + len(private) == free_list.capacity, f"{kind} leaked"
    holders = [n.id for chain in pc._chains.values() for n in chain]
    for n in nodes:
        assert n.refs == holders.count(n.id) and n.children == sum(m.parent is n for m in nodes)
        assert n.parent is None or pc._index.get(n.parent.key) is n.parent  # prefix-closed
    assert set(pc._lru) == {n.id for n in nodes if n.refs == 0}
    assert set(holders) <= {n.id for n in nodes}  # a held node is never evicted
    snaps = [n.snapshot for n in nodes if n.snapshot is not None]
    assert set(pc._snapshot_lru) == {n.id for n in nodes if n.snapshot is not None}
    assert len(set(snaps)) == len(snaps) and not set(snaps) & set(mem.snapshot_slots._free)
    assert len(snaps) + mem.snapshot_slots.num_free == mem.snapshot_slots.capacity


@pytest.mark.parametrize("preset,mode,ring", [("tiny-qwen3.5-moe", "windowed", True), ("tiny-nemotron-h", "native", True)])
def test_random_add_step_abort_keep_the_books(preset, mode, ring, models):
    """A seeded random mix of requests over three documents (prefixes of several lengths, four
    questions, some prompts repeated whole), steps and aborts (waiting, mid-prefill, decoding), on
    pools small enough that pages and snapshots are evicted and admissions wait: ``_check_books`` after every operation, every
    pool back to free or cached once drained, and each request that finished emits the tokens an
    engine without the cache emits for it."""
    model = models(preset)
    kw = dict(max_model_len=128, max_num_seqs=3, num_kv_pages=34, prefill_chunk=24, prefix_snapshots=6)
    engine = _engine(model, mode, ring, True, **kw)
    save, saves = engine.memory.save_snapshot, []
    engine.memory.save_snapshot = lambda slot, *a: (saves.append(slot), save(slot, *a))
    rng = random.Random(7)
    docs = [_tokens(rng, 72) for _ in range(3)]
    questions = [_tokens(rng, n) for n in (1, 5, 12, 20)]
    aborted: set[int] = set()
    ops = {"add": 0, "step": 0, "abort": 0, "held_back": 0}
    for _ in range(200):
        r = rng.random()
        if r < 0.25:
            doc = rng.choice(docs)
            prompt = doc[:rng.choice((0, 24, 40, 56, 72, rng.randint(1, 72)))] + rng.choice(questions)
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True))
            ops["add"] += 1
        elif r < 0.95 and engine.has_unfinished():
            engine.step()
            ops["step"] += 1
            ops["held_back"] += bool(engine.waiting) and len(engine.running) < kw["max_num_seqs"]
        else:
            live = [q.id for q in (*engine.waiting, *engine.running)]
            if live:
                rid = rng.choice(live)
                engine.abort(rid)
                aborted.add(rid)
                ops["abort"] += 1
        _check_books(engine)
    while engine.has_unfinished():
        engine.step()
        _check_books(engine)
    use, stats = engine.memory.usage(), engine.prefix.stats()
    assert use["pages"] == stats["cached_pages"] and use["seqs"] == use["rings"] == use["state_slots"] == 0
    # every branch really ran: hits, evicted pages, snapshot slots taken over, waits for memory
    assert stats["hit_requests"] >= 10 and stats["evicted_pages"] >= 10 and ops["abort"] >= 5, (stats, ops)
    assert ops["held_back"] >= 5 and len(saves) > 2 * kw["prefix_snapshots"], (ops, saves)  # slots taken over
    reference = _engine(model, mode, ring, False, **kw)
    done = [q for q in engine.requests.values() if q.id not in aborted]
    for q in done:
        ref = reference.add_request(q.prompt, q.params)
        while reference.has_unfinished():
            reference.step()
        assert q.tokens == reference.requests[ref].tokens, f"request {q.id}"
