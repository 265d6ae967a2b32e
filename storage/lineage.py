"""Lineage: DuckDB views that join the Parquet tables and the LanceDB index rows of a store.

Every asset row already carries its parents' ids, its run and the fingerprints that made it
(``schemas/tables.py``); these views only join them, so one SQL query walks

```
document version -> chunk -> nugget -> KV entry -> index row -> cartridge, training run
```

in either direction. The views and their columns are defined in ``schemas/views.py``; the index
tables are read through :class:`storage.index.lance.LanceIndex` at the versions the last completed
run published (every column but ``vector``, as searches see them) and registered as Arrow tables
``index_chunks``, ``index_nuggets``, ``index_documents``. Which documents are live is not
decided here: ``live_documents`` is :func:`storage.corpus.live_events` (committed runs only,
tombstones), registered as a table and joined to ``documents``.

Read-only and confined: the connection (:func:`storage.tables.connect_duckdb`) reads the
store's Parquet files and the Arrow tables registered here, and no other file, URL or extension
(``read_text('/etc/hostname')``, ``COPY ... TO``, ``ATTACH``, ``INSTALL httpfs`` fail with a
``PermissionException``, reported as :class:`LineageError`). Nothing here takes the store's
write lock or writes a file, so it works while a build runs (a build's Parquet files appear
whole, by rename; its rows and index versions count once it publishes, like every other
reader's).
:func:`run_query` accepts one SELECT statement (``WITH``, ``DESCRIBE``, ``SUMMARIZE`` included)
and refuses anything else.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping

import duckdb
import pyarrow as pa

from coinrag.schemas.tables import (
    EXTRACTION_ABANDONED,
    EXTRACTION_MALFORMED,
    EXTRACTION_OK,
    INDEX_TABLES,
    TABLES,
    PlaceInDocument,
    arrow_schema,
    column_names,
)
from coinrag.schemas.views import PRODUCERS, SAME_AS_TABLE, VIEWS, CurrentProducer
from coinrag.storage.corpus import live_events
from coinrag.storage.store import Store
from coinrag.storage.tables import connect_duckdb


class LineageError(ValueError):
    """Bad SQL, a statement that is not a query, or an id the store does not hold."""


# ---------------------------------------------------------------------------- view definitions
#
# Each SELECT lists one expression per column of the view's dataclass, in field order; the
# names come from the dataclass (CREATE VIEW v (columns) AS ...), and are checked after creation.


def _cols(record: type, alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + c for c in column_names(record))


def run_order_desc(alias: str) -> str:
    """ORDER BY terms, latest first, of the run ``alias.run_id``: its start time, then its id."""
    started = f"(SELECT min(started_at) FROM runs r WHERE r.run_id = {alias}.run_id)"
    return f"{started} DESC NULLS LAST, {alias}.run_id DESC"


# Live documents are defined once, in storage/corpus.py (committed runs only, tombstones, run
# order); open_lineage registers its answer as _live_keys (doc_id, doc_version, run_id: the row
# that made each document live) and this view only fetches those rows.
_LIVE_KEYS = "_live_keys"
_LIVE_DOCUMENTS = (
    f"SELECT {_cols(TABLES['documents'], 'd')} FROM documents d JOIN {_LIVE_KEYS} l "
    "ON l.doc_id = d.doc_id AND l.doc_version = d.doc_version AND l.run_id = d.run_id "
    "QUALIFY row_number() OVER (PARTITION BY d.doc_id) = 1"  # a row written twice (gc crash)
)


_KV_FP = "split_part({a}.location, '/', 1)"
_KV_ORDER = (
    "CAST(regexp_extract({a}.location, 'shard-([0-9]+)', 1) AS BIGINT) DESC, "
    "CAST(regexp_extract({a}.location, 'slot-([0-9]+)', 1) AS BIGINT) DESC"
)
# The KV entry holds the nugget's span: a whole chunk (kept NULL), or a kept range around it
# (kv_keep = "nuggets": kept is [s0, e0, s1, e1, ...], storage/kv/kept.py).
_HOLDS_SPAN = (
    "({k}.kept IS NULL OR len(list_filter(range(1, len({k}.kept), 2), lambda i: "
    "{k}.kept[i] <= {n}.tok_start AND {n}.tok_end <= {k}.kept[i + 1])) > 0)"
)
_CARTRIDGE_ORDER = (
    "{a}.step DESC, CAST(split_part(split_part({a}.location, '/', -1), '-', 2) AS BIGINT) DESC"
)
_LIVE = "EXISTS (SELECT 1 FROM live_documents l WHERE l.doc_version = {a}.doc_version)"

# One extraction answer per (text_hash, extractor_fp): the latest ok one, else the latest.
_EXTRACTIONS = (
    "SELECT * FROM extractions x QUALIFY row_number() OVER (PARTITION BY x.text_hash, "
    f"x.extractor_fp ORDER BY x.status = 'ok' DESC, {run_order_desc('x')}) = 1"
)
_UNIQUE_CHUNKS = "SELECT * FROM chunks c QUALIFY row_number() OVER (PARTITION BY c.chunk_id) = 1"
_RECOVERIES = (
    "(SELECT chunk_id, extractor_fp, tau, run_id FROM nuggets "
    "UNION ALL SELECT chunk_id, extractor_fp, tau, run_id FROM abandoned)"
)
_LATEST_FIRST = "ORDER BY r.started_at DESC NULLS LAST, {a}.run_id DESC"

# Internal views (not part of schemas/views.py): the current assets the other views refer to.
# - _last_build: the producers of the last *completed* build (from runs: its fingerprints and
#   its tau parameter); a build that failed or is still running does not decide what is live;
# - _live_chunks: chunks of live document versions, of the last completed build's chunking
#   (tokenizer, chunker) where the version has chunks of it, else of its latest chunking: a
#   rebuild with another chunk size supersedes the older chunks once it completes;
# - _live_nuggets: nuggets of live chunks from the last completed build's recovery (extractor,
#   tau) where the chunk has one, else from its latest recovery.
_HELPERS: dict[str, str] = {
    "_last_build": """
        SELECT json_extract_string(r.fingerprints_json, '$.tokenizer_fp') || '|'
                 || json_extract_string(r.fingerprints_json, '$.chunker_fp') AS chunking,
               json_extract_string(r.fingerprints_json, '$.extractor_fp') AS extractor_fp,
               TRY_CAST(json_extract_string(r.parameters_json, '$.tau') AS DOUBLE) AS tau
        FROM latest_runs r WHERE r.flow = 'build' AND r.status = 'completed'
        ORDER BY r.ended_at DESC NULLS LAST, r.run_id DESC LIMIT 1""",
    "_live_chunks": f"""
        SELECT * EXCLUDE (chunking, latest) FROM (
          SELECT c.*, c.tokenizer_fp || '|' || c.chunker_fp AS chunking,
                 first_value(c.tokenizer_fp || '|' || c.chunker_fp) OVER
                   (PARTITION BY c.doc_version
                    ORDER BY (c.tokenizer_fp || '|' || c.chunker_fp = b.chunking) DESC NULLS LAST,
                    {_LATEST_FIRST.format(a="c").removeprefix("ORDER BY ")}) AS latest
          FROM ({_UNIQUE_CHUNKS}) c LEFT JOIN latest_runs r ON r.run_id = c.run_id
          LEFT JOIN _last_build b ON true
          WHERE EXISTS (SELECT 1 FROM live_documents l WHERE l.doc_version = c.doc_version))
        WHERE chunking = latest""",
    "_live_nuggets": f"""
        SELECT n.* FROM (SELECT * FROM nuggets QUALIFY row_number() OVER
                         (PARTITION BY nugget_id, extractor_fp, tau ORDER BY run_id) = 1) n
        JOIN (SELECT v.chunk_id, v.extractor_fp, v.tau FROM {_RECOVERIES} v
              LEFT JOIN latest_runs r ON r.run_id = v.run_id
              LEFT JOIN _last_build b ON true
              QUALIFY row_number() OVER
                (PARTITION BY v.chunk_id
                 ORDER BY (v.extractor_fp = b.extractor_fp AND v.tau = b.tau) DESC NULLS LAST,
                 {_LATEST_FIRST.format(a="v").removeprefix("ORDER BY ")}) = 1) lr
          ON lr.chunk_id = n.chunk_id AND lr.extractor_fp = n.extractor_fp AND lr.tau = n.tau
        WHERE n.chunk_id IN (SELECT chunk_id FROM _live_chunks)""",
}

_SQL: dict[str, str] = {
    "latest_runs": (
        f"SELECT {_cols(TABLES['runs'], 'r')} FROM runs r QUALIFY row_number() OVER "
        "(PARTITION BY r.run_id ORDER BY r.ended_at DESC NULLS LAST) = 1"
    ),
    "live_documents": _LIVE_DOCUMENTS,
    "kv_entries": (
        f"SELECT {_cols(TABLES['kv_manifest'], 'k')} FROM kv_manifest k "
        f"QUALIFY row_number() OVER (PARTITION BY {_KV_FP.format(a='k')}, k.content_key, k.kept "
        f"ORDER BY {_KV_ORDER.format(a='k')}) = 1"
    ),
    "lineage_chunks": f"""
        SELECT c.chunk_id, c.doc_id, c.doc_version, c.ordinal, c.n_tokens, c.content_key,
               c.text_hash, c.tokenizer_fp, c.chunker_fp, c.run_id,
               c.chunk_id IN (SELECT chunk_id FROM _live_chunks),
               k.location, k.kept, k.model_fp, k.run_id, i.embedder_fp, i.run_id,
               (SELECT min(e.run_id) FROM embeddings e
                 WHERE e.text_hash = c.text_hash AND e.embedder_fp = i.embedder_fp),
               {_cols(PlaceInDocument, "c")}
        FROM ({_UNIQUE_CHUNKS}) c
        LEFT JOIN kv_entries k ON k.content_key = c.content_key
        LEFT JOIN index_chunks i ON i.chunk_id = c.chunk_id""",
    "lineage_nuggets": f"""
        SELECT n.nugget_id, n.chunk_id, n.doc_id, n.doc_version, n.content_key, n.tok_start,
               n.tok_end, n.match_kind, n.similarity, n.tau, n.run_id,
               EXISTS (SELECT 1 FROM _live_nuggets l WHERE l.nugget_id = n.nugget_id
                       AND l.extractor_fp = n.extractor_fp AND l.tau = n.tau),
               n.extractor_fp, x.backend, x.llm_model, x.prompt_version, x.status, x.run_id,
               (SELECT count(*) FROM extraction_calls l WHERE l.text_hash = x.text_hash
                 AND l.run_id = x.run_id AND l.backend = x.backend
                 AND l.llm_model = x.llm_model),
               (SELECT coalesce(sum(l.cost_usd), 0.0) FROM extraction_calls l
                 WHERE l.text_hash = x.text_hash AND l.run_id = x.run_id
                 AND l.backend = x.backend AND l.llm_model = x.llm_model),
               c.tokenizer_fp, c.chunker_fp, k.location, k.kept, k.model_fp, k.run_id,
               i.embedder_fp, i.run_id, {_cols(PlaceInDocument, "n")}
        FROM (SELECT * FROM nuggets QUALIFY row_number() OVER
              (PARTITION BY nugget_id, extractor_fp, tau ORDER BY run_id) = 1) n
        LEFT JOIN ({_UNIQUE_CHUNKS}) c ON c.chunk_id = n.chunk_id
        LEFT JOIN ({_EXTRACTIONS}) x
               ON x.text_hash = c.text_hash AND x.extractor_fp = n.extractor_fp
        LEFT JOIN kv_entries k ON k.content_key = n.content_key
               AND {_HOLDS_SPAN.format(k="k", n="n")}
        LEFT JOIN index_nuggets i ON i.nugget_id = n.nugget_id""",
    "abandoned_extractions": f"""
        SELECT c.chunk_id, c.doc_id, c.doc_version, a.text_hash, a.extractor_fp, a.backend,
               a.llm_model, a.prompt_version,
               (SELECT count(DISTINCT m.run_id) FROM extractions m
                 WHERE m.text_hash = a.text_hash AND m.extractor_fp = a.extractor_fp
                 AND m.status = '{EXTRACTION_MALFORMED}'),
               a.error, a.run_id, c.chunk_id IN (SELECT chunk_id FROM _live_chunks)
        FROM (SELECT * FROM extractions x WHERE x.status = '{EXTRACTION_ABANDONED}'
              AND NOT EXISTS (SELECT 1 FROM extractions o WHERE o.text_hash = x.text_hash
                              AND o.extractor_fp = x.extractor_fp
                              AND o.status = '{EXTRACTION_OK}')
              QUALIFY row_number() OVER (PARTITION BY x.text_hash, x.extractor_fp
                                         ORDER BY {run_order_desc("x")}) = 1) a
        JOIN ({_UNIQUE_CHUNKS}) c ON c.text_hash = a.text_hash""",
    "lineage_cartridges": f"""
        SELECT m.cartridge_id, m.doc_id, m.doc_version, m.model_fp, m.cartridge_fp, m.kind,
               m.step, m.location, m.run_id, r.flow, {_LIVE.format(a="m")}
        FROM (SELECT * FROM cartridge_manifest m QUALIFY row_number() OVER
              (PARTITION BY m.cartridge_id ORDER BY {_CARTRIDGE_ORDER.format(a="m")}) = 1) m
        LEFT JOIN latest_runs r ON r.run_id = m.run_id""",
    "run_fingerprints": """
        SELECT r.run_id, r.flow, r.status, r.started_at, j.key, j.value ->> '$'
        FROM latest_runs r, json_each(r.fingerprints_json) j
        WHERE coalesce(j.value ->> '$', '') <> ''""",
}


def _count_by_run(table: str) -> str:
    return f"LEFT JOIN (SELECT run_id, count(*) AS n FROM {table} GROUP BY run_id) {table}_n "


_RUN_COST_TABLES = (
    "documents",
    "chunks",
    "nuggets",
    "kv_manifest",
    "embeddings",
    "cartridge_manifest",
)
_SQL["run_costs"] = (
    "SELECT r.run_id, r.flow, r.status, r.started_at, r.ended_at, r.code_version, r.cost_usd, "
    "coalesce(l.calls, 0), CAST(coalesce(l.tokens_in, 0) AS BIGINT), "
    "CAST(coalesce(l.tokens_out, 0) AS BIGINT), "
    "coalesce(l.cost_usd, 0.0), "
    + ", ".join(f"coalesce({t}_n.n, 0)" for t in _RUN_COST_TABLES)
    + " FROM latest_runs r LEFT JOIN (SELECT run_id, count(*) AS calls, sum(tokens_in) AS "
    "tokens_in, sum(tokens_out) AS tokens_out, sum(cost_usd) AS cost_usd FROM extraction_calls "
    "GROUP BY run_id) l ON l.run_id = r.run_id "
    + " ".join(_count_by_run(t) + f"ON {t}_n.run_id = r.run_id" for t in _RUN_COST_TABLES)
)


# Staleness: (asset, relation, id column, sibling key, sibling relation, producers). An asset is
# stale for a producer when it was built with another value than the current one and no sibling
# (same key) was built with the current one: a rebuild with the new settings supersedes it.
_LIVE_CHUNKS = "_live_chunks"
_LIVE_NUGGETS = "_live_nuggets"
_LIVE_KV = (
    "(SELECT k.*, c.doc_id FROM kv_entries k JOIN (SELECT DISTINCT content_key, doc_id "
    f"FROM {_LIVE_CHUNKS}) c ON c.content_key = k.content_key)"
)
_STALE_SOURCES: tuple[tuple[str, str, str, str, str, tuple[str, ...]], ...] = (
    ("chunk", _LIVE_CHUNKS, "chunk_id", "doc_version", "chunks", ("tokenizer_fp", "chunker_fp")),
    ("nugget", _LIVE_NUGGETS, "nugget_id", "chunk_id", _RECOVERIES, ("extractor_fp", "tau")),
    ("kv_entry", _LIVE_KV, "location", "content_key", "kv_entries", ("model_fp",)),
    ("index_chunk", "index_chunks", "chunk_id", "chunk_id", "(SELECT NULL)", ("embedder_fp",)),
    ("index_nugget", "index_nuggets", "nugget_id", "nugget_id", "(SELECT NULL)", ("embedder_fp",)),
    ("index_document", "index_documents", "doc_id", "doc_id", "(SELECT NULL)", ("embedder_fp",)),
    (
        "cartridge",
        "(SELECT * FROM lineage_cartridges WHERE live)",
        "cartridge_id",
        "doc_version",
        "lineage_cartridges",
        ("cartridge_model_fp",),
    ),
)
_SQL_TYPES = {str: "VARCHAR", float: "DOUBLE", int: "BIGINT"}
# The column an asset records a producer in, where it is not the producer's own name.
_PRODUCER_COLUMN = {"cartridge_model_fp": "model_fp"}


def _stale_sql() -> str:
    parts = []
    for asset, relation, id_col, key, siblings, producers in _STALE_SOURCES:
        for producer in producers:
            if producer not in PRODUCERS:
                raise KeyError(f"{producer} is not in schemas.views.PRODUCERS")
            col = _PRODUCER_COLUMN.get(producer, producer)
            cur = f"CAST(p.current AS {_producer_type(col)})"
            sibling = (
                ""
                if siblings == "(SELECT NULL)"
                else f"AND NOT EXISTS (SELECT 1 FROM {siblings} s "
                f"WHERE s.{key} = a.{key} AND s.{col} = {cur})"
            )
            parts.append(
                f"SELECT '{asset}', CAST(a.{id_col} AS VARCHAR), a.doc_id, '{producer}', "
                f"CAST(a.{col} AS VARCHAR), p.current, a.run_id FROM {relation} a "
                f"JOIN current_producers p ON p.producer = '{producer}' "
                f"WHERE a.{col} <> {cur} {sibling}"
            )
    return " UNION ALL ".join(parts)


def _producer_type(producer: str) -> str:
    """SQL type of a producer column (the same name in every table that has it)."""
    for record in (*TABLES.values(), *INDEX_TABLES.values()):
        hints = typing.get_type_hints(record)
        if producer in hints:
            return _SQL_TYPES[hints[producer]]
    raise KeyError(f"no table has a {producer} column")


_SQL["stale_assets"] = _stale_sql()
_SQL["current_producers"] = f"SELECT {_cols(CurrentProducer)} FROM _current_producers"


# ---------------------------------------------------------------------------- connection


def _register_index(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    """``index_<name>``: the published LanceDB index rows (the versions ``[published]`` of
    ``STORE/coinrag.toml`` names, as searches read them), every column but the vector; empty
    tables when nothing is published yet."""
    from coinrag.storage.index.lance import IndexNotBuilt, LanceIndex

    try:
        index: LanceIndex | None = LanceIndex.open(store)
    except IndexNotBuilt:
        index = None
    for name, record in INDEX_TABLES.items():
        columns = [c for c in column_names(record) if c != "vector"]
        if index is not None:
            data = index.columns(name, columns)
        else:
            data = arrow_schema(record).empty_table().select(columns)
        con.register(f"index_{name}", data)


def _register_live(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    """``_live_keys``: :func:`storage.corpus.live_events` as (doc_id, doc_version, run_id)."""
    events = live_events(store)
    schema = arrow_schema(TABLES["documents"])
    fields = [schema.field(n) for n in ("doc_id", "doc_version", "run_id")]
    data = pa.table(
        [
            list(events),
            [v for v, _ in events.values()],
            [r for _, r in events.values()],
        ],
        schema=pa.schema(fields),
    )
    con.register(_LIVE_KEYS, data)


def _register_current(con: duckdb.DuckDBPyConnection, current: Mapping[str, str]) -> None:
    unknown = sorted(set(current) - set(PRODUCERS))
    if unknown:
        raise KeyError(f"unknown producer(s) {', '.join(unknown)}; known: {', '.join(PRODUCERS)}")
    schema = arrow_schema(CurrentProducer)
    data = pa.table(
        {
            schema.names[0]: [str(k) for k in current],
            schema.names[1]: [str(v) for v in current.values()],
        },
        schema=schema,
    )
    con.register("_current_producers", data)


def open_lineage(
    store: Store, current: Mapping[str, str] | None = None
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with every table, index table and lineage view of ``store``.

    ``current``: the current producers (``schemas.views.PRODUCERS`` -> value, e.g. from
    :func:`tasks.fingerprints.current_producers`); without it ``current_producers`` and
    ``stale_assets`` are empty.
    """
    if not store.exists():
        raise LineageError(f"{store} is not a coinrag store (no tables/ folder)")
    con = connect_duckdb(store)
    _register_index(con, store)
    _register_live(con, store)
    _register_current(con, current or {})
    for name, record in VIEWS.items():
        if name not in SAME_AS_TABLE and "_last_build" not in _created(con):
            for helper, sql in _HELPERS.items():
                con.execute(f"CREATE VIEW {helper} AS {sql}")
        expected = column_names(record)
        con.execute(f"CREATE VIEW {name} ({', '.join(expected)}) AS {_SQL[name]}")
        got = [d[0] for d in con.sql(f"SELECT * FROM {name} LIMIT 0").description]
        if got != expected:  # a SELECT with more expressions than the dataclass has fields
            raise AssertionError(f"view {name} has columns {got}, schemas/views.py says {expected}")
    return con


def _created(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {row[0] for row in con.sql("SELECT view_name FROM duckdb_views()").fetchall()}


def describe_views() -> dict[str, list[tuple[str, str]]]:
    """``view -> [(column, arrow type), ...]`` from ``schemas/views.py`` (for help texts)."""
    return {
        name: [(f.name, str(f.type)) for f in arrow_schema(record)]
        for name, record in VIEWS.items()
    }


# ---------------------------------------------------------------------------- queries


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """The result of one read-only query (SELECT, WITH, DESCRIBE, SUMMARIZE) as Arrow.

    Raises :class:`LineageError` for SQL that does not parse or bind (DuckDB's message), for
    more than one statement, and for anything but a query.
    """
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise LineageError(f"invalid SQL: {exc}") from None
    if len(statements) != 1:
        raise LineageError(f"expected one SQL statement, got {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise LineageError(f"only queries are allowed (SELECT ...), got a {kind.name} statement")
    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.PermissionException as exc:
        raise LineageError(
            f"not allowed: lineage SQL reads only this store's tables and views, no other file, "
            f"URL or extension ({exc})"
        ) from None
    except duckdb.Error as exc:
        raise LineageError(f"query failed: {exc}") from None


# The walk from one asset: section -> SQL over the views (one parameter: the id).
_WALKS: dict[str, dict[str, str]] = {
    "nugget": {
        "nugget": "SELECT * FROM lineage_nuggets WHERE nugget_id = $id",
        "chunk": "SELECT * FROM lineage_chunks WHERE chunk_id IN "
        "(SELECT chunk_id FROM nuggets WHERE nugget_id = $id)",
        "document": "SELECT * EXCLUDE (text) FROM documents WHERE doc_version IN "
        "(SELECT doc_version FROM nuggets WHERE nugget_id = $id)",
        "cartridges": "SELECT * FROM lineage_cartridges WHERE doc_version IN "
        "(SELECT doc_version FROM nuggets WHERE nugget_id = $id)",
    },
    "chunk": {
        "chunk": "SELECT * FROM lineage_chunks WHERE chunk_id = $id",
        "document": "SELECT * EXCLUDE (text) FROM documents WHERE doc_version IN "
        "(SELECT doc_version FROM chunks WHERE chunk_id = $id)",
        "nuggets": "SELECT * FROM lineage_nuggets WHERE chunk_id = $id ORDER BY tok_start",
        "cartridges": "SELECT * FROM lineage_cartridges WHERE doc_version IN "
        "(SELECT doc_version FROM chunks WHERE chunk_id = $id)",
    },
    "doc": {
        "document": "SELECT d.* EXCLUDE (text), EXISTS (SELECT 1 FROM live_documents l "
        "WHERE l.doc_version = d.doc_version AND l.doc_id = d.doc_id) AS live "
        "FROM documents d WHERE d.doc_id = $id ORDER BY live DESC, d.run_id DESC",
        "index_document": "SELECT * FROM index_documents WHERE doc_id = $id",
        "chunks": "SELECT * FROM lineage_chunks WHERE doc_id = $id "
        "ORDER BY live DESC, doc_version, ordinal",
        "nuggets": "SELECT * FROM lineage_nuggets WHERE doc_id = $id "
        "ORDER BY live DESC, doc_version, chunk_id, tok_start",
        "cartridges": "SELECT * FROM lineage_cartridges WHERE doc_id = $id",
    },
}
WALK_KINDS = tuple(_WALKS)

# Columns of the sections above that name a run (their runs are listed in the "runs" section).
_RUN_COLUMNS = ("run_id", "extraction_run_id", "kv_run_id", "index_run_id", "embedding_run_id")


def walk(con: duckdb.DuckDBPyConnection, kind: str, ident: str) -> dict[str, pa.Table]:
    """The chain through one asset, up (its document version, chunk, extraction and the runs
    that made them) and down (nuggets, KV entries, index rows, cartridges of its document
    version, training runs whose model built its KV): ``section -> rows``.

    ``kind``: nugget | chunk | doc. Raises :class:`LineageError` for an unknown id.
    """
    if kind not in _WALKS:
        raise LineageError(f"unknown kind {kind!r}; one of {', '.join(_WALKS)}")
    sections: dict[str, pa.Table] = {}
    for section, sql in _WALKS[kind].items():
        sections[section] = con.sql(sql, params={"id": ident}).to_arrow_table()
    first = next(iter(sections.values()))
    if first.num_rows == 0:
        raise LineageError(f"no {kind} {ident!r} in this store")
    run_ids: set[str] = set()
    model_fps: set[str] = set()
    for table in sections.values():
        for col in _RUN_COLUMNS:
            if col in table.column_names:
                run_ids.update(v for v in table.column(col).to_pylist() if v)
        for col in ("kv_model_fp", "model_fp"):
            if col in table.column_names:
                model_fps.update(v for v in table.column(col).to_pylist() if v)
    sections["runs"] = con.sql(
        "SELECT * FROM latest_runs WHERE list_contains($ids, run_id) ORDER BY started_at",
        params={"ids": sorted(run_ids)},
    ).to_arrow_table()
    sections["training_runs"] = con.sql(
        "SELECT * FROM run_fingerprints WHERE name = 'model_fp' AND flow <> 'build' "
        "AND list_contains($fps, fingerprint) ORDER BY started_at",
        params={"fps": sorted(model_fps)},
    ).to_arrow_table()
    return sections
