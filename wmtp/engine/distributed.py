"""Tensor parallelism over the processes of one host (DESIGN §11): the ranks, their process group,
and the engine every rank runs. The model's side (which rows each rank holds, the collectives of its
layers) is ``wmtp.models.parallel``.

Architecture: every rank runs the same ``Engine`` over its shard of the model, on the same request
stream. The calling process is rank 0: it spawns ranks 1..N-1 (``torch.multiprocessing``, spawn),
and all join one torch.distributed group (NCCL on GPUs, one GPU per rank; gloo on CPUs), plus a gloo
group for the commands. Rank 0 takes the requests; at each ``step`` it broadcasts what was added or
aborted since the last one (with the seed it drew for each request) and every rank then runs the
same step. Why this and not a scheduler that ships each iteration's tensors: the scheduler, the
memory accounting and sampling are deterministic functions of the command stream and of the logits,
and the logits are gathered (the same bits on every rank), so every rank reaches rank 0's decisions
without exchanging them; the engine's iteration code (eager, or replayed as CUDA graphs, whose
captured kernels include the collectives) runs unchanged, with one host sync per iteration as with
one process; and the only message per step is one small broadcast of commands on the CPU group.

Failure: a watchdog thread on rank 0 waits on the workers' process sentinels. When one exits
unasked (killed, or an exception, whose traceback it reports), every other worker is stopped and
the process group aborted, so no rank waits in a collective; rank 0's current or next call raises
``RankFailure`` naming the rank. Workers exit when rank 0's connection closes, and a watcher thread
ends one whose parent is gone. Collectives time out after ``timeout_s``. Spawned workers import the
caller's ``__main__`` module: scripts guard their entry point with ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine, StepOutput
from wmtp.engine.sampling import SamplingParams
from wmtp.errors import WmtpError
from wmtp.models.parallel import TPGroup

# a collective's limit: ranks run in lockstep, so this bounds the slowest rank's work between two
# collectives (loading a shard from disk precedes the first: 30 minutes)
TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 300.0  # spawning, importing torch and meeting at the store
# how long rank 0 waits, after a collective failed, for the watchdog to see which rank exited
FAILURE_GRACE_S = 5.0
# workers wait for the next command without a practical limit (an idle server)
_COMMAND_TIMEOUT = timedelta(days=3650)

_rank: TPGroup | None = None  # this process's place once it joined a group
_control: Any = None  # the gloo group of the commands
_kept: dict[int, Any] = {}  # what calls keep between calls on each rank (engines, by key)


class RankFailure(WmtpError):
    """A tensor-parallel rank exited or the ranks fell out of step; the group is gone."""


def local_tp() -> TPGroup | None:
    """This process's rank of the running tensor-parallel group (None outside one)."""
    return _rank


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:<rank>`` for "cuda" (one GPU per rank), else ``device``."""
    return f"cuda:{rank}" if device == "cuda" else device


def check_devices(size: int, device: str) -> None:
    """``WmtpError`` for a device that cannot hold ``size`` ranks (before anything is spawned)."""
    if device not in ("cuda", "cpu"):
        raise WmtpError(f"tensor parallelism takes device='cuda' (rank r on cuda:r) or 'cpu'; got {device!r}")
    visible = torch.cuda.device_count() if device == "cuda" else None
    if visible is not None and size > visible:
        raise WmtpError(f"tensor_parallel_size={size} needs {size} visible CUDA devices; {visible} visible "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def _join(rank: int, size: int, port: int, device: str, timeout_s: float) -> None:
    global _rank, _control
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    _control = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)
    _rank = TPGroup(rank, size)


def _leave() -> None:
    global _rank, _control
    _rank = _control = None
    _kept.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def _broadcast(message: Any = None) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def _watch_parent(parent: int) -> None:
    """A worker whose rank 0 is gone (killed before it could stop it) ends itself."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker(rank: int, size: int, port: int, device: str, timeout_s: float, threads: int, report: Any) -> None:
    """Ranks 1..N-1: join, then run each call rank 0 broadcasts until it broadcasts None."""
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        _join(rank, size, port, device, timeout_s)
        while (message := _broadcast()) is not None:
            released, fn, args = message
            for key in released:
                _kept.pop(key, None)
            with contextlib.suppress(WmtpError):  # bad input: rank 0 raises it too (Ranks.call)
                fn(*args)
        _leave()
    except BaseException:
        with contextlib.suppress(Exception):
            report.send(traceback.format_exc())
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """N ranks on this host: this process is rank 0, ranks 1..N-1 are spawned workers. ``call(fn,
    *args)`` runs ``fn(*args)`` on every rank in lockstep (``fn`` picklable by reference: a module
    function) and returns rank 0's result. One group per process (torch.distributed has one world):
    ``shared`` returns the running one, which every ``LLM`` of that size reuses, and the ranks live
    until ``close`` or the end of the process."""

    _live: ClassVar[Ranks | None] = None

    @classmethod
    def shared(cls, size: int, device: str, timeout_s: float = TIMEOUT_S) -> Ranks:
        live = cls._live
        if live is not None and (live.size, live.device) == (size, device) and live.failure is None:
            return live
        if live is not None:
            live.close()
        return cls(size, device, timeout_s)

    def __init__(self, size: int, device: str, timeout_s: float = TIMEOUT_S) -> None:
        check_devices(size, device)
        if size < 2:
            raise WmtpError(f"Ranks: size={size}; a tensor-parallel group has at least 2 ranks")
        if Ranks._live is not None or dist.is_initialized():
            raise WmtpError("a torch.distributed group is already running in this process; close it first")
        self.size, self.device = size, device
        self.failure: str | None = None
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._keys = itertools.count()
        self._released: list[int] = []
        # CPU ranks share the host's cores: each takes its part of rank 0's threads (with 2 threads
        # each on 2 cores a tiny Qwen3-Next score took 2.9 s instead of 0.07 s); restored by close
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // size) if device == "cpu" else self._threads
        torch.set_num_threads(threads)
        port, ctx = _free_port(), torch.multiprocessing.get_context("spawn")
        self.procs, self._reports = [], []
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(rank, size, port, device, timeout_s, threads, send),
                            name=f"wmtp-tp-rank{rank}", daemon=True)
            p.start()
            send.close()
            self.procs.append(p)
            self._reports.append(recv)
        Ranks._live = self
        threading.Thread(target=self._watch, name="wmtp-tp-watchdog", daemon=True).start()
        # joined from a thread, so that a worker dying before it joins is an error now, not at the timeout
        joined: list[BaseException | None] = []
        joiner = threading.Thread(target=lambda: joined.append(self._join_or_error(port, timeout_s)), daemon=True)
        joiner.start()
        while joiner.is_alive() and not self._failed.wait(0.05):
            pass
        error = joined[0] if joined else None
        if self.failure is not None or error is not None:
            why = self.failure or f"the tensor-parallel group did not form: {error!r}"
            self.close()
            raise RankFailure(why) from error

    def _join_or_error(self, port: int, timeout_s: float) -> BaseException | None:
        try:
            _join(0, self.size, port, self.device, timeout_s)
        except BaseException as e:
            return e
        return None

    # ---- calls -------------------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on every rank; rank 0's result. A ``WmtpError`` (bad input, which every rank
        refuses alike) is raised here and the ranks stay up; any other exception on rank 0, or the
        exit of any rank, stops the group (the ranks are out of step) and raises here."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        released, self._released = self._released, []
        try:
            _broadcast((released, fn, args))
            for key in released:
                _kept.pop(key, None)
            return fn(*args)
        except WmtpError:
            raise
        except BaseException as e:
            if isinstance(e, Exception) and self._failed.wait(FAILURE_GRACE_S):  # a collective saw a rank go
                raise RankFailure(self.failure) from e
            self._fail(f"rank 0 raised {type(e).__name__} inside a tensor-parallel call ({e}); the other ranks "
                       "were stopped")
            raise

    def new_key(self) -> int:
        """A key under which every rank keeps something between calls (an engine), passed to them
        in a call's arguments; ``release`` drops it."""
        return next(self._keys)

    def release(self, key: int) -> None:
        """Drop what every rank keeps under ``key``: here now, on the others with the next call
        (safe from a finalizer: no collective runs here)."""
        _kept.pop(key, None)
        self._released.append(key)

    # ---- failure and shutdown ----------------------------------------------------------------------
    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        proc, report = self.procs[rank - 1], self._reports[rank - 1]
        proc.join(1.0)
        tb = ""
        with contextlib.suppress(EOFError, OSError):  # EOF: it died without reporting (killed)
            tb = report.recv() if report.poll(0.5) else ""
        self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                   + (f"; its error:\n{tb}" if tb else ""))

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
            self._stop_workers()
            if self.device == "cuda":  # unblock collectives waiting for a rank that is gone
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()
            self._failed.set()

    def _stop_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)

    def close(self) -> None:
        """Stop the workers (asked; killed if they do not exit) and leave the process group."""
        if Ranks._live is not self:
            return
        self._closing = True
        if self.failure is None:
            with contextlib.suppress(Exception):
                _broadcast(None)
            for p in self.procs:
                p.join(10.0)
        self._stop_workers()
        with contextlib.suppress(Exception):
            _leave()
        torch.set_num_threads(self._threads)
        Ranks._live = None
        with self._lock:
            self.failure = self.failure or "the tensor-parallel group was closed"


@atexit.register
def _close_live() -> None:
    if Ranks._live is not None:
        Ranks._live.close()


# ---- the engine over the ranks ----------------------------------------------------------------------
def check_tensor_parallel(model: str, size: int, device: str):
    """``ConfigError`` / ``WmtpError`` where checkpoint directory or preset ``model`` cannot be
    sharded ``size`` ways on ``device``, before anything is spawned; returns its (whole) config."""
    from pathlib import Path

    from wmtp.config import ModelConfig
    from wmtp.models.loader import build_model
    from wmtp.models.parallel import check_shardable
    from wmtp.quant import QuantConfig

    if Path(model).is_dir():
        cfg, quant = ModelConfig.from_file(Path(model) / "config.json"), QuantConfig.from_checkpoint(Path(model))
    else:
        from wmtp.presets import PRESETS, preset_config

        cfg, raw = preset_config(model), PRESETS[model].get("quantization_config")
        quant = None if raw is None else QuantConfig.from_config_dict(raw, f"preset {model}")
    check_shardable(cfg, size)
    if quant is not None and size > 1:  # whether a shard would cut a scale block: the model's own rule, on meta
        build_model(cfg, "meta", torch.float32, quant=quant, tp=TPGroup(0, size))
    check_devices(size, device)
    return cfg


def _build_engine(key: int, model: str, spec: SpecConfig, eng: EngineConfig, device: str, dtype: Any, seed: int,
                  backend: str) -> Engine:
    import wmtp

    tp = local_tp()
    shard = wmtp.load_model(model, device=rank_device(device, tp.rank), dtype=dtype, seed=seed, backend=backend, tp=tp)
    _kept[key] = engine = Engine(shard, spec, eng)
    return engine


def slowest_rank(seconds: float) -> float:
    """An iteration's time as the slowest rank measured it, the same on every rank: the depth
    controllers see identical tables and choose identical depths (their local clocks differ)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control)
    return float(t)


def _step(key: int, commands: list[tuple]) -> list[StepOutput]:
    """One engine step on every rank; the other ranks first apply rank 0's adds and aborts."""
    engine = _kept[key]
    if local_tp().rank != 0:
        for cmd, *args in commands:
            getattr(engine, cmd)(*args)
    return engine.step()


class TPEngine:
    """Rank 0's face of an ``Engine`` that every rank runs (module docstring): ``add_request`` and
    ``abort`` act here at once and reach the other ranks with the next ``step``, which all run;
    every other attribute is rank 0's engine's (read it, do not change it: the other ranks would
    not follow)."""

    def __init__(self, ranks: Ranks, key: int, engine: Engine) -> None:
        import weakref

        self.ranks, self.key, self.engine = ranks, key, engine
        self._commands: list[tuple] = []
        self.close = weakref.finalize(self, ranks.release, key)

    @classmethod
    def start(cls, size: int, model: str, spec: SpecConfig, eng: EngineConfig, device: str, dtype: Any = None,
              seed: int = 0, backend: str = "torch") -> TPEngine:
        """An engine of checkpoint / preset ``model`` over ``size`` ranks (``Ranks.shared``); bad
        sizes and devices raise before anything is spawned."""
        check_tensor_parallel(model, size, device)
        ranks = Ranks.shared(size, device)
        key = ranks.new_key()
        return cls(ranks, key, ranks.call(_build_engine, key, model, spec, eng, device, dtype, seed, backend))

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        if isinstance(params, SamplingParams) and params.seed is None:  # every rank samples alike
            params = dataclasses.replace(params, seed=torch.seed() % 2**63)
        rid = self.engine.add_request(prompt, params)  # validates: the other ranks get only accepted requests
        self._commands.append(("add_request", list(prompt), params))
        return rid

    def abort(self, rid: int) -> None:
        self.engine.abort(rid)
        self._commands.append(("abort", rid))

    def step(self) -> list[StepOutput]:
        commands, self._commands = self._commands, []
        return self.ranks.call(_step, self.key, commands)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
