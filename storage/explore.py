"""What the store explorer (``coinrag api``'s ``/ui``, ``inference/server/ui/``) reads: the
store's summary, its live documents page by page, and one document with its chunks, nuggets,
extractions, KV entries and index rows, all through the lineage views
(:func:`storage.lineage.open_lineage`); nothing here opens a Parquet file or a LanceDB table
itself.

One :class:`StoreExplorer` holds one read-only DuckDB connection (the views of the store as it
was when it was opened: reopen it after a publish) behind a lock, since the server's page
threads share it. Rows come back as plain dicts keyed by the views' own column names.

Example::

    explorer = StoreExplorer.open(Store.at("store/sample"))
    explorer.counts()                      # {"documents": 3, "chunks": 4, "nuggets": 24}
    explorer.documents("odyssey", 0, 20)   # (1, [{"doc_id": "2001:-a-space-odyssey", ...}])
    explorer.document("2001:-a-space-odyssey")["chunks"][0]["nuggets"][0]["text"]
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import duckdb

from coinrag.schemas.tables import EXTRACTION_ABANDONED, EXTRACTION_OK
from coinrag.storage.lineage import open_lineage, run_order_desc, walk
from coinrag.storage.store import Store

# The store's folders whose disk use the summary reports (STORE/<name>).
DISK_FOLDERS = ("tables", "kv", "index", "cartridges", "models", "reports")
# A chunk text's extraction status: its latest ok answer, else its latest run's (the order of
# lineage's views); in the run that gives up, its abandoned row before its last malformed one.
_LATEST_EXTRACTION = (
    "SELECT text_hash, status, error, backend, llm_model, run_id FROM extractions x "
    "WHERE list_contains($hashes, text_hash) QUALIFY row_number() OVER (PARTITION BY text_hash "
    f"ORDER BY x.status = '{EXTRACTION_OK}' DESC, {run_order_desc('x')}, "
    f"x.status = '{EXTRACTION_ABANDONED}' DESC) = 1"
)

# Walks of the kinds storage.lineage.walk does not know: section -> SQL (one parameter: $id).
_OWN_WALKS: dict[str, dict[str, str]] = {
    "run": {
        "run": "SELECT * EXCLUDE (counts_json) FROM latest_runs WHERE run_id = $id",
        "costs": "SELECT * FROM run_costs WHERE run_id = $id",
        "fingerprints": "SELECT name, fingerprint FROM run_fingerprints WHERE run_id = $id",
        "documents": "SELECT doc_id, doc_version, source, n_chars FROM documents "
        "WHERE run_id = $id ORDER BY doc_id LIMIT 200",
        "kv_entries": "SELECT location, chunk_id, tokens, bytes FROM kv_entries "
        "WHERE run_id = $id ORDER BY location LIMIT 200",
    },
    "kv": {
        "kv_entry": "SELECT * FROM kv_entries WHERE location = $id",
        "chunks": "SELECT chunk_id, doc_id, doc_version, ordinal, n_tokens, live, kv_kept "
        "FROM lineage_chunks WHERE kv_location = $id",
    },
}


def _dicts(relation: duckdb.DuckDBPyRelation) -> list[dict[str, Any]]:
    return relation.to_arrow_table().to_pylist()


# The live assets every page reads, copied once into in-memory tables when the explorer opens
# (the views recompute their window functions over the Parquet files on every query: 25 ms a
# query on a small store); a version's assets never change, a new version gets a new explorer.
_SNAPSHOTS = {
    "x_chunks": "SELECT * EXCLUDE (token_ids, token_spans) FROM _live_chunks",
    "x_nuggets": "SELECT * FROM _live_nuggets",
    "x_documents": "SELECT * FROM live_documents",
    "x_kv": "SELECT DISTINCT c.chunk_id, k.* FROM kv_entries k "
    "JOIN (SELECT chunk_id, content_key FROM x_chunks) c ON c.content_key = k.content_key",
    "x_abandoned": "SELECT * FROM abandoned_extractions WHERE live",
}


class StoreExplorer:
    """Read-only queries of one store for the explorer pages (one connection, one lock)."""

    def __init__(self, store: Store, con: duckdb.DuckDBPyConnection) -> None:
        self.store, self.con = store, con
        self.lock = threading.Lock()
        for name, sql in _SNAPSHOTS.items():
            con.execute(f"CREATE TEMP TABLE {name} AS {sql}")

    @classmethod
    def open(cls, store: Store, current: Mapping[str, str] | None = None) -> StoreExplorer:
        """``current``: the current producers (``schemas.views.PRODUCERS`` -> value) that
        decide :meth:`stale`; without them nothing is stale."""
        return cls(store, open_lineage(store, current))

    def sql(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        with self.lock:
            return _dicts(self.con.sql(sql, params=params or None))

    def counts(self) -> dict[str, int]:
        """Live documents, chunks and nuggets."""
        (row,) = self.sql(
            "SELECT (SELECT count(*) FROM x_documents) AS documents, "
            "(SELECT count(*) FROM x_chunks) AS chunks, "
            "(SELECT count(*) FROM x_nuggets) AS nuggets"
        )
        return row

    def kv_totals(self) -> dict[str, int]:
        """KV entries of live chunks: ``{"entries", "tokens", "bytes"}`` (tokens of the chunks,
        bytes as stored: codec and kept ranges applied)."""
        (row,) = self.sql(
            "SELECT count(*) AS entries, coalesce(sum(k.tokens), 0) AS tokens, "
            "coalesce(sum(k.bytes), 0) AS bytes FROM kv_entries k WHERE k.content_key IN "
            "(SELECT content_key FROM x_chunks)"
        )
        return {k: int(v) for k, v in row.items()}

    def runs(self, limit: int = 10) -> list[dict[str, Any]]:
        """The latest runs, newest first: ``run_costs`` columns plus ``counts`` (the run's
        recorded counts: malformed, salvaged, abandoned, rejects, ...) and ``error``."""
        rows = self.sql(
            "SELECT c.*, r.counts_json, r.error FROM run_costs c JOIN latest_runs r "
            "ON r.run_id = c.run_id ORDER BY c.started_at DESC NULLS LAST LIMIT $n",
            n=limit,
        )
        for row in rows:
            row["counts"] = json.loads(row.pop("counts_json") or "{}")
        return rows

    def stale(self, limit: int = 50) -> tuple[int, list[dict[str, Any]]]:
        """``(how many, the first limit)`` rows of ``stale_assets``."""
        (n,) = self.sql("SELECT count(*) AS n FROM stale_assets")
        return n["n"], self.sql("SELECT * FROM stale_assets LIMIT $n", n=limit)

    def disk_use(self) -> dict[str, int]:
        """Bytes under each of :data:`DISK_FOLDERS` (0 when absent)."""
        out = {}
        for name in DISK_FOLDERS:
            try:
                out[name] = self.store.tree_bytes(self.store.root / name)
            except (FileNotFoundError, OSError):
                out[name] = 0
        return out

    def documents(self, query: str, offset: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """``(matches, rows)``: live documents whose id or source contains ``query`` (any
        case; ``%`` and ``_`` match themselves), by id, ``limit`` from ``offset``; each with its
        source, format (the reader's, ``record`` for a JSONL / Parquet row), title (a record's
        ``title`` field where the reader gave none), characters,
        chunks, nuggets and abandoned extractions."""
        like = "ILIKE $pattern ESCAPE '\\'"
        where = f"WHERE d.doc_id {like} OR d.source {like}"
        pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        (total,) = self.sql(f"SELECT count(*) AS n FROM x_documents d {where}", pattern=pattern)
        rows = self.sql(
            "SELECT d.doc_id, d.source, coalesce(d.format, 'record') AS format, "
            "coalesce(d.title, json_extract_string(d.metadata_json, '$.title')) AS title, "
            "d.n_chars, d.run_id, "
            "(SELECT count(*) FROM x_chunks c WHERE c.doc_id = d.doc_id) AS chunks, "
            "(SELECT count(*) FROM x_nuggets n WHERE n.doc_id = d.doc_id) AS nuggets, "
            "(SELECT count(*) FROM x_abandoned a WHERE a.doc_id = d.doc_id) "
            f"AS abandoned FROM x_documents d {where} ORDER BY d.doc_id "
            "LIMIT $limit OFFSET $offset",
            pattern=pattern,
            limit=limit,
            offset=offset,
        )
        return total["n"], rows

    def document(self, doc_id: str) -> dict[str, Any] | None:
        """The live version of ``doc_id`` (None when it has none): its row (``text``
        included) and ``chunks`` in order, each with its ``nuggets`` (by ``char_start``), its
        ``extraction`` (the latest answer for its text, ``status`` and ``error``), its
        ``abandoned`` (extractor gave up) and ``rejects`` (candidates not recovered), its
        ``kv`` entries and its ``index`` row (``None`` when not indexed) and index nuggets."""
        docs = self.sql("SELECT * FROM x_documents WHERE doc_id = $id", id=doc_id)
        if not docs:
            return None
        chunks = self.sql(
            "SELECT * FROM x_chunks WHERE doc_id = $id ORDER BY ordinal",
            id=doc_id,
        )
        ids = [c["chunk_id"] for c in chunks]
        by_chunk: dict[str, dict[str, list[Any]]] = {i: {} for i in ids}

        def group(section: str, sql: str, **params: Any) -> None:
            for row in self.sql(sql, ids=ids, **params):
                by_chunk[row["chunk_id"]].setdefault(section, []).append(row)

        group(
            "nuggets",
            "SELECT * FROM x_nuggets WHERE list_contains($ids, chunk_id) "
            "ORDER BY chunk_id, char_start, char_end",
        )
        group("abandoned", "SELECT * FROM x_abandoned WHERE list_contains($ids, chunk_id)")
        group("rejects", "SELECT * FROM abandoned WHERE list_contains($ids, chunk_id)")
        group("kv", "SELECT * FROM x_kv WHERE list_contains($ids, chunk_id) ORDER BY location")
        group("index", "SELECT * FROM index_chunks WHERE list_contains($ids, chunk_id)")
        group(
            "index_nuggets",
            "SELECT nugget_id, chunk_id, embedder_fp, run_id FROM "
            "index_nuggets WHERE list_contains($ids, chunk_id)",
        )
        hashes = [c["text_hash"] for c in chunks]
        extraction = {r["text_hash"]: r for r in self.sql(_LATEST_EXTRACTION, hashes=hashes)}
        for chunk in chunks:
            parts = by_chunk[chunk["chunk_id"]]
            chunk.update({k: parts.get(k, []) for k in ("nuggets", "abandoned", "rejects", "kv")})
            chunk["index"] = (parts.get("index") or [None])[0]
            chunk["index_nuggets"] = parts.get("index_nuggets", [])
            chunk["extraction"] = extraction.get(chunk["text_hash"])
        return {**docs[0], "chunks": chunks}

    def walk(self, kind: str, ident: str) -> dict[str, list[dict[str, Any]]]:
        """The chain through one asset as rows: :func:`storage.lineage.walk` for a ``nugget``,
        ``chunk`` or ``doc``; for a ``run`` its record, costs, fingerprints and what it made
        (:data:`_OWN_WALKS`); for a ``kv`` entry (its location) the entry and its chunks
        (``LineageError`` for an unknown id)."""
        if kind in _OWN_WALKS:
            return {name: self.sql(sql, id=ident) for name, sql in _OWN_WALKS[kind].items()}
        with self.lock:
            sections = walk(self.con, kind, ident)
        return {name: table.to_pylist() for name, table in sections.items()}

    def kind_of(self, ident: str) -> str | None:
        """Which walk an id belongs to (``nugget``, ``chunk``, ``doc``, ``run``, ``kv``), or
        None for an id the store does not hold."""
        (row,) = self.sql(
            "SELECT EXISTS (SELECT 1 FROM nuggets WHERE nugget_id = $id) AS nugget, "
            "EXISTS (SELECT 1 FROM chunks WHERE chunk_id = $id) AS chunk, "
            "EXISTS (SELECT 1 FROM documents WHERE doc_id = $id) AS doc, "
            "EXISTS (SELECT 1 FROM latest_runs WHERE run_id = $id) AS run, "
            "EXISTS (SELECT 1 FROM kv_entries WHERE location = $id) AS kv",
            id=ident,
        )
        return next((kind for kind, found in row.items() if found), None)

    def close(self) -> None:
        with self.lock:
            self.con.close()
