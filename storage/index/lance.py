"""The retrieval index: LanceDB tables ``chunks``, ``windows`` (pieces of a chunk the embedder
sees whole: ``tasks/embed.py``), ``nuggets`` and ``documents`` under ``STORE/index/``.

Schemas come from ``schemas/tables.py`` (``INDEX_TABLES``); the ``vector`` column, a
``list<float32>`` there, is stored as ``fixed_size_list<float32>[dim]`` (what LanceDB indexes).

- One embedder per index. Its fingerprint and dimension are recorded in
  ``STORE/index/coinrag-index.json`` (and in each table's schema metadata). Every search states the
  fingerprint of the embedder that made its query vector, and a different one is refused with
  :class:`EmbedderMismatch` naming both. A build with a new embedder resets the index
  (:meth:`LanceIndex.open_for_write` with ``reset_on_mismatch``): the tables are dropped and
  rebuilt from the embedding cache, so only the vectors are recomputed. A table whose columns
  are not this code's (written by an older coinrag) is emptied the same way, alone, and written
  again from the cache by the build (a reader of the older published version reads it as it
  is: its words in ``text``, no windows).
- Writes are upserts by id (``merge_insert(id).when_matched_update_all()
  .when_not_matched_insert_all()``), so a rebuild never duplicates a row; deletes are by
  ``doc_id`` (:meth:`LanceIndex.delete_documents`) or by id.
- BTREE scalar indexes on the id columns (``chunk_id``, ``window_id``, ``nugget_id``,
  ``doc_id``) make the prefilter ``chunk_id IN (...)`` and the deletes cheap.
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
- A full-text (BM25) index on ``search_text`` (the heading path and the text; LanceDB's native
  inverted index, :data:`FTS_CONFIG`) makes chunks and nuggets searchable by their words
  (:meth:`LanceIndex.search_text`). It is created by the first build that indexes a table
  (and by the next build of a store indexed before it existed) and is part of each table
  version like the table's rows: a reader checked out at the published version searches the
  index of that version, rows written after the index are searched unindexed until
  ``optimize`` merges them in, and deleted rows are never found.
- A nugget search restricted to some chunks (the second stage of CoinRAG's two-stage retrieval)
  is a prefiltered *exact* search: the filter keeps a few hundred rows, and an IVF index probing
  only some partitions could miss rows of those chunks and return fewer than ``k``.

Scores are cosine similarities (``1 - cosine distance``); vectors are L2-normalised anyway.

Split by job: this module opens, writes and reads the tables (:class:`LanceIndex`);
``index_tables.py`` holds their columns, metadata and errors, ``index_ann.py`` the ANN and
full-text parameters (measured) and the in-memory search of small tables, ``index_search.py``
and ``index_upkeep.py`` the searching and the maintenance (indexes, compaction, pruning) halves
of :class:`LanceIndex`. Every name stays importable from here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.schemas.tables import INDEX_TABLES
from coinrag.storage.index.ann import (  # noqa: F401  (re-exported: the search parameters)
    FLAT_MAX_BYTES,
    VECTOR_INDEX_MIN_ROWS,
    VECTOR_INDEX_TYPE,
    FlatTable,
    create_vector_index,
    tune_ann_query,
)
from coinrag.storage.index.bm25 import Bm25Index
from coinrag.storage.index.search import IndexSearch
from coinrag.storage.index.tables import (  # noqa: F401  (re-exported: columns and errors)
    _DELETE_BATCH,
    _WRITE_BATCH,
    CHUNK_HIT_COLUMNS,
    DOCUMENT_HIT_COLUMNS,
    FTS_TABLES,
    HIT_COLUMNS,
    ID_COLUMNS,
    META_FILE,
    NUGGET_HIT_COLUMNS,
    EmbedderMismatch,
    IndexMeta,
    IndexNotBuilt,
    LexicalIndexMissing,
    _batches,
    _sql_list,
    in_filter,
    lance_schema,
    same_columns,
    vectors_array,
)
from coinrag.storage.index.upkeep import IndexUpkeep
from coinrag.storage.store import Store


class LanceIndex(IndexSearch, IndexUpkeep):
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
        self._fts_columns: dict[str, str] = {}  # table -> the column its words are searched in
        self.migrated: list[str] = []  # tables emptied by open_for_write: written by an older
        # coinrag (other columns), rebuilt from the embedding cache
        self._flat_tables: dict[str, FlatTable | None] = {}  # a reader's tables in memory
        self._text_tables: dict[str, Bm25Index | None] = {}  # their BM25 copies (text search)
        self.flat_max_bytes = FLAT_MAX_BYTES  # the largest table (its vectors) kept in memory
        self._counts: dict[str, int] = {}  # a reader's row counts
        self._column_names: dict[str, frozenset[str]] = {}  # a reader's tables' columns

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
            fusion=data.get("fusion") or None,
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
                fusion=state.get("fusion") or None,
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
        """What a build records as published: the embedder, the fusion chosen for this index
        (if any) and each table's latest version."""
        versions = {}
        for name in INDEX_TABLES:
            tbl = self.table(name)
            if tbl is not None:
                tbl.checkout_latest()
                versions[name] = int(tbl.version)
        state: dict[str, Any] = {
            "embedder_fp": self.meta.embedder_fp,
            "dim": self.meta.dim,
            "embedder_name": self.meta.embedder_name,
            "versions": versions,
        }
        if self.meta.fusion:
            state["fusion"] = dict(self.meta.fusion)
        return state

    def record_fusion(self, fusion: Mapping[str, Any]) -> None:
        """Record ``fusion`` (``{"dense_weight": w, "page_support": s, ...}``: each in [0, 1];
        ``page_support`` optional) as this index's hybrid fusion in
        ``coinrag-index.json``; the next publish makes it part of the published index record.
        A new embedder resets it (its weight was chosen for other vectors)."""
        if "dense_weight" not in fusion:
            raise ValueError("a fusion record needs its dense_weight")
        for key in ("dense_weight", "page_support"):
            if key in fusion and not 0.0 <= float(fusion[key]) <= 1.0:
                raise ValueError(f"fusion {key} {fusion[key]} is not in [0, 1]")
        self.meta = dataclasses.replace(self.meta, fusion=dict(fusion))
        self._write_meta()

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
        are useless to this one), else :class:`EmbedderMismatch` is raised. A table whose
        columns are not this code's (written by an older coinrag: ``search_text`` or the
        ``windows`` table came later) is emptied the same way, alone (``index.migrated`` names
        them): the build writes its rows again from the embedding cache, embedding only the
        texts that are new (windows, heading prefixes).
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
        index = cls(store, meta)
        index._migrate()
        return index, False

    def _migrate(self) -> None:
        """Empty (:meth:`_reset`) each table whose columns differ from its schema's; forget
        its vector index, so that :meth:`ensure_indexes` trains one again."""
        names = self._table_names()
        for name in INDEX_TABLES:
            if name not in names:
                continue
            want = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
            if not same_columns(self.db.open_table(name).schema, want):
                self._reset(name)
                self.migrated.append(name)
        if self.migrated:
            kept = {k: v for k, v in (self.meta.vector_indexes or {}).items()}
            for name in self.migrated:
                kept.pop(name, None)
            self.meta = dataclasses.replace(self.meta, vector_indexes=kept)
            self._write_meta()

    def _reset(self, name: str) -> None:
        """Empty a table with this index's schema as a new version (older versions, the
        published one among them, stay readable until pruned)."""
        if name in self._table_names():
            schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
            self.db.create_table(name, schema=schema, mode="overwrite")
        self._tables.pop(name, None)
        self._fts_columns.pop(name, None)
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
        """An Arrow table with ``name``'s schema from plain columns and an (n, dim) matrix; a
        nullable column not given is null (a row with no pages or section)."""
        schema = lance_schema(name, self.meta.dim, self.meta.embedder_fp)
        arrays = []
        for f in schema:
            if f.name == "vector":
                arrays.append(vectors_array(vectors, self.meta.dim))
            elif f.name not in columns and f.nullable:
                arrays.append(pa.nulls(len(vectors), type=f.type))
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
        self, name: str, where: str, limit: int | None, extra: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """At most ``limit`` rows (None: all) of ``name`` (their :data:`HIT_COLUMNS` and
        ``extra`` columns, e.g. ``vector``) matching ``where`` (``chunk_id IN (...)``), in no
        particular order."""
        tbl = self.table(name)
        if tbl is None or (limit is not None and limit <= 0):
            return []
        flat = self._flat_for(name, where)
        if flat is not None and set(extra) <= {"vector"}:  # the unit vector, from memory
            rows = flat.rows_with_vectors(where, self.present(name, HIT_COLUMNS[name]))[:limit]
            return rows if extra else [{k: v for k, v in r.items() if k != "vector"} for r in rows]
        columns = [*self.present(name, HIT_COLUMNS[name]), *extra]
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
