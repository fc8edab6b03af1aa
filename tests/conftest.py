"""Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel is defined)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per pytest-xdist worker: workers already fill the cores, and torch's own
# threads on top of them spin against each other (tiny forwards ran several times slower).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)


def _patch_triton_language_once_per_launch() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` for the interpreter at every launch (and
    restores it after), and patches it again at every call of a ``@triton.jit`` helper made from
    inside a kernel (``tl.sum``, ``tl.zeros``, the kernels' own device functions): about 0.7 ms a
    call, a quarter of an interpreted engine test's time. The patch depends only on which of
    ``triton.language`` / ``triton.language.core`` the helper's module sees, so within one launch it
    is applied once per such set, and the helper runs exactly as before."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if triton.__version__ != "3.6.0":  # the version pinned in pyproject.toml; others run unpatched
        return
    patched: set[tuple[bool, bool]] = set()
    keys: dict[int, tuple[bool, bool]] = {}  # id of a helper's module globals -> which languages it sees
    grid_call, nested_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        patched.clear()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.clear()

    def helper(self, *args, **kwargs):
        g = self.fn.__globals__
        key = keys.get(id(g))
        if key is None:
            key = keys[id(g)] = (any(v is tl for v in g.values()), any(v is tl.core for v in g.values()))
        if key in patched:
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        patched.add(key)
        return nested_call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()


@pytest.fixture(autouse=True)
def _whole_tiles_where_marked(request):
    """Tests marked ``whole_tiles`` (engine-level runs of the Triton backend) launch the kernels
    with ``wmtp.kernels.common.whole_tiles`` under the interpreter; kernel tests keep the GPU's."""
    if request.node.get_closest_marker("whole_tiles") is None:
        yield
        return
    from wmtp.kernels.common import whole_tiles

    with whole_tiles():
        yield
