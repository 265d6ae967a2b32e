"""``coinrag lineage``: SQL over a store's lineage views, walks, stale assets (read-only)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from coinrag.flows.cli.common import BuiltStore, fail


def lineage(
    store: BuiltStore,
    sql: Annotated[
        str | None, typer.Argument(help="One SELECT over the lineage views and the tables.")
    ] = None,
    nugget: Annotated[
        str | None, typer.Option(help="Walk up and down from this nugget_id.")
    ] = None,
    chunk: Annotated[str | None, typer.Option(help="Walk up and down from this chunk_id.")] = None,
    doc: Annotated[str | None, typer.Option(help="Walk down from this doc_id.")] = None,
    stale: Annotated[
        bool, typer.Option("--stale", help="Assets whose producer differs from the settings'.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV (SQL and --stale).")] = False,
) -> None:
    """Lineage of a store's assets: run SQL over its views, walk the chain through one nugget,
    chunk or document, or list stale assets. Without any of these: list the views. Read-only
    (works while a build runs)."""
    from coinrag.flows import preflight, render
    from coinrag.storage.lineage import LineageError
    from coinrag.tasks import lineage as queries

    walks = {k: v for k, v in {"nugget": nugget, "chunk": chunk, "doc": doc}.items() if v}
    modes = len(walks) + (sql is not None) + stale
    if modes > 1:
        fail("give one of SQL, --nugget, --chunk, --doc, --stale", 2)
    if json_out and csv_out:
        fail("--json and --csv exclude each other", 2)
    if csv_out and walks:
        fail("--csv prints one table: use it with SQL or --stale (--json for a walk)", 2)
    st = preflight.built_store(store)
    out = Console()
    if modes == 0:
        render.print_views(out)
        return
    try:
        if walks:
            ((kind, ident),) = walks.items()
            sections = queries.lineage_walk(st, kind, ident)
        else:
            result = queries.lineage_stale(st) if stale else queries.lineage_sql(st, sql or "")
    except LineageError as exc:  # an id the store lacks (1), or SQL that cannot run (2)
        fail(str(exc), 1 if walks else 2)
    except (OSError, ValueError) as exc:  # settings or producers of --stale that cannot load
        fail(f"cannot compute the current producers from {st.uri(st.settings_path)}: {exc}", 1)
    if walks:
        if json_out:
            print(render.to_json(sections))
        else:
            for name, table in sections.items():
                render.print_section(out, name, table)
    elif json_out:
        print(render.to_json(result))
    elif csv_out:
        sys.stdout.write(render.to_csv(result))
    else:
        render.print_table(out, result, "stale assets" if stale else None)
