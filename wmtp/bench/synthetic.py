"""Benchmark-only engine states (DESIGN §6): a request that already holds S tokens of context
(random KV, draft KV and recurrent states, no prefill) and forced acceptance of exactly k drafts.

Cost is content-free, so random-weight models give cost figures at any context and any AL. Every
result made with these must say "synthetic" / "forced acceptance".
"""

from __future__ import annotations

import time

import torch

from wmtp.engine.engine import Engine, Request, Status
from wmtp.engine.sampling import SamplingParams


@torch.no_grad()
def randomize_pools(engine: Engine, seed: int = 0) -> None:
    """Fill every KV / draft-KV / state pool with small random values (content-free cost)."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    model = engine.model
    for layer in model.attention_layers() + model.mtp_attention_layers():
        for cache in (getattr(layer, "k_cache", None), getattr(layer, "v_cache", None)):
            if cache is None:  # MTP layers hold no cache in dense mode
                continue
            if cache.element_size() == 1:  # fp8: normal_ has no 8-bit kernel
                for rows in cache.split(1 << 20):
                    rows.copy_(torch.randn(rows.shape, generator=gen, device=rows.device))
            else:
                cache.normal_(0, 1, generator=gen)
    for layer in model.recurrent_layers():
        layer.conv_state.normal_(0, 0.1, generator=gen)
        layer.ssm_state.normal_(0, 0.01, generator=gen)


def add_synthetic_request(engine: Engine, context: int, max_tokens: int, seed: int = 0) -> Request:
    """Admit a request whose first ``context`` tokens count as prefilled (pool contents are
    whatever ``randomize_pools`` left): it starts decoding at once. Raises MemoryError, leaving the
    engine as it was, when the pools cannot hold it now."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (context,), generator=gen).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed))
    req = engine.requests[rid]
    engine._admit_waiting()
    if req.status != Status.PREFILL:  # still waiting: take it back out, nothing was reserved
        engine.waiting.remove(req)
        engine.requests.pop(rid)
        raise MemoryError(f"no room now for a synthetic request of {context} + {max_tokens} tokens")
    req.prefilled = context
    req.tokens.append(int(torch.randint(1, vocab, (1,), generator=gen)))
    req.metrics.num_generated = 1
    req.metrics.first_token_time = time.perf_counter()
    req.status = Status.DECODE
    if engine.spec.speculative:  # the draft state a real prefill leaves: d_1 and the MTP output
        engine._set_draft(req, torch.randn(1, engine.model.config.hidden_size, generator=gen).to(engine.device, engine.dtype))
    return req


def force_acceptance(engine: Engine, accepted: int) -> None:
    """Every iteration accepts exactly ``accepted`` drafts (bonus token: the target's argmax there)."""
    if not 0 <= accepted <= engine.spec.gamma:
        raise ValueError(f"forced acceptance k={accepted} must be in [0, γ={engine.spec.gamma}]")

    engine.forced_accept = accepted
