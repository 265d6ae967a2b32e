"""Evaluation metrics, Table-3 selection, question validation, and a small end-to-end run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coinrag.inference.evaluation.evaluate import (
    doc_recall,
    evaluate,
    exact_match,
    normalize_answer,
    token_f1,
)
from coinrag.inference.evaluation.report import aggregate, best_under_budget, p99
from coinrag.inference.retrieval.retriever import FUSION_METHOD, HYBRID_DENSE_WEIGHT_WITH_NUGGETS
from coinrag.schemas.qa import QuestionsError, load_questions

# ---------------------------------------------------------------------------- metrics


def test_normalisation_squad_cases() -> None:
    assert normalize_answer("The Cat!") == "cat"
    assert normalize_answer("  an   apple,  a pear ") == "apple pear"
    assert normalize_answer("Theater") == "theater"  # articles only as whole words
    assert exact_match("The Cat", "cat") == 1.0
    assert exact_match("cats", "cat") == 0.0
    assert token_f1("The Cat", "cat") == 1.0


def test_partial_overlap_f1_by_hand() -> None:
    # pred tokens: [blue, whale, is, big]; gold: [blue, whale]; common 2
    # precision 2/4, recall 2/2 -> F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert token_f1("The blue whale is big", "a blue whale") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: pred [x, x, y], gold [x, y, y]
    # common = min(2,1) + min(1,2) = 2; p = 2/3, r = 2/3 -> 2/3
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert token_f1("red", "blue") == 0.0


def test_multiple_gold_answers_take_the_max() -> None:
    gold = ["Paris, France", "Paris", "the city of light"]
    assert exact_match("paris", gold) == 1.0
    assert token_f1("Paris is nice", gold) == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("city of light", gold) == 1.0


def test_empty_prediction_and_empty_gold() -> None:
    assert token_f1("", "cat") == 0.0
    assert exact_match("", "cat") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("cat", []) == 0.0


def test_p99_and_recall() -> None:
    assert p99(list(range(1, 101))) == pytest.approx(99.01)  # linear interpolation
    assert p99([5.0]) == 5.0
    assert math.isnan(p99([]))
    assert doc_recall(["a", "b"], ["b"]) == 1.0
    assert doc_recall(["a"], ["b", "a"]) == 0.5
    assert doc_recall(["a"], None) is None


def _row(method, kc, k, f1, ttft, recall=None, active=10):
    return dict(method=method, kc=kc, k=k, f1=f1, em=0.0, recall=recall, ttft_ms=ttft,
                active_tokens=active)  # fmt: skip


def test_aggregate_and_best_under_budget() -> None:
    rows = [
        _row("coinrag", 2, 5, 0.2, 40.0, recall=1.0),
        _row("coinrag", 2, 5, 0.4, 60.0, recall=0.0),
        _row("coinrag", 4, 10, 0.5, 90.0),
        _row("coinrag", 8, 20, 0.7, 300.0),
        _row("turborag", 4, 0, 0.6, 150.0),
    ]
    results = aggregate(rows)
    by = {(r["method"], r["kc"], r["k"]): r for r in results.to_pylist()}
    assert by[("coinrag", 2, 5)]["f1"] == pytest.approx(0.3)
    assert by[("coinrag", 2, 5)]["recall"] == pytest.approx(0.5)
    assert by[("coinrag", 4, 10)]["recall"] is None
    assert by[("coinrag", 2, 5)]["ttft_mean_ms"] == pytest.approx(50.0)
    assert by[("coinrag", 2, 5)]["ttft_p99_ms"] == pytest.approx(40 + 0.99 * 20)
    assert by[("coinrag", 2, 5)]["n"] == 2

    table = best_under_budget(results, [30.0, 100.0, 1000.0])
    got = {(r["method"], r["budget_ms"]): r for r in table.to_pylist()}
    assert got[("coinrag", 30.0)]["f1"] is None and got[("coinrag", 30.0)]["kc"] is None
    assert (got[("coinrag", 100.0)]["kc"], got[("coinrag", 100.0)]["k"]) == (4, 10)
    assert got[("coinrag", 100.0)]["f1"] == pytest.approx(0.5)
    assert got[("coinrag", 1000.0)]["f1"] == pytest.approx(0.7)
    assert got[("turborag", 100.0)]["f1"] is None
    assert got[("turborag", 1000.0)]["f1"] == pytest.approx(0.6)
    assert table.num_rows == 6


# ---------------------------------------------------------------------------- questions


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"answers": ["x"]}', "'question' must be a non-empty string"),
        ('{"question": "  ", "answers": ["x"]}', "'question' must be a non-empty string"),
        ('{"question": "q?"}', "'answers' must be a non-empty list"),
        ('{"question": "q?", "answers": []}', "'answers' must be a non-empty list"),
        ('{"question": "q?", "answers": "x"}', "'answers' must be a non-empty list"),
        ('{"question": "q?", "answers": ["x"], "doc_ids": "d"}', "'doc_ids' must be a list"),
    ],
)
def test_question_validation_names_the_line(tmp_path, line, message) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "ok?", "answers": ["yes"]}\n\n' + line + "\n")
    with pytest.raises(QuestionsError, match=rf"q\.jsonl:3: {message}"):
        load_questions(path)


def test_questions_load_and_empty_file(tmp_path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "ok?", "answers": ["yes"], "doc_ids": ["d1"]}\n')
    (q,) = load_questions(path)
    assert (q.question, q.answers, q.doc_ids, q.line) == ("ok?", ["yes"], ["d1"], 1)
    path.write_text("\n")
    with pytest.raises(QuestionsError, match="no questions"):
        load_questions(path)
    with pytest.raises(QuestionsError, match="no such questions file"):
        load_questions(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------- end to end

DOCS = [
    ("lakes", "Lake Baikal in Siberia is the deepest lake in the world. It holds about one fifth "
     "of the unfrozen fresh water on Earth. The lake is home to the Baikal seal."),
    ("volcano", "Mount Etna is an active volcano on the east coast of Sicily. It is the tallest "
     "active volcano in Europe outside the Caucasus. Its eruptions are frequent."),
    ("bridge", "The Golden Gate Bridge spans the strait between San Francisco Bay and the Pacific "
     "Ocean. It opened in 1937. Its towers are painted international orange."),
    ("tea", "Darjeeling tea is grown in the hills of West Bengal in India. The first flush is "
     "picked in spring. It is often called the champagne of teas."),
]  # fmt: skip
QUESTIONS = [
    {"question": "What is the deepest lake in the world?", "answers": ["Lake Baikal"],
     "doc_ids": ["lakes"]},
    {"question": "When did the Golden Gate Bridge open?", "answers": ["1937"],
     "doc_ids": ["bridge"]},
    {"question": "Where is Darjeeling tea grown?", "answers": ["West Bengal", "India"]},
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")  # build_flow needs the Prefect API
@pytest.mark.heavy  # over 5 s: the second tier
def test_evaluate_end_to_end(tmp_path: Path) -> None:
    from coinrag.flows.build import build_flow

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in DOCS))
    store = tmp_path / "store"
    build_flow(str(src), str(store), {"extractor": "rules"})
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "eval"

    results = evaluate(
        store, questions, out, sweep=[(1, 2), (2, 3)], max_new_tokens=4,
        budgets_ms=(1e-6, math.inf), quiet=True,
    )  # fmt: skip

    # coinrag per (kc, k); turborag and standard once per kc with k = 0
    expected = {("coinrag", 1, 2), ("coinrag", 2, 3), ("turborag", 1, 0), ("turborag", 2, 0),
                ("standard", 1, 0), ("standard", 2, 0)}  # fmt: skip
    on_disk = pq.read_table(out / "results.parquet")
    assert on_disk.equals(results)
    assert results.column_names == [
        "dataset", "model", "method", "retrieval", "kc", "k", "f1", "em", "recall",
        "ttft_mean_ms", "ttft_p99_ms", "active_tokens", "n",
    ]  # fmt: skip
    assert set(results.column("retrieval").to_pylist()) == {"hybrid"}  # the store's default
    rows = results.to_pylist()
    assert {(r["method"], r["kc"], r["k"]) for r in rows} == expected
    assert all(r["n"] == 3 and r["ttft_p99_ms"] >= r["ttft_mean_ms"] > 0 for r in rows)
    assert all(0.0 <= r["f1"] <= 1.0 and 0.0 <= r["recall"] <= 1.0 for r in rows)
    by = {(r["method"], r["kc"]): r for r in rows}
    # coinrag uses nugget slices of the same chunks: never more context than turborag
    assert by[("coinrag", 2)]["active_tokens"] <= by[("turborag", 2)]["active_tokens"]
    assert by[("standard", 2)]["active_tokens"] == by[("turborag", 2)]["active_tokens"]
    # turborag and standard share one retrieval: same recall
    assert by[("standard", 1)]["recall"] == by[("turborag", 1)]["recall"]

    per_q = pq.read_table(out / "per_question.parquet")
    assert per_q.num_rows == 3 * len(expected)
    for col in ("question", "answer", "gold", "f1", "em", "recall", "ttft_ms", "timings",
                "active_tokens", "evidence_doc_ids"):  # fmt: skip
        assert col in per_q.column_names
    third = [r for r in per_q.to_pylist() if r["qid"] == 2]
    assert all(r["recall"] is None for r in third)  # no gold doc ids
    assert all(dict(r["timings"])["ttft"] == r["ttft_ms"] for r in per_q.to_pylist())

    budgets = pq.read_table(out / "best_under_budget.parquet")
    assert budgets.num_rows == 3 * 2
    table = budgets.to_pylist()
    assert all(r["f1"] is None for r in table if r["budget_ms"] < 1)
    assert all(r["f1"] is not None for r in table if math.isinf(r["budget_ms"]))
    for name in ("f1_vs_p99_ttft.png", "f1_vs_active_tokens.png"):
        assert (out / name).stat().st_size > 1000
    assert isinstance(results, pa.Table)


# ---------------------------------------------------------------------------- retrieval only


@pytest.mark.usefixtures("prefect_harness")  # build_flow needs the Prefect API
@pytest.mark.heavy  # over 5 s: the second tier
def test_retrieval_only_on_a_store_without_kv(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from coinrag.flows.build import build_flow
    from coinrag.flows.cli import app
    from coinrag.inference.evaluation.retrieval_only import evaluate_retrieval
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.storage.store import Store

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in DOCS))
    store = tmp_path / "store"
    build_flow(str(src), str(store), {"extractor": "rules", "kv": False})
    assert not (store / "kv").exists() or not any((store / "kv").iterdir())
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "retrieval"

    results = evaluate_retrieval(store, questions, out, kcs=(1, 2), ks=(2,))

    modes = ("dense", "lexical", "hybrid")
    rows = {(r["retrieval"], r["evidence"], r["kc"], r["k"]): r for r in results.to_pylist()}
    assert set(rows) == {
        (m, *key)
        for m in modes
        for key in (("chunks", 1, 0), ("chunks", 2, 0), ("two_stage", 1, 2), ("two_stage", 2, 2),
                    ("one_stage", 0, 2))
    }  # fmt: skip
    assert all(r["n"] == 2 for r in rows.values())  # the question without gold ids is left out
    # hits and recall recomputed by hand from the retriever, for every question and mode
    retriever = Retriever(Store.at(store), load_embedder("minilm"))
    gold = [q for q in QUESTIONS if "doc_ids" in q]
    for mode in modes:
        for kc in (1, 2):
            found = [
                [e.doc_id for e in retriever.chunks_only(q["question"], kc, mode=mode).evidence]
                for q in gold
            ]
            recall = [doc_recall(f, q["doc_ids"]) for f, q in zip(found, gold, strict=True)]
            hit = [any(d in q["doc_ids"] for d in f) for f, q in zip(found, gold, strict=True)]
            row = rows[(mode, "chunks", kc, 0)]
            assert row["recall"] == pytest.approx(sum(recall) / len(recall))
            assert row["hit"] == pytest.approx(sum(hit) / len(hit))
        assert rows[(mode, "chunks", 2, 0)]["hit"] >= rows[(mode, "chunks", 1, 0)]["hit"]
    assert all(0.0 <= r["mrr"] <= 1.0 for r in rows.values())  # every mode has its MRR
    per_q = pq.read_table(out / "retrieval_per_question.parquet").to_pylist()
    # two-stage evidence never leaves the chosen chunks' documents
    chunk_docs = {(r["retrieval"], r["qid"], r["kc"]): set(r["evidence_doc_ids"]) for r in per_q
                  if r["evidence"] == "chunks"}  # fmt: skip
    for r in per_q:
        if r["evidence"] == "two_stage":
            assert set(r["evidence_doc_ids"]) <= chunk_docs[(r["retrieval"], r["qid"], r["kc"])]
    assert pq.read_table(out / "retrieval.parquet").equals(results)
    lineage = json.loads((out / "eval_run.json").read_text())
    assert lineage["retrievals"] == list(modes) and lineage["kind"] == "retrieval"
    assert lineage["published"]["index"]["versions"]  # the index versions the numbers read
    # nothing chosen for this store, which has nuggets: the default for an index with nuggets
    weight = HYBRID_DENSE_WEIGHT_WITH_NUGGETS
    assert lineage["fusion"] == {"method": FUSION_METHOD, "dense_weight": weight}

    runner = CliRunner()
    ok = runner.invoke(app, ["eval", str(questions), "--store", str(store), "--out",
                             str(tmp_path / "cli"), "--retrieval-only", "--kc", "1"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "two_stage" in ok.output
    assert all(m in ok.output for m in modes)  # the three modes side by side
    one = runner.invoke(app, ["eval", str(questions), "--store", str(store), "--out",
                              str(tmp_path / "cli1"), "--retrieval-only", "--kc", "1",
                              "--retrieval", "lexical"])  # fmt: skip
    assert one.exit_code == 0, one.output
    written = pq.read_table(tmp_path / "cli1" / "retrieval.parquet")
    assert set(written.column("retrieval").to_pylist()) == {"lexical"}
    bad = runner.invoke(app, ["eval", str(questions), "--store", str(store), "--out",
                              str(tmp_path / "cli2"), "--retrieval-only",
                              "--retrieval", "fuzzy"])  # fmt: skip
    assert bad.exit_code == 2 and "fuzzy" in bad.output
    missing = runner.invoke(app, ["eval", str(questions), "--store", str(tmp_path / "nope"),
                                  "--out", str(tmp_path / "x"), "--retrieval-only"])  # fmt: skip
    assert missing.exit_code == 1
    # without KV, the generation methods say what is missing
    no_kv = runner.invoke(app, ["eval", str(questions), "--store", str(store), "--out",
                                str(tmp_path / "y"), "--limit", "1"])  # fmt: skip
    assert no_kv.exit_code == 1
    assert "no KV" in no_kv.output
    # the engine loads only what the methods asked for need: standard RAG needs no KV
    standard = runner.invoke(app, ["eval", str(questions), "--store", str(store), "--out",
                                   str(tmp_path / "s"), "--limit", "1", "--methods", "standard",
                                   "--max-new-tokens", "2", "--retrieval", "dense",
                                   "lexical"])  # fmt: skip
    assert standard.exit_code == 0, standard.output
    results = pq.read_table(tmp_path / "s" / "results.parquet")
    assert results.column("method").to_pylist() == ["standard", "standard"]
    assert results.column("retrieval").to_pylist() == ["dense", "lexical"]  # compared side by side
    assert "standard (lexical)" in standard.output  # labelled by mode when several run
    assert json.loads((tmp_path / "s" / "eval_run.json").read_text())["retrievals"] == [
        "dense",
        "lexical",
    ]
    table3 = pq.read_table(tmp_path / "s" / "table3.parquet")
    assert set(table3.column("retrieval").to_pylist()) == {"dense", "lexical"}

    # the same store rebuilt without nuggets (extractor none): only the chunks mode runs
    build_flow(str(src), str(store), {"extractor": "none", "kv": False})
    only_chunks = evaluate_retrieval(
        store, questions, tmp_path / "r2", kcs=(2,), ks=(2,), retrievals=("dense",)
    )
    assert only_chunks.column("evidence").to_pylist() == ["chunks"]
    assert only_chunks.column("recall").to_pylist() == [rows[("dense", "chunks", 2, 0)]["recall"]]
