"""Lexical (LanceDB full-text, BM25) and hybrid retrieval: the full-text index kept in step with
the tables through every change the store handles, the search modes, and their fusion.

Real LanceDB tables in temp dirs, written by the real embed stage; vectors come from a cheap
deterministic embedder (``HashEmbedder``) where only the lexical side is under test."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_index_retrieval import HashEmbedder, cut

from coinrag.inference.retrieval.normalise import MinMax
from coinrag.inference.retrieval.retriever import (
    FUSION_NORMALISER,
    HYBRID_DENSE_WEIGHT_WITH_NUGGETS,
    HYBRID_DEPTH,
    SEARCH_MODES,
    HybridSearch,
    Query,
    Retriever,
    relative_scores,
    search_mode,
)
from coinrag.schemas.settings import RETRIEVAL_MODES, BuildSettings, SettingsError
from coinrag.storage.index.lance import FTS_TABLES, ID_COLUMNS, LanceIndex, LexicalIndexMissing
from coinrag.storage.store import Store
from coinrag.tasks.embed import embed_stage
from coinrag.tasks.ingest import SourceDocument

MINMAX = MinMax()
NEW_WORD = "quetzalcoatlus"  # in no sample document
OLD_WORD = "xylophonist"


def _docs() -> list[SourceDocument]:
    texts = {
        "birds": "Penguins are flightless birds of the southern hemisphere. "
        f"A {OLD_WORD} once played for the penguins of Antarctica.",
        "rivers": "The Amazon river carries more water than any other river on Earth.",
        "volcanoes": "Mount Etna is an active stratovolcano on the east coast of Sicily.",
        "stars": "A neutron star is the collapsed core of a massive supergiant star.",
    }
    return [SourceDocument(k, v, {}, "test") for k, v in texts.items()]


def _lexical_docs(index: LanceIndex, word: str, table: str = "chunks") -> set[str]:
    return {r["doc_id"] for r in index.search_text(table, word, 10)}


@pytest.fixture()
def store_and_rows(tmp_path, smollm2_tokenizer):
    store = Store.at(tmp_path / "s").init()
    docs = _docs()
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    embed_stage(store, chunks, nuggets, docs, HashEmbedder(), "r1")
    return store, docs


def _fused(lists, weights=(0.75, 0.25), normaliser=MINMAX):
    scores = relative_scores(lists, weights, normaliser)
    return sorted(scores, key=lambda item: -scores[item])


def test_relative_score_fusion_by_hand():
    """Min-max normalisation (the rule before distribution-based; still a registered one)."""
    # dense 0.9, 0.5, 0.1 -> 1, 0.5, 0; lexical 12, 4 -> 1, 0 (any scale)
    scores = relative_scores([[("a", 0.9), ("b", 0.5), ("c", 0.1)], [("c", 12.0), ("a", 4.0)]],
                             [0.75, 0.25], MINMAX)  # fmt: skip
    assert scores == pytest.approx({"a": 0.75, "b": 0.375, "c": 0.25})
    # the lexical scores' scale does not matter, only their spread
    for rule in (MINMAX, FUSION_NORMALISER):
        scaled = relative_scores([[("a", 0.9), ("b", 0.5)], [("b", 1200.0), ("a", 400.0)]], [1, 1],
                                 rule)  # fmt: skip
        assert scaled == pytest.approx(
            relative_scores([[("a", 0.9), ("b", 0.5)], [("b", 1.2), ("a", 0.4)]], [1, 1], rule)
        )
        assert _fused([[("x", 2.0), ("y", 1.0)], []], normaliser=rule) == ["x", "y"]
    # a ranking of one row (or of equal scores): min-max gives it 1, dbsf 0.5 (its mean)
    lone = [[("p", 0.3)], [("q", 5.0)]]
    assert relative_scores(lone, [0.75, 0.25], MINMAX) == {"p": 0.75, "q": 0.25}
    assert relative_scores(lone, [0.75, 0.25], FUSION_NORMALISER) == {"p": 0.375, "q": 0.125}
    assert _fused([[("p", 1.0), ("q", 0.0)], [("q", 1.0), ("p", 0.0)]], [1, 1]) == ["p", "q"]
    # a strong lexical match lifts a chunk past a dense one it nearly ties with, not past one
    # dense is sure of
    near = [("d1", 0.80), ("d2", 0.79), ("d3", 0.40)]
    assert _fused([near, [("d2", 20.0), ("d3", 5.0)]])[0] == "d2"
    sure = [("d1", 0.80), ("d2", 0.50), ("d3", 0.40)]
    assert _fused([sure, [("d2", 20.0), ("d3", 5.0)]])[0] == "d1"


def test_modes_are_the_settings_modes():
    assert tuple(SEARCH_MODES) == RETRIEVAL_MODES
    assert search_mode(None).name == BuildSettings().retrieval == "hybrid"
    with pytest.raises(ValueError, match="'fuzzy' is not one of dense, lexical, hybrid"):
        search_mode("fuzzy")
    with pytest.raises(SettingsError, match="retrieval 'fuzzy'"):
        BuildSettings(retrieval="fuzzy").validate()


def test_build_creates_the_full_text_index(store_and_rows):
    store, _ = store_and_rows
    index = LanceIndex.open(store)
    for name in FTS_TABLES:
        assert index.has_text_index(name)
    assert not index.lacks_text_index()
    assert _lexical_docs(index, OLD_WORD) == {"birds"}
    assert _lexical_docs(index, OLD_WORD, "nuggets") <= {"birds"}
    # stemming: "rivers" finds "river"; stop words alone find nothing
    assert _lexical_docs(index, "Rivers") == {"rivers"}
    assert index.search_text("chunks", "the of and is", 5) == []


def test_edit_is_found_by_its_new_words_only(store_and_rows, smollm2_tokenizer):
    store, docs = store_and_rows
    published = LanceIndex.open_latest(store).published_state()
    edited = replace(docs[0], text=docs[0].text.replace(OLD_WORD, NEW_WORD))
    new_docs = [edited, *docs[1:]]
    chunks, nuggets = cut(smollm2_tokenizer, new_docs)
    embed_stage(store, chunks, nuggets, new_docs, HashEmbedder(), "r2")
    latest = LanceIndex.open_latest(store)
    assert _lexical_docs(latest, NEW_WORD) == {"birds"}
    assert _lexical_docs(latest, OLD_WORD) == set()
    assert _lexical_docs(latest, NEW_WORD, "nuggets") <= {"birds"}
    assert _lexical_docs(latest, OLD_WORD, "nuggets") == set()
    # A reader of the version published before the edit searches that version's words.
    before = LanceIndex(store, latest.meta, published["versions"])
    assert _lexical_docs(before, OLD_WORD) == {"birds"}
    assert _lexical_docs(before, NEW_WORD) == set()


def test_deleted_document_is_never_found_lexically(store_and_rows):
    store, _ = store_and_rows
    index = LanceIndex.open_latest(store)
    assert _lexical_docs(index, "Etna") == {"volcanoes"}
    index.delete_documents(["volcanoes"])
    assert _lexical_docs(index, "Etna") == set()
    assert _lexical_docs(index, "Etna", "nuggets") == set()
    # compaction, index merging and version pruning keep the index in step
    index.ensure_indexes()
    index.prune_versions()
    again = LanceIndex.open_latest(store)
    assert _lexical_docs(again, "Etna") == set()
    assert _lexical_docs(again, "Amazon") == {"rivers"}
    assert _lexical_docs(again, OLD_WORD) == {"birds"}


def test_an_index_without_full_text_is_refused_then_repaired(tmp_path, smollm2_tokenizer):
    store = Store.at(tmp_path / "s").init()
    docs = _docs()
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    emb = HashEmbedder()
    embed_stage(store, chunks, nuggets, docs, emb, "r1")
    index = LanceIndex.open_latest(store)
    for name in FTS_TABLES:  # as an index built before lexical search existed
        index.table(name).drop_index("search_text_idx")
    stale = LanceIndex.open_latest(store)
    assert stale.lacks_text_index()
    with pytest.raises(LexicalIndexMissing, match="run `coinrag build` on the store once"):
        stale.search_text("chunks", "Amazon", 3)
    assert Retriever(store, emb, stale, mode="dense").chunks_only("Amazon", 2).evidence
    counts = embed_stage(store, chunks, nuggets, docs, emb, "r2")  # an unchanged rebuild
    assert counts.chunks_written == counts.nuggets_written == 0
    assert "fts:search_text" in counts.indexes_built["chunks"]
    assert _lexical_docs(LanceIndex.open_latest(store), "Amazon") == {"rivers"}


def test_retriever_modes(store_and_rows):
    store, _ = store_and_rows
    emb = HashEmbedder()
    retriever = Retriever(store, emb, LanceIndex.open_latest(store), mode="lexical")
    question = f"Who played for the penguins, the {OLD_WORD}?"
    lexical = retriever.chunks_only(question, kc=2)
    assert lexical.mode == "lexical" and lexical.embed_ms == 0.0  # no embedding needed
    assert lexical.chunks[0].doc_id == "birds"
    dense = retriever.chunks_only(question, kc=2, mode="dense")
    assert dense.mode == "dense" and dense.embed_ms > 0.0
    hybrid = retriever.chunks_only(question, kc=4, mode="hybrid")
    # the fusion by hand over the two rankings (each of depth HYBRID_DEPTH)
    index = retriever.index
    dense_rows = HybridSearch.dense.rank(index, "chunks", Query(question, emb), HYBRID_DEPTH)
    d = [(r["chunk_id"], r["score"]) for r in dense_rows]
    assert d == [
        (h.chunk_id, h.score)
        for h in retriever.chunks_only(question, HYBRID_DEPTH, mode="dense").chunks
    ]
    lex = [(r["chunk_id"], r["score"]) for r in index.search_text("chunks", question, HYBRID_DEPTH)]
    w = HYBRID_DENSE_WEIGHT_WITH_NUGGETS  # nothing chosen for this index, which has nuggets
    scores = relative_scores([d, lex], [w, 1 - w])
    assert [h.chunk_id for h in hybrid.chunks] == sorted(scores, key=lambda c: -scores[c])[:4]
    assert [h.score for h in hybrid.chunks] == pytest.approx(sorted(scores.values())[::-1][:4])
    assert hybrid.chunks[0].doc_id == "birds"  # first in lexical, fused to the top
    # two-stage: nuggets inside the stage-1 chunks only, in every mode
    for mode in RETRIEVAL_MODES:
        res = retriever.two_stage(question, kc=1, k=3, mode=mode)
        assert res.mode == mode
        assert {e.chunk_id for e in res.evidence} <= {h.chunk_id for h in res.chunks}
        one = retriever.one_stage(question, k=3, mode=mode)
        # lexical finds only nuggets sharing a word with the question
        assert one.mode == mode and len(one.evidence) == (3 if mode != "lexical" else 2)
        docs = retriever.documents(question, 2, mode=mode)
        want = 2 if mode != "lexical" else 1  # only "birds" shares a word with the question
        assert len(docs) == want and len({r["doc_id"] for r in docs}) == want
    assert retriever.documents(question, 1, mode="lexical")[0]["doc_id"] == "birds"
    restricted = retriever.chunks_only(question, kc=3, doc_ids=["rivers"], mode="hybrid")
    assert {h.doc_id for h in restricted.chunks} == {"rivers"}


def test_a_reader_searches_small_tables_in_memory_exactly(store_and_rows):
    """A reader pinned to published versions keeps a small table (no ANN index) in memory: its
    exact cosine search returns LanceDB's flat search's rows and scores."""
    store, _ = store_and_rows
    emb = HashEmbedder()
    writer = LanceIndex.open_latest(store)
    reader = LanceIndex(store, writer.meta, writer.published_state()["versions"])
    for text in ("penguins of Antarctica", "a river on Earth", "collapsed core"):
        q = emb.embed_queries([text])[0]
        for table in ("chunks", "nuggets"):
            want = writer.search_vector(table, q, 5, embedder_fp=emb.fingerprint)
            got = reader.search_vector(table, q, 5, embedder_fp=emb.fingerprint)
            assert reader._flat(table) is not None and writer._flat(table) is None
            assert [r[ID_COLUMNS[table]] for r in got] == [r[ID_COLUMNS[table]] for r in want]
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)
            assert set(got[0]) == set(want[0])  # the same columns
