"""The decode kernels over quantized weights and the paged attention kernel compile for Hopper
(sm_90) on any machine (``tests/hopper_compile.py``, one process of its own with Triton compiling,
not interpreting). The interpreter runs the kernels' Python and the kernel tests check their
numerics, but only a compile checks inline PTX (the e2m1 conversions), compiled-mode typing
(loop-carried values, constexpr branches) and register allocation before a GPU runs them: every
case must give an sm_90 cubin, the quantized kernels' without register spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

pytest.importorskip("triton")

from tests.hopper_compile import cases  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    # xdist's workers share their base temp's parent (one per session): the first worker to get here
    # compiles every case, the others read its results instead of compiling them all again
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hopper_compile.json"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            run = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-4000:]
            out.write_text(run.stdout.strip().splitlines()[-1])
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(cases()))
def test_kernel_compiles_for_hopper(case, compiled):
    assert compiled[case] is None, compiled[case]
