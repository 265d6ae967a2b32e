"""Slice reads: token ranges of stored entries, planned into block-aligned reads and fetched.

``KvStore.read_slices`` resolves each request ``(content_key, start, end)`` to the entry that
holds it, its shard and slot, and the entry's stored tokens (``storage/kv/store.py``; an entry of
kept ranges stores them back to back, ``storage/kv/kept.py``, so chunk tokens ``[start, end)``
are stored tokens ``[offset, offset + end - start)``; a range it does not hold never gets here),
then, in stored tokens:

1. :func:`plan_reads` merges the requests on one slot into reads of whole blocks (a read covers
   ``[floor(s / block) * block, ceil(e / block) * block)``; ranges that overlap, touch or lie at
   most ``merge_gap_blocks`` blocks apart are served by one read);
2. the reads are fetched all at once by :func:`gather_ranges` (local disk and object stores):
   one byte range per read, its blocks' crc32c checked here, no index read for shards
   ``encode_shard`` wrote (where each block lies follows from the token counts), the index
   read once per reader otherwise; or through Zarr (:func:`gather_zarr`: Zarr reads the shard
   index and the blocks on every read, checking every crc32c), for shards in another format;
3. the codec decodes each request's tokens of its read into its target (``storage/kv/codecs.py``
   ``decode_into``: a quantized codec dequantizes those tokens only).

What a read cost is counted by :class:`CountingReader` (the data bytes the store returned) into
:class:`ReadStats`. The bytes read over the bytes needed (``amplification``; needed: the tokens'
share of the stored bytes, ``KvLayout.needed_bytes``) is where slice reads lose: a read is whole
blocks, so a nugget of ``n`` tokens reads ``(n - 1 + block) / n`` of what it needs on average
(block alignment at both ends), plus 4 bytes of crc32c per block. Hence 4-token blocks for the
identity codec (k = 10 nuggets of ~12 tokens: ~1.2, against ~2.2 with 16-token blocks;
``tests/benchmarks/bench_kv_slices.py``). A quantized codec keeps 16-token blocks: each block
carries its keys' per-channel scales, which cost more bytes per token the smaller the block.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np
from zarr.core.sync import sync as _zarr_sync
from zarr.storage import WrapperStore

from coinrag.storage.kv.errors import CorruptKvEntry
from coinrag.storage.kv.layout import KvLayout
from coinrag.storage.kv.shard import (
    ShardMeta,
    back_to_back,
    block_problem,
    parse_index,
    stored_blocks,
)


@dataclass
class ReadStats:
    """What one read call cost. ``bytes_read`` counts data bytes returned by the store (inner
    chunks and shard indexes), ``bytes_needed`` the bytes of the tokens asked for."""

    requests: int = 0
    bytes_read: int = 0
    bytes_needed: int = 0
    store_gets: int = 0
    zarr_reads: int = 0
    seconds: float = 0.0

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0


class CountingReader(WrapperStore[Any]):
    """A read-only Zarr store wrapper (LocalStore or FsspecStore) that counts the data bytes it
    returns (not metadata); :meth:`counted` adds ranges fetched past Zarr."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.data_bytes = 0
        self.data_gets = 0

    def _count(self, key: str, buf: Any) -> None:
        if buf is not None and not key.endswith("zarr.json"):
            self.data_bytes += len(buf)
            self.data_gets += 1

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        self._count(key, buf)
        return buf

    async def get_partial_values(self, prototype: Any, key_ranges: Iterable[Any]) -> list[Any]:
        key_ranges = list(key_ranges)
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        for (key, _), buf in zip(key_ranges, bufs, strict=True):
            self._count(key, buf)
        return bufs

    def counted(self, got: list[Any]) -> list[Any]:
        """``got`` (fetched ranges; exceptions in place of failed ones), counted."""
        for raw in got:
            if not isinstance(raw, BaseException):
                self.data_bytes += len(raw)
                self.data_gets += 1
        return got


@dataclass
class SlicePlan:
    """One read: token range [t0, t1) of one slot, serving some requests."""

    shard: str
    slot: int
    t0: int
    t1: int
    requests: list[int]


def plan_reads(
    per_slot: dict[tuple[str, int], list[tuple[int, int, int]]],
    block_of: Callable[[str], int],
    merge_gap_blocks: int = 0,
) -> list[SlicePlan]:
    """``(shard, slot) -> [(start, end, request index), ...]`` -> block-aligned reads.

    E.g. blocks of 16 tokens, one slot, requests ``(3, 5)``, ``(20, 40)``, ``(100, 110)``:
    reads ``[0, 48)`` (requests 0 and 1: their blocks touch) and ``[96, 112)`` (request 2).
    """
    plans: list[SlicePlan] = []
    for (name, slot), items in per_slot.items():
        block = block_of(name)
        items.sort()
        for s, e, i in items:
            b0 = (s // block) * block
            b1 = -(-e // block) * block
            last = plans[-1] if plans else None
            if (
                last is not None
                and (last.shard, last.slot) == (name, slot)
                and b0 <= last.t1 + merge_gap_blocks * block
            ):
                last.t1 = max(last.t1, b1)
                last.requests.append(i)
            else:
                plans.append(SlicePlan(name, slot, b0, b1, [i]))
    return plans


Fail = Callable[[SlicePlan, str], CorruptKvEntry]  # the error naming a plan's first request
Diagnose = Callable[[ShardMeta, int, BaseException], str]  # why a slot's read failed


def shard_geometry(layout: KvLayout, shard: ShardMeta) -> KvLayout:
    """``layout`` with the shard's own block size (each shard records the one it was written
    with)."""
    if shard.block_tokens == layout.block_tokens:
        return layout
    return dataclasses.replace(layout, block_tokens=shard.block_tokens)


def gather_zarr(
    plans: list[SlicePlan],
    shards: dict[str, ShardMeta],
    layout: KvLayout,
    fail: Fail,
    diagnose: Diagnose,
) -> list[np.ndarray]:
    """The plans' stored values (the codec's, for tokens ``[t0, t1)``), read through Zarr, all
    reads issued at once on Zarr's I/O loop (every block's crc32c checked by Zarr)."""
    codec = layout.codec
    arrays = []
    for plan in plans:
        try:
            arrays.append(shards[plan.shard].array.async_array)
        except Exception as exc:
            raise fail(plan, f"shard unreadable: {exc}") from exc

    async def run() -> list[Any]:
        coros = []
        for plan, array in zip(plans, arrays, strict=True):
            shard = shards[plan.shard]
            t1 = min(plan.t1, shard.width)
            sel = codec.zarr_selection(plan.slot, plan.t0, t1, shard.block_tokens)
            coros.append(array.getitem(sel))
        return await asyncio.gather(*coros, return_exceptions=True)

    results = _zarr_sync(run())
    for plan, result in zip(plans, results, strict=True):
        if isinstance(result, BaseException):
            problem = diagnose(shards[plan.shard], plan.slot, result)
            raise fail(plan, problem) from result
    return [np.asarray(r) for r in results]


def gather_ranges(
    plans: list[SlicePlan],
    shards: dict[str, ShardMeta],
    layout: KvLayout,
    root: PurePath,
    fetch: Callable[[list[str], list[int], list[int]], list[Any]],
    fail: Fail,
    diagnose: Diagnose,
) -> list[np.ndarray]:
    """The plans' stored values, fetched as byte ranges of the shard files (``fetch(paths,
    starts, ends)``, issued all at once; an exception in place of a failed range): one range per
    plan where its blocks lie back to back in the file (always, for shards written by
    ``encode_shard``; Zarr's own writer may order a multi-slot shard's blocks otherwise, and then
    each block is one range), decoded here with every block's crc32c checked.

    Where the blocks lie: a shard ``encode_shard`` wrote has its index computed from its token
    counts (``ShardMeta.computed_index``: no index bytes read); another shard's index is
    fetched once per reader (one range, crc32c-checked, kept on its :class:`ShardMeta`). Zarr's
    reader would read the index and then each block, one after the other, on every read. A
    shard whose ``zarr.json`` describes another format goes through :func:`gather_zarr`."""
    out: list[np.ndarray | None] = [None] * len(plans)
    zarr_plans = [i for i, p in enumerate(plans) if not shards[p.shard].direct]
    if zarr_plans:
        got = gather_zarr([plans[i] for i in zarr_plans], shards, layout, fail, diagnose)
        for i, array in zip(zarr_plans, got, strict=True):
            out[i] = array
    direct = [i for i in range(len(plans)) if out[i] is None]
    files = _ShardFiles(root, fetch, fail)
    files.load_indexes([plans[i] for i in direct], shards, layout)
    by_plan = files.fetch_blocks({i: plans[i] for i in direct}, shards)
    for i in direct:
        out[i] = _decode_blocks(plans[i], shards[plans[i].shard], layout, by_plan[i], fail)
    return [a for a in out if a is not None]


_Blocks = list[tuple[int, int, int]]  # (block, offset in the file, bytes), back to back


@dataclass
class _ShardFiles:
    """The shard files under ``root``, read as byte ranges (``fetch(paths, starts, ends)``,
    issued all at once); ``fail(plan, problem)``: the error a bad range raises."""

    root: PurePath
    fetch: Callable[[list[str], list[int], list[int]], list[Any]]
    fail: Fail

    def load_indexes(
        self, plans: list[SlicePlan], shards: dict[str, ShardMeta], layout: KvLayout
    ) -> None:
        """Give every shard the ``plans`` read its index: computed from its token counts where
        ``encode_shard`` wrote it, else fetched (one range per shard, all at once) and its crc32c
        checked."""
        need_index = [shards[n] for n in sorted({p.shard for p in plans})]
        for shard in need_index:
            if shard.index is None:
                shard.index = shard.computed_index(layout)
        need_index = [s for s in need_index if s.index is None]
        if not need_index:
            return
        paths, starts, ends = [], [], []
        for shard in need_index:
            start, end = shard.index_range()
            paths.append(str(self.root / shard.name / shard.data_key))
            starts.append(start)
            ends.append(end)
        for shard, raw in zip(need_index, self.fetch(paths, starts, ends), strict=True):
            plan = next(p for p in plans if p.shard == shard.name)
            if isinstance(raw, BaseException):
                raise self.fail(plan, f"read failed: {raw}") from raw
            shard.index = parse_index(raw, shard.shape[0], shard.width, shard.block_tokens)
            if shard.index is None:
                raise self.fail(plan, "the shard index fails its crc32c")

    def fetch_blocks(
        self, plans: dict[int, SlicePlan], shards: dict[str, ShardMeta]
    ) -> dict[int, list[tuple[_Blocks, Any]]]:
        """plan number -> its stored blocks' bytes, as ``(blocks, raw bytes)`` per range: one range
        per plan where its blocks lie back to back, else one per block; every range fetched at
        once."""
        ranges: list[tuple[int, _Blocks]] = []  # (plan, its blocks)
        paths, starts, ends = [], [], []
        for i, plan in plans.items():
            shard = shards[plan.shard]
            block = shard.block_tokens
            b0, b1 = plan.t0 // block, min(plan.t1, shard.width) // block
            stored = stored_blocks(shard.index[plan.slot, b0:b1], b0)  # type: ignore[index]
            groups = [stored] if stored and back_to_back(stored) else [[item] for item in stored]
            path = str(self.root / plan.shard / shard.data_key)
            for group in groups:
                ranges.append((i, group))
                paths.append(path)
                starts.append(group[0][1])
                ends.append(group[-1][1] + group[-1][2])
        fetched = self.fetch(paths, starts, ends) if paths else []
        by_plan: dict[int, list[tuple[_Blocks, Any]]] = {i: [] for i in plans}
        for (i, group), raw in zip(ranges, fetched, strict=True):
            if isinstance(raw, BaseException):
                raise self.fail(plans[i], f"read failed: {raw}") from raw
            by_plan[i].append((group, raw))
        return by_plan


def _decode_blocks(
    plan: SlicePlan,
    shard: ShardMeta,
    layout: KvLayout,
    got: list[tuple[_Blocks, Any]],
    fail: Fail,
) -> np.ndarray:
    """The plan's stored values from its fetched blocks (each block's crc32c checked; a block
    not stored reads as zeros)."""
    g = shard_geometry(layout, shard)
    size = g.block_bytes
    first = plan.t0 // shard.block_tokens
    blocks = (min(plan.t1, shard.width) - plan.t0) // shard.block_tokens
    for group, raw in got:
        at = 0
        for b, _, n in group:
            problem = block_problem(raw[at : at + n], b, size + 4)
            if problem:
                raise fail(plan, problem)
            at += n
    if len(got) == 1 and len(got[0][0]) == blocks:  # the usual case: one range, no copy
        rows = np.frombuffer(got[0][1], dtype=np.uint8).reshape(blocks, size + 4)
        payloads = rows[:, :size]
    else:  # blocks in several ranges, or blocks not stored (read as zeros)
        payloads = np.zeros((blocks, size), dtype=np.uint8)
        for group, raw in got:
            data = np.frombuffer(raw, dtype=np.uint8).reshape(len(group), size + 4)
            for j, (b, _, _) in enumerate(group):
                payloads[b - first] = data[j, :size]
    return layout.codec.from_payloads(payloads, g)
