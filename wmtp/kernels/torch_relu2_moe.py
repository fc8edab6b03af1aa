"""Nemotron-H's MoE in plain PyTorch (the reference; DESIGN §10): sigmoid routing with a
score-correction bias and group-limited choice, and ReLU² experts without a gate.

Routing per token: scores s = sigmoid(x @ W_router.T) (fp32); experts are chosen by s + bias (the
bias steers the choice only): the ``topk_group`` of ``n_group`` groups with the largest sum of their
two best biased scores are kept, then the top-k experts among them; their weights are the unbiased
s, renormalised to sum 1 (``norm_topk_prob``; + 1e-20 in the denominator), times
``routed_scaling_factor``. An expert computes ``down(relu(up(x))^2)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from wmtp.kernels.common import SigmoidRouting
from wmtp.quant import QuantWeight, dense


def sigmoid_route(x: Tensor, r: SigmoidRouting) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) for tokens x [T, H] (the router in fp32, as
    transformers runs it)."""
    weight, bias, top_k, n_group, topk_group, norm_topk_prob, scale = r
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias.float()
    T, E = choice.shape
    if n_group > 1:
        groups = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1)[1], 1.0).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, idx


def relu2_experts(x: Tensor, up: Tensor | QuantWeight, down: Tensor | QuantWeight, weights: Tensor,
                  idx: Tensor) -> Tensor:
    """``sum_k weights[t, k] * down[e](relu(up[e] @ x[t])^2)`` with e = idx[t, k]; up [E, I, W], down
    [E, W, I] (packed, ``layers.Experts``; quantized ones through their reference dequantization).
    Each expert's output is rounded to x's dtype before the weighted fp32 sum."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        y = F.linear(F.relu(F.linear(x[tok], dense(up[e], x.dtype))).square(), dense(down[e], x.dtype))
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.to(x.dtype)
