"""Sampling params, filtering, greedy verification and the exactness of speculative sampling (DESIGN §5).

The statistical test simulates one speculative iteration (g = 2 drafts) on a tiny vocabulary whose
target distributions depend on the previously emitted tokens, completes the output to three tokens by
plain target sampling, and compares the empirical JOINT distribution of (t1, t2, t3) with the exact
target joint by a chi-square test. The same harness with deliberately broken acceptance rules must
fail, so a pass means something.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import broken_accept_q_over_p, broken_accept_resample_p, chi2_pvalue
from wmtp.errors import WmtpError
from wmtp.engine.sampling import (
    SamplingParams,
    accept_greedy,
    accept_speculative,
    filtered_probs,
    make_generator,
    sample,
)

# --------------------------------------------------------------------------------------------------
# SamplingParams


def test_params_defaults_and_greedy() -> None:
    sp = SamplingParams()
    assert sp.greedy and sp.top_k == 0 and sp.top_p == 1.0 and sp.max_tokens == 16
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=0).greedy


def test_params_stop_ids_normalised_and_frozen() -> None:
    sp = SamplingParams(stop_token_ids=[3, 0, 7])  # type: ignore[arg-type]
    assert sp.stop_token_ids == (3, 0, 7) and isinstance(sp.stop_token_ids, tuple)
    assert hash(sp) == hash(SamplingParams(stop_token_ids=(3, 0, 7)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.top_k = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": [1, 2.0]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_params_reject_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(WmtpError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    value = next(iter(kwargs.values()))
    shown = repr(value[-1] if isinstance(value, list) else value)
    assert shown in str(info.value)  # the offending value is named too


# --------------------------------------------------------------------------------------------------
# filtered_probs


def test_greedy_one_hot_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    probs = filtered_probs(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(sample(probs, None), torch.tensor([1, 0]))


def test_temperature_only_is_softmax() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = filtered_probs(logits, SamplingParams(temperature=0.6))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float() / 0.6, dim=-1))


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    probs = filtered_probs(logits, SamplingParams(temperature=1.3, top_k=7))
    kept = probs > 0
    assert torch.equal(kept.sum(-1), torch.full((8,), 7))
    top = torch.topk(logits, 7, dim=-1).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(-1, top, True))
    ref = torch.softmax((logits / 1.3).masked_fill(~kept, float("-inf")), dim=-1)
    torch.testing.assert_close(probs, ref)


def test_top_k_ties_kept_and_large_k_is_off() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert torch.equal(filtered_probs(logits, SamplingParams(temperature=1.0, top_k=1)) > 0,
                       torch.tensor([[False, True, True, False]]))
    full = filtered_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(filtered_probs(logits, SamplingParams(temperature=1.0, top_k=9)), full)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.77, 0.9, 0.999])
def test_top_p_keeps_minimal_nucleus(top_p: float) -> None:
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(3)) * 2
    base = torch.softmax(logits, dim=-1)
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    for row in range(logits.shape[0]):
        sorted_p, order = torch.sort(base[row], descending=True)
        m = int((torch.cumsum(sorted_p, 0) < top_p).sum()) + 1  # smallest prefix with mass >= top_p
        m = min(m, base.shape[1])
        kept = probs[row] > 0
        assert int(kept.sum()) == m
        assert bool(kept[order[:m]].all())
        torch.testing.assert_close(probs[row][kept], base[row][kept] / base[row][kept].sum())


def test_top_p_always_keeps_one_token() -> None:
    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal((probs > 0).sum(-1), torch.tensor([1, 1]))
    assert probs[0, 0] == 1.0


def test_top_k_then_top_p_order() -> None:
    # top-k first (keep 3: mass renormalised), then the nucleus of the renormalised distribution.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    # after top-k: [4/9, 3/9, 2/9, 0]; 4/9 < 0.7 <= 7/9 -> keep two tokens
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.01, 1.0),
)
def test_rows_sum_to_one(seed: int, temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(seed)) * 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = filtered_probs(logits, params)
    assert probs.shape == logits.shape and bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert bool(((probs > 0).sum(-1) >= 1).all())
    # the argmax token always survives the filters
    assert bool(probs.gather(-1, logits.argmax(-1, keepdim=True)).gt(0).all())


def test_filtered_probs_rejects_bad_logits() -> None:
    with pytest.raises(WmtpError, match="logits"):
        filtered_probs(torch.zeros(3, 0), SamplingParams(temperature=1.0))
    with pytest.raises(WmtpError, match="logits"):
        filtered_probs(torch.zeros(3, 4, dtype=torch.int64), SamplingParams(temperature=1.0))


# --------------------------------------------------------------------------------------------------
# accept_greedy


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: bonus after d_g
        ([1, 6, 7], [5, 6, 7, 8], (0, 5)),  # first rejected
        ([5, 6, 9], [5, 6, 7, 8], (2, 7)),  # middle
        ([5, 0, 7], [5, 6, 7, 8], (1, 6)),  # later match after a mismatch does not count
        ([], [4], (0, 4)),  # no drafts
    ],
)
def test_accept_greedy(draft: list[int], target: list[int], expected: tuple[int, int]) -> None:
    got = accept_greedy(torch.tensor(draft, dtype=torch.int64), torch.tensor(target))
    assert got == expected and all(type(x) is int for x in got)


def test_accept_greedy_shape_errors() -> None:
    with pytest.raises(WmtpError, match="target_argmax"):
        accept_greedy(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(WmtpError, match="draft_tokens"):
        accept_greedy(torch.tensor([[1, 2]]), torch.tensor([1, 2, 3]))


# --------------------------------------------------------------------------------------------------
# accept_speculative: unit behaviour


def test_speculative_with_one_hot_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    v = 9
    for trial in range(50):
        tg = torch.Generator().manual_seed(100 + trial)
        target = torch.randint(0, v, (4,), generator=tg)
        noise = torch.randint(0, v, (3,), generator=tg)
        draft = torch.where(torch.rand(3, generator=tg) < 0.6, target[:3], noise)
        p = torch.nn.functional.one_hot(target, v).float()
        q = torch.nn.functional.one_hot(draft, v).float()
        assert accept_speculative(draft, q, p, gen) == accept_greedy(draft, target)


def test_speculative_reproducible_with_seed() -> None:
    tg = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(3, 7, generator=tg), -1)
    p = torch.softmax(torch.randn(4, 7, generator=tg), -1)
    d = torch.multinomial(q, 1, generator=tg).squeeze(-1)
    gens = (make_generator(7), make_generator(7))
    runs = [[accept_speculative(d, q, p, g) for _ in range(30)] for g in gens]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


def test_speculative_zero_residual_falls_back_to_p() -> None:
    # q >= p everywhere (q unnormalised): rejection leaves an all-zero residual -> sample from p.
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 2.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    results = {accept_speculative(torch.tensor([1]), q, p, gen) for _ in range(200)}
    assert (0, 1) in results  # rejected, resampled from p[0]
    assert {r for r in results if r[0] == 0} == {(0, 1)}


def test_speculative_never_accepts_zero_target_prob() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.9, 0.05, 0.05]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        a, tok = accept_speculative(torch.tensor([0]), q, p, gen)
        assert a == 0 and tok in (1, 2)


def test_speculative_shape_errors() -> None:
    d = torch.tensor([1, 2])
    with pytest.raises(WmtpError, match="p_probs"):
        accept_speculative(d, torch.rand(2, 5), torch.rand(2, 5), None)
    with pytest.raises(WmtpError, match="q_probs"):
        accept_speculative(d, torch.rand(2, 4), torch.rand(3, 5), None)
    with pytest.raises(WmtpError, match="q_probs"):
        accept_speculative(d, torch.rand(1, 5), torch.rand(3, 5), None)


# --------------------------------------------------------------------------------------------------
# accept_speculative: exactness (statistical)

AcceptFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Generator | None"], "tuple[int, int]"]

V = 6
N_DRAWS = 30_000


def _chain_tables(params: SamplingParams, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Target tables p1[V], P2[t1] and P3[t1, t2]; draft tables q1[V], Q2[d1]; all filtered by params."""
    gen = torch.Generator().manual_seed(seed)
    logit = {
        "p1": torch.randn(1, V, generator=gen) * 1.5,
        "p2": torch.randn(V, V, generator=gen) * 1.5,
        "p3": torch.randn(V * V, V, generator=gen) * 1.5,
    }
    # the draft: correlated with the target (so both drafts get accepted often enough) but clearly off
    logit["q1"] = logit["p1"] + torch.randn(1, V, generator=gen) * 1.5
    logit["q2"] = logit["p2"] + torch.randn(V, V, generator=gen) * 1.5
    t = {k: filtered_probs(x, params) for k, x in logit.items()}
    return {"p1": t["p1"][0], "p2": t["p2"], "p3": t["p3"].view(V, V, V), "q1": t["q1"][0], "q2": t["q2"]}


def _simulate(
    accept: AcceptFn, tab: dict[str, torch.Tensor], n: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """n independent speculative iterations with g = 2, each completed to 3 tokens by target sampling.

    Returns (counts of the 3-token joint [V**3], histogram of accepted drafts [3]).
    """
    gen = torch.Generator().manual_seed(seed)
    p1, p2, p3, q1, q2 = tab["p1"], tab["p2"], tab["p3"], tab["q1"], tab["q2"]
    d1 = torch.multinomial(q1.expand(n, V), 1, replacement=True, generator=gen).squeeze(-1)
    d2 = torch.multinomial(q2[d1], 1, generator=gen).squeeze(-1)
    drafts = torch.stack([d1, d2], dim=1)
    q_rows = torch.stack([q1.expand(n, V), q2[d1]], dim=1)  # [n, 2, V]
    p_rows = torch.stack([p1.expand(n, V), p2[d1], p3[d1, d2]], dim=1)  # [n, 3, V]

    out = torch.full((n, 3), -1, dtype=torch.int64)
    accepted = np.zeros(n, dtype=np.int64)
    for i in range(n):
        a, tok = accept(drafts[i], q_rows[i], p_rows[i], gen)
        out[i, :a] = drafts[i, :a]
        out[i, a] = tok
        accepted[i] = a
    # continuation after the iteration: plain sampling from the target
    need2 = out[:, 1] < 0
    if bool(need2.any()):
        out[need2, 1] = torch.multinomial(p2[out[need2, 0]], 1, generator=gen).squeeze(-1)
    need3 = out[:, 2] < 0
    if bool(need3.any()):
        out[need3, 2] = torch.multinomial(p3[out[need3, 0], out[need3, 1]], 1, generator=gen).squeeze(-1)
    cells = (out[:, 0] * V + out[:, 1]) * V + out[:, 2]
    counts = torch.bincount(cells, minlength=V**3).numpy()
    return counts, np.bincount(accepted, minlength=3)


def _run(accept: AcceptFn, params: SamplingParams, seed: int = 0) -> tuple[float, np.ndarray]:
    tab = _chain_tables(params)
    joint = (tab["p1"][:, None, None] * tab["p2"][:, :, None] * tab["p3"]).double().numpy().ravel()
    assert abs(joint.sum() - 1) < 1e-5
    joint /= joint.sum()
    counts, hist = _simulate(accept, tab, N_DRAWS, seed)
    return chi2_pvalue(counts, joint), hist


PARAM_CASES = [
    pytest.param(SamplingParams(temperature=1.0), id="t1.0"),
    pytest.param(SamplingParams(temperature=1.3, top_k=3), id="t1.3-k3"),
    pytest.param(SamplingParams(temperature=0.8, top_p=0.7), id="t0.8-p0.7"),
    pytest.param(SamplingParams(temperature=0.7, top_k=4, top_p=0.85), id="t0.7-k4-p0.85"),
]


@pytest.mark.parametrize("params", PARAM_CASES)
def test_speculative_sampling_is_exact(params: SamplingParams) -> None:
    pvalue, hist = _run(accept_speculative, params)
    print(f"correct rule {params}: chi2 p = {pvalue:.4g}, accepted-draft histogram = {hist.tolist()}")
    # every path (reject d1, reject d2, accept both) is exercised often
    assert hist.min() > N_DRAWS * 0.05, hist
    assert pvalue > 0.01


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(broken_accept_q_over_p, id="q_over_p"),
        pytest.param(broken_accept_resample_p, id="resample_p"),
    ],
)
@pytest.mark.parametrize("params", [PARAM_CASES[0], PARAM_CASES[3]])
def test_statistical_harness_detects_broken_rule(broken: AcceptFn, params: SamplingParams) -> None:
    pvalue, _ = _run(broken, params)
    print(f"broken rule {broken.__name__} {params}: chi2 p = {pvalue:.4g}")
    assert pvalue < 1e-6


def test_filtered_target_differs_from_unfiltered() -> None:
    """The filtered cases compare against the filtered target: make sure filtering really changes it."""
    full = _chain_tables(SamplingParams(temperature=0.7))
    filt = _chain_tables(SamplingParams(temperature=0.7, top_k=4, top_p=0.85))
    assert bool((filt["p3"] == 0).any()) and not bool((full["p3"] == 0).any())
    assert math.isclose(float(filt["p3"].sum()), V * V, rel_tol=1e-5)
