"""The CLI on a built store, where issue 12 found README and behaviour apart (items 5, 10, 12):
``gc --dry-run`` reports what ``gc`` reclaims, ``eval`` prints its report on stdout and takes
``--kc 1 2``, MRR for every retrieval mode, a refused model names both fingerprints, blank
questions are refused by the engine itself, a NUL in a document id is rejected."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.tables import DocumentRow, KvManifestRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness")


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _gc_numbers(output: str) -> dict[str, int]:
    """The measures of ``coinrag gc``'s table (``measure  value`` rows)."""
    out = {}
    for line in output.splitlines():
        m = re.match(r"^\W*([a-z_]+)\W+(\d+)\W*$", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def _tree(root: Path) -> dict[str, int]:
    """Sizes of the store's files, but the runs table and the lock (which every run writes)."""
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and "runs" not in p.parts and p.name != ".lock"
    }


def test_gc_dry_run_reports_what_gc_reclaims(sample_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    st = Store.at(store)
    doc_ids = sorted({d.doc_id for d in read_rows(st, DocumentRow)})
    deleted = cli("delete", doc_ids[1], "--store", str(store))
    assert deleted.exit_code == 0, deleted.output

    before = _tree(store)
    dry = cli("gc", "--store", str(store), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert _tree(store) == before  # a dry run changes nothing (but its runs row)
    real = cli("gc", "--store", str(store))
    assert real.exit_code == 0, real.output

    would, did = _gc_numbers(dry.output), _gc_numbers(real.output)
    assert did["bytes_reclaimed"] > 0 and did["kv_shards_compacted"] > 0
    assert did["index_versions_removed"] > 0, did
    for measure in (
        "kv_entries_dropped",
        "kv_entries_moved",
        "kv_shards_compacted",
        "kv_bytes_freed",
        "kv_bytes_written",
        "index_versions_removed",
        "index_bytes_freed",
        "temp_paths_removed",
        "temp_bytes_freed",
        "bytes_reclaimed",
    ):
        assert would[measure] == did[measure], (measure, would, did)
    assert f"would reclaim {would['kv_entries_dropped']} KV entries" in dry.output
    assert f"{would['bytes_reclaimed']} bytes" in dry.output
    again = _gc_numbers(cli("gc", "--store", str(store), "--dry-run").output)
    assert again["bytes_reclaimed"] == 0 and again["kv_entries_dropped"] == 0


QUESTIONS = [
    # the eval format
    {"question": "Who directed 2001: A Space Odyssey?", "answers": ["Stanley Kubrick"]},
    # the train nuggets format: answer, gold_doc_ids (doc_ids: the documents to retrieve in)
    {"question": "Which prize did Marie Curie share in 1903?", "answer": "Nobel Prize in Physics"},
]


def _questions(tmp_path: Path, sample_store: Path) -> Path:
    by_title = {d.doc_id: d.text for d in read_rows(Store.at(sample_store), DocumentRow)}

    def gold(word: str) -> str:
        return next(doc_id for doc_id, text in by_title.items() if word in text)

    lines = [
        {**QUESTIONS[0], "doc_ids": [gold("Kubrick")]},
        {**QUESTIONS[1], "gold_doc_ids": [gold("Skłodowska")], "doc_ids": sorted(by_title)},
    ]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in lines))
    return path


def test_eval_report_on_stdout_with_list_options(sample_store: Path, tmp_path: Path) -> None:
    questions = _questions(tmp_path, sample_store)
    out = tmp_path / "eval"
    result = cli(
        "eval", str(questions), "--store", str(sample_store), "--out", str(out),
        "--methods", "coinrag", "turborag", "--kc", "1", "2", "--k", "2",
        "--max-new-tokens", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "TTFT P99" in result.stdout and "best F1" in result.stdout  # the report
    assert "TTFT P99" not in result.stderr
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert sorted((r["method"], r["kc"], r["k"]) for r in rows) == [
        ("coinrag", 1, 2), ("coinrag", 2, 2), ("turborag", 1, 0), ("turborag", 2, 0),
    ]  # fmt: skip
    assert all(r["n"] == 2 and r["recall"] is not None for r in rows)  # both formats read
    per_q = pq.read_table(out / "per_question.parquet").to_pylist()
    assert {tuple(r["gold"]) for r in per_q} == {("Stanley Kubrick",), ("Nobel Prize in Physics",)}


def test_eval_draws_its_progress_without_a_refresh_thread(
    sample_store: Path, tmp_path: Path, monkeypatch
) -> None:
    """``eval``'s progress bar is redrawn after each answer, never from Rich's refresh thread:
    that thread takes the GIL ten times a second and the timed reads waited for it."""
    import rich.live

    started: list[object] = []
    original = rich.live._RefreshThread.start

    def start(thread) -> None:
        started.append(thread)
        original(thread)

    monkeypatch.setattr(rich.live._RefreshThread, "start", start)
    questions = _questions(tmp_path, sample_store)
    result = cli(
        "eval", str(questions), "--store", str(sample_store), "--out", str(tmp_path / "eval"),
        "--methods", "coinrag", "--k", "2", "--max-new-tokens", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert started == []


def test_retrieval_only_mrr_for_every_mode(sample_store: Path, tmp_path: Path) -> None:
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.qa import load_questions

    questions = _questions(tmp_path, sample_store)
    out = tmp_path / "retrieval"
    result = cli(
        "eval", str(questions), "--store", str(sample_store), "--out", str(out),
        "--retrieval-only", "--kc", "1", "2", "--k", "1", "3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {
        (r["retrieval"], r["evidence"], r["kc"], r["k"]): r
        for r in pq.read_table(out / "retrieval.parquet").to_pylist()
    }
    assert {e for _, e, _, _ in rows} == {"chunks", "two_stage", "one_stage"}
    assert {m for m, _, _, _ in rows} == {"dense", "lexical", "hybrid"}
    assert all(r["mrr"] is not None for r in rows.values())
    # recomputed from the retriever: 1 / rank of the first gold nugget by score, in each mode
    retriever = Retriever(Store.at(sample_store), load_embedder("minilm"))
    for (mode, kind, kc, k), row in rows.items():
        if kind == "chunks":
            continue
        reciprocal = []
        for q in load_questions(questions):
            res = (
                retriever.two_stage(q.question, kc=kc, k=k, mode=mode)
                if kind == "two_stage"
                else retriever.one_stage(q.question, k=k, mode=mode)
            )
            ranked = [e.doc_id for e in sorted(res.evidence, key=lambda e: -e.score)]
            hits = [i for i, d in enumerate(ranked, start=1) if d in q.doc_ids]
            reciprocal.append(1.0 / hits[0] if hits else 0.0)
        assert row["mrr"] == pytest.approx(sum(reciprocal) / len(reciprocal)), (mode, kind, kc, k)
    assert "two_stage" in result.stdout


def test_a_refused_model_names_both_fingerprints(
    sample_store: Path, tmp_path: Path, smollm2_tokenizer
) -> None:
    from coinrag.inference.model.loading import load_model
    from coinrag.storage.kv import KvStore

    other = save_tiny_llama(tmp_path / "other-model", smollm2_tokenizer, seed=1)
    result = cli("query", "Who?", "--store", str(sample_store), "--model", str(other))
    assert result.exit_code == 1
    message = " ".join(result.output.split())
    stored = {r.model_fp for r in read_rows(Store.at(sample_store), KvManifestRow)}
    (stored_fp,) = stored
    (kv_fp,) = {r.location.split("/")[0] for r in read_rows(Store.at(sample_store), KvManifestRow)}
    dtype = KvStore.open(Store.at(sample_store), kv_fp).layout.dtype  # the store's kv_dtype
    asked_fp = load_model(str(other), dtype=dtype).model_fp
    assert asked_fp in message and stored_fp in message, message


def test_the_engine_refuses_blank_questions(sample_store: Path) -> None:
    from coinrag.inference.methods import RagEngine

    engine = RagEngine.open(str(sample_store), max_new_tokens=2)
    retrieval = engine.retrieve("Who directed it?", "turborag", 1, 1)
    for blank in ("", "  ", "\u200b\n"):
        with pytest.raises(ValueError, match="blank"):
            engine.answer(blank)
        with pytest.raises(ValueError, match="blank"):
            engine.run(blank, "turborag", retrieval)
    assert engine.answer("Who directed it?", method="turborag", kc=1).answer is not None


def test_a_nul_in_a_document_id_is_rejected(sample_corpus: Path, tmp_path: Path) -> None:
    docs = sample_docs(sample_corpus, 2)
    docs[1]["id"] = "bad\u0000id"
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    config = tmp_path / "coinrag.toml"
    config.write_text('[build]\nextractor = "none"\nkv = false\nindex = false\n')
    store = tmp_path / "store"
    result = cli("build", str(src), "--store", str(store), "--config", str(config))
    assert result.exit_code == 3, result.output
    assert "U+0000" in result.output and "bad_record" in result.output
    assert [d.doc_id for d in read_rows(Store.at(store), DocumentRow)] == [docs[0]["id"]]
