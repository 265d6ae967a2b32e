"""The KV store: per-chunk K/V of one (generation model, RAG prompt prefix), in Zarr 3.

The layout (in memory, on disk) and the identity ``kv_fp`` are stated in
``storage/kv/layout.py``; this module is the protocol around them: what makes an entry valid,
how shards are written, published, read and checked. Where the bytes live (local disk or an
object store) is the transport's business (``storage/kv/transport.py``); the shard file format
is ``storage/kv/shard.py``; slice reads ``storage/kv/reads.py``; gc ``storage/kv/reclaim.py``.

Writes
------
Zarr rewrites a whole shard on a partial write, so shards are written *whole*, once: the build
stage hands :meth:`KvStore.write_entries` up to ``slots_per_shard`` entries at a time (default:
as many as fit in 64 MiB, at least 4 and at most 64: few files, yet small enough that writing a
shard overlaps the computation of the next ones and the write buffers stay small). For each
shard (:meth:`KvStore.stage_shard`, then :meth:`KvStore.publish_shard`):

1. the shard file is encoded in one buffer (``shard.encode_shard``: the Zarr v3 sharding format,
   byte for byte what Zarr's own writer produces up to the order of inner chunks, for a
   fraction of its CPU) and written with one call (O_DIRECT where the file system takes it),
   next to the ``zarr.json`` Zarr writes, in ``.tmp-<uuid>/``; ``encoder="zarr"`` uses Zarr's
   ``array[...] = data`` instead (the reference path);
2. it is read back and verified: the file's bytes against the encoded buffer (crc32c of the
   whole file), the buffer having been encoded from the very arrays whose sha256 go to the
   manifest (with ``encoder="zarr"``: decoded by Zarr, every inner crc32c checked, and compared);
   an object store's copy is uploaded and read back too;
3. the folder becomes ``shard-NNNNNN`` (atomic rename; object stores: a claimed copy),
   optionally after fsync (``fsync=True``: durability against power loss, not only against a
   killed process);
4. only then are its ``KvManifestRow`` rows appended (``storage.tables``).

An entry is valid only once its manifest row exists: a crash leaves at most an orphan shard (or
a ``.tmp-`` folder), never a half-written entry that reads as valid; ``gc`` removes orphans.
Shard numbers only grow (1 + the largest number on disk or in the manifest), and for one
content_key the row with the largest (shard, slot) wins, so a rebuilt entry supersedes the old row.

Reads and checks
----------------
A read resolves the manifest row to its shard and slot and checks cheaply first (the slot holds
that key with that token count; the shard's files have the sizes they were written with), then
reads: whole entries through Zarr (every block's crc32c checked; the manifest's sha256 on
request), token ranges through ``storage/kv/reads.py``. A failed check raises
:class:`CorruptKvEntry` naming the entry and the reason; such an entry is never served.

Entries are keyed by ``storage.kv.kept.entry_key``: the content_key for a whole chunk, the
content_key and a digest of the kept ranges for a store that keeps only nugget spans
(``kv_keep = "nuggets"``), where one content_key may have several entries (the spans of two
extractors, until gc). A slice read names the chunk's content_key and its token range: it is
served by the latest entry of that content_key that holds the whole range, else it fails
(:class:`UnstoredKvSlice`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import accumulate
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
import zarr

from coinrag.schemas.tables import ChunkRow, KvManifestRow
from coinrag.storage.kv.basis_folder import BasisFolder
from coinrag.storage.kv.catalog import ShardCatalog
from coinrag.storage.kv.codecs import entry_checksum
from coinrag.storage.kv.errors import (
    CorruptKvEntry,
    KvError,
    KvFingerprintMismatch,
    MissingKvEntry,
    UnstoredKvSlice,
)
from coinrag.storage.kv.kept import KvEntry, kept_of, key_of_row
from coinrag.storage.kv.layout import (
    ATTR,
    KV_CHECK_LEVELS,
    KvLayout,
    checked_layout,
    location_order,
    parse_location,
)
from coinrag.storage.kv.prefix import PrefixFolder
from coinrag.storage.kv.reads import (
    CountingReader,
    ReadStats,
    SlicePlan,
    gather_ranges,
    gather_zarr,
    plan_reads,
    shard_geometry,
)
from coinrag.storage.kv.reclaim import KvReclaim, find_garbage, reclaim_dead, remove_garbage
from coinrag.storage.kv.shard import ShardMeta
from coinrag.storage.kv.transport import ScratchBuffers, ThreadScratch, transport_for
from coinrag.storage.kv.writes import ShardStager, StagedShard, WriteStats, distinct_entries
from coinrag.storage.store import Store


class KvStore:
    """The KV entries of one ``kv_fp`` under ``STORE/kv/<kv_fp>/``.

    Use :meth:`create` (build side) or :meth:`open` (read side). Not safe for concurrent
    writers: the build holds the store's write lock.
    """

    def __init__(
        self,
        store: Store,
        layout: KvLayout,
        *,
        fsync: bool = False,
        encoder: str = "direct",
        direct_io: bool = True,
    ) -> None:
        self.encoder = encoder
        self.store = store
        self.layout = layout
        self.kv_fp = layout.kv_fp
        self.root: PurePath = store.kv_dir(self.kv_fp)  # a Path for a local store
        self.fsync = fsync
        self.transport = transport_for(store)
        self._reader = CountingReader(self.transport.zarr_store(self.root, read_only=True))
        self._catalog = ShardCatalog(store, layout, self.root, self.transport, self._reader)
        self._manifest: dict[str, KvManifestRow] | None = None
        self._by_content: dict[str, list[str]] = {}  # content_key -> entry keys, latest first
        self._max_manifest_shard = -1
        self.write_stats = WriteStats()
        self.last_read = ReadStats()
        self._slice_scratch = ThreadScratch()  # the slice reads' bytes, reused per thread
        self._stager = ShardStager(
            layout, self.root, self.transport, encoder=encoder, fsync=fsync, direct_io=direct_io
        )
        self._prefix = PrefixFolder(store, layout, self.root, self.transport, self._reader, fsync)
        # a basis codec's keys: the basis read on first use (written by the kv stage)
        self.key_basis = BasisFolder(store, layout, self.root, self.transport, self._reader, fsync)
        if layout.codec.needs_basis:
            layout.key_basis.bind(self.key_basis.read)

    def release_buffers(self) -> None:
        """Free the write path's scratch buffers (about two shards' worth)."""
        self._stager.scratch.clear()
        self._catalog.scratch.clear()

    # ------------------------------------------------------------------ open / create

    @classmethod
    def create(cls, store: Store, layout: KvLayout, **options: Any) -> KvStore:
        """Open the KV store of ``layout``, creating its group if it does not exist yet.

        ``options`` (write side): ``fsync`` (False), ``encoder`` ("direct" | "zarr"),
        ``direct_io`` (True: O_DIRECT shard writes where the file system supports them).
        """
        root = store.kv_dir(layout.kv_fp)
        if not store.is_file(root / "zarr.json"):
            attributes = {ATTR: layout.identity()}
            transport_for(store).create_group(root, attributes, bool(options.get("fsync")))
        return cls.open(store, layout.kv_fp, layout, **options)

    @classmethod
    def open(
        cls, store: Store, kv_fp: str, layout: KvLayout | None = None, **options: Any
    ) -> KvStore:
        """Open the KV store ``kv_fp``; with ``layout``, check that it is the one asked for.

        Raises :class:`KvFingerprintMismatch` when the stored identity (model_fp, prefix,
        dims, dtype) differs from ``layout`` or from ``kv_fp``, and FileNotFoundError when no KV
        was built for ``kv_fp``.
        """
        root = store.kv_dir(kv_fp)
        if not store.is_file(root / "zarr.json"):
            raise FileNotFoundError(
                f"no KV store for {kv_fp} at {store.uri(root)} (run the kv stage)"
            )
        reader = transport_for(store).zarr_store(root, read_only=True)
        group = zarr.open_group(store=reader, mode="r")
        stored = dict(group.attrs.get(ATTR) or {})
        if not stored:
            raise KvError(f"{root} is not a coinrag KV store (no {ATTR} attributes)")
        layout = checked_layout(stored, kv_fp, layout)
        return cls(store, layout, **options)

    # ------------------------------------------------------------------ manifest

    def manifest(self, refresh: bool = False) -> dict[str, KvManifestRow]:
        """entry key -> its current manifest row under this kv_fp (the latest row wins); the key
        is the content_key for whole chunks (``storage/kv/kept.py``)."""
        if self._manifest is None or refresh:
            import pyarrow.compute as pc

            from coinrag.storage.tables import read_rows

            rows = read_rows(
                self.store,
                KvManifestRow,
                filter=pc.starts_with(pc.field("location"), pattern=self.kv_fp + "/"),
            )
            current: dict[str, tuple[tuple[int, int], KvManifestRow]] = {}
            top = -1
            for row in rows:
                if row.model_fp != self.layout.model_fp:
                    raise KvFingerprintMismatch(
                        row.model_fp,
                        self.layout.model_fp,
                        f"manifest row {row.location} of {row.content_key}",
                    )
                order = location_order(row.location)
                top = max(top, order[0])
                key = key_of_row(row)
                if key not in current or current[key][0] < order:
                    current[key] = (order, row)
            self._manifest = {key: row for key, (_, row) in current.items()}
            self._max_manifest_shard = top
            self._by_content = {}
            latest_first = sorted(current.items(), key=lambda item: item[1][0], reverse=True)
            for key, (_, row) in latest_first:
                self._by_content.setdefault(row.content_key, []).append(key)
        return self._manifest

    def forget_manifest(self) -> None:
        """Drop the cached manifest (its table was rewritten); the next use reads it again."""
        self._manifest = None

    def __contains__(self, key: str) -> bool:
        return key in self.manifest()

    def _row(self, key: str) -> KvManifestRow:
        row = self.manifest().get(key)
        if row is None:
            raise MissingKvEntry(f"no KV entry for {key} under {self.kv_fp}")
        kv_fp, _, _ = parse_location(row.location)
        if kv_fp != self.kv_fp:  # defensive: manifest() filters by kv_fp
            raise KvFingerprintMismatch(kv_fp, self.kv_fp, f"entry {key}")
        return row

    def entries_of(self, content_key: str) -> list[str]:
        """The keys of the current entries of ``content_key``, latest first (one for a store of
        whole chunks; none when it has no entry)."""
        self.manifest()
        return list(self._by_content.get(content_key, ()))

    def chunk_tokens(self, content_key: str) -> int:
        """The token count of the chunk ``content_key`` names (from its latest entry: the
        length of the forward that computed it, what re-rotation needs). Raises
        :class:`MissingKvEntry` when it has no entry."""
        keys = self.entries_of(content_key)
        if not keys:
            raise MissingKvEntry(f"no KV entry for {content_key} under {self.kv_fp}")
        return self.manifest()[keys[0]].tokens

    def _locate(self, content_key: str, start: int, end: int) -> tuple[str, int]:
        """``(entry key, stored offset)`` of chunk tokens ``[start, end)``: the latest entry of
        ``content_key`` that holds them all. Raises :class:`MissingKvEntry` (no entry),
        IndexError (outside the chunk) or :class:`UnstoredKvSlice` (not stored)."""
        keys = self.entries_of(content_key)
        if not keys:
            raise MissingKvEntry(f"no KV entry for {content_key} under {self.kv_fp}")
        manifest = self.manifest()
        for key in keys:
            row = manifest[key]
            if not 0 <= start <= end <= row.tokens:
                raise IndexError(
                    f"slice [{start}, {end}) out of range for {content_key} ({row.tokens} tokens)"
                )
            kept = kept_of(row.kept)
            offset = start if kept is None else kept.locate(start, end)
            if offset is not None:
                return key, offset
        held = "; ".join(str(kept_of(manifest[key].kept)) for key in keys)
        raise UnstoredKvSlice(content_key, start, end, held)

    # ------------------------------------------------------------------ shards

    def shard_names(self) -> list[str]:
        """Shard folders on disk (verified and renamed into place), in write order."""
        return self._catalog.names()

    @property
    def _shards(self) -> dict[str, ShardMeta]:
        """The shards' metadata read so far (``catalog.ShardCatalog``)."""
        return self._catalog.meta

    def _shard(self, name: str) -> ShardMeta:
        return self._catalog.get(name)

    def forget_shard(self, name: str) -> None:
        """Drop what this object remembers of a shard (it is being removed)."""
        self._catalog.forget(name)

    def _resolve(
        self,
        key: str,
        file_checks: dict[str, str | None] | None = None,
        ranged: bool = False,
    ) -> tuple[KvManifestRow, ShardMeta, int]:
        """The row of the entry ``key`` (:meth:`manifest`), its opened shard and slot; raises
        CorruptKvEntry (naming the row's content_key) on a cheap failed check (``file_checks``,
        ``ranged``: ``catalog.ShardCatalog.file_problem``)."""
        row = self._row(key)
        ck = row.content_key
        _, name, slot = parse_location(row.location)
        try:
            shard = self._shard(name)
        except Exception as exc:  # missing folder, unreadable zarr.json
            self._shards.pop(name, None)
            raise CorruptKvEntry(ck, row.location, f"shard unreadable: {exc}") from exc
        if (
            slot >= len(shard.content_keys)
            or shard.content_keys[slot] != ck
            or (shard.kept[slot] if slot < len(shard.kept) else None) != row.kept
        ):
            raise CorruptKvEntry(ck, row.location, "slot holds another entry")
        if shard.tokens[slot] != KvEntry.of_row(row).stored_tokens:
            raise CorruptKvEntry(ck, row.location, "token count differs from manifest")
        problem = self._catalog.file_problem(shard, file_checks, ranged)
        if problem:
            raise CorruptKvEntry(ck, row.location, problem)
        return row, shard, slot

    # ------------------------------------------------------------------ reads

    def read_entry(self, content_key: str, verify: bool = True) -> torch.Tensor:
        """What one entry stores (``content_key``: its key, see :meth:`manifest`): the KV of its
        chunk, ``(layers, 2, kv_heads, tokens, head_dim)`` in the model dtype, or for an entry
        of kept ranges their concatenation, ``(layers, 2, kv_heads, stored tokens, head_dim)``
        (keys as the layout stores them: ``layout.keys_at_zero``).

        Every inner chunk's crc32c is checked by the read; ``verify`` also checks the manifest's
        sha256 of the whole entry. Raises :class:`CorruptKvEntry` or :class:`MissingKvEntry`.
        """
        t0 = time.perf_counter()
        before = (self._reader.data_bytes, self._reader.data_gets)
        row, stored, g = self._read_stored(content_key, verify)
        tokens = KvEntry.of_row(row).stored_tokens
        tensor = self.layout.codec.decode(stored, g)[:, :, :, :tokens].contiguous()
        self.last_read = ReadStats(
            requests=1,
            bytes_read=self._reader.data_bytes - before[0],
            bytes_needed=self.layout.needed_bytes(tokens),
            store_gets=self._reader.data_gets - before[1],
            zarr_reads=1,
            seconds=time.perf_counter() - t0,
        )
        return tensor

    def read_stored(self, content_key: str) -> np.ndarray:
        """One entry's stored values as the codec stored them (C-contiguous, sha256-checked
        against the manifest): what :meth:`write_stored` takes, so moving an entry between
        shards (``gc``) never decodes and re-encodes a lossy codec's values."""
        return self._read_stored(content_key, verify=True)[1]

    def _read_stored(
        self, content_key: str, verify: bool
    ) -> tuple[KvManifestRow, np.ndarray, KvLayout]:
        """``(row, the entry's stored values, the geometry of its shard)``: one read of the
        entry's blocks (a byte range where the transport reads ranges, else through Zarr)."""
        ranged = self.transport.ranged_slice_reads
        row, shard, slot = self._resolve(content_key, ranged=ranged)
        g = shard_geometry(self.layout, shard)
        block = shard.block_tokens
        tokens = KvEntry.of_row(row).stored_tokens
        plan = SlicePlan(shard.name, slot, 0, -(-tokens // block) * block, [0])

        def fail(_: SlicePlan, reason: str) -> CorruptKvEntry:
            return CorruptKvEntry(row.content_key, row.location, reason)

        shards = {shard.name: shard}
        diagnose = self._catalog.diagnose
        if ranged:
            fetch = self._fetch_ranges
            (got,) = gather_ranges([plan], shards, self.layout, self.root, fetch, fail, diagnose)
        else:
            (got,) = gather_zarr([plan], shards, self.layout, fail, diagnose)
        stored = np.ascontiguousarray(self.layout.codec.trim(got, tokens, g))
        if verify and entry_checksum(stored) != row.checksum:
            raise CorruptKvEntry(row.content_key, row.location, "sha256 differs from the manifest")
        return row, stored, g

    def verify_entry(self, content_key: str) -> bool:
        """True iff the entry has a manifest row and its stored bytes match it (sha256)."""
        try:
            self.read_entry(content_key, verify=True)
        except (CorruptKvEntry, MissingKvEntry):
            return False
        return True

    def read_slices(
        self, requests: Sequence[tuple[str, int, int]], merge_gap_blocks: int = 0
    ) -> list[torch.Tensor]:
        """Token ranges of chunks: ``[(content_key, tok_start, tok_end), ...]`` (the chunk's
        token coordinates) -> ``[(layers, 2, kv_heads, tok_end - tok_start, head_dim), ...]``
        in request order, in the model dtype (keys as the layout stores them:
        ``layout.keys_at_zero``): :meth:`read_slices_into` one tensor, each request's tokens a
        view of it."""
        lay = self.layout
        lengths = [e - s for _, s, e in requests]
        out = torch.empty(lay.entry_shape(sum(lengths)), dtype=lay.torch_dtype)
        self.read_slices_into(requests, out, merge_gap_blocks)
        starts = accumulate([0, *lengths])
        return [out[..., a : a + n, :] for a, n in zip(starts, lengths, strict=False)]

    def read_slices_into(
        self,
        requests: Sequence[tuple[str, int, int]],
        out: torch.Tensor,
        merge_gap_blocks: int = 0,
        rope: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> bool:
        """:meth:`read_slices` written back to back into ``out`` ``(layers, 2, kv_heads,
        Σ (tok_end - tok_start), head_dim)`` in the model dtype, any strides (e.g. the part of
        an assembled context after its prefix), decoded straight there (a quantized codec
        dequantizes only the tokens asked for). ``rope``: cos and sin ``(Σ (tok_end -
        tok_start), R / 2)`` float32 of ``out``'s tokens; True where the codec rotated the keys
        (stored at position 0) by them as it placed them (``KvCodec.decode_tokens``), False
        where the caller must rotate them.

        Each request is served by the latest entry of its content_key that holds the whole
        range (:meth:`_locate`; every range of a whole-chunk entry); a range no entry holds
        raises :class:`UnstoredKvSlice` (``kv_keep = "nuggets"``: only nugget spans are stored).
        Requests on the same entry whose block-aligned ranges overlap or touch (or lie at most
        ``merge_gap_blocks`` blocks apart) are served by one read; all reads are issued at once
        (concurrently). Each touched inner chunk is crc32c-checked; the whole-entry sha256 is
        not (it would need the whole entry: use :meth:`verify_entry`). ``self.last_read`` says
        what it cost.
        """
        t0 = time.perf_counter()
        lay = self.layout
        total = sum(e - s for _, s, e in requests)
        if tuple(out.shape) != lay.entry_shape(total) or out.dtype != lay.torch_dtype:
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype}; {len(requests)} slices of {total} "
                f"tokens in all need {lay.entry_shape(total)} {lay.torch_dtype}"
            )
        before = (self._reader.data_bytes, self._reader.data_gets)
        per_slot: dict[tuple[str, int], list[tuple[int, int, int]]] = defaultdict(list)
        resolved: dict[str, tuple[KvManifestRow, ShardMeta, int]] = {}
        located: list[tuple[str, int, int]] = []  # per request: entry key, stored [start, end)
        needed = 0
        file_checks: dict[str, str | None] = {}
        for i, (ck, s, e) in enumerate(requests):
            if s == e:  # nothing to read; the chunk must still have an entry and s be in it
                n = self.chunk_tokens(ck)
                if not 0 <= s <= n:
                    raise IndexError(f"slice [{s}, {e}) out of range for {ck} ({n} tokens)")
                located.append((ck, 0, 0))
                continue
            key, offset = self._locate(ck, s, e)
            located.append((key, offset, offset + e - s))
            if key not in resolved:
                resolved[key] = self._resolve(key, file_checks, ranged=True)
            _, shard, slot = resolved[key]
            needed += lay.needed_bytes(e - s)
            per_slot[(shard.name, slot)].append((offset, offset + e - s, i))
        plans = plan_reads(per_slot, lambda name: self._shards[name].block_tokens, merge_gap_blocks)

        def fail(plan: SlicePlan, reason: str) -> CorruptKvEntry:
            row = resolved[located[plan.requests[0]][0]][0]
            return CorruptKvEntry(row.content_key, row.location, reason)

        if plans:
            diagnose = self._catalog.diagnose
            if self.transport.ranged_slice_reads:  # the bytes are decoded before this returns
                fetch = partial(self._fetch_ranges, scratch=self._slice_scratch.get())
                results = gather_ranges(plans, self._shards, lay, self.root, fetch, fail, diagnose)
            else:
                results = gather_zarr(plans, self._shards, lay, fail, diagnose)
            at = list(accumulate([0, *(e - s for _, s, e in requests)]))
            placed = [(o0, o1, a) for (_, o0, o1), a in zip(located, at, strict=False)]
            rotated = self._decode_into(plans, results, placed, out, rope)
        else:
            rotated = rope is not None  # no token to rotate
        self.last_read = ReadStats(
            requests=len(requests),
            bytes_read=self._reader.data_bytes - before[0],
            bytes_needed=needed,
            store_gets=self._reader.data_gets - before[1],
            zarr_reads=len(plans),
            seconds=time.perf_counter() - t0,
        )
        return rotated

    def _decode_into(
        self,
        plans: Sequence[SlicePlan],
        results: Sequence[np.ndarray],
        placed: Sequence[tuple[int, int, int]],
        out: torch.Tensor,
        rope: tuple[np.ndarray, np.ndarray] | None,
    ) -> bool:
        """Decode each request's stored tokens ``[start, end)`` (``placed[i]``, with ``at``: where
        it goes in ``out``'s token axis) from the read that served it (``results[j]`` of
        ``plans[j]``), one codec call per block size (shards may differ); whether every call
        rotated the keys by ``rope``."""
        rotated = True
        by_block: dict[int, list[int]] = defaultdict(list)
        for j, plan in enumerate(plans):
            by_block[self._shards[plan.shard].block_tokens].append(j)
        for js in by_block.values():
            picks = [
                (n, placed[i][0] - plans[j].t0, placed[i][1] - plans[j].t0, placed[i][2])
                for n, j in enumerate(js)
                for i in plans[j].requests
            ]
            picks.sort(key=lambda pick: pick[3])  # in request order: out back to back
            g = shard_geometry(self.layout, self._shards[plans[js[0]].shard])
            got = [results[j] for j in js]
            rotated &= self.layout.codec.decode_tokens(got, g, picks, out, rope)
        return rotated

    def _fetch_ranges(
        self,
        paths: list[str],
        starts: list[int],
        ends: list[int],
        scratch: ScratchBuffers | None = None,
    ) -> list[Any]:
        """Byte ranges of files, fetched concurrently, counted in the reader's statistics like
        Zarr's reads; an exception in place of a failed one (``scratch``: the transport may
        read into it)."""
        return self._reader.counted(self.transport.fetch_ranges(paths, starts, ends, scratch))

    # ------------------------------------------------------------------ checks

    def invalid_entries(self, content_keys: Iterable[str], level: str = "stat") -> set[str]:
        """The keys (with a manifest row) whose entries fail a check (:meth:`entry_problems`)."""
        return set(self.entry_problems(content_keys, level))

    def entry_problems(self, content_keys: Iterable[str], level: str = "stat") -> dict[str, str]:
        """key -> why its entry fails a check, for the keys (with a manifest row) that do.

        ``stat``: the shard folder and metadata are readable, the slot holds that key and the
        data files have the sizes they were written with (one stat per shard; finds deleted and
        truncated shards). ``crc32c``: also reads each entry's blocks and the shard indexes and
        checks their crc32c (finds flipped bytes; reads every byte of the entries once, at
        crc32c's hardware speed). ``sha256`` (or ``full``): also reads every entry and checks
        the manifest's sha256 (the strongest check; sha256 costs about 6x crc32c per byte).
        """
        if level not in KV_CHECK_LEVELS:
            raise ValueError(f"unknown check level {level!r} ({', '.join(KV_CHECK_LEVELS)})")
        bad: dict[str, str] = {}
        file_checks: dict[str, str | None] = {}
        manifest = self.manifest()
        slots: dict[str, dict[int, str]] = defaultdict(dict)  # shard -> slot -> key
        for ck in content_keys:
            if ck not in manifest:
                continue
            try:
                if level in ("sha256", "full"):
                    self._read_stored(ck, verify=True)
                else:
                    _, shard, slot = self._resolve(ck, file_checks)
                    slots[shard.name][slot] = ck
            except CorruptKvEntry as exc:
                bad[ck] = f"{exc.reason} ({exc.location})"
        if level == "crc32c":
            for name, keys in slots.items():
                for slot, problem in self._catalog.verify_slots(self._shards[name], keys).items():
                    bad[keys[slot]] = f"{problem} ({manifest[keys[slot]].location})"
        return bad

    # ------------------------------------------------------------------ writes

    def _next_shard_number(self) -> int:
        on_disk = [int(n.removeprefix("shard-")) for n in self.shard_names()]
        self.manifest()
        return max([-1, self._max_manifest_shard, *on_disk]) + 1

    def write_entries(
        self, entries: Sequence[tuple[ChunkRow | KvEntry, torch.Tensor]], run_id: str
    ) -> list[KvManifestRow]:
        """Store entries, ``slots_per_shard`` per shard, and append their manifest rows.

        ``entries``: ``(chunk, kv)`` with ``kv`` of shape ``(layers, 2, kv_heads,
        chunk.n_tokens, head_dim)`` in the layout's dtype, or ``(KvEntry, kv)`` with ``kv``
        what the entry stores (``KvEntry.cut``: its kept ranges, concatenated); keys in the
        layout's frame (after RoPE, or rotated back to position 0 where
        ``layout.keys_at_zero``: the model side, ``inference/model/encode.py``, hands them so, and
        the ranges are cut after that rotation). Entries are keyed by their key (the
        ``content_key`` of a whole chunk); a key repeated in ``entries`` is stored once (first
        wins). Each shard is written whole, read back and verified, renamed into place, and only
        then are its rows appended; the rows of all shards are returned.
        """
        unique = distinct_entries(self.layout, entries)
        return self._write(unique, run_id, stored=False)

    def write_stored(
        self, entries: Sequence[tuple[ChunkRow | KvEntry, np.ndarray]], run_id: str
    ) -> list[KvManifestRow]:
        """:meth:`write_entries` for entries given as their stored values
        (:meth:`read_stored`; an entry of kept ranges as a :class:`KvEntry`): written bit for
        bit as they are (no decode, no re-encode)."""
        return self._write(list(entries), run_id, stored=True)

    def _write(self, unique: list[Any], run_id: str, stored: bool) -> list[KvManifestRow]:
        rows: list[KvManifestRow] = []
        step = self.layout.slots_per_shard
        for start in range(0, len(unique), step):
            staged = self._stager.stage(unique[start : start + step], run_id, stored)
            rows += self.publish_shard(staged, run_id)
        return rows

    def stage_shard(
        self, group: Sequence[tuple[ChunkRow | KvEntry, torch.Tensor]], run_id: str
    ) -> StagedShard:
        """Write one shard of ``group`` (``(chunk or entry, kv)``, distinct keys, at most
        ``slots_per_shard``) under ``.tmp-<uuid>/``, read it back and verify it; nothing is
        valid until :meth:`publish_shard`. Safe to call from several processes at once: it
        writes only its own new folder (``writes.ShardStager``)."""
        return self._stager.stage(group, run_id)

    def publish_shard(self, staged: StagedShard, run_id: str) -> list[KvManifestRow]:
        """Make a staged shard valid: move it to the next ``shard-NNNNNN`` (atomic) and append
        its manifest rows (``run_id``: the publishing run's). Only the write-lock holder calls
        this, so shard numbers are given in publication order."""
        if staged.kv_fp != self.kv_fp:
            raise KvFingerprintMismatch(staged.kv_fp, self.kv_fp, f"staged {staged.tmp_name}")
        from coinrag.storage.tables import append_rows

        tmp = self.root / staged.tmp_name
        if not self.store.is_file(tmp / "zarr.json"):
            raise KvError(
                f"staged shard {self.store.uri(tmp)} is missing "
                "(was it written on another machine's local disk?)"
            )
        try:
            name = self.transport.publish(tmp, self.root, self._next_shard_number(), self.fsync)
        except BaseException:
            self.store.remove(tmp)
            raise
        rows = staged.manifest_rows(name, self.layout, run_id)
        st = self.write_stats
        st.add(staged)
        t0 = time.perf_counter()
        append_rows(self.store, rows, run_id, "kv")
        st.manifest_s += time.perf_counter() - t0
        manifest = self.manifest()
        for row in rows:
            key = key_of_row(row)
            manifest[key] = row
            keys = self._by_content.setdefault(row.content_key, [])
            if key in keys:
                keys.remove(key)
            keys.insert(0, key)  # the latest entry of its content_key
        self._max_manifest_shard = max(
            self._max_manifest_shard, location_order(rows[0].location)[0]
        )
        return rows

    # ------------------------------------------------------------------ prefix

    def write_prefix(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> None:
        """Store ``C_p``: ``(layers, 2, kv_heads, len(prefix_ids), head_dim)``. Written once;
        a second call with the same ids is a no-op."""
        self._prefix.write(prefix_kv, prefix_ids)

    def has_prefix(self) -> bool:
        return self._prefix.exists()

    def read_prefix(self) -> tuple[torch.Tensor, list[int]]:
        """``(C_p, prefix_ids)``: ``(layers, 2, kv_heads, |p|, head_dim)``, sha256-checked."""
        return self._prefix.read()

    def corrupt_prefix(self) -> str | None:
        """Why the stored ``C_p`` fails its check, or None (``prefix.PrefixFolder.problem``)."""
        return self._prefix.problem()

    def repair_prefix(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> bool:
        """Replace a stored ``C_p`` that fails its check by ``prefix_kv``; True when it is bit
        for bit the one it replaces, so the entries stay valid (``prefix.PrefixFolder.repair``)."""
        return self._prefix.repair(prefix_kv, prefix_ids)

    # ------------------------------------------------------------------ garbage

    def garbage(self) -> list[PurePath]:
        """Folders no current manifest row points to: orphan and superseded shards, ``.tmp-``
        leftovers of killed writes (``reclaim.find_garbage``)."""
        return find_garbage(self)

    def gc(self) -> list[PurePath]:
        """Remove :meth:`garbage` (the caller holds the store's write lock); return it."""
        return remove_garbage(self)

    def reclaim(self, live: set[str], run_id: str, dry_run: bool = False) -> KvReclaim:
        """Drop the entries whose key (:meth:`manifest`) is not in ``live``; return what was
        (or, with ``dry_run``, would be) reclaimed (``reclaim.reclaim_dead``). The caller holds
        the store's write lock."""
        return reclaim_dead(self, live, run_id, dry_run)


def stored_content_keys(store: Store, layout: KvLayout) -> set[str]:
    """The content_keys with a manifest row under ``layout``'s kv_fp (no shard is read)."""
    return {row.content_key for row in KvStore(store, layout).manifest().values()}
