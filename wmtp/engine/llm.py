"""``wmtp.LLM``: the offline API (vLLM-style) over the engine: generate, streaming, tokenizer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.sampling import SamplingParams
from wmtp.errors import WmtpError
from wmtp.models.base import TargetLM
from wmtp.tokenizer import TextTokenizer

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    metrics: dict[str, Any]


class LLM:
    """``LLM(model_path_or_preset, spec=SpecConfig(...), device=..., dtype=..., max_model_len=...)``.

    ``backend="auto"`` picks the Triton kernels on a CUDA device (when triton is installed) and the
    PyTorch reference otherwise. ``model`` may also be a built ``TargetLM`` (its own device, dtype
    and backend; no tokenizer). ``tensor_parallel_size=N`` shards the model over N ranks, one
    process each (``device="cuda"``: rank r on cuda:r; ``"cpu"``: gloo), that this process starts and
    drives (``wmtp.engine.distributed``); the pools (and ``kv_memory_bytes``) are then each rank's,
    and ``close()`` frees them on every rank."""

    def __init__(
        self,
        model: str | TargetLM,
        spec: SpecConfig | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        page_size: int = 64,
        num_kv_pages: int | None = None,
        kv_memory_bytes: int | None = None,
        prefill_chunk: int = 512,
        seed: int = 0,
        backend: str = "auto",
        decode_graphs: str = "auto",
        overlap: bool = True,
        tensor_parallel_size: int = 1,
        prefix_cache: bool = False,
        prefix_snapshot_interval: int = EngineConfig.prefix_snapshot_interval,
        prefix_snapshots: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        import wmtp
        from wmtp.models.backend import default_backend

        eng = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, page_size=page_size,
                           num_kv_pages=num_kv_pages, kv_memory_bytes=kv_memory_bytes, prefill_chunk=prefill_chunk,
                           decode_graphs=decode_graphs, overlap=overlap, prefix_cache=prefix_cache,
                           prefix_snapshot_interval=prefix_snapshot_interval, prefix_snapshots=prefix_snapshots,
                           kv_cache_dtype=kv_cache_dtype)
        self.spec = spec or SpecConfig()
        if isinstance(model, TargetLM):  # a built model of any family
            if tensor_parallel_size != 1:
                raise WmtpError("tensor_parallel_size > 1 takes a checkpoint directory or preset name (each rank "
                                "loads its own shard), not a built model")
            self.model, self.tokenizer = model, None
        else:
            backend = default_backend(device) if backend == "auto" else backend
            if tensor_parallel_size != 1:
                from wmtp.engine.distributed import TPEngine

                self.engine = TPEngine.start(tensor_parallel_size, model, self.spec, eng, device, dtype, seed, backend)
                self.model = self.engine.model  # rank 0's shard
            else:
                self.model = wmtp.load_model(model, device=device, dtype=dtype, seed=seed, backend=backend)
            self.tokenizer = TextTokenizer.for_model(model, self.model.config.vocab_size)
        if tensor_parallel_size == 1:
            self.engine = Engine(self.model, self.spec, eng)

    # ---- inputs --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise WmtpError("text prompts need a tokenizer (tokenizer.json in the checkpoint); pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) if isinstance(t, torch.Tensor) else t for t in prompt]  # add_request validates

    def _output(self, rid: int) -> RequestOutput:
        req = self.engine.requests[rid]
        gen = req.tokens[len(req.prompt):]
        text = self.tokenizer.decode(gen) if self.tokenizer else None
        return RequestOutput(rid, list(req.prompt), gen, text, req.finish_reason is not None,
                             req.finish_reason, req.metrics.to_dict())

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. Bad input raises before any work."""
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise WmtpError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, plist):  # validate all before admitting any
            if not isinstance(p, SamplingParams):
                raise WmtpError(f"params must be SamplingParams, got {type(p).__name__}")
            self.engine.memory.check_fits_ever(len(ids), p.max_tokens)
        rids = [self.engine.add_request(ids, p) for ids, p in zip(encoded, plist)]
        pending = set(rids)
        while pending:
            for out in self.engine.step():
                if out.finished:
                    pending.discard(out.request_id)
        return [self._output(r) for r in rids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput holding only the newly emitted tokens each time some arrive."""
        rid = self.engine.add_request(self.encode(prompt), params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    full = self._output(rid)
                    text = self.tokenizer.decode(out.new_token_ids) if self.tokenizer else None
                    yield RequestOutput(rid, full.prompt_token_ids, out.new_token_ids, text, out.finished,
                                        out.finish_reason, full.metrics)
                    if out.finished:
                        return
        finally:
            self.engine.abort(rid)  # a consumer that stops early frees the request's memory

    def stats(self) -> dict:
        """Engine-wide metrics: histogram, AL, α_j, T_iter, TTFT / TPOT medians, pool bytes and use."""
        return self.engine.stats()

    def memory_report(self) -> dict[str, int]:
        """Pool bytes (per rank under tensor parallelism: each holds its heads' KV and states)."""
        return self.engine.memory.bytes_report()

    def close(self) -> None:
        """Free the engine's pools on every tensor-parallel rank (the ranks stay up for the next
        ``LLM`` of their size); a no-op in one process."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
