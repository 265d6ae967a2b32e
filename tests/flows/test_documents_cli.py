"""A folder of real documents end to end (issue 32): a mixed folder (a Chromium-printed PDF, a
page of the Python docs' HTML, a Word file made here, Markdown, text, and bad files) built by
``coinrag build``; pages and sections in every chunk and nugget, in ``query --json``, the API,
``eval`` and the lineage views; a second build parses nothing; a renamed file recomputes no KV;
a removed one is pruned; a deleted one is gone from the answers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from api_harness import serving
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.server.app import ServerConfig
from coinrag.schemas.tables import ChunkRow, NuggetRow, RejectRow
from coinrag.storage.corpus import live_documents
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness", "one_torch_thread")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANUAL = "Zorvath Widget Manual"


def _manual(path: Path) -> None:
    """A Word file with a title, headings, a list and a table (python-docx, as Word writes)."""
    import docx

    doc = docx.Document()
    doc.core_properties.title = MANUAL
    doc.add_heading("Installation", level=1)
    doc.add_paragraph("The Zorvath widget is installed with the kelpie tool in four minutes.")
    doc.add_heading("Cleaning", level=2)
    doc.add_paragraph("Clean the widget's brass valve with lemon oil once a month.")
    doc.add_paragraph("Never use vinegar", style="List Bullet")
    table = doc.add_table(rows=2, cols=2)
    for row, cells in zip(table.rows, (("Part", "Price"), ("Valve", "12 euros")), strict=True):
        for cell, text in zip(row.cells, cells, strict=True):
            cell.text = text
    doc.save(str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("documents")
    src = root / "src"
    (src / "faq").mkdir(parents=True)
    shutil.copy(FIXTURES / "pdf" / "general.pdf", src / "faq" / "general.pdf")
    shutil.copy(FIXTURES / "html" / "general.html", src / "faq" / "general.html")
    _manual(src / "manual.docx")
    (src / "notes.md").write_text(
        "# Harbour notes\n\n## Keldia\n\nZorvath is a harbour town on the island of Keldia, "
        "founded by the shipwright Ilsa Moren in 1802.\n",
        encoding="utf-8",
    )
    (src / "plain.txt").write_text("Keldia exports dried kelp and brass.\n", encoding="utf-8")
    shutil.copy(FIXTURES / "html" / "genindex-Y.html", src / "genindex-Y.html")  # left out
    # The bad files: one reject each, the rest built.
    (src / "broken.pdf").write_bytes((FIXTURES / "pdf" / "general.pdf").read_bytes()[:3000])
    shutil.copy(FIXTURES / "pdf" / "scanned.pdf", src / "scanned.pdf")
    (src / "empty.txt").write_bytes(b"")
    (root / "secret.txt").write_text("Outside SOURCE: never read.", encoding="utf-8")
    os.symlink(root / "secret.txt", src / "escape.txt")
    return src


@pytest.fixture(scope="module")
def built(folder: Path) -> tuple[Path, object]:
    store = folder.parent / "store"
    result = CliRunner().invoke(
        app, ["build", str(folder), "--store", str(store), "--extractor", "rules", "--threads", "1"]
    )
    return store, result


def test_the_folder_builds_and_each_bad_file_is_one_reject(built) -> None:
    store, result = built
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    rejects = {r.source: r.reason for r in read_rows(Store.at(store), RejectRow)}
    assert rejects == {
        "broken.pdf": "corrupt",
        "scanned.pdf": "no_text_layer",
        "empty.txt": "empty_file",
        "escape.txt": "outside_source",
    }
    for name in rejects:
        assert name in result.output
    # A page of links is left out, named, and is not a reject nor a document.
    assert "left out genindex-Y.html: navigation_page" in " ".join(result.output.split())
    docs = live_documents(Store.at(store))
    assert {d: r.format for d, r in docs.items()} == {
        "faq/general.pdf": "pdf",
        "faq/general.html": "html",
        "manual": "docx",
        "notes": "markdown",
        "plain": "text",
    }
    assert all("never read" not in r.text for r in docs.values())
    assert docs["manual"].title == MANUAL and docs["faq/general.pdf"].page_starts[0] == 0


def test_every_chunk_and_nugget_knows_its_pages_and_section(built) -> None:
    st = Store.at(built[0])
    chunks = read_rows(st, ChunkRow)
    pdf = [c for c in chunks if c.doc_id == "faq/general.pdf"]
    assert pdf and all(c.path == "faq/general.pdf" and 1 <= c.page_first for c in pdf)
    assert max(c.page_last for c in pdf) == len(live_documents(st)["faq/general.pdf"].page_starts)
    html = [c for c in chunks if c.doc_id == "faq/general.html"]
    assert all(c.section and c.section[0] == "General Python FAQ" for c in html[1:])
    assert all(c.page_first is None for c in html)
    nuggets = {n.doc_id: n for n in read_rows(st, NuggetRow)}
    assert nuggets["manual"].section[0] == "Installation"
    assert nuggets["faq/general.pdf"].page_first is not None


def _query(store: Path, question: str) -> dict:
    result = CliRunner().invoke(
        app,
        ["query", question, "--store", str(store), "--method", "coinrag", "--kc", "1"]
        + ["--max-new-tokens", "4", "--json", "--threads", "1"],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_query_and_api_evidence_name_the_page_and_the_section(built) -> None:
    store = built[0]
    manual = _query(store, "How do I clean the brass valve of the Zorvath widget?")
    assert manual["evidence"] and {e["doc_id"] for e in manual["evidence"]} == {"manual"}
    cleaning = [e for e in manual["evidence"] if e["section"] == ["Installation", "Cleaning"]]
    assert cleaning and cleaning[0]["citation"] == "manual.docx | Installation > Cleaning"
    pdf = _query(store, "Is there a tutorial for Python beginners, in the general FAQ PDF?")
    for e in pdf["evidence"]:
        if e["doc_id"] == "faq/general.pdf":
            assert e["citation"].startswith(f"faq/general.pdf p. {e['page_labels'][0]}")
    config = ServerConfig(store=str(store), methods=("coinrag",), max_new_tokens=4)
    with serving(config) as (base, _srv), httpx.Client(timeout=120) as client:
        got = client.post(
            f"{base}/query",
            json={"question": "How do I clean the brass valve?", "method": "coinrag", "kc": 1},
        )
    assert got.status_code == 200, got.text
    evidence = got.json()["evidence"]
    assert evidence and all(e["citation"].startswith("manual.docx | ") for e in evidence)


def test_eval_and_lineage_name_the_place_of_the_evidence(built, tmp_path: Path) -> None:
    store = built[0]
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps(
            {
                "question": "Where was Ilsa Moren's harbour town?",
                "answers": ["Keldia"],
                "doc_ids": ["notes"],
            }
        )
        + "\n",  # fmt: skip
        encoding="utf-8",
    )
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        ["eval", str(questions), "--store", str(store), "--out", str(out), "--retrieval-only"]
        + ["--kc", "1"],
    )
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "retrieval_per_question.parquet").to_pylist()
    assert any(
        "notes.md | Harbour notes > Keldia" in c for r in rows for c in r["evidence_citations"]
    )
    sql = "SELECT path, page_first, page_labels, section FROM lineage_chunks WHERE live"
    view = CliRunner().invoke(app, ["lineage", "--store", str(store), sql, "--json"])
    assert view.exit_code == 0, view.output
    places: dict[str, list[dict]] = {}
    for row in json.loads(view.stdout):
        places.setdefault(row["path"], []).append(row)
    assert min(r["page_first"] for r in places["faq/general.pdf"]) == 1
    assert [r["section"] for r in places["notes.md"]] == [["Harbour notes"]]


@pytest.mark.heavy  # over 5 s: the second tier
def test_rebuilds_parse_nothing_reuse_kv_for_a_rename_and_prune_a_removed_file(
    built, folder: Path
) -> None:
    store = built[0]

    def build(**more: object) -> dict:
        summary = build_flow(str(folder), str(store), {"extractor": "rules", "threads": 1, **more})
        assert len(summary["rejected"]) == 4  # the bad files are still there
        return summary

    again = build()
    assert again["documents_parsed"] == 0 and again["documents_new"] == 0
    assert again["kv_computed"] == 0 and again["embedded"] == 0
    (folder / "notes.md").rename(folder / "harbour.md")
    (folder / "plain.txt").unlink()
    moved = build(prune=True)
    assert moved["documents_new"] == 1 and moved["documents_parsed"] == 1
    assert moved["kv_computed"] == 0 and moved["kv_reused"] == moved["chunks"]
    assert moved["documents_pruned"] == 2  # notes (now harbour) and plain
    assert set(live_documents(Store.at(store))) == {
        "faq/general.pdf",
        "faq/general.html",
        "manual",
        "harbour",
    }
    deleted = CliRunner().invoke(app, ["delete", "faq/general.html", "--store", str(store)])
    assert deleted.exit_code == 0, deleted.output
    assert "faq/general.html" not in live_documents(Store.at(store))
    left = _query(store, "Is Python free to use for commercial purposes?")
    assert all(e["doc_id"] != "faq/general.html" for e in left["evidence"])
