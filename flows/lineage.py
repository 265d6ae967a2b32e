"""``coinrag lineage``: SQL over the lineage views, the chain through one asset, stale assets.

Composition only: the views are ``storage/lineage.py``, the current producers
``tasks/fingerprints.py``; this module picks what to run and prints it (a rich table, JSON or
CSV). Read-only: it never takes the store's write lock, so it runs beside a build.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.table import Table

from storage.lineage import describe_views, open_lineage, run_query, walk
from storage.store import Store

# Queries that name one of these need the current producers (computed from the settings).
_NEEDS_CURRENT = ("stale_assets", "current_producers")


def _current(store: Store) -> dict[str, str]:
    from tasks.fingerprints import current_producers, store_settings

    return current_producers(store_settings(store))


def lineage_sql(store: Store, sql: str) -> pa.Table:
    """The rows of one read-only query over the views (``storage.lineage.LineageError`` if bad).

    The current producers are computed only when the query names ``stale_assets`` or
    ``current_producers`` (it costs loading the tokenizer and the embedder).
    """
    needs = any(name in sql.lower() for name in _NEEDS_CURRENT)
    con = open_lineage(store, _current(store) if needs else None)
    return run_query(con, sql)


def lineage_stale(store: Store) -> pa.Table:
    """Every stale asset against the settings in ``STORE/coinrag.toml``."""
    con = open_lineage(store, _current(store))
    return run_query(con, "SELECT * FROM stale_assets ORDER BY asset, producer, asset_id")


def lineage_walk(store: Store, kind: str, ident: str) -> dict[str, pa.Table]:
    """The chain up and down through one ``kind`` (nugget | chunk | doc) id."""
    return walk(open_lineage(store), kind, ident)


# ---------------------------------------------------------------------------- printing


def _jsonable(table: pa.Table) -> list[dict[str, Any]]:
    return table.to_pylist()


def to_json(result: pa.Table | Mapping[str, pa.Table]) -> str:
    """One JSON document: a list of rows, or ``{section: [rows]}`` for a walk."""
    if isinstance(result, pa.Table):
        return json.dumps(_jsonable(result), default=str, ensure_ascii=False)
    data = {name: _jsonable(t) for name, t in result.items()}
    return json.dumps(data, default=str, ensure_ascii=False)


def to_csv(table: pa.Table) -> str:
    """CSV with a header line (lists and timestamps as their text)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.column_names)
    for row in table.to_pylist():
        writer.writerow(["" if v is None else v for v in row.values()])
    return out.getvalue()


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def print_table(console: Console, table: pa.Table, title: str | None = None) -> None:
    """All rows and columns as a rich table."""
    out = Table(title=title, show_lines=False)
    for name in table.column_names:
        out.add_column(name, overflow="fold")
    for row in table.to_pylist():
        out.add_row(*(_cell(v) for v in row.values()))
    console.print(out)
    console.print(f"[dim]{table.num_rows} row(s)[/]")


def print_section(console: Console, name: str, table: pa.Table) -> None:
    """One section of a walk: one row as field/value lines; several rows as a table of the
    columns that differ, after a line with the values they share."""
    if table.num_rows == 0:
        console.print(f"[bold]{name}[/]: none")
        return
    rows = table.to_pylist()
    if len(rows) == 1:
        out = Table(title=name, show_header=False, title_justify="left")
        out.add_column("field", style="dim")
        out.add_column("value", overflow="fold")
        for key, value in rows[0].items():
            out.add_row(key, _cell(value))
        console.print(out)
        return
    same = [c for c in table.column_names if len({_cell(r[c]) for r in rows}) == 1]
    varying = [c for c in table.column_names if c not in same]
    console.print(f"[bold]{name}[/]: {len(rows)} rows")
    if same:
        console.print(
            "[dim]  all rows: " + ", ".join(f"{c}={_cell(rows[0][c])}" for c in same) + "[/]"
        )
    if varying:
        print_table(console, table.select(varying))


def print_views(console: Console) -> None:
    """The lineage views and their columns."""
    for name, columns in describe_views().items():
        console.print(f"[bold]{name}[/]: " + ", ".join(f"{c} {t}" for c, t in columns))
    console.print(
        "[dim]also every table (documents, chunks, nuggets, kv_manifest, runs, ...) and the "
        "index rows index_chunks, index_nuggets, index_documents[/]"
    )
