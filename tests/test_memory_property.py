"""Property tests of KV / state pool accounting.

1. ``MemoryManager`` alone (no tensors, no ``bind``), driven by a Hypothesis rule-based state
   machine in every pool layout (dense / native / windowed ring / windowed no-ring): admissions of
   random sizes (including ones that can never fit), releases and finishes, with the pool invariants
   checked after every operation and a leak check at the end of every run.
2. The real engine on tiny random-weight models: a seeded random mix of add_request / step / abort,
   with capacity and leak checks after every operation and a full drain at the end.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.engine.config import EngineConfig
from wmtp.engine.engine import Status
from wmtp.engine.memory import CapacityError, MemoryManager
from wmtp.errors import WmtpError
from wmtp.presets import preset_config

PRESET = "tiny-qwen3-next"  # hybrid: every request also takes a recurrent-state slot
POOLS = ("pages", "draft_pages", "rings", "state_slots", "seqs")

# ==================================================================================================
# 1. MemoryManager state machine
# ==================================================================================================

MEM_MODES = ("dense", "native", "windowed-ring", "windowed-noring")
OPS: Counter = Counter()  # mode -> operations executed (all examples of one run)
MIN_OPS_PER_MODE = 2_600  # x 4 modes >= 10,000


def _spec(mode: str, d: int, window: int, sink: int, min_ctx: int) -> SpecConfig:
    if mode == "dense":
        return SpecConfig(mode="dense", num_draft_tokens=d)
    if mode == "native":
        return SpecConfig(mode="native", num_draft_tokens=max(d, 2))
    if mode == "windowed-ring":
        return SpecConfig(mode="windowed", num_draft_tokens=max(d, 2), window=window, sink=sink, ring=True)
    return SpecConfig(mode="windowed", num_draft_tokens=max(d, 2), window=window, sink=sink, ring=False,
                      window_min_context=min_ctx)


def make_machine(mode: str) -> type[RuleBasedStateMachine]:
    class MemoryMachine(RuleBasedStateMachine):
        """Model: ``self.model`` maps request id -> total tokens it was admitted with."""

        @initialize(
            d=st.integers(1, 5),
            window=st.integers(1, 64),
            sink=st.integers(0, 8),
            min_ctx=st.integers(0, 40),
            max_model_len=st.integers(1, 160),
            max_num_seqs=st.integers(1, 6),
            page_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
            sizing=st.sampled_from(["default", "pages", "pages", "bytes"]),
            num_pages=st.integers(1, 48),
            slack=st.integers(0, 10_000),
        )
        def setup(self, d, window, sink, min_ctx, max_model_len, max_num_seqs, page_size, sizing, num_pages,
                  slack):
            self.cfg = preset_config(PRESET)
            self.spec = _spec(mode, d, window, sink, min_ctx)
            self.eng = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, page_size=page_size,
                                    num_kv_pages=num_pages if sizing == "pages" else None)
            dd = self.spec.num_draft_tokens
            per_seq = math.ceil((max_model_len + dd) / page_size)
            paged_draft = self.spec.speculative and not self.spec.uses_ring
            if sizing == "bytes":
                # Size from a byte budget that leaves room for exactly `num_pages` pages.
                probe = MemoryManager(self.cfg, self.spec, self.eng, torch.float32)
                num_pages = max(num_pages, per_seq // max_num_seqs, 1)
                rings = max_num_seqs if self.spec.uses_ring else 0
                # verify record: d tokens' fp32 delta-rule inputs (k per k-head; v, g, beta per v-head)
                # + K-1+d window rows
                c, d = self.cfg, self.spec.verify_tokens
                token = (c.linear_num_key_heads * c.linear_key_head_dim
                         + c.linear_num_value_heads * (c.linear_value_head_dim + 2)) * 4
                per_layer = d * token + (c.linear_conv_kernel_dim - 1 + d) * c.gdn_conv_dim * 4
                verify = self.spec.speculative * max_num_seqs * len(c.linear_attention_layers) * per_layer
                fixed = (rings * self.spec.ring_size * probe.draft_slot_bytes + max_num_seqs * probe.state_slot_bytes
                         + verify)
                per_page = probe.target_page_bytes + (page_size * probe.draft_slot_bytes if paged_draft else 0)
                budget = fixed + num_pages * per_page + slack % per_page
                self.eng = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                        page_size=page_size, kv_memory_bytes=budget)
            self.mm = MemoryManager(self.cfg, self.spec, self.eng, torch.float32)
            # Pool sizes, derived independently of MemoryManager._plan.
            exp_pages = per_seq * max_num_seqs if sizing == "default" else num_pages
            self.cap = {
                "pages": exp_pages,
                "draft_pages": exp_pages if paged_draft else 0,
                "rings": max_num_seqs if self.spec.uses_ring else 0,
                "state_slots": max_num_seqs,  # hybrid preset
                "seqs": max_num_seqs,
            }
            z = self.mm.sizes
            assert (z.num_pages, z.num_draft_pages, z.num_rings, z.num_state_slots) == (
                self.cap["pages"], self.cap["draft_pages"], self.cap["rings"], self.cap["state_slots"])
            self.paged_draft = paged_draft
            self.model: dict[int, int] = {}
            self.next_id = 0

        # ---- expectations ----------------------------------------------------------------------
        def _need_pages(self, total: int) -> int:
            return math.ceil((total + self.spec.num_draft_tokens) / self.eng.page_size)

        def _expected_usage(self) -> dict[str, int]:
            pages = sum(self._need_pages(t) for t in self.model.values())
            n = len(self.model)
            return {"pages": pages, "draft_pages": pages if self.paged_draft else 0,
                    "rings": n if self.spec.uses_ring else 0, "state_slots": n, "seqs": n}

        def _expected_can_admit(self, total: int) -> bool:
            use, need = self._expected_usage(), self._need_pages(total)
            return (use["seqs"] < self.cap["seqs"]
                    and use["pages"] + need <= self.cap["pages"]
                    and (not self.paged_draft or use["draft_pages"] + need <= self.cap["draft_pages"])
                    and (not self.spec.uses_ring or use["rings"] < self.cap["rings"])
                    and use["state_slots"] < self.cap["state_slots"])

        # ---- operations ------------------------------------------------------------------------
        @rule(data=st.data())
        def admit(self, data):
            OPS[mode] += 1
            L = self.eng.max_model_len
            if data.draw(st.integers(0, 4), "kind"):  # 4 in 5: within max_model_len (if L allows)
                prompt_len = data.draw(st.integers(1, max(L - 1, 1)), "prompt")
                max_tokens = data.draw(st.integers(1, max(L - prompt_len, 1)), "max_tokens")
            else:  # anything, mostly too long
                prompt_len = data.draw(st.integers(1, 2 * L + 8), "prompt")
                max_tokens = data.draw(st.integers(1, 2 * L + 8), "max_tokens")
            total = prompt_len + max_tokens
            need = self._need_pages(total)
            if total > L:
                with pytest.raises(CapacityError, match="max_model_len"):
                    self.mm.check_fits_ever(prompt_len, max_tokens)
                OPS[mode, "refused"] += 1
                return
            if need > self.cap["pages"]:
                with pytest.raises(CapacityError, match=rf"needs {need} KV pages.*pool has {self.cap['pages']}"):
                    self.mm.check_fits_ever(prompt_len, max_tokens)
                OPS[mode, "refused"] += 1
                return
            self.mm.check_fits_ever(prompt_len, max_tokens)  # fits some day: must not raise
            ok = self.mm.can_admit(total)
            assert ok == self._expected_can_admit(total), (total, self.mm.usage(), self.cap)
            if not ok:
                before = self.mm.usage()
                with pytest.raises(RuntimeError, match="without can_admit"):
                    self.mm.admit(self.next_id, total)
                assert self.mm.usage() == before
                OPS[mode, "waited"] += 1
                return
            rid, self.next_id = self.next_id, self.next_id + 1
            alloc = self.mm.admit(rid, total)
            assert len(alloc.pages) == need
            assert len(alloc.draft_pages) == (need if self.paged_draft else 0)
            assert (alloc.ring is not None) == self.spec.uses_ring
            assert alloc.state_slot is not None
            assert self.mm.held[rid][0] is alloc
            self.model[rid] = total
            OPS[mode, "admitted"] += 1

        def _release_one(self, data, label):
            OPS[mode] += 1
            OPS[mode, label] += 1
            rid = data.draw(st.sampled_from(sorted(self.model)), label)
            self.mm.release(rid)
            del self.model[rid]
            assert rid not in self.mm.held

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def release(self, data):
            self._release_one(data, "release")

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def finish(self, data):  # a request reaching stop / length frees exactly what release frees
            self._release_one(data, "finish")

        # ---- invariants (checked after every operation) ----------------------------------------
        @invariant()
        def pools_consistent(self):
            mm = self.mm
            use = mm.usage()
            assert set(use) == set(POOLS)
            for k in POOLS:
                assert 0 <= use[k] <= self.cap[k], (k, use, self.cap)
            assert use == self._expected_usage(), (use, self._expected_usage())
            assert set(mm.held) == set(self.model)
            # usage() == the sum over held allocations
            allocs = [a for a, _ in mm.held.values()]
            held_ids = {
                "pages": [p for a in allocs for p in a.pages],
                "draft_pages": [p for a in allocs for p in a.draft_pages],
                "rings": [a.ring for a in allocs if a.ring is not None],
                "state_slots": [a.state_slot for a in allocs if a.state_slot is not None],
                "seqs": [s for _, s in mm.held.values()],
            }
            lists = {"pages": mm.pages, "draft_pages": mm.draft_pages, "rings": mm.rings,
                     "state_slots": mm.state_slots, "seqs": mm.seq_slots}
            for k, ids in held_ids.items():
                assert len(ids) == use[k], (k, len(ids), use)
                assert len(set(ids)) == len(ids), f"{k}: an id is held twice: {sorted(ids)}"
                assert all(0 <= i < self.cap[k] for i in ids), (k, ids)
                fl = lists[k]
                # held ids and free ids partition 0..capacity-1
                assert set(ids) == fl._used
                assert len(fl._free) == len(set(fl._free)) and not set(fl._free) & set(ids)
                assert set(fl._free) | set(ids) == set(range(fl.capacity))

        def teardown(self):
            if not hasattr(self, "mm"):
                return
            for rid in list(self.mm.held):
                self.mm.release(rid)
            assert self.mm.usage() == dict.fromkeys(POOLS, 0)
            for fl in (self.mm.pages, self.mm.draft_pages, self.mm.rings, self.mm.state_slots, self.mm.seq_slots):
                assert fl.num_free == fl.capacity

    MemoryMachine.__name__ = MemoryMachine.__qualname__ = f"MemoryMachine_{mode.replace('-', '_')}"
    return MemoryMachine


@pytest.mark.parametrize("mode", MEM_MODES)
def test_memory_manager_stateful(mode):
    for k in [k for k in OPS if k == mode or isinstance(k, tuple) and k[0] == mode]:
        del OPS[k]
    run_state_machine_as_test(
        make_machine(mode),
        settings=settings(max_examples=40, stateful_step_count=100, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), database=None),
    )
    assert OPS[mode] >= MIN_OPS_PER_MODE, f"only {OPS[mode]} operations ran in mode {mode}"
    kinds = {k[1]: v for k, v in OPS.items() if isinstance(k, tuple) and k[0] == mode}
    for kind in ("admitted", "refused", "waited", "release", "finish"):
        assert kinds.get(kind, 0) >= 100, (mode, kinds)  # every branch really exercised
    print(f"MemoryManager[{mode}]: {OPS[mode]} operations {kinds}")


# ==================================================================================================
# 2. Engine-level randomized add / step / abort
# ==================================================================================================

SPEC = SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2)
ENGINE_CASES = {
    # (preset, LLM kwargs, number of ops)
    "tiny-llama": dict(max_model_len=96, max_num_seqs=3, page_size=8, num_kv_pages=20),
    # 11 pages < 13 needed by a max_model_len request: the "KV pages" refusal is reachable too;
    # a small prefill chunk makes prompts prefill over several steps (aborts mid-prefill).
    "tiny-qwen3-next": dict(max_model_len=96, max_num_seqs=3, page_size=8, num_kv_pages=11, prefill_chunk=16),
}
NUM_OPS = 400


def _caps(mem) -> dict[str, int]:
    z = mem.sizes
    return {"pages": z.num_pages, "draft_pages": z.num_draft_pages, "rings": z.num_rings,
            "state_slots": z.num_state_slots, "seqs": mem.eng.max_num_seqs}


def _snapshot(eng) -> tuple:
    return (eng.memory.usage(), sorted(eng.requests), [r.id for r in eng.waiting], [r.id for r in eng.running],
            sorted(eng.memory.held))


def _check(eng, caps) -> None:
    use = eng.memory.usage()
    for k in POOLS:
        assert 0 <= use[k] <= caps[k], (k, use, caps)
    if not eng.has_unfinished():
        assert use == dict.fromkeys(POOLS, 0), f"idle engine holds memory: {use}"
    # only running requests hold memory, and usage() is exactly what they hold
    assert sorted(eng.memory.held) == sorted(r.id for r in eng.running)
    assert use["seqs"] == len(eng.running)
    assert use["pages"] == sum(len(r.alloc.pages) for r in eng.running)
    assert use["draft_pages"] == sum(len(r.alloc.draft_pages) for r in eng.running)
    for r in eng.waiting:
        assert r.status == Status.WAITING and r.alloc is None
    for r in eng.running:
        assert r.status in (Status.PREFILL, Status.DECODE) and r.alloc is not None
    for r in eng.requests.values():
        if r.status == Status.FINISHED:
            assert r.alloc is None and r not in eng.running and r not in eng.waiting


@pytest.fixture(scope="module", params=list(ENGINE_CASES))
def engine_case(request):
    # One intra-op thread: the tiny model's ops are far too small to gain from more, and with a
    # busy machine (2 cores) torch's thread pool makes every op 100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield request.param, LLM(request.param, spec=SPEC, **ENGINE_CASES[request.param])
    finally:
        torch.set_num_threads(threads)


def test_engine_random_ops_no_leak(engine_case):
    preset, llm = engine_case
    eng = llm.engine
    caps = _caps(eng.memory)
    L, vocab = eng.eng.max_model_len, eng.model.config.vocab_size
    rng = random.Random(1234)
    streamed: dict[int, list[int]] = {}
    params_of: dict[int, SamplingParams] = {}
    aborted: set[int] = set()
    ops = Counter()
    expected_id = 0

    def do_step():
        for out in eng.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            req = eng.requests[out.request_id]
            assert out.finished == (req.status == Status.FINISHED)
            if out.finished:
                assert out.finish_reason == req.finish_reason

    for _ in range(NUM_OPS):
        r = rng.random()
        if r < 0.35:  # add_request
            kind = rng.random()
            if kind < 0.2:  # can never fit: max_model_len (and, for small pools, the KV page count)
                n = rng.randint(1, L + 20)
                max_tokens = rng.randint(max(L - n + 1, 1), L + 20)
            elif kind < 0.25:  # within max_model_len, but more KV pages than the pool has (if any such)
                lo = caps["pages"] * eng.eng.page_size - SPEC.num_draft_tokens + 1
                total = rng.randint(min(lo, L), L) if lo <= L else rng.randint(L + 1, L + 20)
                n = rng.randint(max(total - 60, 1), total - 1)
                max_tokens = total - n
            elif kind < 0.3:  # malformed prompt
                n, max_tokens = 0, 4
            else:
                n, max_tokens = rng.randint(1, 60), rng.randint(1, 30)
            prompt = [rng.randrange(1, vocab) for _ in range(n)]
            if 0.25 <= kind < 0.3 and rng.random() < 0.5:
                prompt = [1, vocab + 3]  # out-of-range token id
            temp = rng.choice([0.0, 0.0, 0.8, 1.2])
            stop = tuple(rng.sample(range(1, vocab), rng.choice([0, 0, 3, 40])))
            params = SamplingParams(temperature=temp, top_k=rng.choice([0, 20]), max_tokens=max_tokens,
                                    stop_token_ids=stop, ignore_eos=rng.random() < 0.5, seed=rng.randrange(2**31))
            fits = (len(prompt) > 0 and all(0 <= t < vocab for t in prompt) and len(prompt) + max_tokens <= L
                    and math.ceil((len(prompt) + max_tokens + SPEC.num_draft_tokens) / eng.eng.page_size)
                    <= caps["pages"])
            before = _snapshot(eng)
            if fits:
                rid = eng.add_request(prompt, params)
                assert rid == expected_id  # refusals did not consume ids
                expected_id += 1
                params_of[rid] = params
                ops["add"] += 1
            else:
                with pytest.raises(WmtpError) as exc:
                    eng.add_request(prompt, params)
                if len(prompt) + max_tokens > L and prompt and all(0 <= t < vocab for t in prompt):
                    assert isinstance(exc.value, CapacityError) and "max_model_len" in str(exc.value)
                elif prompt and all(0 <= t < vocab for t in prompt):
                    assert isinstance(exc.value, CapacityError) and "KV pages" in str(exc.value)
                    ops["refused_pages"] += 1
                assert _snapshot(eng) == before, "a refused request changed engine state"
                ops["refused"] += 1
        elif r < 0.88:
            do_step()
            ops["step"] += 1
        else:  # abort a random live id (or, now and then, a finished / unknown one: a no-op)
            live = [r.id for r in (*eng.waiting, *eng.running)]
            if live and rng.random() < 0.85:
                rid = rng.choice(live)
                aborted.add(rid)
                ops["abort_live"] += 1
            else:
                rid = rng.choice([*eng.requests, 10**6]) if eng.requests else 10**6
                before = _snapshot(eng)
                was_finished = rid in eng.requests and eng.requests[rid].status == Status.FINISHED
                if was_finished or rid not in eng.requests:
                    eng.abort(rid)
                    assert _snapshot(eng) == before
                    ops["abort_noop"] += 1
                    _check(eng, caps)
                    continue
                aborted.add(rid)
                ops["abort_live"] += 1
            eng.abort(rid)
            assert eng.requests[rid].status == Status.FINISHED
        _check(eng, caps)

    # drain
    drain_steps = 0
    while eng.has_unfinished():
        do_step()
        _check(eng, caps)
        drain_steps += 1
        assert drain_steps < 2_000, "engine does not drain"
    assert eng.memory.usage() == dict.fromkeys(POOLS, 0), f"leaked: {eng.memory.usage()}"
    assert not eng.memory.held
    for name in ("pages", "draft_pages", "rings", "state_slots", "seq_slots"):
        fl = getattr(eng.memory, name)
        assert fl.num_free == fl.capacity and not fl._used, f"leaked {name}"

    reasons = Counter()
    for rid, req in eng.requests.items():
        assert req.status == Status.FINISHED
        assert req.finish_reason in {"stop", "length", "abort"}, (rid, req.finish_reason)
        reasons[req.finish_reason] += 1
        gen = req.tokens[len(req.prompt):]
        p = params_of[rid]
        assert len(gen) <= p.max_tokens
        assert streamed.get(rid, []) == gen, f"request {rid}: streamed tokens differ from its output"
        if req.finish_reason == "abort":
            assert rid in aborted
        elif req.finish_reason == "length":
            assert len(gen) == p.max_tokens
        else:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eng.stop_ids))
            assert gen and gen[-1] in stops and not set(gen[:-1]) & stops
    total_ops = sum(v for k, v in ops.items() if k in ("add", "refused", "step", "abort_live", "abort_noop"))
    assert total_ops == NUM_OPS
    assert ops["add"] >= 30 and ops["refused"] >= 5 and ops["abort_live"] >= 5, ops
    assert reasons["length"] and reasons["abort"], reasons
    if caps["pages"] < math.ceil((L + SPEC.num_draft_tokens) / eng.eng.page_size):
        assert ops["refused_pages"] >= 1, ops
    print(f"{preset}: ops={dict(ops)} drain_steps={drain_steps} finish={dict(reasons)}")
