"""The ``coinrag`` command line.

Exit codes: 0 done; 1 failed (nothing or not everything was built: the message says why);
2 usage error (unknown option, bad value); 3 built, but some documents were rejected (listed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="coinrag: the offline asset factory for KV-cache-reuse RAG.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

SAMPLE = Path(__file__).parent / "sample" / "wiki_sample.jsonl"


@app.callback()
def _root() -> None:
    """coinrag: the offline asset factory for KV-cache-reuse RAG."""


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.command()
def build(
    source: Annotated[
        str,
        typer.Argument(
            help="Folder of .txt/.md files, a .jsonl file ({id, text, ...}), a .parquet file "
            "(id, text columns), or 'sample' for the bundled sample corpus."
        ),
    ],
    store: Annotated[
        Path, typer.Option("--store", help="The store directory (created if absent).")
    ],
    extractor: Annotated[
        str | None,
        typer.Option(
            help="openai | openai-batch | local | rules | none "
            "(default: openai if OPENAI_API_KEY is set, else local)."
        ),
    ] = None,
    llm_model: Annotated[
        str | None, typer.Option("--llm-model", help="LLM for extraction (default gpt-4o-mini).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Generation model whose tokenizer chunks: a folder, a .gguf file, or "
            "'smollm2' (default, the packaged SmolLM2-135M-Instruct)."
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML file with a [build] table of the same settings.")
    ] = None,
    chunker: Annotated[str | None, typer.Option(help="fixed (default) | sentence")] = None,
    chunk_size: Annotated[int | None, typer.Option(help="Tokens per chunk (default 512).")] = None,
    tau: Annotated[
        float | None, typer.Option(help="Fuzzy recovery threshold (default 0.7).")
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Simultaneous LLM requests (default 8).")
    ] = None,
) -> None:
    """Build or update STORE from SOURCE: chunks, nuggets, and (later stages) KV and indexes."""
    from schemas.settings import SettingsError, load_settings
    from tasks.ingest import SourceError

    if source == "sample":
        source = str(SAMPLE)
    try:
        settings = load_settings(
            config,
            {
                "extractor": extractor,
                "llm_model": llm_model,
                "model": model,
                "chunker": chunker,
                "chunk_size": chunk_size,
                "tau": tau,
                "concurrency": concurrency,
            },
        )
    except SettingsError as exc:
        _fail(str(exc), 2)
    if not Path(source).expanduser().exists():
        _fail(f"source {source} does not exist", 1)

    from flows.build import build_flow
    from storage.store import StoreLocked

    try:
        summary = build_flow(source=source, store=str(store), settings=settings.to_dict())
    except (SourceError, StoreLocked) as exc:
        _fail(str(exc), 1)
    _print_summary(summary)
    if summary["rejected"]:
        for r in summary["rejected"]:
            console.print(f"[yellow]rejected[/] {r['doc_id'] or '-'}: {r['reason']}: {r['detail']}")
        _fail(f"{len(summary['rejected'])} document(s) rejected (see the rejects table)", 3)


def _print_summary(summary: dict) -> None:
    table = Table(title=f"coinrag build {summary['run_id']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key not in ("run_id", "rejected"):
            table.add_row(key, str(value))
    Console().print(table)


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
