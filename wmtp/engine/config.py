"""Speculation and engine settings, validated on construction (bad values name the field)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wmtp.engine.window import DraftWindow
from wmtp.errors import ConfigError
from wmtp.quant import KV_CACHE_DTYPES

MODES = ("dense", "native", "windowed")
DEFAULT_MAX_DRAFT_TOKENS = 8  # "auto" depth's d_max when not given: the depth sweeps' range (d = 2..8)


@dataclass(frozen=True)
class SpecConfig:
    """How the MTP head drafts (DESIGN §1). ``num_draft_tokens`` = d = γ + 1 verify tokens.

    ``window_min_context=N``: a request drafts with the window only once its context exceeds N
    (shorter contexts read all keys, which needs the full-length pool: ``ring=False``).
    ``draft_vocab``: the draft proposes tokens of this sub-vocabulary only (a ``wmtp draft-vocab``
    rank file, or token ids), its first ``draft_vocab_size`` when given (``engine.draft_vocab``).
    ``num_draft_tokens="auto"``: each iteration drafts γ ∈ [0, d_max − 1] tokens, the depth that
    maximises expected tokens per second (``engine.depth``); d_max = ``max_draft_tokens``. It is held
    as ``num_draft_tokens = d_max, adaptive = True``: every pool, ring and buffer is sized for d_max,
    and ``gamma`` / ``verify_tokens`` are the largest an iteration may use.
    """

    mode: str = "windowed"
    num_draft_tokens: int | str = 4
    max_draft_tokens: int | None = None
    adaptive: bool = False
    window: int = 4032
    sink: int = 64
    ring: bool = True
    window_min_context: int = 0
    draft_vocab: str | tuple[int, ...] | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"SpecConfig.mode={self.mode!r}; supported: {list(MODES)}")
        self._resolve_depth()
        name = "max_draft_tokens (d_max)" if self.adaptive else "num_draft_tokens (d)"
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ConfigError(f"SpecConfig.{name}={self.num_draft_tokens!r} must be an int >= 1")
        if self.mode != "dense" and self.num_draft_tokens < 2:
            raise ConfigError(
                f"SpecConfig.{name}={self.num_draft_tokens} must be >= 2 in mode {self.mode!r} "
                "(d = 1 means no draft: use mode='dense')"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"SpecConfig.window (W)={self.window!r} must be an int >= 1")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ConfigError(f"SpecConfig.sink={self.sink!r} must be an int >= 0")
        if self.window_min_context < 0:
            raise ConfigError(f"SpecConfig.window_min_context={self.window_min_context} must be >= 0")
        if isinstance(self.draft_vocab, list):  # ids as a list: hashable like the rest of the config
            object.__setattr__(self, "draft_vocab", tuple(self.draft_vocab))
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or size < 1 or self.draft_vocab is None):
            raise ConfigError(f"SpecConfig.draft_vocab_size={self.draft_vocab_size!r} must be an int >= 1 beside a "
                              "draft_vocab")
        if self.draft_vocab is not None and not self.speculative:
            raise ConfigError("SpecConfig.draft_vocab: mode 'dense' has no draft")
        if self.uses_ring and self.window_min_context > 0:
            raise ConfigError(
                "SpecConfig.window_min_context > 0 needs ring=False: below that context the draft reads "
                f"every key, which the ring of sink+W+d={self.ring_size} slots does not keep"
            )

    def _resolve_depth(self) -> None:
        """``num_draft_tokens="auto"`` → ``adaptive`` with d = ``max_draft_tokens`` (or the default)."""
        d, d_max = self.num_draft_tokens, self.max_draft_tokens
        if d == "auto":
            object.__setattr__(self, "adaptive", True)
            object.__setattr__(self, "num_draft_tokens", DEFAULT_MAX_DRAFT_TOKENS if d_max is None else d_max)
        elif isinstance(d, str):
            raise ConfigError(f"SpecConfig.num_draft_tokens={d!r}: an int >= 1, or 'auto'")
        elif d_max is not None and not (self.adaptive and d_max == d):
            raise ConfigError(f"SpecConfig.max_draft_tokens={d_max!r} is the bound of num_draft_tokens='auto'; "
                              f"with a fixed num_draft_tokens={d!r} leave it unset")
        if self.adaptive and self.mode == "dense":
            raise ConfigError("SpecConfig.num_draft_tokens='auto': mode 'dense' has no draft")

    @property
    def speculative(self) -> bool:
        return self.mode != "dense"

    @property
    def gamma(self) -> int:
        """Drafted tokens per iteration (γ = d - 1); 0 in dense mode."""
        return self.num_draft_tokens - 1 if self.speculative else 0

    @property
    def verify_tokens(self) -> int:
        return self.gamma + 1

    @property
    def draft_window(self) -> DraftWindow | None:
        return DraftWindow(self.sink, self.window) if self.mode == "windowed" else None

    @property
    def uses_ring(self) -> bool:
        return self.mode == "windowed" and self.ring

    @property
    def ring_size(self) -> int:
        return self.sink + self.window + self.num_draft_tokens

    def draft_vocab_ids(self, vocab_size: int) -> list[int] | None:
        """The draft vocabulary's token ids (None: the whole vocabulary)."""
        if self.draft_vocab is None:
            return None
        from wmtp.engine.draft_vocab import load_ids

        return load_ids(self.draft_vocab, self.draft_vocab_size, vocab_size)

    def window_for(self, context_len: int) -> DraftWindow | None:
        """The window a request with ``context_len`` committed tokens drafts with (None = all keys)."""
        if self.mode != "windowed" or context_len <= self.window_min_context:
            return None
        return self.draft_window

    def windowed(self, context_len: torch.Tensor) -> torch.Tensor:
        """``window_for(L) is not None`` over a tensor of lengths, on their device (no host sync)."""
        if self.mode != "windowed":
            return torch.zeros_like(context_len, dtype=torch.bool)
        return context_len > self.window_min_context


@dataclass(frozen=True)
class EngineConfig:
    """Capacity knobs. Pools are sized once, up front; admission never exceeds them."""

    max_model_len: int = 4096
    max_num_seqs: int = 8
    # 64: pages of whole 64-key tiles take the attention kernel's contiguous path (one scalar page
    # per tile, no per-key lookups); every GPU figure in benchmarks/results/h200 ran at 64
    page_size: int = 64
    num_kv_pages: int | None = None  # default: enough for max_num_seqs requests of max_model_len
    kv_memory_bytes: int | None = None  # alternative: size the pools from a byte budget
    prefill_chunk: int = 512
    # "auto": CUDA graphs for greedy decode iterations on CUDA with the triton backend; "capture"
    # forces them; "eager" runs the same static-buffer path without capturing (tests); "off".
    decode_graphs: str = "auto"
    # Greedy static-path iterations: launch iteration i + 1 before reading iteration i's results, so
    # the GPU does not idle while the host emits tokens and relaunches (one iteration in flight).
    overlap: bool = True
    # Prefix caching (DESIGN §12, ``wmtp.engine.prefix_cache``): full prompt pages stay in a
    # content-addressed index, shared by later requests with the same prefix. What a resumed prefill
    # needs besides KV (recurrent state, the draft's ring or last page, the last hidden state) is
    # snapshotted every ``prefix_snapshot_interval`` pages and at the end of each prompt into
    # ``prefix_snapshots`` slots (None: 4 per sequence slot), counted in the memory budget.
    prefix_cache: bool = False
    # 128 pages = 8192 tokens at page size 64: a multiple of the prefill chunks in use (512 in
    # serve, 8192 in bench ttft), so snapshot boundaries cut no chunk short; a hit recomputes at most
    # that many tokens past its snapshot.
    prefix_snapshot_interval: int = 128
    prefix_snapshots: int | None = None
    # K / V of the target and the draft (pool, ring, snapshots): "auto" = the model's dtype, or
    # "fp8_e4m3" with per-layer scales (``wmtp.quant``): half the bytes read and held per token
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "page_size", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"EngineConfig.{name}={v!r} must be an int >= 1")
        if self.decode_graphs not in ("auto", "capture", "eager", "off"):
            raise ConfigError(f"EngineConfig.decode_graphs={self.decode_graphs!r}; use auto, capture, eager or off")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"EngineConfig.num_kv_pages={self.num_kv_pages} must be >= 1")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ConfigError(f"EngineConfig.kv_memory_bytes={self.kv_memory_bytes} must be >= 1")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"EngineConfig.prefix_cache={self.prefix_cache!r} must be True or False")
        if not isinstance(self.prefix_snapshot_interval, int) or self.prefix_snapshot_interval < 1:
            raise ConfigError(f"EngineConfig.prefix_snapshot_interval={self.prefix_snapshot_interval!r} must be an "
                              "int >= 1 (pages)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        snaps = self.prefix_snapshots
        if snaps is not None and (not isinstance(snaps, int) or snaps < 0):
            raise ConfigError(f"EngineConfig.prefix_snapshots={snaps!r} must be None or an int >= 0")
