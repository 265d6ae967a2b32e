"""``train retriever`` and ``train fusion`` end to end on the sample corpus: a tiny fine-tune of
the packaged MiniLM on the store's nugget pairs writes a new embedder folder (another
fingerprint, its lineage), the index is re-embedded and published with it, the fusion is chosen
again for it, queries use it, and an incremental build keeps it (embedding only what is new)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_fixtures import held_and_retriever_pages

from coinrag.inference.retrieval.embedders import LINEAGE_FILE, load_embedder
from coinrag.inference.retrieval.retriever import Retriever, dense_weight
from coinrag.storage.index.lance import EmbedderMismatch, LanceIndex
from coinrag.storage.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]
EVALUATION = REPO / "infra" / "python_natural_questions.jsonl"
TINY = {
    "max_pairs": 16,
    "batch_size": 4,
    "max_minutes": 2.0,
    "query_max_length": 24,
    "passage_max_length": 48,
    "lr": 1e-4,
    "adopt": "always",  # the guard's own test is below
}


def test_train_retriever_end_to_end(tmp_path, sample_corpus, prefect_harness):
    from coinrag.flows.build import build_flow
    from coinrag.flows.retriever import store_embedder, train_retriever_flow, tune_fusion_flow
    from coinrag.inference.retrieval.fusion import SUPPORT_GRID
    from coinrag.inference.retrieval.rerank import PageSupport, recorded_support

    docs = sample_corpus.read_text(encoding="utf-8").splitlines(True)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(docs[:10]))
    store = tmp_path / "store"
    build_flow(str(src), str(store), {"extractor": "rules", "kv": False})
    st = Store.at(store)
    base_fp = LanceIndex.open(st).embedder_fp

    # The fusion alone: chosen on the store's nuggets, published with the index version.
    fusion = tune_fusion_flow(str(store), [str(EVALUATION)])
    assert fusion["embedder_fp"] == base_fp and fusion["questions"] > 0
    assert st.published()["index"]["fusion"]["dense_weight"] == fusion["dense_weight"]
    # ... with rerank = support's page support share, chosen and confirmed the same way.
    assert fusion["page_support"] in SUPPORT_GRID
    assert fusion["page_support_method"] == PageSupport.method
    assert set(fusion["page_support_held_out"]) == {"chosen", "default"}
    assert recorded_support(LanceIndex.open(st)) == fusion["page_support"]

    out = tmp_path / "adapted"
    summary = train_retriever_flow(str(store), str(out), [str(EVALUATION)], settings=TINY)
    new_fp = summary["embedder_fp"]
    assert summary["adopted"] and "guard" not in summary
    assert summary["base_embedder_fp"] == base_fp != new_fp
    assert summary["counts"]["pairs"] > 0 and summary["counts"]["steps"] > 0
    lineage = json.loads((out / LINEAGE_FILE).read_text())
    assert lineage["base_embedder_fp"] == base_fp and lineage["run_id"] == summary["run_id"]
    assert lineage["exclude_questions"][0]["path"] == str(EVALUATION)
    assert load_embedder(out).fingerprint == new_fp

    # The index is the new embedder's, published with a fusion chosen for its vectors.
    index = LanceIndex.open(st)
    assert index.embedder_fp == new_fp
    assert st.published()["index"]["fusion"]["embedder_fp"] == new_fp
    assert dense_weight(index) == summary["fusion"]["dense_weight"]
    assert st.read_toml()["build"]["embedder"] == str(out)

    # Queries embed with it; the base embedder is refused.
    embedder = store_embedder(st)
    assert embedder.fingerprint == new_fp
    result = Retriever(st, embedder).two_stage("Who directed the film 2001?", kc=2, k=4)
    assert result.chunks and result.evidence
    with pytest.raises(EmbedderMismatch):
        Retriever(st, load_embedder())

    # An incremental build with the default embedder setting keeps the adapted one: only the
    # new document's texts are embedded, the fusion stays.
    src.write_text("".join(docs[:11]))
    again = build_flow(str(src), str(store), {"extractor": "rules", "kv": False})
    assert LanceIndex.open(st).embedder_fp == new_fp
    assert 0 < again["embedded"] < summary["build"]["embedded"]
    assert st.published()["index"]["fusion"]["embedder_fp"] == new_fp


def test_guard_keeps_the_stores_embedder_when_the_adapted_one_finds_less(
    tmp_path, sample_corpus, prefect_harness
):
    """A fine-tune at an absurd learning rate (0.5: AdamW moves every weight by about that)
    wrecks the encoder; the guard asks both embedders the held-out pages' nuggets (each asked of
    its page's other chunks: 64-token chunks; 7 of the 10 pages held out) and keeps the store's
    embedder: nothing is re-embedded, the store's settings, index and fusion are as they were,
    and the run records the judgment."""
    from coinrag.flows.build import build_flow
    from coinrag.flows.retriever import train_retriever_flow
    from coinrag.schemas.tables import RunRow
    from coinrag.storage.tables import read_rows

    texts = [json.loads(line)["text"] for line in sample_corpus.read_text().splitlines()]
    texts = [t for t in texts if len(t.split()) >= 40][:10]
    held, trained = held_and_retriever_pages(7, 3)
    src = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(held + trained, texts, strict=True)
    ]
    src.write_text("".join(lines))
    store = tmp_path / "store"
    build_flow(str(src), str(store), {"extractor": "rules", "kv": False, "chunk_size": 64})
    st = Store.at(store)
    before = (LanceIndex.open(st).embedder_fp, st.read_toml()["build"], st.published()["index"])

    wrecking = {**TINY, "adopt": "if-better", "lr": 0.5, "max_pairs": 32}
    out = tmp_path / "wrecked"
    summary = train_retriever_flow(str(store), str(out), [str(EVALUATION)], settings=wrecking)
    guard = summary["guard"]
    assert summary["adopted"] is False and not guard["adopted"]
    assert guard["questions"] > 0 and guard["adapted"]["mrr"] < guard["base"]["mrr"], guard
    assert "build" not in summary and "fusion" not in summary
    assert "reembed_seconds" not in summary["counts"] and summary["counts"]["guard_seconds"] >= 0
    after = (LanceIndex.open(st).embedder_fp, st.read_toml()["build"], st.published()["index"])
    assert after == before
    assert load_embedder(out).fingerprint == summary["embedder_fp"]  # the folder is written
    statuses = [r.status for r in read_rows(st, RunRow) if r.run_id == summary["run_id"]]
    assert "completed" in statuses, statuses
