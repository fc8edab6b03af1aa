"""``act_mul`` (one pass of ``act(a) * b``) against its twin, PyTorch's two ops: SiLU and sigmoid,
fp32 and bf16, contiguous rows, a slice of wider rows (the grouped experts' gate half), a per-head
view into a fused projection (the attention output gate), a layout whose rows do not collapse."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from wmtp.kernels.act_mul import SIGMOID, SILU, act_mul, act_mul_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _views(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 2 * 48, generator=g) * 4).to(DEVICE, dtype)
    qg = (torch.randn(5, 3, 2 * 40, generator=g) * 4).to(DEVICE, dtype)  # per head [query | gate]
    t = (torch.randn(24, 9, generator=g) * 4).to(DEVICE, dtype)
    return [(h[:, :48], h[:, 48:]), (qg[..., 40:], qg[..., :40].contiguous()), (t.t(), t.t().contiguous() + 1)]


@pytest.mark.parametrize("act", [SILU, SIGMOID])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_mul_matches_the_twin(act, dtype):
    for a, b in _views(dtype):
        got, want = act_mul(a, b, act), act_mul_reference(a, b, act)
        assert got.shape == want.shape and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:  # the activation and the product each rounded to bf16: within one step of the twin's on a GPU
            # (exp's last bits), two under the interpreter (its casts to bf16 truncate)
            step = 2 ** -7 if DEVICE == "cuda" else 2 ** -6
            torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=1e-6)


def test_act_mul_errors_name_the_operands():
    a = torch.zeros(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"act_mul: a \(3, 4\) torch.float32 and b \(3, 5\)"):
        act_mul(a, torch.zeros(3, 5, device=DEVICE), SILU)
    with pytest.raises(ValueError, match="act 7 must be SILU"):
        act_mul(a, a, 7)
