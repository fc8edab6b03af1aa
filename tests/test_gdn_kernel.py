"""The Triton recurrent gated delta rule (decode / verify) against its twin, TorchBackend.gated_delta_net:
outputs, the states left in the pool slots, the per-token inputs a verify records, and the rollback
that replays them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.models.backend import TorchBackend, TritonBackend  # noqa: E402
from wmtp.models.context import ForwardContext  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gate_inputs(T, hk, hv, g):
    """A fused ``in_proj_ba`` output [T, hk, 2r] ([b | a] per k-head, as the checkpoint lays it out)
    and the layer's A_log, dt_bias [hv]; decays exp(g) land in about (0.1, 1)."""
    ba = torch.randn(T, hk, 2 * (hv // hk), generator=g)
    A_log = torch.empty(hv).uniform_(0.1, 1.0, generator=g).log()
    return {"ba": ba, "A_log": A_log, "dt_bias": torch.randn(hv, generator=g) * 0.5}


def _split_ba(t):
    """Replaces ``ba`` by its strided [T, G, R] views b, a (what ``GatedDeltaNet._project`` hands on)."""
    ba = t.pop("ba")
    t["b"], t["a"] = ba.split(ba.shape[-1] // 2, dim=-1)
    return t


def _inputs(q_lens, hk=2, hv=4, dk=16, dv=24, kernel=4, slots=(3, 0, 5), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = sum(q_lens)
    conv_dim = 2 * hk * dk + hv * dv
    t = {
        "mixed_qkv": torch.randn(T, conv_dim, generator=g),
        **_gate_inputs(T, hk, hv, g),
        "conv_weight": torch.randn(conv_dim, kernel, generator=g) * 0.5,
        "conv_state": torch.randn(6, conv_dim, kernel - 1, generator=g),
        "ssm_state": torch.randn(6, hv, dk, dv, generator=g) * 0.1,
    }
    t = _split_ba({k: v.to(DEVICE, torch.float32 if k == "ssm_state" else dtype) for k, v in t.items()})
    ctx = dict(q_starts=[10] * len(q_lens), q_lens=list(q_lens),
               state_slots=torch.tensor(slots[: len(q_lens)], device=DEVICE), device=DEVICE)
    return t, ctx, (hk, hv, dk, dv, kernel)


@pytest.mark.parametrize("record,q_lens", [(False, [1]), (False, [5, 1, 3]), (False, [7, 7]),
                                           (True, [1]), (True, [7, 7]), (True, [3, 3, 3])])
def test_recurrent_kernel_matches_reference(q_lens, record):
    t, ctx, dims = _inputs(q_lens)
    ref = {k: v.clone() for k, v in t.items()}  # a, b become contiguous: the reference takes any layout
    c_ref = ForwardContext(**ctx, record_states=record)
    c_tri = ForwardContext(**ctx, record_states=record)
    want = TorchBackend().gated_delta_net(**{k: ref[k] for k in ref}, ctx=c_ref, layer_idx=0, dims=dims)
    got = TritonBackend().gated_delta_net(**{k: t[k] for k in t}, ctx=c_tri, layer_idx=0, dims=dims)
    assert (got - want).abs().max().item() < 1e-5
    assert (t["ssm_state"] - ref["ssm_state"]).abs().max().item() < 1e-5  # untouched slots too
    assert torch.equal(t["conv_state"], ref["conv_state"])
    if record:  # a verify leaves the states alone and records each token's inputs
        start = _inputs(q_lens)[0]
        assert torch.equal(t["ssm_state"], start["ssm_state"]) and torch.equal(t["conv_state"], start["conv_state"])
        (w_got, r_got), (w_ref, r_ref) = c_tri.recorded[0], c_ref.recorded[0]
        assert w_got.shape == w_ref.shape and r_got.shape == r_ref.shape == (sum(q_lens), 2 * 16 + 4 * (24 + 2))
        assert torch.equal(w_got, w_ref)
        assert (r_got - r_ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("record", [False, True])
def test_reference_batch_equals_one_request_at_a_time(record):
    """The twin runs a batch of equal-length requests (decode, verify) as one recurrence over all
    their heads: the same outputs, slot states and records as each request alone."""
    q_lens = [3, 3, 3]
    t, ctx, dims = _inputs(q_lens, seed=4)
    alone = {k: v.clone() for k, v in t.items()}
    batch_ctx = ForwardContext(**ctx, record_states=record)
    got = TorchBackend().gated_delta_net(**t, ctx=batch_ctx, layer_idx=0, dims=dims)
    for b in range(len(q_lens)):
        rows = slice(3 * b, 3 * b + 3)
        one = {k: v[rows] if k in ("mixed_qkv", "a", "b") else v for k, v in alone.items()}
        c1 = ForwardContext(q_starts=[10], q_lens=[3], state_slots=ctx["state_slots"][b : b + 1], device=DEVICE,
                            record_states=record)
        want = TorchBackend().gated_delta_net(**one, ctx=c1, layer_idx=0, dims=dims)
        assert (got[rows] - want).abs().max().item() < 1e-6
        if record:
            (w_b, r_b), (w_1, r_1) = batch_ctx.recorded[0], c1.recorded[0]
            assert torch.equal(w_b[b], w_1[0]) and (r_b[rows] - r_1).abs().max().item() < 1e-6
    assert (t["ssm_state"] - alone["ssm_state"]).abs().max().item() < 1e-6
    assert torch.equal(t["conv_state"], alone["conv_state"])


def test_record_needs_equal_lengths():
    t, ctx, dims = _inputs([2, 3])
    with pytest.raises(ValueError, match="same q_len"):
        TritonBackend().gated_delta_net(**t, ctx=ForwardContext(**ctx, record_states=True), layer_idx=0, dims=dims)


def _reference_recurrent(q, k, v, a, b, A_log, dt_bias, state):
    """One request through ``torch_gdn``: gates, k-heads repeated to the v-heads, then the delta rule
    a token at a time. Returns o [n, HV, Dv] and the fp32 state after every token [n, HV, Dk, Dv]."""
    from wmtp.kernels.torch_gdn import gated_delta_rule_recurrent, gdn_gates

    group = v.shape[1] // q.shape[1]
    g, beta = gdn_gates(a.flatten(1), b.flatten(1), A_log, dt_bias)
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    outs, states = [], []
    for t in range(q.shape[0]):
        o, state = gated_delta_rule_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                              beta[t : t + 1], state)
        outs.append(o)
        states.append(state)
    return torch.cat(outs), torch.stack(states)


# Half precision checks that beta is rounded to b's dtype before use, as the reference's is. The
# Triton interpreter truncates fp32 -> bf16 (GPUs round to nearest, as torch), so bf16 runs on GPUs.
_BF16_GPU = pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                      reason="needs CUDA")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, _BF16_GPU])
@pytest.mark.parametrize("block_v", [16, 32])
@pytest.mark.parametrize("record", [False, True])
def test_gdn_decode_matches_reference(record, block_v, dtype):
    """gdn_decode (conv + delta rule, one launch) against causal_conv1d then the delta rule per
    request: x a strided column view of a wider packed projection, g / beta from strided a, b
    views of a fused ba projection, GVA (HV = 2 HK), requests of different q_len (equal when
    recording), Dv not a multiple of block_v, a + dt_bias past softplus' threshold. Checks o, the
    ssm and conv states left in the slots (others untouched), and the recorded windows and states."""
    from wmtp.kernels.gdn import gdn_decode
    from wmtp.kernels.torch_gdn import causal_conv1d, gdn_gates, verify_record

    gen = torch.Generator().manual_seed(block_v + record)
    q_lens = [3, 3, 3] if record else [5, 1, 3]
    slots, hk, hv, dk, dv = [4, 0, 2], 2, 4, 16, 40
    T, C = sum(q_lens), 2 * hk * dk + hv * dv
    t = _gate_inputs(T, hk, hv, gen)
    t["ba"][0, 1, 2] = 30.0  # a of v-head 2 at token 0: softplus(x) = x beyond 20
    packed = torch.randn(T, C + 9, generator=gen)
    t = {**t, "conv_weight": torch.randn(C, 4, generator=gen) * 0.5, "conv_state": torch.randn(5, C, 3, generator=gen)}
    t = _split_ba({k: x.to(DEVICE, dtype) for k, x in t.items()})
    x = packed.to(DEVICE, dtype)[:, :C]  # rows strided, as the packed in_proj's view
    state = (torch.randn(5, hv, dk, dv, generator=gen) * 0.1).to(DEVICE)
    conv_state, want_state, want_conv = t["conv_state"], state.clone(), t["conv_state"].clone()
    old_conv = conv_state.clone()
    offs = [sum(q_lens[:i]) for i in range(len(q_lens))]
    i32 = dict(device=DEVICE, dtype=torch.int32)
    old_state = state.clone()
    o, win, rec = gdn_decode(x, t["conv_weight"], conv_state, t["a"], t["b"], t["A_log"], t["dt_bias"], state,
                             torch.tensor(slots, device=DEVICE), torch.tensor(offs, **i32), torch.tensor(q_lens, **i32),
                             q_lens[0] if record else None, block_v=block_v)
    assert (rec is not None) == (win is not None) == record
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # half precision: a conv output may land an ulp apart from torch's at a rounding boundary
    state_tol = 1e-5 if dtype == torch.float32 else 1e-3
    for b, (lo, n, slot) in enumerate(zip(offs, q_lens, slots)):
        rows = slice(lo, lo + n)
        y, want_conv[slot] = causal_conv1d(x[rows], t["conv_weight"], old_conv[slot])
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        o_ref, s_ref = _reference_recurrent(q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv), t["a"][rows],
                                            t["b"][rows], t["A_log"], t["dt_bias"], want_state[slot])
        want_state[slot] = s_ref[-1]
        assert (o[rows].float() - o_ref.float()).abs().max().item() < tol
        if record:  # k (normalised, per k-head), v, g, beta as the delta rule used them
            want_rec = verify_record(q.view(n, hk, dk).repeat_interleave(hv // hk, 1),
                                     k.view(n, hk, dk).repeat_interleave(hv // hk, 1), v.view(n, hv, dv),
                                     *gdn_gates(t["a"][rows].flatten(1), t["b"][rows].flatten(1), t["A_log"],
                                                t["dt_bias"]), hk)
            assert (rec[rows] - want_rec.float()).abs().max().item() < state_tol
            assert torch.equal(win[b, :3], old_conv[slot].T)  # the old context (oldest first), then the inputs
            assert torch.equal(win[b, 3:], x[rows])
    if record:  # the slots keep the states from before the verify
        assert torch.equal(state, old_state) and torch.equal(conv_state, old_conv)
    else:
        assert (state - want_state).abs().max().item() < state_tol
        assert torch.equal(conv_state, want_conv)


def test_gdn_decode_rejects_bad_input():
    from wmtp.kernels.gdn import gdn_decode

    T, hk, hv, dk, dv = 2, 1, 2, 16, 8
    C = 2 * hk * dk + hv * dv
    t = _split_ba(_gate_inputs(T, hk, hv, torch.Generator().manual_seed(0)))
    x, w, conv = torch.zeros(T, C), torch.zeros(C, 4), torch.zeros(3, C, 3)
    i32 = dict(dtype=torch.int32)
    tail = (torch.zeros(3, hv, dk, dv), torch.tensor([0]), torch.tensor([0], **i32), torch.tensor([T], **i32))
    with pytest.raises(ValueError, match="gdn_decode: a"):
        gdn_decode(x, w, conv, t["a"], t["b"], t["A_log"][:-1], t["dt_bias"], *tail)
    with pytest.raises(ValueError, match="block_v=24"):
        gdn_decode(x, w, conv, t["a"], t["b"], t["A_log"], t["dt_bias"], *tail, block_v=24)
    with pytest.raises(ValueError, match="gdn_decode: conv_weight"):
        gdn_decode(x, w[:, :3], conv, t["a"], t["b"], t["A_log"], t["dt_bias"], *tail)
    with pytest.raises(ValueError, match=r"gdn_decode: x \(2, 47\) must hold q \| k \| v"):
        gdn_decode(x[:, :-1], w, conv, t["a"], t["b"], t["A_log"], t["dt_bias"], *tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, _BF16_GPU])
@pytest.mark.parametrize("T", [1, 2, 5, 70])
def test_conv_prefill_matches_reference(T, dtype):
    """One prefill piece's conv + SiLU (kernel 4) against causal_conv1d: outputs and the new context,
    rows strided (a view into the packed projection), C past a channel block; pieces shorter than
    the context mix the old context into the new one."""
    from wmtp.kernels.gdn import causal_conv1d_prefill
    from wmtp.kernels.torch_gdn import causal_conv1d

    g = torch.Generator().manual_seed(T)
    C = 200
    x = torch.randn(T, C + 56, generator=g).to(DEVICE, dtype)[:, :C]
    w = (torch.randn(C, 4, generator=g) * 0.5).to(DEVICE, dtype)
    state = torch.randn(C, 3, generator=g).to(DEVICE, dtype)
    want, want_state = causal_conv1d(x, w, state)
    got, got_state = causal_conv1d_prefill(x, w, state, block_t=16, block_c=128)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(got_state, want_state)


def test_conv_prefill_rejects_other_kernel_sizes():
    from wmtp.kernels.gdn import causal_conv1d_prefill

    with pytest.raises(ValueError, match=r"causal_conv1d_prefill: weight \(8, 3\) must be \[8, 4\]"):
        causal_conv1d_prefill(torch.zeros(5, 8), torch.zeros(8, 3), torch.zeros(8, 2))


def test_long_pieces_without_fla_use_the_reference():
    """Prefill-sized pieces go to the chunked reference path where fla is absent (same numbers)."""
    from wmtp.kernels.gdn import fla_available

    t, ctx, dims = _inputs([40])
    if fla_available(torch.device(DEVICE)):
        pytest.skip("fla installed: long pieces take fla's chunked kernel (tested below)")
    ref = {k: v.clone() for k, v in t.items()}
    want = TorchBackend().gated_delta_net(**ref, ctx=ForwardContext(**ctx), layer_idx=0, dims=dims)
    got = TritonBackend().gated_delta_net(**t, ctx=ForwardContext(**ctx), layer_idx=0, dims=dims)
    assert torch.equal(got, want)


def test_fla_prefill_shares_one_varlen_table_a_forward(monkeypatch):
    """Every GDN layer of a forward hands fla the same cu_seqlens and chunk table (built on the host and
    queued to the device once, so fla neither copies them with a sync nor per layer), the table at the
    chunk size it is handed; the next forward gets its own. fla's functions are stand-ins here that
    record what they get (its kernels are checked on a GPU below)."""
    import sys
    import types

    from wmtp.kernels.gdn import gdn_chunked_fla

    seen, tables = [], []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                               chunk_size, **kw):
        seen.append((cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size))
        return torch.zeros_like(v), initial_state

    def prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        tables.append((cu_seqlens.tolist(), chunk_size, cu_seqlens_cpu.device.type))
        return torch.full((len(tables), 2), len(tables))

    for name, fn in [("gated_delta_rule", chunk_gated_delta_rule), ("utils.index", prepare_chunk_indices)]:
        fake = types.ModuleType(f"fla.ops.{name}")
        setattr(fake, fn.__name__, fn)
        monkeypatch.setitem(sys.modules, f"fla.ops.{name}", fake)
    hk, hv, dk, dv = 1, 2, 4, 4
    ssm = torch.zeros(3, hv, dk, dv)
    for forward in range(2):
        ctx = ForwardContext([0, 0], [3, 5], None, state_slots=torch.tensor([0, 2]))
        for _layer in range(2):
            gdn_chunked_fla(torch.randn(8, 2 * hk * dk + hv * dv), torch.zeros(8, hv), torch.ones(8, hv), ssm, ctx,
                            (hk, hv, dk, dv, 4))
    assert all(a is b for a, b in zip(seen[0][:3], seen[1][:3])) and all(a is not b for a, b in zip(seen[0][:3], seen[2][:3]))
    chunk = seen[0][3]
    assert tables == [([0, 3, 8], chunk, "cpu")] * 2 and all(s[3] == chunk for s in seen)
    assert seen[0][1].tolist() == [0, 3, 8] and torch.equal(seen[2][0], seen[0][1])
    assert seen[0][2].tolist() == [[1, 1]] and seen[2][2].tolist() == [[2, 2]] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_matches_reference_gpu(dtype):
    """Prefill pieces of several requests (varlen) through fla's chunked kernel, GVA (8 v-heads
    over 2 k-heads), starting from non-zero states: outputs and final states vs the reference."""
    from wmtp.kernels.gdn import fla_available

    if not fla_available(torch.device("cuda")):
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    t, ctx, dims = _inputs([200, 37, 129], hk=2, hv=8, dk=64, dv=64, dtype=dtype)
    ref = {k: v.clone() for k, v in t.items()}
    want = TorchBackend().gated_delta_net(**ref, ctx=ForwardContext(**ctx), layer_idx=0, dims=dims)
    got = TritonBackend().gated_delta_net(**t, ctx=ForwardContext(**ctx), layer_idx=0, dims=dims)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert (got.float() - want.float()).abs().max().item() < tol * max(1.0, want.abs().max().item())
    assert (t["ssm_state"] - ref["ssm_state"]).abs().max().item() < tol * max(1.0, ref["ssm_state"].abs().max().item())
    assert torch.equal(t["conv_state"], ref["conv_state"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_35b_shape_gpu():
    """16 k-heads / 32 v-heads of dim 128, bf16 activations, fp32 state, verify of d = 7."""
    t, ctx, dims = _inputs([7], hk=16, hv=32, dk=128, dv=128, dtype=torch.bfloat16)
    ref = {k: v.clone() for k, v in t.items()}
    want = TorchBackend().gated_delta_net(**ref, ctx=ForwardContext(**ctx, record_states=True), layer_idx=0, dims=dims)
    got = TritonBackend().gated_delta_net(**t, ctx=ForwardContext(**ctx, record_states=True), layer_idx=0, dims=dims)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    assert (t["ssm_state"] - ref["ssm_state"]).abs().max().item() < 1e-3


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_gates_kernel_matches_reference(layout):
    """GDN gates in one launch from strided [T, G, R] views of the projections (no reshape copies)."""
    from wmtp.kernels.gdn import gdn_gates
    from wmtp.kernels.torch_gdn import gdn_gates as reference

    g = torch.Generator().manual_seed(0)
    T, hk, r = 5, 3, 4
    hv = hk * r
    ba = (torch.randn(T, hk, 2 * r, generator=g) * 8).to(DEVICE)  # wide range: softplus threshold, both sides
    A_log, dt_bias = torch.randn(hv, generator=g).to(DEVICE), torch.randn(hv, generator=g).to(DEVICE)
    if layout == "fused":
        b, a = ba.split([r, r], dim=-1)  # [T, hk, r] strided views
    else:
        b, a = ba[:, :, :r].reshape(T, 1, hv), ba[:, :, r:].reshape(T, 1, hv)
    want_g, want_beta = reference(a.reshape(T, hv), b.reshape(T, hv), A_log, dt_bias)
    got_g, got_beta = gdn_gates(a, b, A_log, dt_bias)
    assert torch.allclose(got_g, want_g, atol=1e-5, rtol=1e-5) and torch.allclose(got_beta, want_beta, atol=1e-6)
    with pytest.raises(ValueError, match="gdn_gates"):
        gdn_gates(a, b, A_log[:-1], dt_bias)


@pytest.mark.parametrize("dtype,dv", [(torch.float32, 8), (torch.bfloat16, 40)])
def test_rollback_kernel_matches_reference(dtype, dv):
    """The one-launch rollback (each request's state replayed from its slot through its accepted
    tokens' recorded inputs, conv windows copied, every layer) against the reference; other slots
    untouched. dv 40 spans three value blocks (the last partial), GVA (HV = 2 HK)."""
    from wmtp.kernels.gdn import rollback_states
    from wmtp.kernels.torch_gdn import l2_normalize, record_width
    from wmtp.kernels.torch_gdn import rollback_states as reference

    g = torch.Generator().manual_seed(dv)
    L, slots_n, B, n, HK, HV, DK, C, km1 = 3, 6, 2, 4, 2, 4, 32, 40, 3
    conv = torch.randn(L, slots_n, C, km1, generator=g).to(DEVICE, dtype)
    ssm = (torch.randn(L, slots_n, HV, DK, dv, generator=g) * 0.1).to(DEVICE)
    rows = B * n + 1  # one spare row, as the pool's
    k = l2_normalize(torch.randn(L, rows, HK, DK, generator=g)).flatten(2)
    v = torch.randn(L, rows, HV * dv, generator=g)
    gate = -torch.rand(L, rows, HV, generator=g)  # log decays <= 0
    beta = torch.rand(L, rows, HV, generator=g)
    rec = torch.cat([k, v, gate, beta], dim=2).to(DEVICE)
    assert rec.shape[2] == record_width(HK, DK, HV, dv)
    win = torch.randn(L, B + 1, km1 + n, C, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([4, 1], device=DEVICE)
    # accepted as a strided column (as the decode graphs' results buffer holds it): the kernel must not
    # read it as contiguous
    accepted = torch.tensor([[3, 9], [0, 9]], device=DEVICE)[:, 0]
    before, want_conv, want_ssm = ssm.clone(), conv.clone(), ssm.clone()
    reference(want_conv, want_ssm, rec, win, slots, accepted, n)
    rollback_states(conv, ssm, rec, win, slots, accepted, n)
    assert torch.equal(conv, want_conv)
    assert (ssm - want_ssm).abs().max().item() < 1e-5
    others = [0, 2, 3, 5]
    assert torch.equal(ssm[:, others], before[:, others])
    assert all((ssm[:, s] - before[:, s]).abs().max() > 1e-3 for s in (4, 1))  # both replayed (1 and 4 tokens)
    with pytest.raises(ValueError, match="rollback_states: conv"):
        rollback_states(conv, ssm, rec[:, :B * n - 1], win, slots, accepted, n)
    with pytest.raises(ValueError, match="record_width"):
        rollback_states(conv, ssm, rec[..., 1:], win, slots, accepted, n)


@pytest.mark.parametrize("accepted", [[0, 6], [3, 2], [6, 6]])
def test_rollback_replays_the_verify_exactly(accepted):
    """A verify of 7 tokens (recording) rolled back to ``accepted`` leaves the states that decoding
    the accepted tokens one at a time leaves (the replay runs the verify's steps at its tile), for
    every layer and request: bit for bit on the CPU; on the H200 a few elements differ in the last
    bits (the two kernels' reductions may take different register layouts), so there within 2e-6."""
    from wmtp.kernels.gdn import gdn_decode, rollback_states
    from wmtp.kernels.torch_gdn import record_width

    n, B, slots = 7, 2, [3, 0]
    hk, hv, dk, dv = 2, 4, 16, 24
    L = 2
    gen = torch.Generator().manual_seed(sum(accepted))
    C = 2 * hk * dk + hv * dv
    conv0 = torch.randn(L, 5, C, 3, generator=gen).to(DEVICE)
    ssm0 = (torch.randn(L, 5, hv, dk, dv, generator=gen) * 0.1).to(DEVICE)
    layers = [{"x": torch.randn(B * n, C, generator=gen).to(DEVICE), **_split_ba(_gate_inputs(B * n, hk, hv, gen)),
               "conv_weight": (torch.randn(C, 4, generator=gen) * 0.5).to(DEVICE)} for _ in range(L)]
    for lay in layers:
        for key in ("a", "b", "A_log", "dt_bias"):
            lay[key] = lay[key].to(DEVICE)
    i32 = dict(device=DEVICE, dtype=torch.int32)
    slot_t = torch.tensor(slots, device=DEVICE)
    conv, ssm = conv0.clone(), ssm0.clone()
    tokens = torch.empty(L, B * n, record_width(hk, dk, hv, dv), device=DEVICE)
    windows = torch.empty(L, B, 3 + n, C, device=DEVICE)
    for l, lay in enumerate(layers):
        gdn_decode(lay["x"], lay["conv_weight"], conv[l], lay["a"], lay["b"], lay["A_log"], lay["dt_bias"], ssm[l],
                   slot_t, torch.tensor([0, n], **i32), torch.tensor([n, n], **i32), n, (tokens[l], windows[l]))
    rollback_states(conv, ssm, tokens, windows, slot_t, torch.tensor(accepted, device=DEVICE), n)
    want_conv, want_ssm = conv0.clone(), ssm0.clone()
    for l, lay in enumerate(layers):
        for b, a in enumerate(accepted):
            for t in range(a + 1):  # one token per launch, as a dense decode runs
                r = slice(b * n + t, b * n + t + 1)
                gdn_decode(lay["x"][r], lay["conv_weight"], want_conv[l], lay["a"][r], lay["b"][r], lay["A_log"],
                           lay["dt_bias"], want_ssm[l], slot_t[b : b + 1], torch.tensor([0], **i32),
                           torch.tensor([1], **i32))
    err = (ssm - want_ssm).abs().max().item()
    assert err <= (0.0 if DEVICE == "cpu" else 2e-6), f"replayed state off by {err:.3g}"
    assert torch.equal(conv, want_conv)
