"""Keeping the index fast and small: its scalar, full-text and ANN indexes
(:meth:`IndexUpkeep.ensure_indexes`), compaction, and pruning the table versions no reader needs
(:meth:`IndexUpkeep.prune_versions`). A part of :class:`storage.index.lance.LanceIndex`."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from coinrag.schemas.leases import published_index_versions
from coinrag.schemas.tables import INDEX_TABLES
from coinrag.storage.index.ann import (
    FTS_COLUMN,
    FTS_CONFIG,
    RETRAIN_GROWTH,
    VECTOR_INDEX_MIN_ROWS,
    VECTOR_INDEX_TYPE,
    create_vector_index,
)
from coinrag.storage.index.tables import FTS_TABLES, SCALAR_COLUMNS, IndexMeta
from coinrag.storage.readers import fresh_leases


class IndexUpkeep:
    """The index-maintenance half of :class:`storage.index.lance.LanceIndex` (its tables, meta and
    caches are the index's own: ``table``, ``count``, ``_write_meta`` come from it)."""

    store: Any
    meta: IndexMeta
    _has_ann: dict[str, bool]

    def _index_columns(self, tbl: Any) -> set[str]:
        return {c for idx in tbl.list_indices() for c in idx.columns}

    def ensure_indexes(
        self, min_rows: int | None = None, optimize: bool = True
    ) -> dict[str, list[str]]:
        """Scalar indexes on the id columns; an ANN index on tables of ``min_rows`` or more.

        Returns the indexes created (or retrained) per table. With ``optimize``, new rows are
        merged into existing indexes and small files compacted first.
        """
        from lancedb.index import FTS, BTree

        threshold = VECTOR_INDEX_MIN_ROWS if min_rows is None else min_rows
        made: dict[str, list[str]] = {}
        vector_indexes = dict(self.meta.vector_indexes or {})
        for name in INDEX_TABLES:
            tbl = self.table(name)
            if tbl is None:
                continue
            rows = tbl.count_rows()
            if rows == 0:
                continue
            if optimize:
                self._compact_then_prune(tbl, name)
            have = self._index_columns(tbl)
            for column in SCALAR_COLUMNS[name]:
                if column not in have:
                    tbl.create_index(column, config=BTree(), replace=True)
                    made.setdefault(name, []).append(f"btree:{column}")
            if name in FTS_TABLES and not self._has_fts(tbl, name):
                tbl.create_index(FTS_COLUMN, config=FTS(**FTS_CONFIG), replace=True)
                made.setdefault(name, []).append(f"fts:{FTS_COLUMN}")
                self._has_ann.pop(f"fts:{name}", None)
            info = vector_indexes.get(name)
            stale = info is not None and rows >= RETRAIN_GROWTH * int(info.get("rows", 0))
            if rows >= threshold and ("vector" not in have or info is None or stale):
                self._create_vector_index(tbl, rows)
                vector_indexes[name] = {"type": VECTOR_INDEX_TYPE, "rows": rows}
                made.setdefault(name, []).append(f"{VECTOR_INDEX_TYPE.lower()}:vector")
        if vector_indexes != dict(self.meta.vector_indexes or {}):
            self.meta = dataclasses.replace(self.meta, vector_indexes=vector_indexes)
            self._write_meta()
        return made

    def _has_fts(self, tbl: Any, name: str) -> bool:
        """Whether ``tbl`` has its full-text index on the column its words are searched in
        (``fts_column``: the older ``text`` of a table written before ``search_text``)."""
        column = self.fts_column(name)
        return any(idx.index_type == "FTS" and column in idx.columns for idx in tbl.list_indices())

    def lacks_text_index(self) -> bool:
        """Whether a table of :data:`FTS_TABLES` holds rows but no full-text index (an index
        built before it existed: :meth:`ensure_indexes` adds it)."""
        return any(self.count(n) and not self.has_text_index(n) for n in FTS_TABLES)

    def has_text_index(self, name: str) -> bool:
        """Whether table ``name`` (at this reader's version) has its full-text index."""
        key = f"fts:{name}"
        if key not in self._has_ann:
            tbl = self.table(name)
            self._has_ann[key] = tbl is not None and self._has_fts(tbl, name)
        return self._has_ann[key]

    def _keep_from(self, name: str) -> int | None:
        """The oldest version of table ``name`` to keep: the published one, or an older one a
        reader still holds (a fresh lease, ``storage.readers``), among the versions the table
        still has (a lease naming a version already gone keeps nothing); None when none is."""
        wanted = [
            v[name]
            for lease in fresh_leases(self.store)
            for v in lease.index_versions()
            if name in v
        ]
        published = published_index_versions(self.store.published())
        if name in published:
            wanted.append(published[name])
        present = {v["version"] for v in self.table(name).list_versions()}
        kept = [v for v in wanted if v in present]
        return min(kept) if kept else None

    def _prunable_age(self, name: str) -> timedelta:
        """``cleanup_older_than`` that prunes only versions older than the one to keep
        (:meth:`_keep_from`).

        Lance stamps versions with naive local times; the age is taken under both readings
        (local and UTC) and the larger kept, plus a margin, so the kept version is never
        pruned. With nothing published or held, versions older than a day go.
        """
        keep_from = self._keep_from(name)
        if keep_from is None:
            return timedelta(days=1)
        tbl = self.table(name)
        stamps = [v["timestamp"] for v in tbl.list_versions() if v["version"] == keep_from]
        if not stamps:
            return timedelta(days=1)
        at = stamps[0].replace(tzinfo=None)
        now_local = datetime.now()
        now_utc = datetime.now(UTC).replace(tzinfo=None)
        age = max(now_local - at, now_utc - at, timedelta(0))
        return age + timedelta(seconds=1)

    def _compact_then_prune(self, tbl: Any, name: str, delete_unverified: bool = False) -> None:
        """Compact small files, then prune versions older than the one to keep (the published
        one, or an older one a reader holds: :meth:`_keep_from`).

        Two ``optimize`` calls: Lance takes the cleanup's cutoff (now minus the age) when it
        prunes, after compacting, so an age measured before a long compaction would move the
        cutoff past the published version. The first call compacts and prunes nothing younger
        than ten years; the second has nothing left to compact, so its cutoff is taken
        milliseconds after :meth:`_prunable_age` measured the age (its margin is 1 s).
        """
        tbl.optimize(cleanup_older_than=timedelta(days=3650))
        age = self._prunable_age(name)
        tbl.optimize(cleanup_older_than=age, delete_unverified=delete_unverified)

    def prune_versions(self, dry_run: bool = False) -> dict[str, int]:
        """Remove the versions of each table older than the published one, or than an older
        version a reader still holds (a fresh lease, ``storage.readers``), compacting small
        files on the way; return how many versions each table lost (or would lose)."""
        removed: dict[str, int] = {}
        for name in INDEX_TABLES:
            tbl = self.table(name)
            if tbl is None:
                continue
            before = [v["version"] for v in tbl.list_versions()]
            keep_from = self._keep_from(name)
            if keep_from is None:
                keep_from = max(before)
            old = sum(v < keep_from for v in before)
            if not dry_run and old:
                self._compact_then_prune(tbl, name, delete_unverified=True)
                after = {v["version"] for v in tbl.list_versions()}
                old = sum(v not in after for v in before)
            removed[name] = old
        return removed

    def _create_vector_index(self, tbl: Any, rows: int, index_type: str | None = None) -> None:
        create_vector_index(tbl, rows, self.meta.dim, index_type or VECTOR_INDEX_TYPE)
        self._has_ann.clear()

    def has_vector_index(self, name: str) -> bool:
        if name not in self._has_ann:
            tbl = self.table(name)
            self._has_ann[name] = tbl is not None and "vector" in self._index_columns(tbl)
        return self._has_ann[name]
