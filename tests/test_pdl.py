"""Programmatic dependent launch (``wmtp.kernels.common.pdl`` / ``wait_prior``): every engine kernel
launched with ``launch_pdl`` must wait for the previous kernel before it touches memory, or it reads
stale inputs (a race the CPU interpreter, which has no PDL, can never show). Checked statically here;
on the GPU the captured decode graphs (``test_decode_graphs.py``) run with PDL on."""

import ast
import pathlib

import pytest
import torch

from wmtp.kernels.common import pdl

KERNELS = pathlib.Path(__file__).parent.parent / "wmtp" / "kernels"


def _jit_kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    return [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")
            and any(ast.unparse(d) == "triton.jit" for d in f.decorator_list)]


def _first_statement(f: ast.FunctionDef) -> str:
    body = f.body[1:] if isinstance(f.body[0], ast.Expr) and isinstance(f.body[0].value, ast.Constant) else f.body
    return ast.unparse(body[0])


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_every_engine_kernel_waits_first_and_launches_with_pdl(path):
    tree = ast.parse(path.read_text())
    names = {f.name for f in _jit_kernels(tree)}
    for f in _jit_kernels(tree):
        if f.name == "_stream_xor_kernel":  # the bandwidth probe: launched alone, never in a graph chain
            continue
        params = [a.arg for a in f.args.args]
        assert "PDL" in params, f"{path.name}: {f.name} has no PDL parameter"
        assert _first_statement(f) == "wait_prior(PDL)", f"{path.name}: {f.name} must start with wait_prior(PDL)"
    launches = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                and isinstance(c.func.value, ast.Name) and c.func.value.id in names]
    for c in launches:
        if c.func.value.id == "_stream_xor_kernel":
            continue
        spread = [ast.unparse(k.value) for k in c.keywords if k.arg is None]
        assert any(s.startswith("pdl(") for s in spread), f"{path.name}: launch of {c.func.value.id} lacks **pdl(device)"


def test_pdl_is_off_on_the_cpu():
    assert pdl(torch.device("cpu")) == {"PDL": False}


def test_pdl_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("WMTP_PDL", "0")
    assert pdl(torch.device("cuda")) == {"PDL": False}  # decided before any CUDA call
