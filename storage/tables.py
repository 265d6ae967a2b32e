"""Parquet tables under ``STORE/tables/<table>/``: append-only writes, reads, DuckDB views.

Each stage of each run appends its own files (``<run_id>.<stage>.<n>.parquet``), written under a
temporary name and renamed into place (in an object store: one PUT of the whole file, atomic per
object), so a reader never sees half a file and a killed run loses at most the file it was
writing. The current state of the corpus is computed by readers (latest
version per id), never by rewriting files.

Rows that must be on disk before the writer can take them (an LLM answer, as it arrives, from
any worker) are *staged*: written the same way under ``STORE/staging/<table>/`` and moved into
the table later by the one writer (:func:`stage_rows`), many staged files into one table file.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from coinrag.schemas.tables import TABLES, arrow_schema, table_name
from coinrag.storage.exit_gate import native_scan
from coinrag.storage.store import Store, safe_component

if TYPE_CHECKING:  # imported where used: readers of rows (a query) never pay for DuckDB
    import duckdb

R = TypeVar("R")


def rows_to_arrow(rows: Sequence[Any], record: type) -> pa.Table:
    """Rows (dataclass instances of ``record``) as an Arrow table with the record's schema."""
    schema = arrow_schema(record)
    columns = {name: [getattr(r, name) for r in rows] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


def append_rows(store: Store, rows: Sequence[Any], run_id: str, stage: str) -> PurePath | None:
    """Append rows (all of one record type) as a new Parquet file; return its path.

    Nothing is written for an empty sequence.
    """
    if not rows:
        return None
    record = type(rows[0])
    return _write_file(
        store, store.table_dir(table_name(record)), rows_to_arrow(rows, record), run_id, stage
    )


def stage_rows(store: Store, rows: Sequence[Any], run_id: str, stage: str) -> PurePath | None:
    """Write rows (all of one record type) as one staged file under ``STORE/staging/<table>/``:
    on disk at once, but not part of the table (no reader sees them) until the store's writer
    moves them in (:func:`read_files` them, :func:`append_rows` them, then remove the staged
    files). For rows computed where the table must not be written (a worker of a distributed
    task runner) or one at a time (one file per LLM answer); the writer merges many staged files
    into one table file. Nothing is written for an empty sequence."""
    if not rows:
        return None
    record = type(rows[0])
    return _write_file(
        store, store.staging_dir(table_name(record)), rows_to_arrow(rows, record), run_id, stage
    )


def staged_files(store: Store, record: type, run_id: str | None = None) -> list[PurePath]:
    """The staged files of a table (of one run's, with ``run_id``), sorted by name."""
    directory = store.staging_dir(table_name(record))
    prefix = f"{safe_component(run_id)}." if run_id is not None else ""
    return [
        directory / n
        for n in store.list_names(directory)
        if n.endswith(".parquet") and not n.startswith(".") and n.startswith(prefix)
    ]


def read_files(store: Store, record: type[R], files: Sequence[PurePath]) -> list[R]:
    """The rows of some Parquet files of ``record``'s schema (staged or table files)."""
    if not files:
        return []
    table = scan_files(store, files, arrow_schema(record))
    return [record(**row) for row in table.to_pylist()]


def rewrite_rows(
    store: Store,
    record: type,
    keep: Callable[[Any], bool],
    column: str,
    run_id: str,
    stage: str,
) -> int:
    """Compaction: drop the rows whose ``column`` value fails ``keep``; return how many.

    The only code that removes rows (``gc``, under the store's write lock). A file with rows to
    drop is replaced by a new file of its kept rows (written under a temporary name and renamed
    into place first, then the old file is removed), so a reader or a crash sees each kept row
    at least once; at worst a row twice, never none.
    """
    dropped = 0
    for path in table_files(store, record):
        table = scan_files(store, [path], arrow_schema(record))
        mask = [bool(keep(v)) for v in table.column(column).to_pylist()]
        if all(mask):
            continue
        kept = table.filter(pa.array(mask, type=pa.bool_()))
        dropped += table.num_rows - kept.num_rows
        if kept.num_rows:
            _write_file(store, path.parent, kept, run_id, stage)
        store.remove(path)
    return dropped


def _write_file(
    store: Store, directory: PurePath, table: pa.Table, run_id: str, stage: str
) -> PurePath:
    name = f"{safe_component(run_id)}.{safe_component(stage)}.{uuid.uuid4().hex[:8]}.parquet"
    final = directory / name
    store.write_parquet(final, table)
    return final


def table_files(store: Store, record: type) -> list[PurePath]:
    """The table's Parquet files (not temporary ones), sorted by name."""
    directory = store.table_dir(table_name(record))
    names = store.list_names(directory)
    return [directory / n for n in names if n.endswith(".parquet") and not n.startswith(".")]


def scan_files(
    store: Store,
    files: Sequence[PurePath],
    schema: pa.Schema,
    columns: list[str] | None = None,
    filter: Any = None,
) -> pa.Table:
    """The rows of ``files`` (Parquet of ``schema``) as one Arrow table, the dataset made,
    scanned and freed inside :func:`native_scan`: a dataset over fetched bytes takes the GIL
    again when it is freed, and a daemon thread doing that as the interpreter finalizes aborts
    the process (``storage/exit_gate.py``). The table holds only Arrow's own memory."""
    with native_scan():
        dataset = store.parquet_dataset(files, schema)
        table = dataset.to_table(columns=columns, filter=filter)
        del dataset
    return table


def read_table(
    store: Store, record: type, columns: Sequence[str] | None = None, filter: Any = None
) -> pa.Table:
    """All rows of a table (every run), as Arrow; an empty table if nothing was written yet."""
    schema = arrow_schema(record)
    files = table_files(store, record)
    if not files:
        empty = schema.empty_table()
        return empty.select(list(columns)) if columns else empty
    return scan_files(store, files, schema, list(columns) if columns else None, filter)


def read_rows(store: Store, record: type[R], filter: Any = None) -> list[R]:
    """All rows of a table as record instances."""
    return [record(**row) for row in read_table(store, record, filter=filter).to_pylist()]


def column_values(store: Store, record: type, column: str) -> set[Any]:
    """The distinct values of one column."""
    return set(read_table(store, record, columns=[column]).column(column).to_pylist())


def replace_fields(row: R, **changes: Any) -> R:
    return dataclasses.replace(row, **changes)  # type: ignore[type-var]


def connect_duckdb(store: Store, tables: Iterable[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per table over its Parquet files, confined
    to those files.

    Tables with no files yet get an empty view with the right columns, so SQL written against
    the schema always binds. The connection reads the listed Parquet files and nothing else:
    ``allowed_paths`` names exactly them, ``enable_external_access = false`` refuses every other
    file, URL, ``COPY ... TO``, ``ATTACH``, ``INSTALL``/``LOAD`` (``httpfs`` included), and
    ``lock_configuration`` keeps SQL from undoing that (``duckdb.PermissionException``, or
    ``InvalidInputException`` for a ``SET``). Arrow tables registered afterwards
    (``con.register``) stay readable. On an object store the files are read through the
    store's fsspec filesystem, registered before the lock.
    """
    import duckdb

    con = duckdb.connect(":memory:")
    store.register_with_duckdb(con)
    listings = {
        name: [store.absolute_uri(f) for f in table_files(store, TABLES[name])]
        for name in tables or TABLES
    }
    allowed = sorted({p for paths in listings.values() for p in paths})
    if allowed:
        con.execute("SET allowed_paths = ?", [allowed])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    for name, paths in listings.items():
        if paths:
            listing = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
            con.execute(
                f"CREATE VIEW {name} AS SELECT * FROM read_parquet([{listing}], union_by_name=true)"
            )
        else:
            con.register(f"_{name}_empty", arrow_schema(TABLES[name]).empty_table())
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_empty")
    return con
