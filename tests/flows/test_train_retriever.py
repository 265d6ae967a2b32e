"""``train retriever`` and ``train fusion`` end to end on the sample corpus: a tiny fine-tune of
the packaged MiniLM on the store's nugget pairs writes a new embedder folder (another
fingerprint, its lineage), the index is re-embedded and published with it, the fusion is chosen
again for it, queries use it, and an incremental build keeps it (embedding only what is new)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
}


def test_train_retriever_end_to_end(tmp_path, sample_corpus, prefect_harness):
    from coinrag.flows.build import build_flow
    from coinrag.flows.retriever import store_embedder, train_retriever_flow, tune_fusion_flow

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

    out = tmp_path / "adapted"
    summary = train_retriever_flow(str(store), str(out), [str(EVALUATION)], settings=TINY)
    new_fp = summary["embedder_fp"]
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
