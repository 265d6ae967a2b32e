"""The KV stage's forwards in a pipeline: the KV of batch ``i`` copied to host memory while the
forward of batch ``i + 1`` runs (on a CUDA device), the chunks' KV handed on group by group.

What each batch computes is :func:`~coinrag.inference.model.encode.compute_chunk_kv`'s (one
right-padded forward after ``C_p``, from a fresh rotary state, the cache cut to the chunk's
tokens; ``inference/model/encode.py`` says why that is each chunk's own KV). What differs is
when the host waits:

- on a CUDA device (:class:`BatchKvPipeline`): a batch's forward is launched, its KV
  ``(batch, layers, 2, kv_heads, width, head_dim)`` stacked on the device, and its copy into a
  pinned host buffer queued on a second stream after the forward (an event orders them); the
  host then collects the **previous** batch (waits for its copy, cuts each chunk's KV) while
  the device runs this batch's forward. Pinned buffers come from torch's caching host
  allocator (reused once a batch's KV is freed); ``C_p`` is moved to the device once. The
  driver's writer thread (``tasks/kv.py``) encodes and writes the shards of a group while the
  next groups' forwards run, so the device waits for neither the copy nor the write.
- on a CPU the same steps run one after the other (forward, KV out of the cache, cut): the
  stored KV is the one :func:`compute_chunk_kv` gives, bit for bit
  (``tests/inference/test_kv_pipeline.py``).

:func:`fill_batch_size`: the most chunks of a length whose forward and KV copies fit in a
share of the device's free memory (``kv_fill_device``; the KV stage never lowers
``kv_batch_size``).

E.g. 3 groups of 16 chunks, batches of 8: batches 0..5 launched in turn; group 0 is handed on
once batch 1's KV is on the host, which happens while batch 2's forward runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coinrag.inference.model.encode import (
    KvBatching,
    cache_to_kv,
    check_one_frequency,
    forward_after_prefix,
    keys_to_position_zero,
)
from coinrag.inference.rope import model_rope
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KvLayout

MAX_FILL_CHUNKS = 64  # fill_batch_size's ceiling (a bigger forward gains no MFU, pins more)


@dataclass
class _InFlight:
    """A launched batch: its chunks and its KV on the host, complete once ``done`` is."""

    batch: Sequence[ChunkRow]
    kv: torch.Tensor  # (batch, layers, 2, kv_heads, width, head_dim), host memory
    done: Any  # torch.cuda.Event of its copy, or None (already complete)
    seconds: dict[str, float]  # forward, extract (this batch's)


class BatchKvPipeline:
    """Each batch's chunk KV after ``prefix_kv`` (``C_p``, ``(layers, 2, H, |p|, D)``), with one
    batch in flight on a CUDA device. Each batch's seconds: ``forward`` (launching the forward
    and, on a CPU, running it) and ``extract`` (the KV out of the cache and, on CUDA, waiting
    for its copy: the forward's remaining time included)."""

    def __init__(self, model: Any, prefix_kv: torch.Tensor, pad_id: int = 0) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.prefix_kv = prefix_kv.to(self.device)  # the same tensor where it is there already
        self.pad_id = pad_id
        self.copies = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def launch(self, batch: Sequence[ChunkRow]) -> _InFlight:
        """Run (CPU) or launch (CUDA) the forward of ``batch`` and the copy of its KV to host
        memory. ValueError for chunks needing different RoPE frequencies (``KvBatching``)."""
        p = self.prefix_kv.shape[3]
        check_one_frequency(self.model, p, batch)
        t0 = time.perf_counter()
        rows = [c.token_ids for c in batch]
        with torch.inference_mode():
            cache = forward_after_prefix(self.model, self.prefix_kv, rows, self.pad_id)
            t1 = time.perf_counter()
            stacked = cache_to_kv(cache, start=p)
        del cache
        seconds = {"forward": t1 - t0}
        if self.copies is None:
            flight = _InFlight(batch, stacked.cpu(), None, seconds)
        else:
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            computed = torch.cuda.Event()
            computed.record()  # on the forward's stream
            self.copies.wait_event(computed)
            with torch.cuda.stream(self.copies):
                host.copy_(stacked, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copies)
            stacked.record_stream(self.copies)  # not reused before the copy has read it
            flight = _InFlight(batch, host, done, seconds)
        seconds["extract"] = time.perf_counter() - t1
        return flight

    def collect(self, flight: _InFlight) -> list[torch.Tensor]:
        """The launched batch's KV, one ``(layers, 2, kv_heads, n_tokens, head_dim)`` per chunk
        (views of its host buffer), once its copy is complete."""
        t0 = time.perf_counter()
        if flight.done is not None:
            flight.done.synchronize()
        flight.seconds["extract"] += time.perf_counter() - t0
        return [flight.kv[b, :, :, :, : c.n_tokens] for b, c in enumerate(flight.batch)]

    def run(
        self, batches: Iterable[Sequence[ChunkRow]]
    ) -> Iterator[tuple[Sequence[ChunkRow], list[torch.Tensor], dict[str, float]]]:
        """``(batch, its chunks' KV, its seconds)`` in the order of ``batches``, each batch
        launched before the previous one is collected."""
        pending: _InFlight | None = None
        for batch in batches:
            flight = self.launch(batch)
            if pending is not None:
                yield pending.batch, self.collect(pending), pending.seconds
            pending = flight
        if pending is not None:
            yield pending.batch, self.collect(pending), pending.seconds


def groups_kv(
    model: Any,
    prefix_kv: torch.Tensor,
    groups: Sequence[Sequence[ChunkRow]],
    batch_size: int,
    pad_id: int = 0,
    layout: KvLayout | None = None,
) -> Iterator[tuple[list[tuple[ChunkRow, torch.Tensor]], dict[str, float]]]:
    """Per group of chunks (``tasks.kv.kv_groups``), in order: ``(chunk, kv)`` in the group's
    order and the seconds its batches took (``forward``, ``extract``). Each group is cut into
    the batches of :class:`KvBatching` (at most ``batch_size`` chunks) and one pipeline runs
    across groups (the next group's first forward runs while this group is handed on). kv is
    ``(layers, 2, kv_heads, n_tokens, head_dim)`` in the frame ``layout`` stores (keys at
    position 0 where ``layout.keys_at_zero``; as the model cached it when no layout is given)."""
    p = prefix_kv.shape[3]
    batching = KvBatching.for_model(model, p, batch_size)
    spec = model_rope(model.config) if layout and layout.keys_at_zero else None
    split = [batching.split(group) for group in groups]
    pipeline = BatchKvPipeline(model, prefix_kv, pad_id)
    flat = (batch for batches in split for batch in batches)
    results = pipeline.run(flat)
    for batches in split:
        out: list[tuple[ChunkRow, torch.Tensor]] = []
        seconds = {"forward": 0.0, "extract": 0.0}
        for _ in batches:
            batch, kvs, spent = next(results)
            if spec is not None:
                kvs = [keys_to_position_zero(kv, spec, p) for kv in kvs]
            out += zip(batch, kvs, strict=True)
            for name, value in spent.items():
                seconds[name] += value
        yield out, seconds


def compute_group_kv(
    model: Any,
    prefix_kv: torch.Tensor,
    group: Sequence[ChunkRow],
    batch_size: int,
    pad_id: int = 0,
    timings: dict[str, float] | None = None,
    layout: KvLayout | None = None,
) -> list[tuple[ChunkRow, torch.Tensor]]:
    """``(chunk, kv)`` for one group of chunks: :func:`groups_kv` of ``[group]``; ``timings``
    accumulates its ``forward`` and ``extract`` seconds."""
    ((out, seconds),) = groups_kv(model, prefix_kv, [group], batch_size, pad_id, layout)
    if timings is not None:
        for name, value in seconds.items():
            timings[name] = timings.get(name, 0.0) + value
    return out


def fill_batch_size(
    config: Any,
    dtype_bytes: int,
    chunk_tokens: int,
    prefix_tokens: int,
    free_bytes: int,
    share: float = 0.8,
) -> int:
    """The most chunks of ``chunk_tokens`` tokens (1..``MAX_FILL_CHUNKS``) whose forward after
    ``prefix_tokens`` fits in ``share`` of ``free_bytes`` of device memory, for a model of
    ``config`` (a transformers config) computing in ``dtype_bytes``-byte floats: per token the
    cache and its stacked copy for two batches (one computing, one copying), the layer's
    largest activations (hidden states, q/k/v, the MLP's three projections) and attention
    scores in float32 (the unfused worst case).

    E.g. Qwen2-7B dims in bfloat16, 512-token chunks after 32 tokens: 432,640 bytes per token
    (221 MB per chunk): 10 GB free -> 36 chunks; 120 GB -> 64 (the ceiling)."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers, kv_heads = int(config.num_hidden_layers), int(config.num_key_value_heads)
    kv = layers * 2 * kv_heads * head_dim * dtype_bytes
    activations = (4 * int(config.hidden_size) + 3 * int(config.intermediate_size)) * dtype_bytes
    scores = heads * (prefix_tokens + chunk_tokens) * 4
    per_chunk = chunk_tokens * (4 * kv + activations + scores)
    return max(1, min(MAX_FILL_CHUNKS, int(free_bytes * share) // max(per_chunk, 1)))


def device_free_bytes(model: Any) -> int | None:
    """Free memory of ``model``'s CUDA device (bytes), None on another device."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
