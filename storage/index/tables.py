"""What the retrieval index holds: its tables' id, filter and hit columns, the index
metadata file, the Arrow schema of a table, the errors (``storage/index/lance.py`` says how the
index works)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.schemas.tables import (
    INDEX_TABLES,
    SEARCH_TEXT_VERSION,
    PlaceInDocument,
    arrow_schema,
    column_names,
)

META_FILE = "coinrag-index.json"
ID_COLUMNS = {
    "chunks": "chunk_id",
    "windows": "window_id",
    "nuggets": "nugget_id",
    "documents": "doc_id",
}
FTS_TABLES = ("chunks", "nuggets")  # tables searched by their words (documents: by chunks')
SCALAR_COLUMNS = {
    "chunks": ("chunk_id", "doc_id"),
    "windows": ("window_id", "chunk_id", "doc_id"),
    "nuggets": ("nugget_id", "chunk_id", "doc_id"),
    "documents": ("doc_id",),
}
METRIC = "cosine"
# What a search returns of each table (besides ``score``).
PLACE_COLUMNS = tuple(column_names(PlaceInDocument))  # where a hit is: file, pages, section
CHUNK_HIT_COLUMNS = (
    "chunk_id",
    "doc_id",
    "doc_version",
    "content_key",
    "text",
    "n_tokens",
    *PLACE_COLUMNS,
)
NUGGET_HIT_COLUMNS = (
    "nugget_id",
    "chunk_id",
    "doc_id",
    "doc_version",
    "content_key",
    "text",
    "tok_start",
    "tok_end",
    *PLACE_COLUMNS,
)
DOCUMENT_HIT_COLUMNS = ("doc_id", "doc_version", "title")
WINDOW_HIT_COLUMNS = ("window_id", "chunk_id", "doc_id", "char_start", "char_end")
HIT_COLUMNS = {
    "chunks": CHUNK_HIT_COLUMNS,
    "windows": WINDOW_HIT_COLUMNS,
    "nuggets": NUGGET_HIT_COLUMNS,
    "documents": DOCUMENT_HIT_COLUMNS,
}

_DELETE_BATCH = 2000  # ids per DELETE ... IN (...) statement
_WRITE_BATCH = 50_000  # rows per merge_insert


class EmbedderMismatch(ValueError):
    """A query vector (or a write) made by another embedder than the index's."""

    exit_code = 2

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

    exit_code = 1


@dataclass(frozen=True)
class IndexMeta:
    """What ``coinrag-index.json`` (and the published ``[published.index]`` record) says of the
    index: its embedder, its vector indexes, and ``fusion``: how hybrid search fuses the dense
    and lexical rankings of this index, as chosen for it on synthetic questions of the store
    (``{"dense_weight": 0.6, "method": "dbsf-convex-v1", "chosen_on": "headings", ...}``,
    ``tasks/retrieval/fusion.py``; None: not chosen yet, the code's default weight applies; a
    record whose ``method`` is not the code's ``retriever.FUSION_METHOD`` is kept but not used)."""

    embedder_fp: str
    dim: int
    embedder_name: str = ""
    vector_indexes: Mapping[str, Mapping[str, Any]] | None = None  # table -> {type, rows}
    fusion: Mapping[str, Any] | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "embedder_fp": self.embedder_fp,
            "dim": self.dim,
            "embedder_name": self.embedder_name,
            "vector_indexes": dict(self.vector_indexes or {}),
        }
        if self.fusion:
            data["fusion"] = dict(self.fusion)
        return json.dumps(data, indent=2, sort_keys=True)


SEARCH_TEXT_KEY = "coinrag.search_text"  # schema metadata: the table's SEARCH_TEXT_VERSION


def lance_schema(table: str, dim: int, embedder_fp: str) -> pa.Schema:
    """The LanceDB schema of an index table: the record's, with a fixed-size vector column; a
    table with a ``search_text`` column records :data:`SEARCH_TEXT_VERSION` in its metadata."""
    base = arrow_schema(INDEX_TABLES[table])
    fields = []
    for f in base:
        if f.name == "vector":
            f = pa.field("vector", pa.list_(pa.float32(), dim), nullable=False)
        elif f.name == ID_COLUMNS[table]:
            f = f.with_nullable(False)
        fields.append(f)
    metadata = {"coinrag.embedder_fp": embedder_fp, "coinrag.dim": str(dim)}
    if "search_text" in base.names:
        metadata[SEARCH_TEXT_KEY] = SEARCH_TEXT_VERSION
    return pa.schema(fields, metadata=metadata)


def same_columns(have: pa.Schema, want: pa.Schema) -> bool:
    """Whether a table's schema has exactly the columns (names and types) of ``want`` and its
    search texts were composed the same way (:data:`SEARCH_TEXT_KEY`): a table written by an
    older coinrag (a column added since, search texts composed otherwise) does not."""
    key = SEARCH_TEXT_KEY.encode()
    composed = (have.metadata or {}).get(key) == (want.metadata or {}).get(key)
    return composed and {(f.name, f.type) for f in have} == {(f.name, f.type) for f in want}


def vectors_array(vectors: np.ndarray, dim: int) -> pa.FixedSizeListArray:
    """(n, dim) float32 -> a fixed_size_list<float32>[dim] array (no Python floats on the way)."""
    mat = np.ascontiguousarray(vectors, dtype=np.float32)
    if mat.ndim != 2 or mat.shape[1] != dim:
        raise ValueError(f"expected vectors of shape (n, {dim}), got {mat.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(mat.reshape(-1)), dim)


def _sql_list(values: Iterable[str]) -> str:
    return ", ".join("'" + str(v).replace("'", "''") + "'" for v in values)


class InFilter(str):
    """The prefilter ``column IN (...)``: its SQL text, which is what LanceDB takes, keeping
    its ``column`` and ``values`` (duplicates dropped, order kept) so that a reader's
    in-memory copy of a table (``storage.index.ann.FlatTable``) applies it without SQL."""

    column: str
    values: tuple[str, ...]

    def __new__(cls, column: str, values: Iterable[str]) -> InFilter:
        kept = tuple(dict.fromkeys(str(v) for v in values))
        self = super().__new__(cls, f"{column} IN ({_sql_list(kept)})")
        self.column = column
        self.values = kept
        return self


def in_filter(column: str, values: Iterable[str]) -> InFilter:
    """The prefilter ``column IN (...)`` for these values (quoted; duplicates dropped)."""
    return InFilter(column, values)


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
