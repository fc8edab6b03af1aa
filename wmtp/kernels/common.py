"""Small helpers shared by the reference ops and the kernels."""

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the reference ops: fp32, or fp64 for fp64 inputs (exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def linear_epilogue(y: torch.Tensor, relu2: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """What a linear may apply to its output ``y`` (``Backend.linear``; ``skinny_linear`` in its
    own launch), as PyTorch ops, each rounded to y's dtype: ``relu(y)^2`` with ``relu2``, then ``+ add``."""
    if relu2:
        y = torch.relu(y).square()
    return y if add is None else y + add


class SharedExpert(NamedTuple):
    """The sigmoid-gated shared expert of a MoE layer: SwiGLU weights gate_proj, up_proj [I, H],
    down_proj [H, I] and the gate [1, H] (``out += sigmoid(gate @ x) * mlp(x)``)."""

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate: torch.Tensor


class SigmoidRouting(NamedTuple):
    """Nemotron-H's router (``torch_relu2_moe.sigmoid_route``): the router weight [E, H], the
    score-correction bias [E] and the choice's parameters."""

    weight: torch.Tensor
    bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scale: float


_WHOLE_TILES = False


@contextlib.contextmanager
def whole_tiles() -> Iterator[None]:
    """Inside this block, under Triton's CPU interpreter, the kernels' default launches take one
    tile over each small axis (``launch_tile``) instead of the GPU's tuned tiles. The interpreter
    runs a program's ops on whole numpy arrays, so a program costs its op count whatever its tile:
    fewer, larger programs give the same arithmetic several times faster. Engine-level tests run in
    it; kernel tests keep the GPU's tiles, whose tiling is what they check. No effect on a GPU."""
    global _WHOLE_TILES
    saved, _WHOLE_TILES = _WHOLE_TILES, os.environ.get("TRITON_INTERPRET") == "1"
    try:
        yield
    finally:
        _WHOLE_TILES = saved


def launch_tile(gpu: int, extent: int, cap: int = 1024) -> int:
    """A launch's default tile along an axis of ``extent``: ``gpu``, or inside ``whole_tiles`` the
    whole extent (a power of 2 >= 16, at most ``cap``)."""
    if not _WHOLE_TILES:
        return gpu
    return min(cap, max(16, triton.next_power_of_2(extent)))


def launch_splits(gpu: int) -> int:
    """A launch's default number of splits of a reduction: ``gpu``, or inside ``whole_tiles`` one
    (the split-and-merge arithmetic is the kernel tests')."""
    return 1 if _WHOLE_TILES else gpu


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
MAX_COUNTERS = 1 << 16


def _raw_stream(device: torch.device) -> int:
    """The current CUDA stream's handle, as Triton's launcher reads it (a Python ``Stream`` object
    per launch would cost more host time than the eager path's launches can spare)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for launches whose last-arriving program of a group finishes the
    group's work (and zeroes its counter again). One fixed buffer per device and current stream,
    never reallocated: captured CUDA graphs keep its address, and launches on streams that run at
    once (two engines in a process, a layer's independent parts on two streams) never count into
    one another's groups. Launches on one stream run one after another, so they share its buffer."""
    if n > MAX_COUNTERS:
        raise ValueError(f"arrival_counters: {n} groups in one launch; at most {MAX_COUNTERS}")
    key = (device, _raw_stream(device) if device.type == "cuda" else 0)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(MAX_COUNTERS, device=device, dtype=torch.int32)
    return c


if triton is not None:

    @triton.jit
    def last_to_arrive(COUNT, group, n):
        """Whether this program is the last of ``group``'s ``n`` programs to get here (after its
        stores); that one then zeroes the group's counter for the next launch. The barrier orders
        every thread's stores before the release; the last program's loads of the others' results
        must bypass L1 (``cache_modifier=".cg"``), which may hold lines read before they were final."""
        tl.debug_barrier()
        last = tl.atomic_add(COUNT + group, 1, sem="acq_rel", scope="gpu") == n - 1
        tl.atomic_xchg(COUNT + group, 0, mask=last, sem="relaxed", scope="gpu")
        return last

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        """First statement of every engine kernel. Under programmatic dependent launch (``PDL``) a
        kernel's programs may start while the previous kernel in the stream still runs: wait for it
        to finish (its writes then visible), then let the next kernel's programs start. Nothing may
        be read or written before this, so no program can finish ahead of the previous kernel and
        the chain of waits keeps stream order."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gpu_feature(device: torch.device, capability: tuple[int, int], off_var: str) -> bool:
    """Whether a kernel may use a GPU feature: a CUDA device of at least ``capability`` (compiled, not
    under the CPU interpreter), unless the environment sets ``off_var=0``."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get(off_var) != "0"
            and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= capability)


def pdl(device: torch.device) -> dict[str, bool]:
    """Launch arguments of an engine kernel for programmatic dependent launch: its ``PDL``
    constexpr, and Triton's ``launch_pdl`` where it is on. A decode step is hundreds of short
    kernels; with PDL the next one is scheduled during the previous one's last wave instead of after
    it: 0.5-0.6 us a launch in a CUDA graph of chained GEMVs, and a dense 1.04M-token step 2.9%
    shorter, on the H200 (2543520; benchmarks/results/HISTORY.md). On for CUDA devices of compute capability 9.0+
    (griddepcontrol), off under the CPU interpreter and with ``WMTP_PDL=0``."""
    return {"PDL": True, "launch_pdl": True} if gpu_feature(device, (9, 0), "WMTP_PDL") else {"PDL": False}
