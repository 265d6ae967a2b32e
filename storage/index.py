"""The retrieval index: LanceDB tables ``chunks``, ``nuggets`` and ``documents`` under
``STORE/index/``.

Schemas come from ``schemas/tables.py`` (``INDEX_TABLES``); the ``vector`` column, a
``list<float32>`` there, is stored as ``fixed_size_list<float32>[dim]`` (what LanceDB indexes).

- One embedder per index. Its fingerprint and dimension are recorded in
  ``STORE/index/coinrag-index.json`` (and in each table's schema metadata). Every search states the
  fingerprint of the embedder that made its query vector, and a different one is refused with
  :class:`EmbedderMismatch` naming both. A build with a new embedder resets the index
  (:meth:`LanceIndex.open_for_write` with ``reset_on_mismatch``): the tables are dropped and
  rebuilt from the embedding cache, so only the vectors are recomputed.
- Writes are upserts by id (``merge_insert(id).when_matched_update_all()
  .when_not_matched_insert_all()``), so a rebuild never duplicates a row; deletes are by
  ``doc_id`` (:meth:`LanceIndex.delete_documents`) or by id.
- BTREE scalar indexes on the id columns (``chunk_id``, ``nugget_id``, ``doc_id``) make the
  prefilter ``chunk_id IN (...)`` and the deletes cheap.
- An ANN vector index is built on a table once it holds ``VECTOR_INDEX_MIN_ROWS`` rows; below
  that, exact (flat) search is fast enough (see ``tests/benchmarks/bench_retrieval.py`` for the
  measurements behind the threshold and the index type). Rows added later are merged into the
  index by ``optimize()``; the index is retrained once the table has doubled since training.
- Readers see only **published** state. A build (or a deletion) writes to the tables' latest
  versions and, at its very end, records each table's version in ``STORE/coinrag.toml``
  (``[published.index]``, one atomic rename: :meth:`LanceIndex.published_state`);
  :meth:`LanceIndex.open` checks the tables out at those versions. A build killed half-way
  (stale rows deleted, new ones not yet upserted) leaves the previous versions published and
  readable; the next build continues from the latest versions. Old versions are kept until
  they are older than the published one: ``optimize`` and ``gc`` prune only those. A store
  with no ``[published]`` table at all (written by the stages alone) is read at its latest
  versions. A new embedder overwrites the tables (a new version with a new schema), it never
  drops them, so the published vectors stay readable until the new ones are published.
- A full-text (BM25) index on ``text`` (LanceDB's native inverted index, :data:`FTS_CONFIG`)
  makes chunks and nuggets searchable by their words (:meth:`LanceIndex.search_text`). It is
  created by the first build that indexes a table (and by the next build of a store indexed
  before it existed) and is part of each table version like the table's rows: a reader checked
  out at the published version searches the index of that version, rows written after the
  index are searched unindexed until ``optimize`` merges them in, and deleted rows are never
  found.
- A nugget search restricted to some chunks (the second stage of CoinRAG's two-stage retrieval)
  is a prefiltered *exact* search: the filter keeps a few hundred rows, and an IVF index probing
  only some partitions could miss rows of those chunks and return fewer than ``k``.

Scores are cosine similarities (``1 - cosine distance``); vectors are L2-normalised anyway.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.schemas.leases import published_index_versions
from coinrag.schemas.tables import INDEX_TABLES, arrow_schema
from coinrag.storage.readers import fresh_leases
from coinrag.storage.store import Store

META_FILE = "coinrag-index.json"
ID_COLUMNS = {"chunks": "chunk_id", "nuggets": "nugget_id", "documents": "doc_id"}
FTS_TABLES = ("chunks", "nuggets")  # tables searched by their words (documents: by chunks')
SCALAR_COLUMNS = {
    "chunks": ("chunk_id", "doc_id"),
    "nuggets": ("nugget_id", "chunk_id", "doc_id"),
    "documents": ("doc_id",),
}
METRIC = "cosine"
# What a search returns of each table (besides ``score``).
CHUNK_HIT_COLUMNS = ("chunk_id", "doc_id", "doc_version", "content_key", "text", "n_tokens")
NUGGET_HIT_COLUMNS = (
    "nugget_id",
    "chunk_id",
    "doc_id",
    "doc_version",
    "content_key",
    "text",
    "tok_start",
    "tok_end",
)
DOCUMENT_HIT_COLUMNS = ("doc_id", "doc_version", "title")
HIT_COLUMNS = {
    "chunks": CHUNK_HIT_COLUMNS,
    "nuggets": NUGGET_HIT_COLUMNS,
    "documents": DOCUMENT_HIT_COLUMNS,
}

# Measured on 2 shared CPU cores (load average 4-6) with tests/benchmarks/bench_retrieval.py,
# dim 384, clustered vectors: a flat scan costs ~10 ms at 10^4 rows, ~15-20 ms at 2*10^4,
# ~50 ms at 10^5 and ~0.6-0.9 s at 10^6. IVF_SQ (cosine, rows/4096 partitions, 32 probes,
# refine 5) answers in ~5 ms at 2*10^4-10^5 and ~11 ms at 10^6 with recall@10 = 1.000 against
# exact search, and builds in 0.2 s / 1 s / 18 s. IVF_HNSW_SQ reached the same recall with
# refine 5 (5-8 ms) but took ~20 min to build at 10^6; IVF_PQ built in ~2 min and stayed at
# recall@10 0.89 (chunk-stage recall@5 0.52) even with refine 10. So: IVF_SQ from 2*10^4 rows.
VECTOR_INDEX_MIN_ROWS = int(os.environ.get("COINRAG_VECTOR_INDEX_MIN_ROWS", 20_000))
VECTOR_INDEX_TYPE = "IVF_SQ"
IVF_TARGET_PARTITION_ROWS = 4096  # IVF partitions: rows / this (about sqrt(rows) near 10^7)
HNSW_PARTITION_ROWS = 262_144  # IVF_HNSW_SQ partitions: one HNSW graph per 256Ki rows
HNSW_EF_CONSTRUCTION = 300  # LanceDB's default
SEARCH_NPROBES = 32  # IVF partitions probed per query
SEARCH_REFINE_FACTOR = 5  # re-rank 5*k candidates with the exact float32 vectors
SEARCH_EF = 100  # HNSW candidate list (IVF_HNSW_* indexes only)
# A coarse ANN search (the nugget votes of dense chunk scoring: approximate by design): on 142,565
# nuggets of the Python docs, top-100 recall 0.956 against exact in 11.5 ms, vs 1.000 in 18.6 ms
# with the fine parameters above (one thread).
COARSE_NPROBES = 16
COARSE_REFINE_FACTOR = 2
RETRAIN_GROWTH = 2.0  # retrain the ANN index when the table has grown this much since training
# LanceDB's native full-text (BM25) index on the ``text`` column of chunks and nuggets: simple
# word tokens, lower case, ASCII folding, English stemming and stop words, no positions (no
# phrase queries: questions are matched as bags of words).
FTS_COLUMN = "text"
FTS_CONFIG: dict[str, Any] = {
    "with_position": False,
    "base_tokenizer": "simple",
    "language": "English",
    "lower_case": True,
    "stem": True,
    "remove_stop_words": True,
    "ascii_folding": True,
}
_DELETE_BATCH = 2000  # ids per DELETE ... IN (...) statement
_WRITE_BATCH = 50_000  # rows per merge_insert


class EmbedderMismatch(ValueError):
    """A query vector (or a write) made by another embedder than the index's."""

    def __init__(self, index_fp: str, query_fp: str, where: str = "") -> None:
        self.index_fp = index_fp
        self.query_fp = query_fp
        super().__init__(
            f"the index{(' at ' + where) if where else ''} was built with embedder {index_fp}, "
            f"but the query was embedded with {query_fp}; embed the query with the index's "
            "embedder, or rebuild the index with this one"
        )


class LexicalIndexMissing(FileNotFoundError):
    """A table without its full-text index (an index built before coinrag had one)."""


class IndexNotBuilt(FileNotFoundError):
    """No index under ``STORE/index/`` yet (run a build with the embed stage first)."""


@dataclass(frozen=True)
class IndexMeta:
    embedder_fp: str
    dim: int
    embedder_name: str = ""
    vector_indexes: Mapping[str, Mapping[str, Any]] | None = None  # table -> {type, rows}

    def to_json(self) -> str:
        return json.dumps(
            {
                "embedder_fp": self.embedder_fp,
                "dim": self.dim,
                "embedder_name": self.embedder_name,
                "vector_indexes": dict(self.vector_indexes or {}),
            },
            indent=2,
            sort_keys=True,
        )


def lance_schema(table: str, dim: int, embedder_fp: str) -> pa.Schema:
    """The LanceDB schema of an index table: the record's, with a fixed-size vector column."""
    base = arrow_schema(INDEX_TABLES[table])
    fields = []
    for f in base:
        if f.name == "vector":
            f = pa.field("vector", pa.list_(pa.float32(), dim), nullable=False)
        elif f.name == ID_COLUMNS[table]:
            f = f.with_nullable(False)
        fields.append(f)
    return pa.schema(fields, metadata={"coinrag.embedder_fp": embedder_fp, "coinrag.dim": str(dim)})


def vectors_array(vectors: np.ndarray, dim: int) -> pa.FixedSizeListArray:
    """(n, dim) float32 -> a fixed_size_list<float32>[dim] array (no Python floats on the way)."""
    mat = np.ascontiguousarray(vectors, dtype=np.float32)
    if mat.ndim != 2 or mat.shape[1] != dim:
        raise ValueError(f"expected vectors of shape (n, {dim}), got {mat.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(mat.reshape(-1)), dim)


def _sql_list(values: Iterable[str]) -> str:
    return ", ".join("'" + str(v).replace("'", "''") + "'" for v in values)


def in_filter(column: str, values: Iterable[str]) -> str:
    """The prefilter ``column IN (...)`` for these values (quoted; duplicates dropped)."""
    return f"{column} IN ({_sql_list(dict.fromkeys(values))})"


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class LanceIndex:
    """The three index tables of one store, for one embedder.

    ``versions``: read-only, each table checked out at this version (a table not named does
    not exist for this reader); None: the latest versions (the writer's view).
    """

    def __init__(
        self, store: Store, meta: IndexMeta, versions: Mapping[str, int] | None = None
    ) -> None:
        self.store = store
        self.meta = meta
        self.versions = dict(versions) if versions is not None else None
        self.db = store.connect_lance(store.index_dir)
        self._tables: dict[str, Any] = {}
        self._has_ann: dict[str, bool] = {}  # table -> has a vector index (asked once)
        self._flat_tables: dict[str, FlatTable | None] = {}  # a reader's small tables in memory
        self._counts: dict[str, int] = {}  # a reader's row counts

    # ------------------------------------------------------------------ opening

    @staticmethod
    def read_meta(store: Store) -> IndexMeta | None:
        try:
            data = json.loads(store.read_bytes(store.index_dir / META_FILE).decode("utf-8"))
        except FileNotFoundError:
            return None
        return IndexMeta(
            embedder_fp=data["embedder_fp"],
            dim=int(data["dim"]),
            embedder_name=data.get("embedder_name", ""),
            vector_indexes=data.get("vector_indexes") or {},
        )

    def _write_meta(self) -> None:
        path = self.store.index_dir / META_FILE
        self.store.write_bytes_atomic(path, self.meta.to_json().encode("utf-8"))

    @classmethod
    def open(cls, store: Store, published: dict[str, Any] | None = None) -> LanceIndex:
        """Open the published index for searching; :class:`IndexNotBuilt` if there is none.

        The tables are checked out at the versions the last completed build (or deletion)
        published (``published``: that ``[published]`` record, as read once by the caller;
        default: read now); a store that never published anything is read at its latest
        versions.
        """
        if published is None:
            published = store.published()
        if published is not None:
            state = published.get("index")
            if not state:
                raise IndexNotBuilt(
                    f"no published retrieval index in {store.uri(store.index_dir)}: no build of "
                    "this store with the embed stage has completed yet"
                )
            meta = IndexMeta(
                embedder_fp=state["embedder_fp"],
                dim=int(state["dim"]),
                embedder_name=state.get("embedder_name", ""),
            )
            return cls(store, meta, {k: int(v) for k, v in (state.get("versions") or {}).items()})
        meta = cls.read_meta(store)
        if meta is None:
            raise IndexNotBuilt(
                f"no retrieval index in {store.uri(store.index_dir)}: "
                "run `coinrag build` with the embed stage"
            )
        return cls(store, meta)

    @classmethod
    def open_latest(cls, store: Store) -> LanceIndex | None:
        """The writer's view (latest versions), or None if no index was ever written."""
        meta = cls.read_meta(store)
        return None if meta is None else cls(store, meta)

    def published_state(self) -> dict[str, Any]:
        """What a build records as published: the embedder and each table's latest version."""
        versions = {}
        for name in INDEX_TABLES:
            tbl = self.table(name)
            if tbl is not None:
                tbl.checkout_latest()
                versions[name] = int(tbl.version)
        return {
            "embedder_fp": self.meta.embedder_fp,
            "dim": self.meta.dim,
            "embedder_name": self.meta.embedder_name,
            "versions": versions,
        }

    @classmethod
    def open_for_write(
        cls,
        store: Store,
        embedder_fp: str,
        dim: int,
        embedder_name: str = "",
        reset_on_mismatch: bool = True,
    ) -> tuple[LanceIndex, bool]:
        """Open (or create) the index for ``embedder_fp``; return (index, was_reset).

        An index built by another embedder is dropped when ``reset_on_mismatch`` (its vectors
        are useless to this one), else :class:`EmbedderMismatch` is raised.
        """
        meta = cls.read_meta(store)
        reset = False
        if meta is not None and meta.embedder_fp != embedder_fp:
            if not reset_on_mismatch:
                raise EmbedderMismatch(meta.embedder_fp, embedder_fp, store.uri(store.index_dir))
            reset = True
        if meta is None or reset:
            index = cls(store, IndexMeta(embedder_fp, int(dim), embedder_name, {}))
            for name in INDEX_TABLES:
                index._reset(name)
            index._write_meta()
            return index, reset
        if meta.dim != dim:
            raise ValueError(f"index dim {meta.dim} != embedder dim {dim} for {embedder_fp}")
        return cls(store, meta), False

    def _reset(self, name: str) -> None:
        """Empty a table with this index's schema as a new version (older versions, the
        published one among them, stay readable until pruned)."""
        if name in self._table_names():
            schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
            self.db.create_table(name, schema=schema, mode="overwrite")
        self._tables.pop(name, None)
        self._has_ann.clear()

    def _table_names(self) -> set[str]:
        result = self.db.list_tables()
        names = getattr(result, "tables", result)
        return set(names)

    def table(self, name: str, create: bool = False) -> Any | None:
        """The LanceDB table ``name`` (None if it does not exist and ``create`` is false)."""
        if name not in INDEX_TABLES:
            raise KeyError(f"unknown index table {name!r}")
        if name in self._tables:
            return self._tables[name]
        if self.versions is not None:
            if name not in self.versions:
                return None
            tbl = self.db.open_table(name)
            tbl.checkout(self.versions[name])
        elif name in self._table_names():
            tbl = self.db.open_table(name)
        elif create:
            schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
            tbl = self.db.create_table(name, schema=schema, exist_ok=True)
        else:
            return None
        self._tables[name] = tbl
        return tbl

    @property
    def embedder_fp(self) -> str:
        return self.meta.embedder_fp

    @property
    def dim(self) -> int:
        return self.meta.dim

    def check(self, embedder_fp: str, vector: np.ndarray | None = None) -> None:
        """Refuse a query (or write) from another embedder, or a vector of the wrong size."""
        if embedder_fp != self.meta.embedder_fp:
            raise EmbedderMismatch(
                self.meta.embedder_fp, embedder_fp, self.store.uri(self.store.index_dir)
            )
        if vector is not None and np.asarray(vector).shape[-1] != self.meta.dim:
            raise ValueError(
                f"query vector has {np.asarray(vector).shape[-1]} dims, index {self.dim}"
            )

    # ------------------------------------------------------------------ writing

    def build_table(self, name: str, columns: Mapping[str, Sequence[Any]], vectors: np.ndarray):
        """An Arrow table with ``name``'s schema from plain columns and an (n, dim) matrix."""
        schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
        arrays = []
        for f in schema:
            if f.name == "vector":
                arrays.append(vectors_array(vectors, self.meta.dim))
            else:
                arrays.append(pa.array(columns[f.name], type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    def upsert(self, name: str, data: pa.Table) -> int:
        """Insert or replace rows by id; return the number of rows written."""
        if data.num_rows == 0:
            return 0
        if "embedder_fp" in data.column_names:
            fps = set(data.column("embedder_fp").to_pylist())
            for fp in fps:
                self.check(fp)
        tbl = self.table(name, create=True)
        schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
        data = data.select(schema.names).cast(schema)
        key = ID_COLUMNS[name]
        for start in range(0, data.num_rows, _WRITE_BATCH):
            part = data.slice(start, _WRITE_BATCH)
            (
                tbl.merge_insert(key)
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .execute(part)
            )
        return data.num_rows

    def delete_where(self, name: str, column: str, values: Iterable[str]) -> int:
        """Delete the rows of ``name`` whose ``column`` is in ``values``; return how many."""
        tbl = self.table(name)
        values = sorted(set(values))
        if tbl is None or not values:
            return 0
        deleted = 0
        for part in _batches(values, _DELETE_BATCH):
            result = tbl.delete(f"{column} IN ({_sql_list(part)})")
            deleted += int(getattr(result, "num_deleted_rows", 0) or 0)
        return deleted

    def delete_documents(self, doc_ids: Iterable[str]) -> dict[str, int]:
        """Remove every row of these documents from all three tables; rows deleted per table."""
        doc_ids = list(doc_ids)
        return {name: self.delete_where(name, "doc_id", doc_ids) for name in INDEX_TABLES}

    def columns(self, name: str, columns: Sequence[str]) -> pa.Table:
        """Some columns of every row (no vectors unless asked): an empty table if none."""
        tbl = self.table(name)
        schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
        if tbl is None or tbl.count_rows() == 0:
            return schema.empty_table().select(list(columns))
        return tbl.search().select(list(columns)).limit(None).to_arrow()

    def rows_where(
        self, name: str, where: str, limit: int, extra: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """At most ``limit`` rows of ``name`` (their :data:`HIT_COLUMNS` and ``extra`` columns,
        e.g. ``vector``) matching ``where`` (``chunk_id IN (...)``), in no particular order."""
        tbl = self.table(name)
        if tbl is None or limit <= 0:
            return []
        columns = [*HIT_COLUMNS[name], *extra]
        return tbl.search().where(where).select(columns).limit(limit).to_arrow().to_pylist()

    def count(self, name: str) -> int:
        """Rows of table ``name`` (asked once per table by a reader: its versions are fixed)."""
        if self.versions is not None and name in self._counts:
            return self._counts[name]
        tbl = self.table(name)
        n = 0 if tbl is None else tbl.count_rows()
        if self.versions is not None:
            self._counts[name] = n
        return n

    # ------------------------------------------------------------------ indexes

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
            if name in FTS_TABLES and not self._has_fts(tbl):
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
            self.meta = IndexMeta(
                self.meta.embedder_fp, self.meta.dim, self.meta.embedder_name, vector_indexes
            )
            self._write_meta()
        return made

    def _flat(self, name: str) -> FlatTable | None:
        """The in-memory copy of table ``name`` for a reader (pinned versions) when the table
        has no ANN index and at most ``VECTOR_INDEX_MIN_ROWS`` rows; None otherwise (the
        writer's view changes under it)."""
        if self.versions is None or self.has_vector_index(name):
            return None
        if name not in self._flat_tables:
            tbl = self.table(name)
            flat = None
            if tbl is not None and tbl.count_rows() <= VECTOR_INDEX_MIN_ROWS:
                data = tbl.search().select([*HIT_COLUMNS[name], "vector"]).limit(None).to_arrow()
                vec = data.column("vector").combine_chunks()
                mat = vec.flatten().to_numpy().astype(np.float32).reshape(len(vec), self.dim)
                flat = FlatTable(data.drop_columns(["vector"]), mat)
            self._flat_tables[name] = flat
        return self._flat_tables[name]

    def _has_fts(self, tbl: Any) -> bool:
        return any(
            idx.index_type == "FTS" and FTS_COLUMN in idx.columns for idx in tbl.list_indices()
        )

    def lacks_text_index(self) -> bool:
        """Whether a table of :data:`FTS_TABLES` holds rows but no full-text index (an index
        built before it existed: :meth:`ensure_indexes` adds it)."""
        return any(self.count(n) and not self.has_text_index(n) for n in FTS_TABLES)

    def has_text_index(self, name: str) -> bool:
        """Whether table ``name`` (at this reader's version) has its full-text index."""
        key = f"fts:{name}"
        if key not in self._has_ann:
            tbl = self.table(name)
            self._has_ann[key] = tbl is not None and self._has_fts(tbl)
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

    # ------------------------------------------------------------------ searching

    def _search(
        self,
        name: str,
        vector: np.ndarray,
        k: int,
        embedder_fp: str,
        columns: Sequence[str],
        where: str | None = None,
        exact: bool = False,
        coarse: bool = False,
    ) -> list[dict[str, Any]]:
        self.check(embedder_fp, vector)
        tbl = self.table(name)
        if tbl is None or k <= 0:
            return []
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        in_memory = None if where is not None else self._flat(name)
        if in_memory is not None:
            return in_memory.search(q, k, columns)
        query = (
            tbl.search(q, vector_column_name="vector")
            .distance_type(METRIC)
            .select([*columns, "_distance"])  # asked explicitly: no deprecation warning
            .limit(k)
        )
        if where is not None:
            query = query.where(where, prefilter=True)
        if exact or not self.has_vector_index(name):
            query = query.bypass_vector_index()
        else:
            query = tune_ann_query(query, coarse)
        rows = query.to_arrow().to_pylist()
        for row in rows:
            row["score"] = 1.0 - float(row.pop("_distance"))
        rows.sort(key=lambda r: -r["score"])
        return rows

    def search_vector(
        self,
        name: str,
        vector: np.ndarray,
        k: int,
        *,
        embedder_fp: str,
        where: str | None = None,
        coarse: bool = False,
    ) -> list[dict[str, Any]]:
        """Top-``k`` rows of ``name`` (their :data:`HIT_COLUMNS`) by cosine similarity to
        ``vector`` (``(dim,)`` float32), best first, with ``score``. ``where``: a prefilter,
        under which the search is exact (it keeps a few hundred rows, and an IVF index probing
        some partitions could miss some); ``coarse``: an ANN search with the coarse parameters
        (:data:`COARSE_NPROBES`)."""
        return self._search(
            name,
            vector,
            k,
            embedder_fp,
            HIT_COLUMNS[name],
            where=where,
            exact=where is not None,
            coarse=coarse,
        )

    def search_text(
        self, name: str, text: str, k: int, *, where: str | None = None
    ) -> list[dict[str, Any]]:
        """Top-``k`` rows of ``name`` (their :data:`HIT_COLUMNS`) by BM25 of ``text`` against
        their ``text`` column, best first (dicts with ``score``, the BM25 score); ``where``: a
        prefilter. A query with no indexed word (only stop words, say) finds nothing.
        :class:`LexicalIndexMissing` if the table has no full-text index."""
        columns = HIT_COLUMNS[name]
        from lancedb.query import MatchQuery

        tbl = self.table(name)
        if tbl is None or k <= 0 or not text.strip():
            return []
        if not self.has_text_index(name):
            raise LexicalIndexMissing(
                f"the {name} index in {self.store.uri(self.store.index_dir)} has no full-text "
                "index (built before lexical search existed): run `coinrag build` on the store "
                "once (an unchanged rebuild only adds it), or search with --retrieval dense"
            )
        query = tbl.search(MatchQuery(text, FTS_COLUMN), query_type="fts").select(
            [*columns, "_score"]
        )
        if where is not None:
            query = query.where(where, prefilter=True)
        rows = query.limit(k).to_arrow().to_pylist()
        for row in rows:
            row["score"] = float(row.pop("_score"))
        rows.sort(key=lambda r: -r["score"])
        return rows

    def search_chunks(
        self,
        vector: np.ndarray,
        k: int,
        *,
        embedder_fp: str,
        doc_ids: Sequence[str] | None = None,
    ) -> list[dict]:
        """Top-``k`` chunks by cosine similarity, best first (dicts with ``score``).

        ``doc_ids``: only these documents' chunks (a prefiltered exact search, so it returns
        ``min(k, their chunks)``)."""
        if doc_ids is None:
            return self._search("chunks", vector, k, embedder_fp, CHUNK_HIT_COLUMNS)
        where = in_filter("doc_id", doc_ids)
        return self._search(
            "chunks", vector, k, embedder_fp, CHUNK_HIT_COLUMNS, where=where, exact=True
        )

    def search_nuggets(
        self,
        vector: np.ndarray,
        k: int,
        chunk_ids: Sequence[str] | None = None,
        *,
        embedder_fp: str,
    ) -> list[dict]:
        """Top-``k`` nuggets, best first; with ``chunk_ids``, only nuggets of those chunks.

        The restricted search prefilters ``chunk_id IN (...)`` (BTREE index) and then ranks the
        remaining rows exactly, so it returns ``min(k, nuggets of those chunks)`` rows.
        """
        cols = NUGGET_HIT_COLUMNS
        if chunk_ids is None:
            return self._search("nuggets", vector, k, embedder_fp, cols)
        ids = list(dict.fromkeys(chunk_ids))
        if not ids:
            self.check(embedder_fp, vector)
            return []
        where = in_filter("chunk_id", ids)
        return self._search("nuggets", vector, k, embedder_fp, cols, where=where, exact=True)

    def search_documents(self, vector: np.ndarray, k: int, *, embedder_fp: str) -> list[dict]:
        """Top-``k`` documents (one vector each), best first."""
        return self._search("documents", vector, k, embedder_fp, DOCUMENT_HIT_COLUMNS)


def create_vector_index(tbl: Any, rows: int, dim: int, index_type: str = VECTOR_INDEX_TYPE) -> None:
    """Train an ANN index on ``tbl.vector`` (cosine), sized for ``rows`` rows."""
    from lancedb.index import HnswSq, IvfPq, IvfSq

    partitions = max(1, rows // IVF_TARGET_PARTITION_ROWS)
    if index_type == "IVF_PQ":
        sub = dim // 16 if dim % 16 == 0 else (dim // 8 if dim % 8 == 0 else 1)
        config: Any = IvfPq(distance_type=METRIC, num_partitions=partitions, num_sub_vectors=sub)
    elif index_type == "IVF_SQ":
        config = IvfSq(distance_type=METRIC, num_partitions=partitions)
    elif index_type == "IVF_HNSW_SQ":
        config = HnswSq(
            distance_type=METRIC,
            num_partitions=max(1, rows // HNSW_PARTITION_ROWS),
            ef_construction=HNSW_EF_CONSTRUCTION,
        )
    else:
        raise ValueError(f"unsupported vector index type {index_type!r}")
    tbl.create_index("vector", config=config, replace=True)


def tune_ann_query(query: Any, coarse: bool = False) -> Any:
    """Search parameters for the ANN index (chosen with the benchmark's recall@10); ``coarse``:
    fewer partitions and less refining (:data:`COARSE_NPROBES`)."""
    if coarse:
        return query.nprobes(COARSE_NPROBES).ef(SEARCH_EF).refine_factor(COARSE_REFINE_FACTOR)
    query = query.nprobes(SEARCH_NPROBES).ef(SEARCH_EF)
    return query.refine_factor(SEARCH_REFINE_FACTOR) if SEARCH_REFINE_FACTOR else query


class FlatTable:
    """A reader's in-memory copy of a small table (no ANN index: LanceDB would scan it whole
    anyway): its rows' hit columns and their L2-normalised ``(n, dim)`` float32 vectors, read
    once at the reader's pinned version. An exact cosine search over it is one matrix-vector
    product (0.3 ms for the 5,860 chunks of the Python docs, where LanceDB's flat scan took
    13 ms)."""

    def __init__(self, rows: pa.Table, vectors: np.ndarray) -> None:
        self.rows = rows
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.vectors = vectors / np.where(norms > 0, norms, 1.0)

    def search(self, q: np.ndarray, k: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        """Top-``k`` rows by cosine similarity to ``q``, best first, with ``score``."""
        n = len(self.vectors)
        if n == 0:
            return []
        scores = self.vectors @ (q / (np.linalg.norm(q) or 1.0))
        k = min(k, n)
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        rows = self.rows.select(list(columns)).take(pa.array(top)).to_pylist()
        for row, i in zip(rows, top, strict=True):
            row["score"] = float(scores[i])
        return rows
