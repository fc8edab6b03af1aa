"""Speculative sampling is exact END TO END through the engine (DESIGN §5).

A tiny model with a 6-token vocabulary; a fixed prompt; 20k requests, each with its own seed, run
through the engine in spec mode (draft steps, one batched verify, acceptance + bonus, GDN rollback,
draft-extend, the windowed draft). The empirical joint distribution of the first three emitted
tokens is compared by chi-square with the EXACT joint of plain sampling from the target, enumerated
from the target's own filtered distributions. The same harness with a deliberately broken acceptance
rule swapped into the engine must fail, so a pass means something.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import wmtp.engine.engine as engine_mod
from tests.helpers import broken_accept_resample_p, chi2_pvalue, scramble_
from wmtp.config import ModelConfig
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams, filtered_probs
from wmtp.models.loader import build_model
from wmtp.presets import PRESETS

V = 6
N_DRAWS = 20_000
BATCH = 1000
PROMPT = [1, 4, 2, 5, 3, 0, 1, 1, 4, 2, 2, 5]  # 12 tokens: longer than sink + W below


def _model(preset: str, seed: int):
    # fewest layers that keep every mechanism: one attention layer (plus one GDN layer on hybrids)
    layers = 2 if PRESETS[preset].get("full_attention_interval") else 1
    raw = dict(PRESETS[preset], vocab_size=V, num_hidden_layers=layers)
    model = build_model(ModelConfig.from_dict(raw), "cpu", torch.float32)
    return scramble_(model, seed=seed, gain=1.0).eval()


@torch.no_grad()
def _exact_joint(model, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) of plain sampling, enumerated: one scoring pass per (t1, t2) prefix."""
    n = len(PROMPT)
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for t1 in range(V):
        for t2 in range(V):
            p = filtered_probs(model.score(PROMPT + [t1, t2])[n - 1 :].float(), params).double()
            joint[t1, t2] = p[0, t1] * p[1, t2] * p[2]
    joint = joint.numpy().ravel()
    return joint / joint.sum()


@torch.no_grad()
def _engine_draws(model, spec: SpecConfig, params: SamplingParams) -> tuple[np.ndarray, list[int], set[int]]:
    """Counts of the first three emitted tokens over N_DRAWS seeded requests, the engine-wide
    accepted-draft histogram (every acceptance count must be exercised) and the depths used."""
    torch.set_num_threads(1)
    eng = Engine(model, spec, EngineConfig(max_model_len=32, max_num_seqs=BATCH, page_size=8,
                                           prefill_chunk=BATCH * len(PROMPT)))
    for i in range(N_DRAWS):
        eng.add_request(PROMPT, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                               top_p=params.top_p, max_tokens=3, ignore_eos=True, seed=i))
    while eng.has_unfinished():
        eng.step()
    assert all(v == 0 for v in eng.memory.usage().values())
    out = np.array([r.tokens[len(PROMPT) : len(PROMPT) + 3] for r in eng.requests.values()])
    hist = np.sum([r.metrics.hist for r in eng.requests.values()], axis=0).tolist()
    return np.bincount((out[:, 0] * V + out[:, 1]) * V + out[:, 2], minlength=V**3), hist, set(eng.metrics.gammas)


CASES = [
    pytest.param("tiny-llama", SpecConfig(mode="windowed", num_draft_tokens=3, sink=2, window=4),
                 SamplingParams(temperature=1.0), id="llama-windowed-t1.0"),
    pytest.param("tiny-qwen3-next", SpecConfig(mode="native", num_draft_tokens=3),
                 SamplingParams(temperature=0.8, top_k=4, top_p=0.9), id="qwen3next-native-t0.8-k4-p0.9"),
    # a pruned draft vocabulary: q is zero outside V′ = {0, 2, 3, 5}, the output still the target's
    pytest.param("tiny-llama", SpecConfig(mode="windowed", num_draft_tokens=3, sink=2, window=4,
                                          draft_vocab=(0, 2, 3, 5)),
                 SamplingParams(temperature=1.0), id="llama-windowed-t1.0-draft-vocab"),
]


@pytest.mark.parametrize("preset,spec,params", CASES)
def test_engine_speculative_sampling_is_exact(preset: str, spec: SpecConfig, params: SamplingParams) -> None:
    model = _model(preset, seed=3)
    counts, hist, _ = _engine_draws(model, spec, params)
    pvalue = chi2_pvalue(counts, _exact_joint(model, params))
    print(f"{preset} {spec.mode} {params}: chi2 p = {pvalue:.4g}, accepted-draft histogram = {hist}")
    assert min(hist) > 0.05 * sum(hist), f"some acceptance path is barely exercised: {hist}"
    assert pvalue > 0.01


def test_adaptive_depth_sampling_is_exact() -> None:
    """The depth chosen per iteration from the acceptance seen so far (DESIGN §5) must not bias the
    output: the choice depends on earlier iterations only, never on this iteration's draws."""
    model = _model("tiny-llama", seed=3)
    spec = SpecConfig(mode="windowed", num_draft_tokens="auto", max_draft_tokens=3, sink=2, window=4)
    params = SamplingParams(temperature=1.0)
    counts, hist, gammas = _engine_draws(model, spec, params)
    pvalue = chi2_pvalue(counts, _exact_joint(model, params))
    print(f"adaptive depth: chi2 p = {pvalue:.4g}, depths used = {sorted(gammas)}, histogram = {hist}")
    assert len(gammas) > 1, f"the controller never changed depth: {gammas}"
    assert pvalue > 0.01


def test_engine_harness_detects_broken_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p (not the residual) after a rejection is a classic bug: it must be caught."""
    preset, spec, params = CASES[0].values
    monkeypatch.setattr(engine_mod, "accept_speculative", broken_accept_resample_p)
    model = _model(preset, seed=3)
    counts, _, _ = _engine_draws(model, spec, params)
    pvalue = chi2_pvalue(counts, _exact_joint(model, params))
    print(f"broken rule through the engine: chi2 p = {pvalue:.4g}")
    assert pvalue < 1e-4
