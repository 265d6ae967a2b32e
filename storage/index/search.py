"""Searching the index: by vector (ANN, exact under a prefilter, or a reader's in-memory copy
of a small table) and by words (BM25: LanceDB's full-text index, or a reader's in-memory copy
that gives its answers, ``storage/index/bm25.py``). A part of
:class:`storage.index.lance.LanceIndex`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.storage.index.ann import (
    FTS_COLUMN,
    FTS_CONFIG,
    VECTOR_INDEX_MIN_ROWS,
    FlatTable,
    fts_column,
    large_tables_in_memory,
    tune_ann_query,
)
from coinrag.storage.index.bm25 import ANALYZED_CONFIG, Bm25Index, same_answers
from coinrag.storage.index.tables import (
    CHUNK_HIT_COLUMNS,
    DOCUMENT_HIT_COLUMNS,
    FTS_TABLES,
    HIT_COLUMNS,
    ID_COLUMNS,
    METRIC,
    NUGGET_HIT_COLUMNS,
    InFilter,
    LexicalIndexMissing,
    in_filter,
)


class IndexSearch:
    """The searching half of :class:`storage.index.lance.LanceIndex` (which gives it ``table``,
    ``check``, ``dim``, ``has_vector_index`` and ``has_text_index``)."""

    store: Any
    versions: dict[str, int] | None
    flat_max_bytes: int
    _fts_columns: dict[str, str]
    _flat_tables: dict[str, FlatTable | None]
    _text_tables: dict[str, Bm25Index | None]
    _column_names: dict[str, frozenset[str]]

    def _flat(self, name: str) -> FlatTable | None:
        """The reader's in-memory copy of table ``name`` (pinned versions), read on first use:
        float32 up to ``VECTOR_INDEX_MIN_ROWS`` rows, float16 above (unless this process
        searches large tables by their ANN index: ``keep_large_tables_in_memory``), if its
        vectors take at most ``flat_max_bytes`` (else None: the ANN index serves); None for the
        writer (its view changes under it)."""
        if self.versions is None:
            return None
        if name not in self._flat_tables:
            tbl = self.table(name)
            flat = None
            rows = 0 if tbl is None else tbl.count_rows()
            half = rows > VECTOR_INDEX_MIN_ROWS
            # 4 bytes a component: float32, or float16 and at most a copy to rank by
            fits = rows * self.dim * 4 <= self.flat_max_bytes
            if tbl is not None and fits and (large_tables_in_memory() or not half):
                words = [self.fts_column(name)] if name in FTS_TABLES else []
                columns = self.present(name, [*dict.fromkeys([*HIT_COLUMNS[name], *words])])
                columns.append("vector")
                data = tbl.search().select(columns).limit(None).to_arrow()
                vec = data.column("vector").combine_chunks()
                mat = vec.flatten().to_numpy().astype(np.float32).reshape(len(vec), self.dim)
                flat = FlatTable(data.drop_columns(["vector"]), mat, half=half)
            self._flat_tables[name] = flat
        return self._flat_tables[name]

    def present(self, name: str, columns: Sequence[str]) -> list[str]:
        """``columns`` that table ``name`` has: a table written by an older coinrag lacks the
        newer hit columns (the place columns: ``schemas.tables.PlaceInDocument``), which its
        hits then do not carry (read as None) until a build writes the table again."""
        names = self._column_names.get(name)
        if names is None:
            tbl = self.table(name)
            if tbl is None:
                return list(columns)
            names = frozenset(tbl.schema.names)
            if self.versions is not None:  # a reader's versions are fixed: asked once
                self._column_names[name] = names
        return [c for c in columns if c in names]

    def fts_column(self, name: str) -> str:
        """The column table ``name``'s words are searched in (``index_ann.fts_column``: the
        heading path and the text; the text alone in a table written before that existed)."""
        if name not in self._fts_columns:
            tbl = self.table(name)
            self._fts_columns[name] = FTS_COLUMN if tbl is None else fts_column(tbl.schema)
        return self._fts_columns[name]

    def _flat_for(self, name: str, where: str | None) -> FlatTable | None:
        """The in-memory copy if it can answer a search under ``where`` (none, or an
        :class:`InFilter` on one of its columns)."""
        flat = self._flat(name)
        if flat is None or where is None:
            return flat
        if isinstance(where, InFilter) and where.column in flat.rows.column_names:
            return flat
        return None

    def _lexical(self, name: str) -> Bm25Index | None:
        """The reader's in-memory BM25 copy of table ``name``'s text, made on first use beside
        its :class:`FlatTable` (so under the same conditions), or None (LanceDB answers): the
        writer, a one-shot reader (``keep_large_tables_in_memory(False)``), a table not in
        memory, another full-text configuration than the copy's (:data:`ANALYZED_CONFIG`), an
        index with unindexed rows (lance scores those with other statistics), text the copy
        cannot tokenize for sure, or a copy whose answer to one probe (a row's text) is not
        LanceDB's (an index that still counts deleted rows)."""
        if name not in self._text_tables:
            flat = self._flat(name)
            copy = None
            if (
                large_tables_in_memory()  # a serving reader (a one-shot query would spend
                # 1.3 s making the copy of the 5,860 chunks of the Python docs to save 5 ms)
                and FTS_CONFIG == ANALYZED_CONFIG
                and flat is not None
                and self.fts_column(name) in flat.rows.column_names
            ):
                tbl = self.table(name)
                fts = [i.name for i in tbl.list_indices() if i.index_type == "FTS"]
                if fts and not tbl.index_stats(fts[0]).num_unindexed_rows:
                    texts = flat.rows.column(self.fts_column(name)).to_pylist()
                    copy = Bm25Index(texts)
                    if not copy.exact or not self._probe(name, flat, copy, texts):
                        copy = None
            self._text_tables[name] = copy
        return self._text_tables[name]

    def searches_text_in_memory(self, name: str) -> bool:
        """Whether :meth:`search_text` on ``name`` is answered from this reader's in-memory
        BM25 copy (under a millisecond, holding the GIL) rather than by LanceDB (~5 ms,
        releasing it)."""
        return self.versions is not None and self._lexical(name) is not None

    def _probe(self, name: str, flat: FlatTable, copy: Bm25Index, texts: list[str | None]) -> bool:
        """Whether the copy answers as LanceDB does to the text of a row (the first from the
        middle on with an indexed word; its first 64 words), a query whose every score depends
        on the index's statistics."""
        middle = len(texts) // 2
        probe = next(
            (
                " ".join(t.split()[:64])
                for t in texts[middle:] + texts[:middle]
                if t and copy.analyzer.terms(" ".join(t.split()[:64]))
            ),
            None,
        )
        if probe is None:  # no row has an indexed word: nothing to find either way
            return True
        id_column = ID_COLUMNS[name]
        want = self._fts_query(name, probe, [id_column], None).limit(10).to_arrow()
        found = copy.search(probe, 10)
        if found is None:
            return False
        ids = flat.rows.column(id_column).take(pa.array(found[0])).to_pylist()
        lance = zip(
            want.column(id_column).to_pylist(), want.column("_score").to_pylist(), strict=True
        )
        return same_answers(list(lance), list(zip(ids, found[1].tolist(), strict=True)))

    def _search_text_copy(
        self, name: str, text: str, k: int, where: str | None, columns: Sequence[str]
    ) -> list[dict[str, Any]] | None:
        """:meth:`search_text` from the reader's in-memory copies, or None if they cannot
        answer it (no copy, a prefilter other than an :class:`InFilter` on a column of theirs,
        text the copy cannot tokenize for sure)."""
        copy = self._lexical(name)
        flat = self._flat(name)
        if copy is None or flat is None:
            return None
        positions = None
        if where is not None:
            if not isinstance(where, InFilter) or (positions := flat.positions(where)) is None:
                return None
        found = copy.search(text, k, positions)
        if found is None:
            return None
        at, scores = found
        rows = flat.rows.select(self.present(name, columns)).take(pa.array(at)).to_pylist()
        for row, score in zip(rows, scores.tolist(), strict=True):
            row["score"] = float(score)
        return rows

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
        columns = self.present(name, columns)
        in_memory = self._flat_for(name, where)
        if in_memory is not None:
            return in_memory.search(q, k, columns, where if where is not None else None)
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

    def best_of_groups(
        self,
        name: str,
        column: str,
        vector: np.ndarray,
        k: int,
        *,
        embedder_fp: str,
        where: str | None = None,
    ) -> list[tuple[str, float]] | None:
        """The ``k`` values of ``column`` (``chunk_id`` of ``windows``, say) whose best row of
        ``name`` is closest to ``vector`` (``(dim,)`` float32), best first, with that row's
        float32 cosine (from float16 vectors in a large table, within 2**-11: see
        :meth:`FlatTable.best_of_groups`), in one pass over a reader's in-memory copy; None
        where the table is not held in memory (the caller searches its rows with
        :meth:`search_vector`). ``where``: a prefilter."""
        self.check(embedder_fp, vector)
        flat = self._flat_for(name, where)
        if flat is None or column not in flat.rows.column_names:
            return None
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        return flat.best_of_groups(q, k, column, where)

    def search_text(
        self, name: str, text: str, k: int, *, where: str | None = None
    ) -> list[dict[str, Any]]:
        """Top-``k`` rows of ``name`` (their :data:`HIT_COLUMNS`) by BM25 of ``text`` against
        their ``text`` column, best first (dicts with ``score``, the BM25 score); ``where``: a
        prefilter. A query with no indexed word (only stop words, say) finds nothing.
        :class:`LexicalIndexMissing` if the table has no full-text index.

        A reader answers from its in-memory copy where it has one (:meth:`_lexical`): LanceDB's
        rows and scores within float32 rounding, ties among equal scores by row order."""
        columns = self.present(name, HIT_COLUMNS[name])
        tbl = self.table(name)
        if tbl is None or k <= 0 or not text.strip():
            return []
        if not self.has_text_index(name):
            raise LexicalIndexMissing(
                f"the {name} index in {self.store.uri(self.store.index_dir)} has no full-text "
                "index (built before lexical search existed): run `coinrag build` on the store "
                "once (an unchanged rebuild only adds it), or search with --retrieval dense"
            )
        flat = self._flat(name)
        if flat is None:  # the writer's view
            return self._search_text_rows(name, text, k, where, columns)
        in_memory = self._search_text_copy(name, text, k, where, columns)
        if in_memory is not None:
            return in_memory
        # The reader's in-memory copy holds the hit columns: LanceDB returns ids and scores
        # only (the text and the rest cost about 2 ms more a search), the copy the rest.
        id_column = ID_COLUMNS[name]
        found = self._fts_query(name, text, [id_column], where).limit(k).to_arrow()
        rows = flat.rows_by_id(id_column, found.column(id_column).to_pylist(), columns)
        if rows is None:  # an id the copy lacks (not at a pinned version): read them all
            return self._search_text_rows(name, text, k, where, columns)
        for row, score in zip(rows, found.column("_score").to_pylist(), strict=True):
            row["score"] = float(score)
        rows.sort(key=lambda r: -r["score"])
        return rows

    def _fts_query(self, name: str, text: str, columns: Sequence[str], where: str | None) -> Any:
        """LanceDB's BM25 query of ``text`` on table ``name`` (its :meth:`fts_column`)
        selecting ``columns`` and ``_score``, prefiltered by ``where``."""
        from lancedb.query import MatchQuery

        tbl = self.table(name)
        query = tbl.search(MatchQuery(text, self.fts_column(name)), query_type="fts").select(
            [*self.present(name, columns), "_score"]
        )
        return query if where is None else query.where(where, prefilter=True)

    def _search_text_rows(
        self, name: str, text: str, k: int, where: str | None, columns: Sequence[str]
    ) -> list[dict[str, Any]]:
        """:meth:`search_text` reading every hit column from LanceDB."""
        rows = self._fts_query(name, text, columns, where).limit(k).to_arrow().to_pylist()
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
