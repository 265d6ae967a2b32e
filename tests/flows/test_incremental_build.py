"""Incremental builds, counted: an edit, a new document and each producer change redo exactly
what depends on them. Real Prefect harness, real files, real (tiny) models, and the OpenAI path
against the local fake endpoint so that every LLM request is counted at the network edge."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
from fake_openai_server import FakeOpenAI
from store_fixtures import sample_docs, save_tiny_llama, write_corpus

from coinrag.flows.build import build_flow
from coinrag.schemas.keys import text_hash
from coinrag.schemas.tables import ChunkRow, EmbeddingRow, KvManifestRow, NuggetRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.embed import nugget_text
from coinrag.tasks.extractors.factory import make_extractor

pytestmark = pytest.mark.usefixtures("one_torch_thread", "prefect_harness")

API_KEY = "sk-test-incremental-0123456789"


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer) -> tuple[Path, Path]:
    """Two tiny generation models sharing SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return (
        save_tiny_llama(root / "llama-a", smollm2_tokenizer, seed=0),
        save_tiny_llama(root / "llama-b", smollm2_tokenizer, seed=1),
    )


@pytest.fixture()
def fake(monkeypatch):
    with FakeOpenAI(api_key=API_KEY) as server:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        make_extractor.cache_clear()
        yield server
        make_extractor.cache_clear()


def run_rows(st: Store, record: type, run_id: str) -> list:
    return read_rows(st, record, filter=pc.field("run_id") == run_id)


def index_rows(st: Store, table: str, columns: list[str]) -> list[dict]:
    return LanceIndex.open(st).columns(table, columns).to_pylist()


def test_edit_and_new_document_redo_only_their_own_work(tmp_path, sample_corpus, models, fake):
    docs = sample_docs(sample_corpus, 4)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    store = tmp_path / "store"
    st = Store.at(store)
    settings = {"extractor": "openai", "llm_model": "fake-a", "model": str(models[0])}
    settings |= {"chunk_size": 64}
    first = build_flow(str(src), str(store), settings)
    chunks1 = read_rows(st, ChunkRow)
    texts1 = {c.text_hash for c in chunks1}
    assert len(fake.chat_requests()) == first["llm_calls"] == len(texts1) > 4
    assert first["kv_computed"] == len({c.content_key for c in chunks1})

    # Unchanged: no work at all, and nothing is rewritten.
    again = build_flow(str(src), str(store), settings)
    assert len(fake.chat_requests()) == len(texts1)
    for key in ("documents_new", "chunks_new", "extract_requested", "llm_calls", "nuggets_exact"):
        assert again[key] == 0, key
    assert again["kv_computed"] == again["embedded"] == 0
    assert again["kv_reused"] == first["kv_computed"]
    for record in (ChunkRow, NuggetRow, KvManifestRow, EmbeddingRow):
        assert run_rows(st, record, again["run_id"]) == [], record

    # Edit the end of one document: only its chunks are cut, only its new texts go to the LLM,
    # only its new content gets KV and vectors; other documents' index rows are not rewritten.
    edited = docs[1]["id"]
    docs[1] = {**docs[1], "text": docs[1]["text"] + " This closing sentence came with an edit."}
    write_corpus(src, docs)
    before_calls = len(fake.chat_requests())
    keys_before = {c.content_key for c in read_rows(st, ChunkRow)}
    third = build_flow(str(src), str(store), settings)
    new_chunks = run_rows(st, ChunkRow, third["run_id"])
    assert {c.doc_id for c in new_chunks} == {edited}
    assert third["chunks_new"] == len(new_chunks) > 1
    new_texts = {c.text_hash for c in new_chunks} - texts1
    calls = fake.chat_requests()[before_calls:]
    assert third["extract_requested"] == len(calls) == len(new_texts) >= 1
    for request in calls:  # every passage sent is a piece of the edited document
        passage = request.json["messages"][-1]["content"].split("<<<")[1].split(">>>")[0]
        assert passage.strip() and passage.strip() in docs[1]["text"]
    new_keys = {c.content_key for c in new_chunks} - keys_before
    assert third["kv_computed"] == len(new_keys) < len(new_chunks)  # earlier chunks: same KV
    assert {r.content_key for r in run_rows(st, KvManifestRow, third["run_id"])} == new_keys
    embedded = run_rows(st, EmbeddingRow, third["run_id"])
    assert third["embedded"] == len(embedded) > 0
    others = [r for r in index_rows(st, "chunks", ["doc_id", "run_id"]) if r["doc_id"] != edited]
    assert others and {r["run_id"] for r in others} == {first["run_id"]}
    # The published full-text index has the edit's words (nuggets are searched the same way).
    hits = LanceIndex.open(st).search_text("chunks", "closing sentence came with an edit", 1)
    assert hits[0]["doc_id"] == edited and "came with an edit" in hits[0]["text"]

    # A new document: the same, for it alone.
    extra = sample_docs(sample_corpus, 5)[4]
    write_corpus(src, [*docs, extra])
    before_calls = len(fake.chat_requests())
    keys_before = {c.content_key for c in read_rows(st, ChunkRow)}
    texts_before = {c.text_hash for c in read_rows(st, ChunkRow)}
    fourth = build_flow(str(src), str(store), settings)
    added = run_rows(st, ChunkRow, fourth["run_id"])
    assert fourth["documents_new"] == 1 and {c.doc_id for c in added} == {extra["id"]}
    assert fourth["chunks_new"] == len(added)
    assert fourth["llm_calls"] == len(fake.chat_requests()) - before_calls
    assert fourth["llm_calls"] == len({c.text_hash for c in added} - texts_before) > 0
    assert fourth["kv_computed"] == len({c.content_key for c in added} - keys_before)
    assert fourth["embedded"] == len(run_rows(st, EmbeddingRow, fourth["run_id"])) > 0
    index_docs = {
        r["doc_id"]: r["run_id"] for r in index_rows(st, "documents", ["doc_id", "run_id"])
    }
    assert index_docs[extra["id"]] == fourth["run_id"] and index_docs[edited] == third["run_id"]
    assert len(index_docs) == 5


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
def test_producer_changes_invalidate_exactly_their_dependents(
    tmp_path, sample_corpus, models, fake
):
    from test_index_retrieval import _save_tiny

    from coinrag.inference.retrieval.embedders import load_embedder

    src = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    store = tmp_path / "store"
    st = Store.at(store)
    base = {"extractor": "rules", "model": str(models[0]), "chunk_size": 64}
    first = build_flow(str(src), str(store), base)
    chunks = read_rows(st, ChunkRow)
    n_texts, n_keys = len({c.text_hash for c in chunks}), len({c.content_key for c in chunks})
    assert first["kv_computed"] == n_keys and first["extract_ok"] == n_texts

    # A new extractor fingerprint: extraction, nuggets and the new nuggets' vectors only.
    cache_before = {r.text_hash for r in read_rows(st, EmbeddingRow)}
    s2 = base | {"extractor": "openai", "llm_model": "fake-a"}
    second = build_flow(str(src), str(store), s2)
    assert second["chunks_new"] == 0 and second["kv_computed"] == 0
    assert second["kv_reused"] == n_keys
    assert second["llm_calls"] == len(fake.chat_requests()) == n_texts
    nuggets = run_rows(st, NuggetRow, second["run_id"])
    assert second["nuggets_exact"] + second["nuggets_fuzzy"] == len(nuggets) > 0
    new_nugget_texts = {text_hash(nugget_text(n)) for n in nuggets} - cache_before
    written = {r.text_hash for r in run_rows(st, EmbeddingRow, second["run_id"])}
    assert second["embedded"] == len(written) == len(new_nugget_texts) > 0
    assert written == new_nugget_texts  # no chunk or document text was embedded again
    assert {r["run_id"] for r in index_rows(st, "chunks", ["run_id"])} == {first["run_id"]}

    # A new generation model with the same tokenizer: KV only.
    s3 = s2 | {"model": str(models[1])}
    third = build_flow(str(src), str(store), s3)
    assert third["kv_computed"] == n_keys and third["kv_reused"] == 0
    for key in ("chunks_new", "extract_requested", "llm_calls", "nuggets_exact", "embedded"):
        assert third[key] == 0, key
    assert len(list((store / "kv").glob("kv-*"))) == 2  # the first model's KV is kept

    # A new embedder (a tiny random BGE-M3-style encoder): vectors only.
    tiny = _save_tiny(tmp_path / "tiny-bge-m3", load_embedder("minilm"), "xlm-roberta")
    s4 = s3 | {"embedder": str(tiny)}
    fourth = build_flow(str(src), str(store), s4)
    for key in ("chunks_new", "extract_requested", "llm_calls", "nuggets_exact", "kv_computed"):
        assert fourth[key] == 0, key
    index = LanceIndex.open(st)
    assert index.dim == 32 and index.embedder_fp == load_embedder(tiny).fingerprint
    n_rows = index.count("chunks") + index.count("nuggets") + index.count("documents")
    texts = set(index.columns("chunks", ["text"]).column(0).to_pylist())
    texts |= {t.strip() for t in index.columns("nuggets", ["text"]).column(0).to_pylist()}
    assert fourth["embedded"] == len(run_rows(st, EmbeddingRow, fourth["run_id"]))
    assert len(texts) < fourth["embedded"] <= n_rows  # every distinct text once (+ documents)

    # A new chunk size: everything downstream of chunks, for the new content only.
    texts_before = {c.text_hash for c in read_rows(st, ChunkRow)}
    keys_before = {c.content_key for c in read_rows(st, ChunkRow)}
    calls_before = len(fake.chat_requests())
    fifth = build_flow(str(src), str(store), s4 | {"chunk_size": 96})
    new_chunks = run_rows(st, ChunkRow, fifth["run_id"])
    assert fifth["chunks_new"] == fifth["chunks"] == len(new_chunks)
    assert fifth["llm_calls"] == len(fake.chat_requests()) - calls_before
    assert fifth["llm_calls"] == len({c.text_hash for c in new_chunks} - texts_before) > 0
    assert fifth["kv_computed"] == len({c.content_key for c in new_chunks} - keys_before) > 0
    assert fifth["embedded"] > 0
    assert {r["chunk_id"] for r in index_rows(st, "chunks", ["chunk_id"])} == {
        c.chunk_id for c in new_chunks
    }
