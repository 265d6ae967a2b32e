"""``coinrag train fusion --generated N`` end to end: the local question generator (the packaged
SmolLM2) writes questions about chunks of the fusion and report pages only, each question's gold
page is its chunk's, the calls are cached in the store (a second run makes none), the weight is
chosen on those questions and published with the index version, and the run records what it
asked. ``coinrag train retriever --generated N``: the generator's questions about chunks of the
retriever pages only become training pairs, recorded in the run and the embedder's lineage."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.tables import RunRow, SelfStudyCallRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.generated_questions import (
    MIN_CHUNK_CHARS,
    QUESTIONS_PER_CHUNK,
    chunks_to_ask,
)
from coinrag.tasks.retrieval.fusion import page_split

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _page_ids() -> dict[str, list[str]]:
    """Page ids of each split (``page_split`` is a hash of the id): the first few of each."""
    found: dict[str, list[str]] = {"fusion": [], "report": [], "retriever": []}
    i = 0
    while min(len(v) for v in found.values()) < 2:
        name = f"topic-{i}"
        found[page_split(name)].append(name)
        i += 1
    return {k: v[:2] for k, v in found.items()}


def _split_store(tmp_path, sample_corpus):
    """A store (no nuggets, no KV) of long sample texts under page ids of every split."""
    from coinrag.flows.build import build_flow

    texts = [json.loads(line)["text"] for line in sample_corpus.read_text().splitlines()]
    long_texts = [t for t in texts if len(t) >= MIN_CHUNK_CHARS]
    pages = _page_ids()
    ids = [i for split in ("fusion", "report", "retriever") for i in pages[split]]
    src = tmp_path / "docs.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": i, "text": t}) + "\n"
            for i, t in zip(ids, long_texts[: len(ids)], strict=True)
        ),
        encoding="utf-8",
    )
    store = tmp_path / "store"
    build_flow(str(src), str(store), {"extractor": "none", "kv": False})
    return store


def test_fusion_chosen_on_generated_questions(tmp_path, sample_corpus, prefect_harness):
    store = _split_store(tmp_path, sample_corpus)
    st = Store.at(store)
    index = LanceIndex.open(st)
    asked = chunks_to_ask(index, 3)
    assert len(asked) == 3 and {page_split(r["doc_id"]) for r in asked} <= {"fusion", "report"}

    runner = CliRunner()  # (--generator's checks: tests/flows/test_train_generator_options.py)
    args = ["train", "fusion", "--store", str(store), "--generated", "3", "--generator", "local"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    record = json.loads(first.stdout[first.stdout.index("{") :])
    assert record["chosen_on"] == "generated questions" and record["method"] == "dbsf-convex-v1"
    assert record["questions"] > 0  # on the fusion pages' chunks
    assert st.published()["index"]["fusion"]["dense_weight"] == record["dense_weight"]
    assert st.published()["index"]["fusion"]["page_support"] == record["page_support"]
    assert record["question_generator_fp"].startswith("qgen-")

    calls = read_rows(st, SelfStudyCallRow)
    assert len(calls) == 3 and all(c.seed_type == "question" for c in calls)
    assert {c.doc_id for c in calls} == {r["doc_id"] for r in asked}
    run = next(r for r in read_rows(st, RunRow) if r.run_id == record["run_id"])
    counts = json.loads(run.counts_json)
    assert counts["asked_chunks"] == 3
    assert 0 < counts["generated_questions"] <= 3 * QUESTIONS_PER_CHUNK

    # A second run asks nothing again: the same questions, the same weight.
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert len(read_rows(st, SelfStudyCallRow)) == 3
    record2 = json.loads(again.stdout[again.stdout.index("{") :])
    assert record2["dense_weight"] == record["dense_weight"]
    assert record2["questions"] == record["questions"]


def test_retriever_trained_on_generated_questions(tmp_path, sample_corpus, prefect_harness):
    from coinrag.flows.retriever import train_retriever_flow
    from coinrag.inference.retrieval.embedders import LINEAGE_FILE
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.schemas.training_settings import CartridgeSettings
    from coinrag.tasks.generated_questions import generated_questions
    from coinrag.tasks.question_generators.factory import make_generator

    store = _split_store(tmp_path, sample_corpus)
    st = Store.at(store)
    out = tmp_path / "adapted"
    tiny = {"max_pairs": 8, "batch_size": 4, "max_minutes": 1.0, "query_max_length": 24,
            "passage_max_length": 48, "generated_chunks": 2, "generator": "local"}  # fmt: skip
    summary = train_retriever_flow(str(store), str(out), settings=tiny, reembed=False)
    counts = summary["counts"]
    assert counts["asked_chunks"] == 2 and counts["generated_questions"] > 0
    assert 0 < counts["generated_pairs"] <= counts["generated_questions"]
    calls = read_rows(st, SelfStudyCallRow)
    assert len(calls) == 2 and {page_split(c.doc_id) for c in calls} == {"retriever"}
    lineage = json.loads((out / LINEAGE_FILE).read_text())
    assert lineage["question_generator_fp"].startswith("qgen-")
    assert lineage["pair_counts"]["generated_pairs"] == counts["generated_pairs"]
    run = next(r for r in read_rows(st, RunRow) if r.run_id == summary["run_id"])
    assert json.loads(run.parameters_json)["settings"]["generated_chunks"] == 2
    assert json.loads(run.fingerprints_json)["question_generator_fp"].startswith("qgen-")

    # Each generated question is paired with the chunk it was asked about: asked again as the
    # flow asks (the same generator settings), every call is cached and each passage is the
    # text of one of the chunks asked about.
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    asker = make_generator(
        CartridgeSettings(model=settings.model, device=settings.device, generator="local",
                          n_questions=QUESTIONS_PER_CHUNK),
        settings.model,
    )  # fmt: skip
    index = LanceIndex.open(st)
    made = generated_questions(st, index, asker, 2, "again", 0, splits=("retriever",))
    assert made.counts.cached == 2 and len(read_rows(st, SelfStudyCallRow)) == 2
    texts = {r["text"] for r in chunks_to_ask(index, 2, 0, ("retriever",))}
    assert made.questions and {q.passage for q in made.questions} <= texts
