"""What ``test_tensor_parallel`` runs on every rank (``Ranks.call`` pickles module functions by name),
each also runnable in one process (``sharded=False``) for the single-process twin."""

from __future__ import annotations

import torch

import wmtp
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.distributed import local_tp
from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams


def _load(source: str, sharded: bool):
    return wmtp.load_model(source, tp=local_tp() if sharded else None)


@torch.no_grad()
def logits(source: str, ids: list[int], sharded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits [T, V] over ``ids`` and the MTP head's at draft slots 0..T-2 (slot p
    takes (x_{p+1}, h_p); all keys visible)."""
    model = _load(source, sharded)
    ids_t = torch.tensor(ids)
    n = len(ids)
    with model.private_cache(1, n) as cache:
        hidden = model(ids_t, cache.context([0], [n]))
        draft = model.mtp_forward(ids_t[1:], hidden[:-1], cache.context([0], [n - 1]))
        return model.compute_logits(hidden), model.draft_logits(draft)


def forced_run(source: str, spec: SpecConfig, prompts: list[list[int]], accept: int, sharded: bool = True
               ) -> list[list[int]]:
    """Tokens of greedy runs that accept exactly ``accept`` drafts an iteration (the benchmark-only
    knob): the emitted drafts, the rollback to a partial acceptance and the extend over it decide them."""
    engine = Engine(_load(source, sharded), spec, EngineConfig(max_model_len=64, max_num_seqs=len(prompts)))
    engine.forced_accept = accept
    rids = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.requests[r].tokens for r in rids]


def adaptive_run(source: str, spec: SpecConfig, prompts: list[list[int]], accept: int | None = None,
                 sharded: bool = True) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of an adaptive-depth engine whose ranks time deep iterations very differently
    (rank r's deep iterations read (1 + 4r)× slower), and the depths every rank chose; ``accept``
    forces that many accepted drafts an iteration (every draft accepted: deep depths pay off, on
    the ranks whose clocks allow it)."""
    import torch.distributed as dist

    engine = Engine(_load(source, sharded), spec, EngineConfig(max_model_len=96, max_num_seqs=len(prompts)))
    engine.forced_accept = accept
    rank = local_tp().rank if sharded else 0
    record = engine.depth.record
    engine.depth.record = lambda b, g, s: record(b, g, s * (1 + 4 * rank * (g > 1)))
    rids = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    gammas = [list(engine.metrics.gammas)]
    if sharded:
        gammas = [None] * local_tp().size
        from wmtp.engine import distributed

        dist.all_gather_object(gammas, list(engine.metrics.gammas), group=distributed._control)
    return [engine.requests[r].tokens for r in rids], gammas
