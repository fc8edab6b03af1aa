"""Engine: lossless greedy output across dense / native / windowed (ring on and off), window
correctness of the draft, ring safety, GDN rollback, errors. CPU, fp32, tiny models."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.memory import MemoryManager
from wmtp.engine.window import DraftWindow
from wmtp.errors import WmtpError

SINK, W = 4, 16  # small so the window really cuts: prompts run to 150 tokens
MODES = [("native", True), ("windowed", True), ("windowed", False)]


def _llm(preset: str, mode: str = "dense", d: int = 4, ring: bool = True, **kw) -> LLM:
    spec = SpecConfig(mode=mode, num_draft_tokens=d if mode != "dense" else 1, window=W, sink=SINK, ring=ring)
    return LLM(preset, spec=spec, max_model_len=kw.pop("max_model_len", 256), max_num_seqs=kw.pop("max_num_seqs", 4),
               page_size=kw.pop("page_size", 8), prefill_chunk=kw.pop("prefill_chunk", 37), **kw)


def _prompts(n: int, seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.choice([1, 3, 9, 20, 21, 40, 77, 150]) for _ in range(n)]
    return [[rng.randrange(1, vocab) for _ in range(k)] for k in lens]


def _oracle_drafts(engine: Engine, reference: dict[tuple[int, ...], list[int]], hit: float, seed: int) -> None:
    """Make the draft propose the true next token with probability ``hit`` (else a random one), so
    iterations accept every count 0..γ. The MTP forwards still run (KV, windows, ring); only the
    proposed token changes, and verification must be lossless whatever the draft proposes."""
    rng = random.Random(seed)
    original = engine._sample_draft

    def sample_draft(req, logits, pos):
        tok, q = original(req, logits, pos)
        full = reference[tuple(req.prompt)]
        if pos < len(full):
            tok = full[pos] if rng.random() < hit else rng.randrange(engine.model.config.vocab_size)
        return tok, q

    engine._sample_draft = sample_draft


def _run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> list[list[int]]:
    """Feed requests a few steps apart, at most ``batch`` in flight (continuous batching)."""
    eng, outs, queue, live = llm.engine, {}, list(enumerate(prompts)), {}
    step = 0
    while queue or live:
        if queue and len(live) < batch and step % 2 == 0:
            i, p = queue.pop(0)
            live[eng.add_request(p, params)] = i
        for o in eng.step():
            if o.finished:
                i = live.pop(o.request_id)
                req = eng.requests[o.request_id]
                outs[i] = req.tokens
        step += 1
    return [outs[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def dense_reference():
    cache = {}

    def get(preset: str, prompts: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
        key = (preset, max_tokens)
        if key not in cache:
            cache[key] = (_llm(preset), {})
        llm, ref = cache[key]
        todo = [p for p in prompts if tuple(p) not in ref]
        if todo:
            for p, out in zip(todo, llm.generate(todo, SamplingParams(max_tokens=max_tokens, ignore_eos=True))):
                ref[tuple(p)] = p + out.token_ids
        return ref

    return get


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-llama", "tiny-qwen3.5-moe", "tiny-nemotron-h"])
@pytest.mark.parametrize("mode,ring", MODES)
def test_greedy_identical_across_modes(preset, mode, ring, dense_reference):
    """≥ 50 prompts per preset and mode, d from 2 to 8, batch 1 and 4 with staggered arrivals."""
    max_tokens = 24
    prompts = _prompts(52, seed=zlib.crc32(f"{preset} {mode} {ring}".encode()) % 1000)  # the same in every process
    ref = dense_reference(preset, prompts, max_tokens)
    accepted_counts = set()
    for k, (d, batch, hit) in enumerate([(2, 1, 0.7), (3, 4, 0.5), (5, 4, 0.8), (8, 4, 0.9)]):
        chunk = prompts[k * 13 : (k + 1) * 13]
        llm = _llm(preset, mode, d=d, ring=ring)
        _oracle_drafts(llm.engine, ref, hit, seed=k)
        got = _run_staggered(llm, chunk, SamplingParams(max_tokens=max_tokens, ignore_eos=True), batch)
        for p, g in zip(chunk, got):
            assert g == ref[tuple(p)], f"{preset} {mode} ring={ring} d={d}: output differs from dense"
        for r in llm.engine.requests.values():
            accepted_counts |= {n for n, h in enumerate(r.metrics.hist) if h}
        assert all(v == 0 for v in llm.engine.memory.usage().values())
    assert len(accepted_counts) >= 4, f"acceptance paths barely exercised: {accepted_counts}"


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-llama", "tiny-nemotron-h"])
def test_natural_drafts_identical(preset, dense_reference):
    """The model's own (random) draft head, no injected proposals."""
    prompts = _prompts(8, seed=3)
    ref = dense_reference(preset, prompts, 20)
    for mode, ring in MODES:
        out = _llm(preset, mode, d=4, ring=ring).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert [p + o.token_ids for p, o in zip(prompts, out)] == [ref[tuple(p)] for p in prompts]


def test_dense_matches_full_sequence_argmax():
    llm = _llm("tiny-qwen3-next")
    prompt = _prompts(1, seed=9)[0] + [5] * 30
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    seq = prompt + out
    logits = llm.model.score(seq[:-1])
    assert out == torch.argmax(logits[len(prompt) - 1 :], dim=-1).tolist()


# ---- the window rule, enforced -------------------------------------------------------------
def _poison_outside_window(engine: Engine) -> list[int]:
    """Before every draft forward, NaN every draft-KV entry that no query of this forward or any
    later one may read. Within an iteration the draft-extend re-queries from L-1, up to γ-1
    positions before the last draft step, so the dead range is [sink, q_first - (γ-1) - W].
    Returns a list that counts poisoned slots."""
    model, count = engine.model, [0]
    original = model.mtp_forward
    back = engine.spec.gamma - 1

    def mtp_forward(ids, hidden, ctx, layer_idx=0):
        attn = model.mtp_attention_layers()[layer_idx]
        for b, start in enumerate(ctx.q_starts):
            last_dead = start - back - W
            if ctx.window(b) is None or last_dead < SINK:
                continue
            dead = torch.arange(SINK, last_dead + 1)
            slots = ctx.kv_slots.slots(b, dead)
            attn.k_cache[slots] = float("nan")
            attn.v_cache[slots] = float("nan")
            count[0] += len(dead)
        out = original(ids, hidden, ctx, layer_idx)
        assert torch.isfinite(out).all(), "the windowed draft read a key outside its window"
        return out

    model.mtp_forward = mtp_forward
    return count


def test_windowed_draft_reads_only_allowed_keys(dense_reference):
    preset, prompts = "tiny-qwen3-next", _prompts(10, seed=5)
    clean = _llm(preset, "windowed", d=4, ring=False)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [(o.token_ids, o.metrics["acceptance_histogram"]) for o in clean.generate(prompts, params)]
    poisoned = _llm(preset, "windowed", d=4, ring=False)
    count = _poison_outside_window(poisoned.engine)
    got = [(o.token_ids, o.metrics["acceptance_histogram"]) for o in poisoned.generate(prompts, params)]
    assert count[0] > 100
    assert got == want  # same tokens AND same draft acceptance: the draft's outputs did not change


def test_ring_never_overwrites_a_live_window_slot():
    """Track which position each ring slot holds; every key a draft query may read must still be there."""
    llm = _llm("tiny-llama", "windowed", d=5, ring=True)
    model, holder = llm.model, {}
    fwd, write = model.mtp_forward, model.mtp_write_kv

    def record(ctx):
        for b, (s, n) in enumerate(zip(ctx.q_starts, ctx.q_lens)):
            pos = torch.arange(s, s + n)
            for p, slot in zip(pos.tolist(), ctx.kv_slots.slots(b, pos).tolist()):
                holder[(int(ctx.kv_slots.base[b]), slot)] = p

    def checked_forward(ids, hidden, ctx, layer_idx=0):
        for b, (s, n) in enumerate(zip(ctx.q_starts, ctx.q_lens)):
            win = ctx.window(b)
            keys = win.key_positions(s, s + n - 1) if win else torch.arange(s + n)
            keys = keys[keys < s]  # older keys must survive; this forward rewrites its own
            for k, slot in zip(keys.tolist(), ctx.kv_slots.slots(b, keys).tolist()):
                assert holder.get((int(ctx.kv_slots.base[b]), slot)) == k, f"ring slot of position {k} was overwritten"
        record(ctx)
        return fwd(ids, hidden, ctx, layer_idx)

    def recorded_write(ids, hidden, ctx, layer_idx=0):
        record(ctx)
        return write(ids, hidden, ctx, layer_idx)

    model.mtp_forward, model.mtp_write_kv = checked_forward, recorded_write
    prompts = _prompts(6, seed=11)
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, _llm("tiny-llama").generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True)))}
    _oracle_drafts(llm.engine, ref, 0.8, seed=1)
    out = llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    assert [p + o.token_ids for p, o in zip(prompts, out)] == [ref[tuple(p)] for p in prompts]
    assert llm.spec.ring_size == SINK + W + 5


def _draft_log(llm: LLM, ref: dict[tuple[int, ...], list[int]]) -> list[tuple[int, torch.Tensor]]:
    """Oracle proposals (same RNG in every run, so every run has the same iterations) while logging
    (context length, the draft's own logits) at each proposal."""
    log, rng, engine = [], random.Random(0), llm.engine
    original = engine._sample_draft

    def sample_draft(req, logits, pos):
        log.append((len(req.tokens), logits[0].clone()))
        full = ref[tuple(req.prompt)]
        return (full[pos] if pos < len(full) and rng.random() < 0.6 else 7), original(req, logits, pos)[1]

    engine._sample_draft = sample_draft
    return log


def test_window_min_context_switches_the_draft_to_the_window(dense_reference):
    """``window_min_context=N``: while the context is <= N the draft reads every key (its logits
    equal native's); beyond N they equal the always-windowed draft's."""
    N, prompt = 40, _prompts(1, seed=21)[0][:1] * 30
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    ref = dense_reference("tiny-llama", [prompt], 50)
    logs = {}
    for name, mode, min_ctx in [("native", "native", 0), ("windowed", "windowed", 0), ("switch", "windowed", N)]:
        llm = LLM("tiny-llama", spec=SpecConfig(mode=mode, num_draft_tokens=4, window=W, sink=SINK, ring=False,
                                                window_min_context=min_ctx), max_model_len=128, page_size=8)
        logs[name] = _draft_log(llm, ref)
        assert [prompt + llm.generate([prompt], params)[0].token_ids] == [ref[tuple(prompt)]]
    assert [L for L, _ in logs["switch"]] == [L for L, _ in logs["native"]] == [L for L, _ in logs["windowed"]]
    d = SpecConfig(num_draft_tokens=4).verify_tokens
    early = late = cut = 0
    for (L, sw), (_, nat), (_, win) in zip(logs["switch"], logs["native"], logs["windowed"]):
        if L <= N - d:  # every forward behind this proposal ran below the threshold
            assert torch.allclose(sw, nat, atol=1e-5), f"context {L} <= {N}: draft must read every key"
            early += 1
            cut += L > SINK + W + d and not torch.allclose(nat, win, atol=1e-5)
        elif L > N + d:
            assert torch.allclose(sw, win, atol=1e-5), f"context {L} > {N}: draft must use the window"
            late += 1
    assert early >= 5 and late >= 5 and cut >= 1, (early, late, cut)  # both regimes seen; the window really cuts


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_full_attention_draft_prefill_only_writes_kv(preset, dense_reference):
    """A native draft's prefill writes K/V at every prompt slot and runs no MTP forward there: its
    proposals' logits equal those after a prefill that runs the MTP forward over every slot, and
    no draft forward takes more rows than a decode iteration's."""
    prompts, params, d = _prompts(4, seed=13), SamplingParams(max_tokens=24, ignore_eos=True), 4
    ref = dense_reference(preset, prompts, 24)
    logs, rows = {}, {}
    for name in ("write", "forward"):
        llm = _llm(preset, "native", d=d)
        model, forward, rows[name] = llm.model, llm.model.mtp_forward, []
        if name == "forward":  # every prompt slot through the whole MTP layer, as serving stacks prefill it
            def write_by_forward(ids, hidden, ctx, layer_idx=0, model=model):
                model.mtp_forward(ids, hidden, ctx, layer_idx)

            model.mtp_write_kv = write_by_forward

        def counted(ids, hidden, ctx, layer_idx=0, forward=forward, seen=rows[name]):
            seen.append(len(ids))
            return forward(ids, hidden, ctx, layer_idx)

        model.mtp_forward = counted
        logs[name] = _draft_log(llm, ref)
        out = llm.generate(prompts, params)
        assert [p + o.token_ids for p, o in zip(prompts, out)] == [ref[tuple(p)] for p in prompts]
    assert [L for L, _ in logs["write"]] == [L for L, _ in logs["forward"]]
    for (L, a), (_, b) in zip(logs["write"], logs["forward"]):
        assert torch.allclose(a, b, atol=1e-5), f"draft logits at context {L} differ"
    assert max(rows["write"]) <= len(prompts) * (d + 1) < max(rows["forward"]), (max(rows["write"]), max(rows["forward"]))


def test_per_request_memory_bytes():
    """Each request reports the bytes it reserved in each pool; the ring is sink + W + d draft slots."""
    prompt, params = _prompts(1, seed=2)[0][:1] * 50, SamplingParams(max_tokens=10, ignore_eos=True)
    got = {}
    for mode, ring in [("native", True), ("windowed", True), ("windowed", False)]:
        llm = _llm("tiny-qwen3-next", mode, d=4, ring=ring)
        mem = llm.engine.memory
        got[(mode, ring)] = b = llm.generate([prompt], params)[0].metrics["memory_bytes"]
        pages = -(-(50 + 10 + 4) // 8)
        assert b["target_kv"] == pages * mem.target_page_bytes
        assert b["state_pool"] == mem.state_slot_bytes > 0
        assert b["verify_record"] == mem.verify_seq_bytes > 0  # its sequence slot's verify record
        assert b["draft_ring"] == (mode == "windowed" and ring) * (SINK + W + 4) * mem.draft_slot_bytes
        assert b["draft_pool"] == (not (mode == "windowed" and ring)) * pages * 8 * mem.draft_slot_bytes
        assert all(v <= mem.bytes_report()[k] for k, v in b.items())
    assert got[("windowed", True)]["draft_ring"] < got[("native", True)]["draft_pool"]


def test_verify_record_is_preallocated_and_budgeted():
    """The per-token GDN inputs and conv windows a verify records live in the engine's preallocated
    record (counted in the KV budget), not in tensors the forward allocates, and the rollback reads
    them there."""
    llm = _llm("tiny-qwen3-next", "native", d=4)
    eng, mem = llm.engine, llm.engine.memory
    c, seqs = eng.model.config, eng.eng.max_num_seqs
    # per token: k per k-head, v per v-head, g and beta per v-head (fp32)
    width = c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * (c.linear_value_head_dim + 2)
    per_layer = 4 * width * 4 + (c.linear_conv_kernel_dim - 1 + 4) * c.gdn_conv_dim * mem.elt
    assert mem.bytes_report()["verify_record"] == seqs * len(c.linear_attention_layers) * per_layer
    layers, pools = eng.model.recurrent_layers(), eng.model.state_pools
    assert pools.verify_tokens.shape == (len(layers), seqs * 4, width)
    assert pools.verify_windows.shape[:2] == (len(layers), seqs)
    seen = []
    real = eng.model.rollback_states

    def spy(slots, accepted, recorded):
        seen.extend(recorded[l.layer_idx][i].data_ptr() == l.verify_record[1 - i].data_ptr()
                    for l in layers for i in (0, 1))
        return real(slots, accepted, recorded)

    eng.model.rollback_states = spy
    prompt, params = _prompts(1, seed=3)[0][:1] * 20, SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([prompt], params)
    assert seen and all(seen)
    dense = MemoryManager(eng.model.config, SpecConfig(mode="dense"), eng.eng, eng.dtype)
    assert dense.verify_seq_bytes == 0 and dense.bytes_report()["verify_record"] == 0


def test_ever_read_runs_match_the_rule():
    rng = random.Random(0)
    for _ in range(2000):
        win = DraftWindow(rng.randrange(0, 6), rng.randrange(1, 12))
        n = rng.randrange(1, 40)
        lo = rng.randrange(0, n)
        hi = rng.randrange(lo, n + 1)
        want = [p for p in range(lo, hi) if win.ever_read(p, n)]
        got = [p for a, b in win.ever_read_runs(lo, hi, n) for p in range(a, b)]
        assert got == want, (win, n, lo, hi)


# ---- rollback --------------------------------------------------------------------------------
@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_rollback_equals_replay(preset, accepted):
    """After a verify of d tokens rolled back to ``accepted``, conv + recurrent states (GDN or
    Mamba2) equal those of replaying only the accepted tokens (<= 1e-5)."""
    llm = _llm(preset, "native", d=5)
    eng, model = llm.engine, llm.model
    prompt = _prompts(1, seed=2)[0] + list(range(40, 70))
    verify = [7, 8, 9, 10, 11]
    a = eng.add_request(prompt, SamplingParams(max_tokens=8))
    b = eng.add_request(prompt, SamplingParams(max_tokens=8))
    ra, rb = eng.requests[a], eng.requests[b]
    eng._admit_waiting()  # pools and block tables only: the test drives the forwards itself
    for r in (ra, rb):
        with torch.no_grad():
            model(torch.tensor(prompt), eng._target_ctx([r], [0], [len(prompt)]))
    with torch.no_grad():  # a: verify all d tokens with recording, then roll back
        ctx = eng._target_ctx([ra], [len(prompt)], [len(verify)], record=True)
        model(torch.tensor(verify), ctx)
        eng._rollback([ra], [accepted], ctx)
        model(torch.tensor(verify[: accepted + 1]), eng._target_ctx([rb], [len(prompt)], [accepted + 1]))
    for layer in model.recurrent_layers():
        sa, sb = ra.alloc.state_slot, rb.alloc.state_slot
        assert (layer.ssm_state[sa] - layer.ssm_state[sb]).abs().max() <= 1e-5
        assert (layer.conv_state[sa] - layer.conv_state[sb]).abs().max() <= 1e-5


# ---- errors ----------------------------------------------------------------------------------
def test_errors_are_clear_and_engine_keeps_serving():
    llm = _llm("tiny-llama", "windowed", d=3, max_model_len=64)
    ok = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(WmtpError, match="exceeds max_model_len=64"):
        llm.engine.add_request(list(range(1, 70)), SamplingParams(max_tokens=4))
    with pytest.raises(WmtpError, match="vocab_size=512"):
        llm.engine.add_request([1, 99999], SamplingParams())
    with pytest.raises(WmtpError, match="prompt is empty"):
        llm.engine.add_request([], SamplingParams())
    with pytest.raises(WmtpError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(WmtpError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.requests[ok].num_generated == 5
    assert all(v == 0 for v in llm.engine.memory.usage().values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="windowed", num_draft_tokens=0), r"num_draft_tokens \(d\)=0"),
        (dict(mode="native", num_draft_tokens=1), "use mode='dense'"),
        (dict(mode="windowed", window=0), r"window \(W\)=0"),
        (dict(mode="windowed", sink=-1), "sink=-1"),
        (dict(mode="fast"), "mode='fast'"),
        (dict(mode="windowed", window_min_context=100), "needs ring=False"),
    ],
)
def test_spec_config_errors(kwargs, match):
    with pytest.raises(WmtpError, match=match):
        SpecConfig(**kwargs)


def test_unknown_preset_error():
    with pytest.raises(WmtpError, match="unknown preset 'tiny-gpt'"):
        LLM("tiny-gpt")


def test_stop_token_cuts_emission():
    llm = _llm("tiny-llama", "native", d=4)
    prompt = _prompts(1, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    stop = free[6]
    cut = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop]))[0]
    assert cut.token_ids == free[: free.index(stop) + 1] and cut.finish_reason == "stop"


def test_engine_wide_metrics_add_up():
    """The engine-wide histogram is the sum of the per-request ones; every request is counted."""
    llm = _llm("tiny-llama", "windowed", d=4)
    prompts = _prompts(6, seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    s = llm.stats()
    want = [sum(o.metrics["acceptance_histogram"][n] for o in outs) for n in range(4)]
    assert s["acceptance_histogram"] == want
    assert s["finished_requests"] == 6 and s["generated_tokens"] == sum(len(o.token_ids) for o in outs)
    assert s["proposed_draft_tokens"] == 3 * sum(want)
    assert s["accepted_draft_tokens"] == sum(o.metrics["accepted_draft_tokens"] for o in outs)
    assert s["iterations"] >= max(o.metrics["iterations"] for o in outs) and s["memory_use"]["pages"] == 0


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engines_over_one_model_step_in_turn(preset):
    """Engines over one model's weights (each binds its own pools to the layers) stepped in turn
    emit what each emits alone: a step re-attaches its own engine's pools first."""
    import wmtp
    from wmtp.engine.config import EngineConfig

    model = wmtp.load_model(preset, dtype="float32")
    prompts = _prompts(2, seed=5)
    specs = [SpecConfig(mode="dense", num_draft_tokens=1),
             SpecConfig(mode="windowed", num_draft_tokens=3, window=W, sink=SINK)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def engine(spec: SpecConfig) -> tuple[Engine, list[int]]:
        eng = Engine(model, spec, EngineConfig(max_model_len=256, max_num_seqs=2, page_size=8, prefill_chunk=37))
        return eng, [eng.add_request(p, params) for p in prompts]

    def tokens(eng: Engine, ids: list[int]) -> list[list[int]]:
        return [eng.requests[i].tokens for i in ids]

    alone = []
    for spec in specs:
        eng, ids = engine(spec)
        while eng.has_unfinished():
            eng.step()
        alone.append(tokens(eng, ids))
    assert alone[0] == alone[1]  # lossless: the windowed engine emits dense's tokens
    pairs = [engine(spec) for spec in specs]  # the second bound its pools last
    while any(eng.has_unfinished() for eng, _ in pairs):
        for eng, _ in pairs:
            if eng.has_unfinished():
                eng.step()
    assert [tokens(eng, ids) for eng, ids in pairs] == alone


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_unbind_frees_a_deleted_engines_pools(preset):
    """The model keeps no pool of a deleted engine once unbound (it kept the last bound manager's
    pools alive, so a benchmark's next engine found that memory taken), and an engine built after
    still serves."""
    import gc
    import weakref

    import wmtp
    from wmtp.engine.config import EngineConfig

    model = wmtp.load_model(preset, dtype="float32")
    spec = SpecConfig(mode="windowed", num_draft_tokens=3, window=W, sink=SINK)
    cfg = EngineConfig(max_model_len=256, max_num_seqs=2, page_size=8)
    eng = Engine(model, spec, cfg)
    pools = [weakref.ref(t) for t in (model.attention_layers()[0].k_cache._base,
                                       model.mtp_attention_layers()[0].k_cache._base)]
    if model.recurrent_layers():
        pools.append(weakref.ref(model.state_pools.conv))
    del eng
    gc.collect()
    assert all(p() is not None for p in pools)  # still bound: the model holds the manager
    MemoryManager.unbind(model)
    gc.collect()
    assert all(p() is None for p in pools)
    assert model.bound_pools is None and model.attention_layers()[0].k_cache is None
    eng = Engine(model, spec, cfg)
    rid = eng.add_request(_prompts(1, seed=3)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(eng.requests[rid].tokens) > 4
