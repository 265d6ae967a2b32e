"""The KV build stage: each chunk's per-layer K/V, computed once after the RAG prompt prefix.

For every chunk whose ``content_key`` has no valid entry in the KV store of
``kv_fp = (model_fp, prompt prefix)``, the model encodes the chunk after the prefix's cached KV
``C_p`` (``inference/encode.py``: where a chunk sits, how chunks are batched and why the result
is the chunk's own KV) and the chunk's part of the cache is stored (``storage/kv/``; the layout:
``storage/kv/layout.py``). This module is the stage around that: what to compute, in which units,
written how, and what it did.

- ``C_p`` is computed once and stored; a later run reads it back and computes against the stored
  copy, so every entry of a kv_fp was computed against the same bits of ``C_p``.
- Chunks are sorted by length (stable, so document order among equal lengths; most chunks have
  exactly ``chunk_size`` tokens) and batched by ``inference.encode.KvBatching``.
- Units of work (:func:`kv_groups`): the sorted chunks are cut into groups of whole shards
  holding at least one whole batch; a group is computed batch by batch and stored as its
  shards. :func:`kv_stage` runs the groups one after the other in this process; a distributed
  build (``flows/build.py``) computes each group on a worker (:func:`stage_group_kv`: shards
  written under temporary names) and the holder of the store's lock publishes them in group
  order, so both give the same batches, the same shard numbers and bit-identical entries.
- Entries are written ``slots_per_shard`` at a time (one Zarr shard each, written whole); after a
  shard is verified its manifest rows are appended, then ``progress`` is called. With
  ``overlap`` (default) a background thread writes shard ``i`` while the model computes the next
  batches (at most one shard in flight). A run killed mid-way loses at most the shard being
  written; the next run recomputes only the chunks without a valid manifest row. An unchanged
  rerun computes nothing.
- Existing entries are checked at the level ``check`` before they are reused: ``crc32c``
  (default: shard folders and file sizes, then every block of every reused entry and each shard
  index read and crc32c-checked: finds deleted and truncated shards and flipped bytes), ``stat``
  (folders and sizes only, one stat per shard), ``sha256`` (every entry read and checked against
  the manifest's sha256) or ``none``. Entries that fail are rebuilt; the new manifest row
  supersedes the old one. Pass ``rebuild=`` the content_keys a reader found corrupt
  (:class:`storage.kv.CorruptKvEntry`) to rebuild just those. A stored ``C_p`` that fails its
  check is recomputed first (:func:`repair_prefix_kv`); if the recomputed one is not bit for bit
  the damaged one, every entry is rebuilt against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from coinrag.inference.encode import (
    KvBatching,
    compute_group_kv,
    compute_prefix_kv,
    kv_layout,
    pad_id,
)
from coinrag.inference.prompt import RagPrompt
from coinrag.schemas.tables import ChunkRow, KvManifestRow
from coinrag.storage.kv import KvFingerprintMismatch, KvStore, StagedShard
from coinrag.storage.store import Store

ProgressFn = Callable[[int, int], None]  # (entries computed so far, entries to compute)


@dataclass
class KvCounts:
    """What one run of the stage did."""

    kv_fp: str
    chunks: int = 0  # chunks asked for
    unique: int = 0  # distinct content_keys among them
    reused: int = 0  # already stored and valid
    rebuilt: int = 0  # had a manifest row that failed the check (or was named in `rebuild`)
    problems: dict[str, str] = field(default_factory=dict)  # content_key -> why it failed
    prefix_repaired: bool = False  # the stored C_p failed its check and was recomputed
    computed: int = 0  # entries computed and written by this run (includes `rebuilt`)
    forward_passes: int = 0  # batched model calls (the prefix's excluded)
    tokens: int = 0  # chunk tokens computed
    padded_tokens: int = 0  # padding tokens computed (right padding in mixed-length batches)
    shards: int = 0
    logical_bytes: int = 0  # bytes of the entries written (tokens x bytes per token)
    disk_bytes: int = 0  # bytes of the shard files written
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _batches(chunks: Sequence[ChunkRow], batch_size: int) -> list[list[ChunkRow]]:
    ordered = sorted(chunks, key=lambda c: -c.n_tokens)  # stable: document order within a length
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def kv_groups(
    chunks: Sequence[ChunkRow], batch_size: int, slots_per_shard: int
) -> list[list[ChunkRow]]:
    """The units of KV work: chunks sorted by length (stable), cut into groups of
    ``slots_per_shard * ceil(batch_size / slots_per_shard)`` chunks (whole shards, at least one
    whole batch). A group is computed in batches of ``batch_size`` and stored as consecutive
    shards of ``slots_per_shard``, so every runner (one process or many workers) forms the same
    batches and shards and stores bit-identical entries.

    E.g. 10 chunks, batch 4, 4 slots -> groups of 4, 4, 2; batch 8, 4 slots -> groups of 8, 2.
    """
    size = slots_per_shard * -(-batch_size // slots_per_shard)
    return _batches(chunks, size)


def kv_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    loaded: Any,
    prompt: RagPrompt,
    run_id: str,
    batch_size: int = 4,
    progress: ProgressFn | None = None,
    *,
    check: str = "crc32c",
    rebuild: Iterable[str] = (),
    slots_per_shard: int = 0,
    block_tokens: int = 0,
    overlap: bool = True,
    kv_codec: str = "none",
) -> KvCounts:
    """Compute and store the KV of every chunk that has no valid entry yet.

    ``loaded`` is an ``inference.models.LoadedModel`` (``.model``, ``.tokenizer``,
    ``.model_fp``); ``prompt`` the RAG prompt whose prefix the chunks are encoded after.
    ``slots_per_shard=0`` derives it from the entry size (shards of about 64 MiB);
    ``block_tokens=0`` takes the codec's block size; ``kv_codec`` (``none`` | ``int8`` |
    ``int4``) says how entries are stored (``storage/kv/codecs.py``).
    ``overlap`` writes each shard in a background thread while the next batch is computed.
    Returns counts and timings (``seconds``: check, prefix, forward, extract, write, verify,
    manifest (the last three in the writer), wait_write (the stage waiting for the writer),
    total).
    """
    t_start = time.perf_counter()
    model = loaded.model
    layout = kv_layout(
        loaded,
        prompt,
        block_tokens=block_tokens,
        slots_per_shard=slots_per_shard,
        kv_codec=kv_codec,
    )
    kv = KvStore.create(store, layout)
    counts = KvCounts(kv_fp=kv.kv_fp, chunks=len(chunks))
    secs = counts.seconds

    ids = prompt.prefix_ids
    if repair_prefix_kv(kv, counts, lambda: compute_prefix_kv(model, ids), ids):
        rebuild = set(rebuild) | set(kv.manifest(refresh=True))
    todo = plan_kv(kv, chunks, getattr(loaded, "tokenizer_fp", None), counts, check, rebuild)

    t0 = time.perf_counter()
    prefix_kv = prefix_kv_of(kv, model, prompt)
    secs["prefix"] = time.perf_counter() - t0

    pad = pad_id(loaded.tokenizer)
    batching = KvBatching.for_model(model, prefix_kv.shape[3], batch_size)
    secs.update(forward=0.0, extract=0.0, wait_write=0.0)
    writer = _Writer(kv, run_id, counts, progress, len(todo), overlap)
    try:
        for group in kv_groups(todo, batch_size, layout.slots_per_shard):
            entries = compute_group_kv(model, prefix_kv, group, batch_size, pad, secs, layout)
            count_batches(counts, group, batching)
            for start in range(0, len(entries), layout.slots_per_shard):
                writer.submit(entries[start : start + layout.slots_per_shard])
        writer.wait()
    finally:
        writer.close()
        kv.release_buffers()
    ws = kv.write_stats
    secs["wait_write"] = writer.waited
    secs["write"] = ws.encode_write_s
    secs["verify"] = ws.verify_s
    secs["manifest"] = ws.manifest_s
    secs["total"] = time.perf_counter() - t_start
    return counts


def plan_kv(
    kv: KvStore,
    chunks: Sequence[ChunkRow],
    tokenizer_fp: str | None,
    counts: KvCounts,
    check: str = "crc32c",
    rebuild: Iterable[str] = (),
) -> list[ChunkRow]:
    """The chunks (one per content_key) whose KV must be computed: no manifest row, or a row
    that fails the ``check`` (``crc32c`` | ``stat`` | ``sha256`` | ``none``) or is named in
    ``rebuild``. Fills ``counts`` (unique, reused, rebuilt, problems, seconds["check"]).
    Raises ValueError for a chunk cut by another tokenizer."""
    unique: dict[str, ChunkRow] = {}
    for chunk in chunks:
        if tokenizer_fp is not None and chunk.tokenizer_fp != tokenizer_fp:
            raise ValueError(
                f"chunk {chunk.chunk_id} was cut with tokenizer {chunk.tokenizer_fp}, "
                f"the model's is {tokenizer_fp}: its token ids mean nothing to this model"
            )
        unique.setdefault(chunk.content_key, chunk)
    counts.unique = len(unique)

    t0 = time.perf_counter()
    manifest = kv.manifest(refresh=True)
    stored = [ck for ck in unique if ck in manifest]
    bad = set(rebuild) & set(stored)
    if check != "none":
        problems = kv.entry_problems(stored, level=check)
        counts.problems.update(problems)
        bad |= set(problems)
    counts.rebuilt = len(bad)
    counts.reused = len(stored) - len(bad)
    counts.seconds["check"] = time.perf_counter() - t0
    return [c for ck, c in unique.items() if ck not in manifest or ck in bad]


def count_batches(counts: KvCounts, group: Sequence[ChunkRow], batching: KvBatching) -> None:
    """Add a computed group's forward passes, tokens and padding to ``counts``."""
    for batch in batching.split(group):
        n_real = sum(c.n_tokens for c in batch)
        counts.forward_passes += 1
        counts.tokens += n_real
        counts.padded_tokens += len(batch) * max(c.n_tokens for c in batch) - n_real


def stage_group_kv(
    kv: KvStore,
    loaded: Any,
    prefix_kv: torch.Tensor,
    group: Sequence[ChunkRow],
    run_id: str,
    batch_size: int,
) -> tuple[list[StagedShard], dict[str, float]]:
    """A worker's share of the stage: compute one group of :func:`kv_groups` and write it as
    staged shards (``slots_per_shard`` each, under ``.tmp-`` names, verified); the write-lock
    holder publishes them in group order (:meth:`storage.kv.KvStore.publish_shard`).
    Returns the staged shards and the seconds spent (forward, extract)."""
    if loaded.model_fp != kv.layout.model_fp:
        raise KvFingerprintMismatch(
            loaded.model_fp, kv.layout.model_fp, "this worker's model is not the build's"
        )
    secs: dict[str, float] = {}
    entries = compute_group_kv(
        loaded.model, prefix_kv, group, batch_size, pad_id(loaded.tokenizer), secs, kv.layout
    )
    step = kv.layout.slots_per_shard
    try:
        staged = [
            kv.stage_shard(entries[i : i + step], run_id) for i in range(0, len(entries), step)
        ]
    finally:
        kv.release_buffers()
    return staged, secs


class _Writer:
    """Writes shards, in a background thread when ``overlap`` (at most one shard in flight, so
    the next batch's forward runs while the previous shard is written and verified).

    Counts and ``progress`` are updated in the caller's thread once a shard's manifest rows
    exist. If the caller fails, the shard in flight is finished (it is complete and verified
    and gets its rows) before the error propagates.
    """

    def __init__(
        self,
        kv: KvStore,
        run_id: str,
        counts: KvCounts,
        progress: ProgressFn | None,
        total: int,
        overlap: bool,
    ) -> None:
        self.kv, self.run_id, self.counts = kv, run_id, counts
        self.progress, self.total = progress, total
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-writer") if overlap else None
        self.in_flight: Future[list[KvManifestRow]] | None = None
        self.before = (kv.write_stats.disk_bytes, kv.write_stats.shards)
        self.waited = 0.0

    def submit(self, entries: list[tuple[ChunkRow, torch.Tensor]]) -> None:
        self.wait()
        if self.pool is None:
            self._done(self.kv.write_entries(entries, self.run_id))
        else:
            self.in_flight = self.pool.submit(self.kv.write_entries, entries, self.run_id)

    def wait(self) -> None:
        if self.in_flight is not None:
            t0 = time.perf_counter()
            future, self.in_flight = self.in_flight, None
            rows = future.result()
            self.waited += time.perf_counter() - t0
            self._done(rows)

    def _done(self, rows: list[KvManifestRow]) -> None:
        ws, counts = self.kv.write_stats, self.counts
        counts.computed += len(rows)
        counts.logical_bytes += sum(r.bytes for r in rows)
        counts.shards = ws.shards - self.before[1]
        counts.disk_bytes = ws.disk_bytes - self.before[0]
        if self.progress is not None:
            self.progress(counts.computed, self.total)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def stored_prefix_kv(kv: KvStore, prefix_ids: Sequence[int]) -> torch.Tensor:
    """The stored ``C_p``, checked to be the KV of ``prefix_ids``."""
    prefix_kv, ids = kv.read_prefix()
    if ids != list(prefix_ids):
        raise KvFingerprintMismatch(kv.kv_fp, kv.layout.prefix_sha, "stored prefix ids differ")
    return prefix_kv


def repair_prefix_kv(
    kv: KvStore, counts: KvCounts, compute: Callable[[], torch.Tensor], prefix_ids: Sequence[int]
) -> bool:
    """Recompute (``compute()``: ``C_p`` of ``prefix_ids``) and replace a stored ``C_p`` that
    fails its check. True when every stored entry must be rebuilt: the recomputed ``C_p`` is
    not bit for bit the one they were computed against. Sets ``counts.prefix_repaired``."""
    problem = kv.corrupt_prefix()
    if problem is None:
        return False
    counts.prefix_repaired = True
    counts.problems["prefix"] = f"{problem} ({kv.kv_fp}/prefix)"
    return not kv.repair_prefix(compute(), prefix_ids)


def prefix_kv_of(kv: KvStore, model: Any, prompt: RagPrompt) -> torch.Tensor:
    """The stored ``C_p`` (computed and stored first if missing)."""
    if kv.has_prefix():
        return stored_prefix_kv(kv, prompt.prefix_ids)
    prefix_kv = compute_prefix_kv(model, prompt.prefix_ids)
    expected = kv.layout.entry_shape(len(prompt.prefix_ids))
    if tuple(prefix_kv.shape) != expected:
        raise ValueError(
            f"the model's cache has shape {tuple(prefix_kv.shape)}, the layout expects {expected}"
        )
    kv.write_prefix(prefix_kv, prompt.prefix_ids)
    return prefix_kv
