"""Real documents against their text: retrieval hit@kc of stores built from the Python docs as
HTML, as Chromium-printed PDFs and as the reST text of ``infra/python_faq.py`` (issue 32).

Run alone (each store is built once into ``--work`` and reused by later runs; one thread)::

    python infra/python_faq.py DATA                       # questions.jsonl, corpus.jsonl
    python tests/benchmarks/bench_documents.py --work W --faq DATA/questions.jsonl \\
        --text DATA/corpus.jsonl --html /usr/share/doc/python3.11/html --pdf PDF_DIR \\
        --variants text html html-noprefix html-section pdf

Variants (stores without KV and without nuggets, ``extractor = "none"``: what is compared is
how the documents are read, chunked and indexed):

- ``text``: the JSONL corpus of the reST sources (ids ``faq/programming``, ...);
- ``rst``: the same sources as a folder of ``.rst`` files (``infra/python_faq.py``'s ``rst/``,
  ``--rst``): the same text, its section titles parsed by the reST reader;
- ``html``: the HTML folder as SOURCE (``_sources/`` excluded: the same reST again), ids by
  path, so the gold ids match; ``html-noprefix``: the same without the heading prefix in the
  searched text (the heading path and a chunk's inner titles patched out for the build);
  ``html-section``, ``html-sentence``, ``html-content``: other chunkers;
- ``pdf``: a folder of the same pages printed to PDF (``--pdf``);
- modifiers combine on any format: ``html-noprefix-section``, ``text-sentence``.

For every store and question set (the FAQ questions, ``infra/python_natural_questions.jsonl``
and ``infra/python_natural_questions_2.jsonl``)
it runs ``coinrag eval --retrieval-only --kc 1 2 4 8`` (dense, lexical, hybrid) and prints hit@kc
of the top-kc chunks, and each build's seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
NATURAL = REPO / "infra" / "python_natural_questions.jsonl"
NATURAL_2 = REPO / "infra" / "python_natural_questions_2.jsonl"
KCS = (1, 2, 4, 8)


def _variant(
    name: str, args: argparse.Namespace
) -> tuple[str, dict, contextlib.AbstractContextManager]:
    """(source, build settings, build context) of a variant ``FORMAT[-noprefix][-CHUNKER]``."""
    from coinrag.schemas.settings import CHUNKERS

    fmt, *modifiers = name.split("-")
    sources = {"text": args.text, "rst": args.rst, "html": args.html, "pdf": args.pdf}
    if sources.get(fmt) is None:
        raise SystemExit(f"unknown variant {name!r}, or its source not given")
    settings: dict = {"extractor": "none", "kv": False, "threads": 1}
    if fmt == "html":
        settings["exclude"] = "_sources/*"
    stack = contextlib.ExitStack()
    for modifier in modifiers:
        if modifier == "noprefix":  # no heading path, and no inner titles, searched
            stack.enter_context(mock.patch("coinrag.tasks.embed.heading", lambda s: ""))
            stack.enter_context(mock.patch("coinrag.tasks.embed.inner_headings", lambda c, h: []))
        elif modifier in CHUNKERS:
            settings["chunker"] = modifier
        else:
            raise SystemExit(f"unknown variant {name!r}: {modifier!r}")
    return str(sources[fmt]), settings, stack


def build(name: str, args: argparse.Namespace) -> tuple[Path, float | None]:
    from coinrag.flows.build import build_flow

    store = args.work / f"store-{name}"
    if (store / "coinrag.toml").exists():
        return store, None
    source, settings, context = _variant(name, args)
    t = time.perf_counter()
    with context:
        summary = build_flow(source, str(store), settings)
    seconds = time.perf_counter() - t
    keep = ("documents", "rejects", "files_skipped", "chunks", "embedded")
    print(name, {k: summary[k] for k in keep}, f"{seconds:.0f} s", flush=True)
    return store, seconds


def evaluate(name: str, store: Path, questions: Path, args: argparse.Namespace) -> dict:
    """``{(mode, kc): hit}`` of the top-kc chunks."""
    from typer.testing import CliRunner

    from coinrag.flows.cli import app

    out = args.work / f"eval-{name}-{questions.stem}"
    if not (out / "retrieval.parquet").exists():
        result = CliRunner().invoke(
            app,
            ["eval", str(questions), "--store", str(store), "--out", str(out)]
            + ["--retrieval-only", "--threads", "1", "--kc", *map(str, KCS)],
        )
        if result.exit_code != 0:
            raise SystemExit(result.output)
    rows = pq.read_table(out / "retrieval.parquet").to_pylist()
    return {(r["retrieval"], r["kc"]): r["hit"] for r in rows if r["evidence"] == "chunks"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--faq", type=Path, required=True, help="infra/python_faq.py's questions")
    ap.add_argument("--natural", type=Path, nargs="+", default=[NATURAL, NATURAL_2])
    ap.add_argument("--text", type=Path, help="infra/python_faq.py's corpus.jsonl")
    ap.add_argument("--rst", type=Path, help="infra/python_faq.py's rst/ folder")
    ap.add_argument("--html", type=Path, default=Path("/usr/share/doc/python3.11/html"))
    ap.add_argument("--pdf", type=Path, help="the HTML pages printed to PDF")
    ap.add_argument("--variants", nargs="+", default=["text", "html", "html-noprefix", "pdf"])
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    table = []
    for name in args.variants:
        store, seconds = build(name, args)
        for questions in (args.faq, *args.natural):
            hits = evaluate(name, store, questions, args)
            for mode in ("dense", "lexical", "hybrid"):
                cells = " / ".join(f"{100 * hits[(mode, kc)]:.1f}" for kc in KCS)
                table.append(f"| {name} | {questions.stem} | {mode} | {cells} |")
        if seconds is not None:
            print(f"{name}: built in {seconds:.0f} s", flush=True)
    print("| store | questions | mode | hit@1 / @2 / @4 / @8 |\n|---|---|---|---|")
    print("\n".join(table))
    (args.work / "table.md").write_text("\n".join(table) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
