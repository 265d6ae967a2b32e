"""What the ``coinrag`` commands print: rich tables, JSON and CSV.

``coinrag lineage`` (query results, the sections of a walk, the list of views: the queries are
``tasks/lineage.py``), the summary table of ``coinrag build`` and the table of ``coinrag gc``.
Output only: nothing here reads the store.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from coinrag.storage.lineage import describe_views

# ---------------------------------------------------------------------------- lineage


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


# ---------------------------------------------------------------------------- build and gc


def print_build_summary(console: Console, summary: dict[str, Any]) -> None:
    """The counts of a build, one row per measure (``stage_seconds``: one row per stage)."""
    table = Table(title=f"coinrag build {summary['run_id']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, dict):  # stage_seconds: one row per stage
            for name, sub in value.items():
                table.add_row(f"{key}.{name}", str(sub))
        elif key not in ("run_id", "rejected", "left_out", "failures", "warnings"):
            table.add_row(key, str(value))
    console.print(table)


def print_gc(console: Console, counts: dict[str, Any], verb: str) -> None:
    """The table of ``coinrag gc`` and its one-line total (``verb``: reclaimed | would
    reclaim)."""
    table = Table(title=f"coinrag gc ({verb})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in counts.items():
        if key != "kv":
            table.add_row(key, str(value))
    console.print(table)
    console.print(
        f"{verb} {counts['kv_entries_dropped']} KV entries, "
        f"{counts['index_versions_removed']} index versions, "
        f"{counts['temp_paths_removed']} leftovers: {counts['bytes_reclaimed']} bytes"
    )


def print_answer(console: Console, answer: Any) -> None:
    """``coinrag query``'s answer (an ``inference.methods.Answer``): its text, one line of how
    it was found (method, search mode, context tokens, timings in ms), one line per evidence."""
    console.print(answer.answer, style="bold", markup=False, highlight=False)
    console.print(
        f"method {answer.method}, retrieval {answer.retrieval}, "
        f"{answer.active_tokens} context tokens, "
        + ", ".join(f"{name} {ms:.1f} ms" for name, ms in answer.timings.items())
    )
    for e in answer.evidence:
        console.print(evidence_line(e), highlight=False)


def evidence_line(e: dict[str, Any]) -> str:
    """One line of evidence: a nugget or chunk (doc, chunk, token range, text) or, for the
    cartridge method, a document and its cartridge."""
    if "chunk_id" not in e:  # cartridge evidence: {doc_id, cartridge_id}
        return f"  [dim]{escape(e['doc_id'])} cartridge {escape(e['cartridge_id'])}[/]"
    where = e.get("citation") or e["doc_id"]
    return (
        f"  [dim]{escape(where)} {e['chunk_id'][:12]} [{e['tok_start']}:{e['tok_end']})[/] "
        f"{escape(e['text'].strip()[:100])}"
    )
