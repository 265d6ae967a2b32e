"""Garbage collection: reclaim what no live document needs any more. Run under the write lock.

- **KV entries** whose content_key no live chunk references (``storage.kv.KvStore.reclaim``:
  live entries of partly dead shards are moved to new verified shards, then whole dead shards
  go). A live chunk is a chunk of a live document version (``storage.corpus``) cut with the
  tokenizer and chunker of the last completed build; the content keys the published (and the
  latest) index rows point to are kept too, so a reader of the published state never loses its
  KV. Entries of every kv_fp are collected (KV of another model stays as long as its chunks are
  live: switching back costs nothing).
- **LanceDB versions** older than the published one (``LanceIndex.prune_versions``).
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
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import pyarrow.compute as pc

from coinrag.schemas.tables import ChunkRow, RunRow
from coinrag.storage.corpus import live_versions
from coinrag.storage.index import LanceIndex
from coinrag.storage.kv import KvReclaim, KvStore
from coinrag.storage.store import Store
from coinrag.storage.tables import read_table


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
    found += root.glob(f"{_SCRATCH}*")
    return sorted(set(found))


_SCRATCH = ".gc-dry-run-"  # scratch copies of the index made by dry runs
_IMMUTABLE = ("data", "_indices", "_deletions")  # Lance folders whose files are never rewritten


def _scratch_copy(store: Store, scratch: Path) -> Store:
    """A store at ``scratch`` holding a copy of ``store``'s index and ``coinrag.toml``. Local:
    Lance's immutable files (data, index and deletion files, written once under unique names)
    are hard links, the rest copies; object store: everything downloaded."""
    index = scratch / "index"
    if store.is_local:
        src = Path(store.index_dir)
        for path in src.rglob("*"):
            if not path.is_file():
                continue
            rel = path.relative_to(src)
            dst = index / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if any(part in _IMMUTABLE for part in rel.parts[:-1]):
                os.link(path, dst)
            else:
                shutil.copy2(path, dst)
    else:
        store.fs.get(str(store.index_dir) + "/", str(index) + "/", recursive=True)
    if store.is_file(store.settings_path):
        (scratch / "coinrag.toml").write_bytes(store.read_bytes(store.settings_path))
    return Store.at(scratch)


def index_dry_run(store: Store) -> tuple[dict[str, int], int]:
    """``(versions removed per table, bytes freed)`` that pruning the index would give,
    measured by pruning a scratch copy (see the module doc); the store is not touched."""
    base = store.root if store.is_local else Path(tempfile.gettempdir())
    scratch = Path(base) / f"{_SCRATCH}{uuid.uuid4().hex}"
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
    live = live_content_keys(store)
    report.live_content_keys = len(live)
    for kv_fp in kv_fps(store):
        report.kv.append(KvStore.open(store, kv_fp).reclaim(live, run_id, dry_run=dry_run))
    latest = LanceIndex.open_latest(store)
    if latest is not None and dry_run:
        report.index_versions_removed, report.index_bytes_freed = index_dry_run(store)
    elif latest is not None:
        before = store.tree_bytes(store.index_dir)
        report.index_versions_removed = latest.prune_versions()
        report.index_bytes_freed = max(0, before - store.tree_bytes(store.index_dir))
    for path in temp_leftovers(store):
        report.temp_paths_removed += 1
        report.temp_bytes_freed += store.tree_bytes(path)
        if not dry_run:
            store.remove(path)
    return report
