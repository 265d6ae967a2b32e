"""Garbage collection: reclaim what no live document needs any more. Run under the write lock.

- **KV entries** whose content_key no live chunk references (``storage.kv.KvStore.reclaim``:
  live entries of partly dead shards are moved to new verified shards, then whole dead shards
  go). A live chunk is a chunk of a live document version (``storage.corpus``) cut with the
  tokenizer and chunker of the last completed build; the content keys the published (and the
  latest) index rows point to are kept too, so a reader of the published state never loses its
  KV. Entries of every kv_fp are collected (KV of another model stays as long as its chunks are
  live: switching back costs nothing). A KV store that keeps only nugget spans (``kv_keep =
  "nuggets"``) keys its entries by content and kept ranges (``storage/kv/kept.py``): it keeps
  the entries whose ranges a live nugget set uses (:func:`live_nugget_entry_keys`), so the
  entries of spans a replaced extractor found go.
- **LanceDB versions** older than the published one (``LanceIndex.prune_versions``), except
  those a reader still holds: a long-lived reader (``coinrag api``) keeps a lease in
  ``STORE/readers/`` naming the published versions its requests read (``storage.readers``);
  while it is fresh, those versions' table versions and the KV entries their index rows point
  to stay (a build's compaction honours the leases too). Expired or unreadable leases (a
  reader that died) are removed as leftovers.
- **A dry run** reports what the run would reclaim: for KV, the shards it would drop or
  compact and the bytes of the new shards it would write (``KvStore.reclaim``); for LanceDB,
  whose pruning tells its effect only by doing it, the pruning done on a scratch copy of the
  index (:func:`index_dry_run`: files hard-linked, metadata copied; an object store's index is
  downloaded to a local temporary folder).
- **Leftovers of killed writes**: ``.tmp-`` folders, ``.*.tmp`` Parquet files (of tables and of
  ``staging/``), temporary settings files.

Parquet tables are not touched, except ``kv_manifest`` rows of dropped entries; staged rows
(``STORE/staging/``: LLM answers a killed build received) are kept for the next build.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import pyarrow.compute as pc

from coinrag.schemas.leases import published_index_versions
from coinrag.schemas.tables import INDEX_TABLES, ChunkRow, NuggetRow, RunRow
from coinrag.storage.corpus import live_versions
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import KeptRanges, KvReclaim, KvStore, entry_key
from coinrag.storage.readers import READERS_DIR, fresh_leases, readers_dir, stale_lease_paths
from coinrag.storage.store import Store
from coinrag.storage.tables import read_table

log = logging.getLogger("coinrag.gc")


@dataclass
class GcReport:
    """What one ``gc`` reclaimed (or, dry, would reclaim). Bytes are bytes on disk."""

    dry_run: bool
    live_content_keys: int = 0
    kv: list[KvReclaim] = field(default_factory=list)
    index_versions_removed: dict[str, int] = field(default_factory=dict)
    index_bytes_freed: int = 0  # measured (on a dry run: on a scratch copy of the index)
    temp_paths_removed: int = 0
    temp_bytes_freed: int = 0
    reader_versions_kept: int = 0  # published versions older than the current one, held by readers

    @property
    def kv_entries_dropped(self) -> int:
        return sum(k.entries_dropped for k in self.kv)

    @property
    def bytes_reclaimed(self) -> int:
        kv = sum(k.bytes_reclaimed for k in self.kv)
        return kv + self.index_bytes_freed + self.temp_bytes_freed


def _last_build_json(store: Store, column: str) -> dict[str, Any] | None:
    """The JSON column ``column`` of the last completed build's run row (None if none
    completed)."""
    runs = read_table(
        store,
        RunRow,
        columns=["flow", "status", "ended_at", column],
        filter=(pc.field("flow") == "build") & (pc.field("status") == "completed"),
    ).to_pylist()
    if not runs:
        return None
    last = max(runs, key=lambda r: r["ended_at"])
    return json.loads(last[column] or "{}")


def last_build_fingerprints(store: Store) -> dict[str, str]:
    """The fingerprints recorded by the last completed build (empty if none completed)."""
    return _last_build_json(store, "fingerprints_json") or {}


def last_build_tau(store: Store) -> float | None:
    """The ``tau`` of the last completed build (None if none completed)."""
    tau = (_last_build_json(store, "parameters_json") or {}).get("tau")
    return None if tau is None else float(tau)


def last_build_source(store: Store) -> str | None:
    """The SOURCE the last completed build read (None if none completed)."""
    return (_last_build_json(store, "parameters_json") or {}).get("source")


def _live_chunks(store: Store, columns: list[str]) -> dict[str, list]:
    """``columns`` of the chunks of live document versions, cut with the tokenizer and
    chunker of the last completed build."""
    versions = set(live_versions(store).values())
    if not versions:
        return {c: [] for c in columns}
    fps = last_build_fingerprints(store)
    filt = pc.field("doc_version").isin(sorted(versions))
    for name in ("tokenizer_fp", "chunker_fp"):
        if fps.get(name):
            filt = filt & (pc.field(name) == fps[name])
    return read_table(store, ChunkRow, columns=columns, filter=filt).to_pydict()


def live_content_keys(store: Store) -> set[str]:
    """Content keys of live chunks, plus those the published and latest index rows point to."""
    keys = set(_live_chunks(store, ["content_key"])["content_key"])
    for index in _indexes(store):
        keys.update(index.columns("chunks", ["content_key"]).column(0).to_pylist())
    return keys


def live_nugget_entry_keys(store: Store) -> set[str]:
    """Keys of the entries a KV store of nugget spans (``kv_keep = "nuggets"``) still needs:
    per live chunk, the ranges of its nuggets by the last completed build's extractor and tau
    (what that build stored), and per chunk of the published and latest index, the ranges of
    its indexed nuggets (what readers retrieve). ``storage.kv.kept.entry_key`` of each."""
    span_sets: list[tuple[str, list[tuple[int, int]]]] = []  # (content_key, a chunk's spans)
    live = _live_chunks(store, ["chunk_id", "content_key"])
    extractor_fp = last_build_fingerprints(store).get("extractor_fp")
    tau = last_build_tau(store)
    if live["chunk_id"] and extractor_fp and tau is not None:
        content = dict(zip(live["chunk_id"], live["content_key"], strict=True))
        nuggets = read_table(
            store,
            NuggetRow,
            columns=["chunk_id", "tok_start", "tok_end"],
            filter=(pc.field("extractor_fp") == extractor_fp)
            & (pc.field("tau") == tau)
            & pc.field("chunk_id").isin(sorted(content)),
        ).to_pydict()
        built: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for cid, s, e in zip(*nuggets.values(), strict=True):
            built[cid].append((s, e))
        span_sets += [(content[cid], found) for cid, found in built.items()]
    for index in _indexes(store):
        rows = index.columns("nuggets", ["chunk_id", "content_key", "tok_start", "tok_end"])
        indexed: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        for cid, ck, s, e in zip(*rows.to_pydict().values(), strict=True):
            indexed[(cid, ck)].append((s, e))
        span_sets += [(ck, found) for (_, ck), found in indexed.items()]
    return {entry_key(ck, KeptRanges.of_spans(found)) for ck, found in span_sets}


def _indexes(store: Store) -> Iterable[LanceIndex]:
    """The index views whose rows are live: the latest (the writer's), the published one,
    and every version a fresh reader lease holds (one a reader still reads after a newer
    publish)."""
    latest = LanceIndex.open_latest(store)
    if latest is not None:
        yield latest
    published = store.published() or {}
    if published.get("index"):
        yield LanceIndex.open(store, published)
    yield from held_indexes(store)


def held_indexes(store: Store) -> list[LanceIndex]:
    """The index at each version fresh reader leases hold, other than the published one (each
    once); a held version already gone (pruned before the reader leased it) is left out with
    a warning: there is nothing left to keep."""
    current = published_index_versions(store.published())
    records: dict[str, dict] = {}
    for lease in fresh_leases(store):
        for record in lease.versions:
            versions = published_index_versions(record)
            if versions and versions != current:
                records[repr(sorted(versions.items()))] = record
    held = []
    for record in records.values():
        try:
            index = LanceIndex.open(store, record)
            for name in INDEX_TABLES:
                index.table(name)  # checks each table out at the held version
        except Exception as exc:  # or a record this code cannot open
            log.warning("a reader holds index versions %s that are gone: %s", record, exc)
            continue
        held.append(index)
    return held


def kv_fps(store: Store) -> list[str]:
    """The KV stores under ``STORE/kv/`` (one folder per kv_fp)."""
    root = store.root / "kv"
    names = store.list_names(root)
    return [n for n in names if not n.startswith(".") and store.is_file(root / n / "zarr.json")]


def temp_leftovers(store: Store) -> list[PurePath]:
    """Temporary files and folders of killed writes (the KV stores' own are in ``reclaim``).
    An object store writes no temporary files outside the KV stores (each file is one PUT)."""
    return store.temp_files(
        (
            "coinrag.toml.tmp*",
            "tables/*/.*.tmp",
            "staging/*/.*.tmp",
            "kv/.tmp-*",
            "cartridges/*/.tmp-*",
            "index/*.json.tmp",
            "index/*.json.tmp-*",
            f"{_SCRATCH}*",
        )
    )


_SCRATCH = ".gc-dry-run-"  # scratch copies of the index made by dry runs
_IMMUTABLE = ("data", "_indices", "_deletions")  # Lance folders whose files are never rewritten


def _scratch_copy(store: Store, scratch: Path) -> Store:
    """A store at ``scratch`` holding a copy of ``store``'s index and ``coinrag.toml``. Local:
    Lance's immutable files (data, index and deletion files, written once under unique names)
    are hard links, the rest copies; object store: everything downloaded."""
    store.download(store.index_dir, scratch / "index", link_under=_IMMUTABLE)
    if store.is_file(store.settings_path):
        (scratch / "coinrag.toml").write_bytes(store.read_bytes(store.settings_path))
    leases = readers_dir(store)
    for name in store.list_names(leases):  # the readers' holds apply to the copy too
        dst = scratch / READERS_DIR / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            dst.write_bytes(store.read_bytes(leases / name))
        except FileNotFoundError:
            continue
    return Store.at(scratch)


def index_dry_run(store: Store) -> tuple[dict[str, int], int]:
    """``(versions removed per table, bytes freed)`` that pruning the index would give,
    measured by pruning a scratch copy (see the module doc); the store is not touched."""
    scratch = store.scratch_base / f"{_SCRATCH}{uuid.uuid4().hex}"
    try:
        copy = _scratch_copy(store, scratch)
        index = LanceIndex.open_latest(copy)
        if index is None:
            return {}, 0
        before = copy.tree_bytes(copy.index_dir)
        removed = index.prune_versions()
        return removed, max(0, before - copy.tree_bytes(copy.index_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def collect_garbage(store: Store, run_id: str, dry_run: bool = False) -> GcReport:
    """Reclaim dead KV entries, old index versions and leftovers (see the module doc)."""
    report = GcReport(dry_run=dry_run)
    report.reader_versions_kept = len(held_indexes(store))
    live = live_content_keys(store)
    report.live_content_keys = len(live)
    nugget_keys: set[str] | None = None  # computed once, for stores of nugget spans only
    for kv_fp in kv_fps(store):
        kv = KvStore.open(store, kv_fp)
        if kv.layout.keeps_chunks:
            keys = live
        else:
            nugget_keys = live_nugget_entry_keys(store) if nugget_keys is None else nugget_keys
            keys = nugget_keys
        report.kv.append(kv.reclaim(keys, run_id, dry_run=dry_run))
    latest = LanceIndex.open_latest(store)
    if latest is not None and dry_run:
        report.index_versions_removed, report.index_bytes_freed = index_dry_run(store)
    elif latest is not None:
        before = store.tree_bytes(store.index_dir)
        report.index_versions_removed = latest.prune_versions()
        report.index_bytes_freed = max(0, before - store.tree_bytes(store.index_dir))
    for path in temp_leftovers(store) + stale_lease_paths(store):
        report.temp_paths_removed += 1
        report.temp_bytes_freed += store.tree_bytes(path)
        if not dry_run:
            store.remove(path)
    return report
