"""Sampling parameters, target/draft filtering and lossless verification (DESIGN §5).

Invariants:
- ``filtered_probs`` is the ONE function that turns logits into a distribution; the engine applies it
  identically to the target (p) and the draft (q), so speculative sampling reproduces plain sampling
  from the filtered target distribution exactly.
- ``accept_greedy`` and ``accept_speculative`` return ``(a, token)``: ``a`` drafts accepted
  (0 <= a <= g) and the one extra token the target contributes (the correction or the bonus), so every
  iteration emits ``a + 1`` tokens.
- Every random draw goes through the caller's ``torch.Generator``: equal seeds give equal outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from wmtp.errors import WmtpError

__all__ = [
    "SamplingParams",
    "accept_greedy",
    "accept_speculative",
    "filtered_probs",
    "make_generator",
    "sample",
]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. Validated on construction; ``stop_token_ids`` is always a tuple.

    temperature 0 means greedy (top_k / top_p are then irrelevant); top_k 0 and top_p 1 mean "off".
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise WmtpError(f"temperature={t!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise WmtpError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise WmtpError(f"top_p={p!r} must be a number in (0, 1] (1 = off)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise WmtpError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise WmtpError(
                f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token ids (ints >= 0)"
            )
        stop = tuple(self.stop_token_ids)
        for tok in stop:
            if not _is_int(tok) or tok < 0:
                raise WmtpError(
                    f"stop_token_ids contains {tok!r}: every stop token id must be an int >= 0"
                )
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise WmtpError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise WmtpError(f"seed={self.seed!r} must be None or an int >= 0")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device``: seeded with ``seed``, or from fresh OS entropy when ``seed`` is None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """fp32 probabilities ``[..., V]`` after temperature, top-k, then top-p (nucleus).

    Invariants: every row sums to 1 and keeps at least one token. top-k keeps every token whose logit
    is >= the k-th largest (ties may keep more than k). top-p keeps the smallest prefix of the sorted
    distribution whose mass is >= top_p. Greedy params give the one-hot of ``argmax`` (ties: lowest
    index). Apply identically to target and draft logits.
    """
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise WmtpError(f"logits shape {tuple(logits.shape)} must be [..., V] with V >= 1")
    if not logits.is_floating_point():
        raise WmtpError(f"logits dtype {logits.dtype} must be floating point")
    vocab = logits.shape[-1]
    if params.greedy:
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)

    x = logits.float() / params.temperature
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # exclusive prefix sum
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs [N, V]`` (rows need not be normalised) -> int64 ``[N]``."""
    if probs.ndim != 2:
        raise WmtpError(f"probs shape {tuple(probs.shape)} must be [N, V]")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_draft(draft_tokens: Tensor, other: Tensor, name: str) -> int:
    if draft_tokens.ndim != 1:
        raise WmtpError(f"draft_tokens shape {tuple(draft_tokens.shape)} must be [g]")
    g = draft_tokens.shape[0]
    if other.shape[0] != g + 1:
        raise WmtpError(f"{name} has {other.shape[0]} rows; expected g+1 = {g + 1} for g = {g} drafts")
    return g


def accept_greedy(draft_tokens: Tensor, target_argmax: Tensor) -> tuple[int, int]:
    """Greedy verification. ``target_argmax[i]`` is the target's token at the position where draft i
    is proposed (``[g+1]``; the last entry follows d_g). Returns ``(a, bonus)``: ``a`` = length of the
    longest prefix with ``draft_tokens[i] == target_argmax[i]``, ``bonus = target_argmax[a]``.
    """
    if target_argmax.ndim != 1:
        raise WmtpError(f"target_argmax shape {tuple(target_argmax.shape)} must be [g+1]")
    _check_draft(draft_tokens, target_argmax, "target_argmax")
    a = int(accept_greedy_batch(draft_tokens.to(target_argmax.device)[None], target_argmax[None])[0])
    return a, int(target_argmax[a].item())


def accept_greedy_batch(drafts: Tensor, target_argmax: Tensor) -> Tensor:
    """``accept_greedy`` for a batch on the device, no host sync (CUDA graphs): drafts [B, g],
    target_argmax [B, g + 1] -> accepted counts a [B] (int64); the bonus is ``target_argmax[b, a]``."""
    g = drafts.shape[1]
    if target_argmax.shape != (drafts.shape[0], g + 1):
        raise WmtpError(f"target_argmax shape {tuple(target_argmax.shape)} must be [{drafts.shape[0]}, {g + 1}]")
    match = (drafts == target_argmax[:, :g]).to(torch.int64)
    return torch.cumprod(match, dim=1).sum(dim=1)


def accept_speculative(
    draft_tokens: Tensor,
    q_probs: Tensor,
    p_probs: Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. / Chen et al.). Returns ``(a, next_token)``.

    ``q_probs [g, V]``: draft distributions the drafts were sampled from; ``p_probs [g+1, V]``: target
    distributions at the same positions plus one after d_g. Draft i is accepted with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the next token is drawn from
    ``normalize(max(p_i - q_i, 0))`` (from ``p_i`` if that is all zero); if all g are accepted it is
    drawn from ``p_g``. Invariant: emitted tokens are distributed exactly as sampling from p.
    Draw order (reproducible): g uniforms, then one multinomial draw.
    """
    if q_probs.ndim != 2 or p_probs.ndim != 2:
        raise WmtpError(
            f"q_probs {tuple(q_probs.shape)} must be [g, V] and p_probs {tuple(p_probs.shape)} [g+1, V]"
        )
    g = _check_draft(draft_tokens, p_probs, "p_probs")
    if q_probs.shape[0] != g or q_probs.shape[1] != p_probs.shape[1]:
        raise WmtpError(
            f"q_probs shape {tuple(q_probs.shape)} must be [g, V] = [{g}, {p_probs.shape[1]}] "
            f"to match p_probs {tuple(p_probs.shape)}"
        )
    p = p_probs.float()
    q = q_probs.to(device=p.device, dtype=torch.float32)
    a = 0
    if g:
        d = draft_tokens.to(device=p.device, dtype=torch.int64).unsqueeze(-1)
        p_d = p[:g].gather(-1, d).squeeze(-1)
        q_d = q.gather(-1, d).squeeze(-1)
        u = torch.rand(g, generator=generator, device=p.device)
        accepted = u * q_d < p_d  # P(u < p/q) = min(1, p/q) for u ~ U[0, 1); p_d == 0 always rejects
        a = int(torch.cumprod(accepted.to(torch.int64), dim=0).sum().item())
    if a < g:
        dist = (p[a] - q[a]).clamp_min(0.0)
        if not bool(dist.sum() > 0):
            dist = p[a]
    else:
        dist = p[g]
    token = torch.multinomial(dist, 1, generator=generator)
    return a, int(token.item())
