"""Why windowing preserves acceptance (DESIGN §6; paper App. C, Tables 11–12): per-position probes of
the MTP draft, full-context vs windowed keys, on identical inputs.

One target forward over ``token_ids`` gives h_0..h_{T−1}; draft slot p then holds
(embed(x_{p+1}), h_p) and predicts x_{p+2} (DESIGN §2). The draft's first step is run at every probed
slot (``first``..T−2; earlier slots only get their K/V, as in the draft prefill) twice through the
model's own MTP path: ``windows=[None]`` (native, full causal keys) and ``windows=[window]`` (the
DraftWindow rule). Both forwards write identical K/V, so the only difference between them is which
keys each query reads. On long contexts probe a tail (``first`` = T − 512, say): the reference
attention below is O(probed × T).

- Decision invariance: top-1 agreement per slot, and the full draft's top1−top2 logit margin.
- Attention mass: from the draft attention layer's own q/k/v (captured at the backend seam, after
  q/k norm and RoPE), Z_far/Z = softmax mass the window drops, and ‖o_full − o_win‖/‖o_full‖ for the
  value read-out o = Σ_j p_j v_j (per query, all heads together; before the output gate and o_proj).
  "Far" keys are exactly the causal keys that ``DraftWindow.visible`` rejects.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from wmtp.engine.window import DraftWindow


@dataclass
class _Captured:
    """Arguments and output of one backend.attention call."""

    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]] = field(default_factory=list)


class _CapturingBackend:
    """Proxy around a layer's backend that records (q, k, v, scale, out) of each attention call."""

    def __init__(self, inner, record: _Captured) -> None:
        self._inner, self._record = inner, record

    def attention(self, q, k, v, k_cache, v_cache, ctx, scale, gate=None, kv_scale=(1.0, 1.0)):
        out = self._inner.attention(q, k, v, k_cache, v_cache, ctx, scale, None, kv_scale)  # before any output gate
        self._record.calls.append((q.detach(), k.detach(), v.detach(), scale, out.detach()))
        return out if gate is None else out * torch.sigmoid(gate)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@contextlib.contextmanager
def capture_attention(attn: torch.nn.Module) -> Iterator[_Captured]:
    """Record every attention call of one Attention module (its backend is restored on exit)."""
    record, inner = _Captured(), attn.backend
    attn.backend = _CapturingBackend(inner, record)
    try:
        yield record
    finally:
        attn.backend = inner


@dataclass
class ProbeResult:
    """Per probed draft slot (query position ``positions[i]``); ``affected[i]``: the window hides ≥ 1 key."""

    sink: int
    window: int
    positions: list[int]
    affected: list[bool]
    agree: list[bool]
    margin: list[float]
    z_far: list[float]
    readout_change: list[float]

    def summary(self, only_affected: bool = True) -> dict:
        """Aggregates as in the paper's Tables 11–12 (means over the selected steps)."""
        idx = [i for i, a in enumerate(self.affected) if a or not only_affected]
        flipped = [i for i in idx if not self.agree[i]]
        return {
            "sink": self.sink,
            "W": self.window,
            "steps": len(idx),
            "flipped": len(flipped),
            "agreement": _mean([float(self.agree[i]) for i in idx]),
            "margin_all": _mean([self.margin[i] for i in idx]),
            "margin_flipped": _mean([self.margin[i] for i in flipped]),
            "z_far": _mean([self.z_far[i] for i in idx]),
            "readout_change": _mean([self.readout_change[i] for i in idx]),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    def row(self, task: str, context: int) -> dict:
        """A ``probe`` results row (SCHEMA.md): the summary over affected steps plus task and S."""
        return {"task": task, "S": context, **self.summary()}


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else float("nan")


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """top1 − top2 logit per row."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def attention_mass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: DraftWindow, q_start: int = 0,
    max_elements: int = 2**25,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference attention of queries at positions q_start.. (q [m, H, D]) over keys at positions
    0..n−1 (k, v [n, KV, D]), in float64, in query chunks of at most ``max_elements`` scores.

    Returns (z_far [m] mean over heads, readout_change [m], o_full [m, H, D], o_win [m, H, D]).
    Invariant: z_far = 0 and readout_change = 0 wherever the window hides no causal key.
    """
    m, heads, _ = q.shape
    n = k.shape[0]
    group = heads // k.shape[1]
    kf = k.double().repeat_interleave(group, dim=1)
    vf = v.double().repeat_interleave(group, dim=1)
    kpos = torch.arange(n, device=k.device)[None, :]
    chunk = max(1, max_elements // (heads * n))
    z_far, change, o_full, o_win = [], [], [], []
    for lo in range(0, m, chunk):
        qpos = torch.arange(q_start + lo, q_start + min(lo + chunk, m), device=q.device)[:, None]
        causal = (kpos <= qpos)[:, None, :]  # [c, 1, n]
        visible = window.visible(qpos, kpos)[:, None, :]
        scores = torch.einsum("chd,nhd->chn", q[lo : lo + chunk].double(), kf) * scale
        p_full = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        p_win = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        z_far.append((p_full * (causal & ~visible)).sum(-1).mean(-1))
        of, ow = torch.einsum("chn,nhd->chd", p_full, vf), torch.einsum("chn,nhd->chd", p_win, vf)
        change.append((of - ow).flatten(1).norm(dim=-1) / of.flatten(1).norm(dim=-1).clamp_min(1e-30))
        o_full.append(of)
        o_win.append(ow)
    return torch.cat(z_far), torch.cat(change), torch.cat(o_full), torch.cat(o_win)


def target_hidden(model, cache, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Final-norm target hidden states h_0..h_{T−1}, prefilled in chunks through ``cache``."""
    parts = [model(ids[s : s + chunk], cache.context([s], [min(chunk, ids.numel() - s)]))
             for s in range(0, ids.numel(), chunk)]
    return torch.cat(parts)


def draft_step_at(
    model, cache, ids: torch.Tensor, hidden: torch.Tensor, first: int, window: DraftWindow | None, layer_idx: int = 0
) -> tuple[torch.Tensor, tuple]:
    """Teacher-forced first draft step at slots first..T−2 under ``window``; the slots' K/V before
    ``first`` must already be in the cache. Returns (fp32 logits [T−1−first, vocab], the draft
    attention call's (q, k, v, scale, out))."""
    n = ids.numel() - 1
    ctx = cache.context([first], [n - first], windows=[window])
    with capture_attention(model.mtp.layers[layer_idx].self_attn) as rec:
        out = model.mtp_forward(ids[first + 1 :], hidden[first:n], ctx, layer_idx)
    assert len(rec.calls) == 1, "expected exactly one draft attention call"
    return model.compute_logits(out).float(), rec.calls[0]


@torch.no_grad()
def window_probe(
    model, token_ids: Sequence[int] | torch.Tensor, window: DraftWindow, first: int = 0, layer_idx: int = 0,
    prefill_chunk: int = 4096,
) -> ProbeResult:
    """Decision-invariance and attention-mass probe of the draft at slots ``first``..T−2 of ``token_ids``
    (slots before ``first`` only get their K/V written, as the draft prefill does)."""
    ids = _probe_ids(model, token_ids, first)
    with model.private_cache(1, ids.numel()) as cache:
        hidden = target_hidden(model, cache, ids, prefill_chunk)
    return window_probes_from_hidden(model, ids, hidden, [window], first, layer_idx)[0]


def _probe_ids(model, token_ids: Sequence[int] | torch.Tensor, first: int) -> torch.Tensor:
    if model.mtp is None:
        raise ValueError("window_probe: the model has no MTP head")
    device = model.embed_weight.device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(-1)
    if not 0 <= first < ids.numel() - 1:
        raise ValueError(f"window_probe: need 0 <= first < T - 1 (got first={first}, T={ids.numel()})")
    return ids


@torch.no_grad()
def window_probes_from_hidden(
    model, token_ids: Sequence[int] | torch.Tensor, hidden: torch.Tensor, windows: Sequence[DraftWindow],
    first: int = 0, layer_idx: int = 0,
) -> list[ProbeResult]:
    """``window_probe`` for several windows given the target's final hiddens h_0..h_{T−1} (e.g. kept
    from an engine prefill): the full-key draft step runs once, then one windowed step per window."""
    ids = _probe_ids(model, token_ids, first)
    n, device = ids.numel() - 1, ids.device
    attn = model.mtp.layers[layer_idx].self_attn
    positions = list(range(first, n))
    out = []
    with model.private_cache(1, ids.numel()) as cache:
        if first:
            model.mtp_write_kv(ids[1 : first + 1], hidden[:first], cache.context([0], [first]), layer_idx)
        logits_full, (q, _, _, scale, _) = draft_step_at(model, cache, ids, hidden, first, None, layer_idx)
        keys = cache.kv_slots.slots(0, torch.arange(n, device=device))
        k, v = attn.k_cache[keys], attn.v_cache[keys]
        for window in windows:
            logits_win, _ = draft_step_at(model, cache, ids, hidden, first, window, layer_idx)
            z_far, change, _, _ = attention_mass(q, k, v, scale, window, first)
            out.append(ProbeResult(
                sink=window.sink,
                window=window.window,
                positions=positions,
                affected=[window.recent_start(p) > window.sink for p in positions],  # the window hides >= 1 key
                agree=(logits_full.argmax(-1) == logits_win.argmax(-1)).cpu().tolist(),
                margin=top_margin(logits_full).cpu().tolist(),
                z_far=z_far.cpu().tolist(),
                readout_change=change.cpu().tolist(),
            ))
    return out
