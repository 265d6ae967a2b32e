"""Staging shards: entries checked, encoded into a shard, written, read back and verified.

A staged shard lies under ``STORE/kv/<kv_fp>/.tmp-<uuid>/`` and is not valid yet: only
``KvStore.publish_shard`` (the write-lock holder, ``storage/kv/store.py``) moves it into place
and appends its manifest rows. Staging writes only its own new folder, so workers of a
distributed build stage shards in parallel; :class:`StagedShard` is what they hand back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, TypeVar

import numpy as np
import torch

from coinrag.schemas.keys import CODE_VERSION
from coinrag.schemas.tables import ChunkRow, KvManifestRow
from coinrag.storage.kv.codecs import entry_checksum
from coinrag.storage.kv.kept import KvEntry
from coinrag.storage.kv.layout import KvLayout
from coinrag.storage.kv.shard import (
    ShardContent,
    shard_attributes,
    write_shard_direct,
    write_shard_zarr,
)
from coinrag.storage.kv.transport import KvTransport, LocalFiles, ScratchBuffers

V = TypeVar("V")  # an entry's values: a KV tensor or its stored bytes

SHARD_WRITERS = {"direct": write_shard_direct, "zarr": write_shard_zarr}


@dataclass(frozen=True)
class StagedShard:
    """A shard written and verified under ``.tmp-<uuid>/`` but not yet valid: no manifest row
    points to it until :meth:`KvStore.publish_shard` renames it into place and appends its rows.

    It can be made on another process or machine that sees the same store folder (a worker of
    a distributed build) and published by the holder of the store's write lock. Per slot:
    ``chunk_ids``, ``content_keys``, ``tokens`` (stored), ``checksums`` (sha256 of the stored
    bytes), ``chunk_tokens`` (the chunk's) and ``kept`` (the ranges held, flat; None: the whole
    chunk, ``storage/kv/kept.py``).
    """

    kv_fp: str
    tmp_name: str  # folder name under STORE/kv/<kv_fp>/
    chunk_ids: tuple[str, ...]
    content_keys: tuple[str, ...]
    tokens: tuple[int, ...]
    checksums: tuple[str, ...]
    logical_bytes: int
    disk_bytes: int
    encode_write_s: float
    verify_s: float
    chunk_tokens: tuple[int, ...] = ()
    kept: tuple[tuple[int, ...] | None, ...] = ()

    def manifest_rows(self, shard: str, layout: KvLayout, run_id: str) -> list[KvManifestRow]:
        """Its manifest rows once published as ``shard`` (``run_id``: the publishing run's)."""
        n = len(self.content_keys)
        chunk_tokens = self.chunk_tokens or self.tokens
        kept = self.kept or (None,) * n
        return [
            KvManifestRow(
                chunk_id=self.chunk_ids[i],
                content_key=self.content_keys[i],
                model_fp=layout.model_fp,
                location=f"{self.kv_fp}/{shard}#slot-{i}",
                tokens=chunk_tokens[i],
                bytes=layout.entry_bytes(self.tokens[i]),
                checksum=self.checksums[i],
                run_id=run_id,
                code_version=CODE_VERSION,
                kept=None if kept[i] is None else list(kept[i]),  # type: ignore[arg-type]
            )
            for i in range(n)
        ]


@dataclass
class WriteStats:
    """Cumulative cost of writes through one KvStore."""

    shards: int = 0
    entries: int = 0
    logical_bytes: int = 0
    disk_bytes: int = 0
    encode_write_s: float = 0.0
    verify_s: float = 0.0
    manifest_s: float = 0.0

    def add(self, staged: StagedShard) -> None:
        """Count a published shard."""
        self.shards += 1
        self.entries += len(staged.content_keys)
        self.logical_bytes += staged.logical_bytes
        self.disk_bytes += staged.disk_bytes
        self.encode_write_s += staged.encode_write_s
        self.verify_s += staged.verify_s


def distinct_entries(
    layout: KvLayout, entries: Sequence[tuple[ChunkRow | KvEntry, torch.Tensor]]
) -> list[tuple[KvEntry, torch.Tensor]]:
    """The entries with distinct keys (first wins; ``storage/kv/kept.py``), each checked against
    the layout's shape and dtype (ValueError naming the chunk).

    An entry is a ``ChunkRow`` (the whole chunk: ``kv`` of its ``n_tokens``) or a
    :class:`KvEntry`, whose ``kv`` is what it stores (``KvEntry.cut`` of the chunk's KV). A
    layout that keeps only nugget spans takes only entries with kept ranges, and one keeping
    chunks only whole ones."""

    def check(entry: KvEntry, kv: torch.Tensor) -> None:
        if (entry.kept is None) != layout.keeps_chunks:
            held = "the whole chunk" if entry.kept is None else f"ranges {entry.kept}"
            raise ValueError(
                f"entry of {entry.chunk_id} holds {held}, but this KV store keeps "
                f"{'whole chunks' if layout.keeps_chunks else 'nugget spans'} "
                f"(kv_keep = {layout.keep})"
            )
        expected = layout.entry_shape(entry.stored_tokens)
        if tuple(kv.shape) != expected:
            raise ValueError(
                f"KV of {entry.chunk_id} has shape {tuple(kv.shape)}, expected {expected}"
            )
        lossy_input = not layout.codec.lossless and kv.dtype == torch.float32
        if kv.dtype != layout.torch_dtype and not lossy_input:  # a lossy codec quantizes float32
            raise ValueError(f"KV of {entry.chunk_id} is {kv.dtype}, the layout is {layout.dtype}")

    return _distinct(entries, check)


def distinct_stored(
    layout: KvLayout, entries: Sequence[tuple[ChunkRow | KvEntry, np.ndarray]]
) -> list[tuple[KvEntry, np.ndarray]]:
    """Like :func:`distinct_entries`, for entries given as the codec's stored values (checked
    against what the codec stores for their stored token counts)."""

    def check(entry: KvEntry, stored: np.ndarray) -> None:
        expected = layout.entry_bytes(entry.stored_tokens)
        if stored.dtype != layout.storage_dtype or stored.nbytes != expected:
            raise ValueError(
                f"stored values of {entry.chunk_id} are {stored.dtype} {tuple(stored.shape)}, "
                f"expected {expected} bytes of {layout.storage_dtype}"
            )

    return _distinct(entries, check)


def _distinct(
    entries: Iterable[tuple[ChunkRow | KvEntry, V]], check: Callable[[KvEntry, V], None]
) -> list[tuple[KvEntry, V]]:
    """The entries with a key not seen before (the first of each), each passing ``check``."""
    seen: set[str] = set()
    unique: list[tuple[KvEntry, V]] = []
    for ref, value in entries:
        entry = KvEntry.of(ref)
        if entry.key in seen:
            continue
        seen.add(entry.key)
        check(entry, value)
        unique.append((entry, value))
    return unique


class ShardStager:
    """Writes staged shards of one KV store (``root``) through its transport.

    ``encoder``: ``"direct"`` (``shard.encode_shard``, one strided copy into a reused,
    page-aligned buffer, written with O_DIRECT where ``direct_io`` and the file system allow)
    or ``"zarr"`` (Zarr's own writer, the reference). ``fsync``: durability against power loss.
    """

    def __init__(
        self,
        layout: KvLayout,
        root: PurePath,
        transport: KvTransport,
        *,
        encoder: str = "direct",
        fsync: bool = False,
        direct_io: bool = True,
    ) -> None:
        if encoder not in SHARD_WRITERS:
            raise ValueError(f"unknown shard encoder {encoder!r} (direct, zarr)")
        self.layout = layout
        self.root = root
        self.transport = transport
        self.encoder = encoder
        self.fsync = fsync
        self.scratch = ScratchBuffers()
        self.files = LocalFiles(direct_io)

    def stage(
        self,
        group: Sequence[tuple[ChunkRow | KvEntry, Any]],
        run_id: str,
        stored: bool = False,
    ) -> StagedShard:
        """Write one shard of ``group`` (``(chunk or entry, kv)``: :func:`distinct_entries`, at
        most ``slots_per_shard``) under ``.tmp-<uuid>/``, read it back and verify it.
        ``stored``: each ``kv`` is already the codec's stored values (``KvStore.read_stored``),
        written as they are (:func:`distinct_stored`)."""
        lay = self.layout
        group = distinct_stored(lay, group) if stored else distinct_entries(lay, group)
        if not 0 < len(group) <= lay.slots_per_shard:
            raise ValueError(f"a shard holds 1..{lay.slots_per_shard} entries, got {len(group)}")
        t0 = time.perf_counter()
        views = [kv if stored else lay.codec.view(kv, lay) for _, kv in group]
        tokens = [entry.stored_tokens for entry, _ in group]
        block = lay.block_tokens
        width = max(block, -(-max(tokens) // block) * block)
        shape = lay.codec.array_shape(lay, len(group), width)
        checksums = [entry_checksum(v) for v in views]
        tmp_name = f".tmp-{uuid.uuid4().hex}"
        keys = [entry.content_key for entry, _ in group]
        kept = [None if e.kept is None else e.kept.flat() for e, _ in group]
        attrs = shard_attributes(lay, self.encoder, run_id, keys, tokens, checksums, kept)
        write = SHARD_WRITERS[self.encoder]
        with self.transport.staging(self.root, tmp_name, self.fsync) as folder:
            content = ShardContent(lay, views, shape, attrs)
            files, t1 = write(folder, content, self.scratch, self.files)
        return StagedShard(
            kv_fp=lay.kv_fp,
            tmp_name=tmp_name,
            chunk_ids=tuple(entry.chunk_id for entry, _ in group),
            content_keys=tuple(keys),
            tokens=tuple(tokens),
            checksums=tuple(checksums),
            logical_bytes=sum(lay.entry_bytes(t) for t in tokens),
            disk_bytes=sum(files.values()),
            encode_write_s=t1 - t0,
            verify_s=time.perf_counter() - t1,
            chunk_tokens=tuple(entry.n_tokens for entry, _ in group),
            kept=tuple(None if k is None else tuple(k) for k in kept),
        )
