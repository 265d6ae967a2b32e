"""Garbage collection: reclaim what no live document needs any more. Run under the write lock.

- **KV entries** whose content_key no live chunk references (``storage.kv.KvStore.reclaim``:
  live entries of partly dead shards are moved to new verified shards, then whole dead shards
  go). A live chunk is a chunk of a live document version (``storage.corpus``) cut with the
  tokenizer and chunker of the last completed build; the content keys the published (and the
  latest) index rows point to are kept too, so a reader of the published state never loses its
  KV. Entries of every kv_fp are collected (KV of another model stays as long as its chunks are
  live: switching back costs nothing).
- **LanceDB versions** older than the published one (``LanceIndex.prune_versions``).
- **Leftovers of killed writes**: ``.tmp-`` folders, ``.*.tmp`` Parquet files (of tables and of
  ``staging/``), temporary settings files.

Parquet tables are not touched, except ``kv_manifest`` rows of dropped entries; staged rows
(``STORE/staging/``: LLM answers a killed build received) are kept for the next build.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePath

import pyarrow.compute as pc

from schemas.tables import ChunkRow, RunRow
from storage.corpus import live_versions
from storage.index import LanceIndex
from storage.kv import KvReclaim, KvStore
from storage.store import Store
from storage.tables import read_table


@dataclass
class GcReport:
    """What one ``gc`` reclaimed (or, dry, would reclaim). Bytes are bytes on disk."""

    dry_run: bool
    live_content_keys: int = 0
    kv: list[KvReclaim] = field(default_factory=list)
    index_versions_removed: dict[str, int] = field(default_factory=dict)
    index_bytes_freed: int = 0  # measured (0 on a dry run: Lance tells only by deleting)
    temp_paths_removed: int = 0
    temp_bytes_freed: int = 0

    @property
    def kv_entries_dropped(self) -> int:
        return sum(k.entries_dropped for k in self.kv)

    @property
    def bytes_reclaimed(self) -> int:
        kv = sum(k.bytes_reclaimed for k in self.kv)
        return kv + self.index_bytes_freed + self.temp_bytes_freed


def last_build_fingerprints(store: Store) -> dict[str, str]:
    """The fingerprints recorded by the last completed build (empty if none completed)."""
    runs = read_table(
        store,
        RunRow,
        columns=["flow", "status", "ended_at", "fingerprints_json"],
        filter=(pc.field("flow") == "build") & (pc.field("status") == "completed"),
    ).to_pylist()
    if not runs:
        return {}
    last = max(runs, key=lambda r: r["ended_at"])
    return json.loads(last["fingerprints_json"] or "{}")


def live_content_keys(store: Store) -> set[str]:
    """Content keys of live chunks, plus those the published and latest index rows point to."""
    versions = set(live_versions(store).values())
    keys: set[str] = set()
    if versions:
        fps = last_build_fingerprints(store)
        filt = pc.field("doc_version").isin(sorted(versions))
        for name in ("tokenizer_fp", "chunker_fp"):
            if fps.get(name):
                filt = filt & (pc.field(name) == fps[name])
        table = read_table(store, ChunkRow, columns=["content_key"], filter=filt)
        keys.update(table.column("content_key").to_pylist())
    for index in _indexes(store):
        keys.update(index.columns("chunks", ["content_key"]).column(0).to_pylist())
    return keys


def _indexes(store: Store) -> Iterable[LanceIndex]:
    latest = LanceIndex.open_latest(store)
    if latest is not None:
        yield latest
    published = (store.published() or {}).get("index")
    if published:
        yield LanceIndex.open(store)


def kv_fps(store: Store) -> list[str]:
    """The KV stores under ``STORE/kv/`` (one folder per kv_fp)."""
    root = store.root / "kv"
    names = store.list_names(root)
    return [n for n in names if not n.startswith(".") and store.is_file(root / n / "zarr.json")]


def temp_leftovers(store: Store) -> list[PurePath]:
    """Temporary files and folders of killed writes (the KV stores' own are in ``reclaim``).
    An object store writes no temporary files outside the KV stores (each file is one PUT)."""
    if not store.is_local:
        return []
    root = store.require_local("temporary files")
    found = list(root.glob("coinrag.toml.tmp*"))
    found += root.glob("tables/*/.*.tmp")
    found += root.glob("staging/*/.*.tmp")
    found += root.glob("kv/.tmp-*")
    found += root.glob("cartridges/*/.tmp-*")
    found += root.glob("index/*.json.tmp")
    found += root.glob("index/*.json.tmp-*")
    return sorted(set(found))


def collect_garbage(store: Store, run_id: str, dry_run: bool = False) -> GcReport:
    """Reclaim dead KV entries, old index versions and leftovers (see the module doc)."""
    report = GcReport(dry_run=dry_run)
    live = live_content_keys(store)
    report.live_content_keys = len(live)
    for kv_fp in kv_fps(store):
        report.kv.append(KvStore.open(store, kv_fp).reclaim(live, run_id, dry_run=dry_run))
    latest = LanceIndex.open_latest(store)
    if latest is not None:
        before = store.tree_bytes(store.index_dir)
        report.index_versions_removed = latest.prune_versions(dry_run=dry_run)
        report.index_bytes_freed = max(0, before - store.tree_bytes(store.index_dir))
    for path in temp_leftovers(store):
        report.temp_paths_removed += 1
        report.temp_bytes_freed += store.tree_bytes(path)
        if not dry_run:
            store.remove(path)
    return report
