"""Triton skinny linear: ``y = x @ weight.T (+ bias)`` for the few-row (M <= 16 tokens) decode and
verify forwards, where the cost is reading the weight once. cuBLAS takes ~5-10 us a call on the
35B-A3B decode shapes on the H200: ~5 us for 0.1-2 MB weights whose HBM floor is under 1 us, and
7.3 us plus a 1.75 us split-K reduce for the 16.8 MB out_proj (floor 3.9 us).

- A program owns ``BLOCK_N`` output features and all M rows: it streams its ``[BLOCK_N, K]`` weight
  slab once, in ``BLOCK_K`` steps, keeping the ``[BLOCK_M, BLOCK_N]`` fp32 accumulators of every row
  (``BLOCK_M`` = next power of two >= M). Below 16 rows the product is a broadcast multiply-sum
  (no padding of x); at 16 rows it is ``tl.dot`` (tensor cores, which need every tile side >= 16).
- When the output has too few row tiles to fill the GPU (e.g. 2048 features over K = 4096 at 16
  rows), a second grid axis splits K: each split writes fp32 partials to a workspace and a tiny
  second kernel sums them in split order. No atomics, so results are bit-reproducible run to run.
- fp32 accumulation, bias added in fp32, one rounding to x's dtype at the end, as F.linear does.
- CUDA-graph capturable: the configuration depends only on shapes and the device's SM count (no
  host syncs, no data-dependent host logic); the workspace comes from the caching allocator.

The PyTorch twin is ``F.linear`` itself; ``tests/test_linear_kernel.py`` compares the two and
``benchmarks/tune_linear.py`` times them (and sweeps the launch configuration) on the GPU.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 16  # every program holds all rows' accumulators; more rows are a tiled GEMM's job (F.linear)
# Programs per SM the default configuration aims for: enough weight reads in flight to reach HBM
# bandwidth (the MoE GEMV reached ~4.2 TB/s on the H200 at ~4.4 programs per SM, tune_moe.py).
_PROGRAMS_PER_SM = 4
_STEP_BYTES = 8192  # weight bytes a program reads per K step (the MoE GEMV's best: 2 x 8 x 256 bf16)
_MIN_SPLIT_STEPS = 2  # K steps per split below which the reduce launch costs more than it saves
_REDUCE_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAUNCH_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"})


if triton is not None:

    @triton.jit
    def _skinny_linear_kernel(X, W, BIAS, OUT, M, N, K, stride_xm, stride_xk, stride_wn, k_per_split,
                              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n tile, K split): ``OUT[:, tile] = X[:, split] @ W[tile, split].T``. With SPLIT,
        OUT is the fp32 workspace [splits, M, N] and the bias is left to the reduction; otherwise
        the bias is added and the result rounded to OUT's dtype."""
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        k_lo = split * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        w_rows = W + cols.to(tl.int64)[:, None] * stride_wn  # 64-bit: weights may pass 2^31 elements
        x_rows = X + rows[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if BLOCK_M >= 16:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        offs = rows[:, None] * N + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT:
            tl.store(OUT + split * M * N + offs, acc, mask=ok)
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _split_k_reduce_kernel(PART, BIAS, OUT, MN, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """``OUT = sum_s PART[s] (+ bias)`` over the flat [M * N] outputs, splits summed in index
        order (the fixed order is what makes split-K results reproducible)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):
            acc += tl.load(PART + s * MN + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SMs of ``device``; a small stand-in off the GPU (the interpreter), where speed is moot."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_launch(block_m: int, N: int, K: int, elem_size: int, num_sms: int) -> dict[str, int]:
    """The default configuration for a ``block_m``-row tile of x [M, K] times weight [N, K].T (from
    the shape alone; ``block_m`` is next_pow2(M) unless overridden):

    - ``BLOCK_N``: the widest of 64..4 (16 at 16 rows, for ``tl.dot``) that still gives
      ``_PROGRAMS_PER_SM`` row tiles per SM (wider tiles re-read x less often);
    - ``BLOCK_K``: ``_STEP_BYTES`` of weight per step (``BLOCK_N * BLOCK_K`` elements), at most K;
    - ``SPLIT_K``: 1, unless the row tiles fill fewer than 2 programs per SM; then enough splits to
      reach ``_PROGRAMS_PER_SM``, each keeping >= ``_MIN_SPLIT_STEPS`` K steps (a split of fewer
      steps saves less than the reduce launch costs, so a short K is split little or not at all);
    - 8 warps for the broadcast path (the MoE GEMV's best), 4 for ``tl.dot`` (one 16-row MMA tile).
    """
    dot = block_m >= 16
    min_n = 16 if dot else 4
    target = _PROGRAMS_PER_SM * num_sms
    block_n = 64
    while block_n > min_n and triton.cdiv(N, block_n) < target:
        block_n //= 2
    block_k = max(16, min(triton.next_power_of_2(K), _STEP_BYTES // (block_n * elem_size), 1024))
    tiles = triton.cdiv(N, block_n)
    split = 1
    if tiles < 2 * num_sms:
        split = max(1, min(triton.cdiv(target, tiles), triton.cdiv(K, block_k) // _MIN_SPLIT_STEPS))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4 if dot else 8, "num_stages": 3}


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raises ValueError naming the first argument that breaks ``skinny_linear``'s contract."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} must be [M, K] with M <= {MAX_ROWS} rows "
                         f"(use F.linear for more)")
    K = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: weight {tuple(weight.shape)} (strides {weight.stride()}) must be "
                         f"[N, {K}] with unit stride on K (x {tuple(x.shape)})")
    if x.dtype not in _DTYPES:  # fp32 accumulation: fp64 would lose its precision
        raise ValueError(f"skinny_linear: x {x.dtype} must be one of {[str(d) for d in _DTYPES]}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"skinny_linear: weight {weight.dtype} on {weight.device} must match x {x.dtype} "
                         f"on {x.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)} {bias.dtype} must be [{weight.shape[0]}] "
                         f"{x.dtype} on {x.device}")


def _config(M: int, N: int, K: int, x: torch.Tensor, launch: dict) -> dict[str, int]:
    """Default configuration with ``launch``'s overrides, checked for what the kernel needs."""
    unknown = set(launch) - _LAUNCH_KEYS
    if unknown:
        raise ValueError(f"skinny_linear: unknown launch keys {sorted(unknown)} (allowed {sorted(_LAUNCH_KEYS)})")
    block_m = launch.get("BLOCK_M", triton.next_power_of_2(M))
    cfg = {**default_launch(block_m, N, K, x.element_size(), _num_sms(x.device)), **launch}
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if any(b < 1 or b & (b - 1) for b in (bm, bn, bk)) or not triton.next_power_of_2(M) <= bm <= MAX_ROWS:
        raise ValueError(f"skinny_linear: BLOCK_M {bm}, BLOCK_N {bn}, BLOCK_K {bk} must be powers of two, "
                         f"BLOCK_M in [{triton.next_power_of_2(M)}, {MAX_ROWS}] for {M} rows")
    if bm >= 16 and min(bn, bk) < 16:
        raise ValueError(f"skinny_linear: BLOCK_M 16 (tl.dot) needs BLOCK_N and BLOCK_K >= 16, got {bn}, {bk}")
    if cfg["SPLIT_K"] < 1:
        raise ValueError(f"skinny_linear: SPLIT_K {cfg['SPLIT_K']} must be >= 1")
    return cfg


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] with M <= ``MAX_ROWS`` (any strides, e.g. a row
    slice of a larger buffer); weight [N, K] with unit stride on K; bias [N]; all one dtype and
    device. Returns a new contiguous [M, N] in x's dtype: fp32 accumulation, one rounding.

    ``launch`` overrides the defaults (``default_launch``): BLOCK_M (a power of two from
    next_pow2(M) to 16; 16 takes the ``tl.dot`` path), BLOCK_N, BLOCK_K, SPLIT_K (requested K splits;
    fewer run when K has fewer BLOCK_K steps; 1 = no workspace, no second launch), num_warps,
    num_stages. Results are deterministic for a given configuration; split and unsplit ones differ
    by fp32 summation order."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    cfg = _config(M, N, K, x, launch)
    split_k, block_k = cfg.pop("SPLIT_K"), cfg["BLOCK_K"]
    k_per_split = max(block_k, triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k)
    splits = max(1, triton.cdiv(K, k_per_split))  # no empty split: each writes all its partials
    # tl.dot on fp32 in IEEE mode: TF32 would round the inputs, as F.linear does not by default
    # (16-bit inputs multiply exactly whatever the mode)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else out  # never read without bias
    dst = torch.empty(splits, M, N, device=x.device, dtype=torch.float32) if splits > 1 else out
    _skinny_linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), splits)](
        x, weight, b, dst, M, N, K, x.stride(0), x.stride(1), weight.stride(0), k_per_split,
        HAS_BIAS=has_bias, SPLIT=splits > 1, PRECISION=precision, **cfg)
    if splits > 1:
        _split_k_reduce_kernel[(triton.cdiv(M * N, _REDUCE_BLOCK),)](
            dst, b, out, M * N, N, splits, HAS_BIAS=has_bias, BLOCK=_REDUCE_BLOCK)
    return out
