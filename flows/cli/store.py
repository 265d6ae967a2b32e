"""``coinrag build`` and the store's maintenance: ``delete``, ``gc``, ``verify``."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from coinrag.flows.cli import common
from coinrag.flows.cli.common import BuiltStore, ConfigOption, WritableStore, console, fail
from coinrag.flows.settings_options import with_settings_options
from coinrag.schemas.settings import BuildSettings

Source = Annotated[
    str,
    typer.Argument(
        help="Folder of documents (.txt, .md, .rst, .html, .pdf, .docx), a .jsonl file ({id, text, "
        "...}), a .parquet file (id, text columns), or 'sample' for the bundled sample corpus."
    ),
]


@with_settings_options(BuildSettings)
def build(
    source: Source,
    store: WritableStore,
    config: ConfigOption = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Build or update STORE from SOURCE: chunks, nuggets, and (later stages) KV and indexes."""
    from coinrag.flows import preflight
    from coinrag.schemas.settings import load_settings

    source = common.source_path(source)
    settings = load_settings(config, overrides)
    preflight.source(source)
    st = preflight.store_to_write(store)
    preflight.build_settings(settings)
    from coinrag.flows.build import build_flow

    common.prefect_run()
    with st.removed_if_left_empty():  # a failed first build leaves no empty store behind
        summary = build_flow(source=source, store=str(store), settings=settings.to_dict())
    from coinrag.flows import render

    render.print_build_summary(Console(), summary)
    rejected, failures = summary["rejected"], summary["failures"]
    for r in summary.get("left_out", []):
        console.print(f"left out {escape(r['source'])}: {r['reason']}: {escape(r['detail'])}")
    for r in rejected:
        console.print(f"[yellow]rejected[/] {r['doc_id'] or '-'}: {r['reason']}: {r['detail']}")
    if rejected:
        common.error(f"{len(rejected)} document(s) rejected (see the rejects table)")
    for line in failures:
        common.error(f"{line}; run coinrag build again to retry them")
    for line in summary.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if failures or rejected:
        raise typer.Exit(4 if failures else 3)


def delete(
    doc_ids: Annotated[list[str], typer.Argument(help="Ids of the documents to delete.")],
    store: BuiltStore,
) -> None:
    """Delete documents: tombstoned in the tables, gone from the index (their KV is reclaimed
    by `coinrag gc`). An id that is not a live document fails the whole command."""
    from coinrag.flows import preflight
    from coinrag.flows.maintenance import delete_documents

    preflight.unlocked(preflight.built_store(store))
    with common.exit_on(1, FileNotFoundError):
        deleted = delete_documents(str(store), doc_ids)
    for doc_id, version in deleted.items():
        Console().print(f"deleted {doc_id} (version {version})")


def gc(
    store: BuiltStore,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only report what would be reclaimed.")
    ] = False,
) -> None:
    """Reclaim space: KV entries no live chunk uses, old index versions, leftovers of killed
    writes. Takes the store's write lock."""
    from coinrag.flows import preflight, render
    from coinrag.flows.maintenance import gc_counts, gc_store

    preflight.unlocked(preflight.built_store(store))
    with common.exit_on(1, FileNotFoundError):
        report = gc_store(str(store), dry_run=dry_run)
    render.print_gc(Console(), gc_counts(report), "would reclaim" if dry_run else "reclaimed")


def verify(
    store: BuiltStore,
    level: Annotated[
        str,
        typer.Option(help="crc32c (every block, default) | stat (file sizes) | sha256 (entries)."),
    ] = "crc32c",
) -> None:
    """Check every stored KV entry (and prompt-prefix KV); list the corrupt ones with their
    chunk and document. Read-only. Exit 1 if any is corrupt: `coinrag build` repairs them."""
    from coinrag.flows import preflight
    from coinrag.flows.verify import verify_store
    from coinrag.inference.methods import repair_command
    from coinrag.schemas.settings import KV_VERIFY_LEVELS
    from coinrag.storage.store import Store

    if level not in KV_VERIFY_LEVELS:
        fail(f"--level {level!r} is not one of {', '.join(KV_VERIFY_LEVELS)}", 2)
    preflight.built_store(store)
    with common.exit_on(1, FileNotFoundError):
        report = verify_store(str(store), level)
    out = Console()
    for bad in report.corrupt:
        what = f"chunk {bad.chunk_id} (document {bad.doc_id})" if bad.chunk_id else bad.content_key
        out.print(f"corrupt: {what}: {bad.problem}", soft_wrap=True, markup=False)
    out.print(
        f"checked {report.entries} KV entries ({report.logical_bytes:,} bytes) in "
        f"{report.kv_stores} KV store(s) at level {level} in {report.seconds:.1f} s: "
        f"{len(report.corrupt)} corrupt",
        soft_wrap=True,
    )
    if report.corrupt:
        command = repair_command(Store.at(store))
        fail(f"{len(report.corrupt)} corrupt KV entries: {command} recomputes them", 1)
