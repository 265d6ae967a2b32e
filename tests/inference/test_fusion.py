"""Hybrid fusion chosen per index: scoring weights (and ``rerank = support``'s page support
shares) on known-answer questions, the weight recorded with the index version (coinrag-index.json
and the published record) and read back by readers, kept by incremental builds, dropped by a new
embedder, and used by hybrid search; a recorded share used by the ``support`` reranker.

Real LanceDB tables in temp dirs, written by the real embed stage; vectors come from the cheap
deterministic ``HashEmbedder``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_index_retrieval import HashEmbedder, cut
from test_lexical_retrieval import _docs

from coinrag.inference.retrieval.fusion import (
    QuestionLists,
    choose_weight,
    confirmed_weight,
    gold_rank,
    objective,
    question_lists,
    quotes,
    score_supports,
    score_weights,
    supported_rank,
)
from coinrag.inference.retrieval.rerank import PageSupport, recorded_support
from coinrag.inference.retrieval.retriever import (
    FUSION_METHOD,
    HYBRID_DENSE_WEIGHT,
    HYBRID_DENSE_WEIGHT_WITH_NUGGETS,
    DenseSearch,
    LexicalSearch,
    Query,
    Retriever,
    dense_weight,
)
from coinrag.storage.index.lance import META_FILE, LanceIndex
from coinrag.storage.publish import publish, publish_fusion
from coinrag.storage.store import Store
from coinrag.tasks.embed import embed_stage
from coinrag.tasks.retrieval.fusion import GENERATED_KIND, SyntheticQuestion, choose_fusion


def _row(chunk: str, doc: str, score: float) -> dict:
    return {"chunk_id": chunk, "doc_id": doc, "score": score, "text": chunk}


def test_score_weights_worked_example():
    dense = [_row("a", "q", 0.9), _row("b", "p", 0.8), _row("c", "r", 0.1)]
    lexical = [_row("b", "p", 9.0), _row("a", "q", 1.0)]
    question = QuestionLists([dense, lexical], frozenset({"p"}))
    assert gold_rank(question, 1.0) == 2  # dense alone: b second
    assert gold_rank(question, 0.0) == 1  # lexical alone: b first
    scored = score_weights([question], [0.0, 0.5, 1.0])
    assert scored[1.0] == {"hit@1": 0.0, "hit@2": 1.0, "hit@4": 1.0, "hit@8": 1.0, "mrr": 0.5}
    assert scored[0.5]["hit@1"] == 1.0  # b: 0.5 * 0.875 + 0.5 * 1 beats a: 0.5 * 1 + 0
    assert choose_weight(scored, HYBRID_DENSE_WEIGHT) == 0.5  # tie 0 / 0.5: nearer the default
    missed = QuestionLists([dense, lexical], frozenset({"zzz"}))
    assert gold_rank(missed, 0.5) is None
    assert score_weights([missed], [0.5])[0.5]["mrr"] == 0.0


def test_score_supports_worked_example():
    """Dense alone (weight 1): page ``q``'s one chunk first, page ``p``'s two next. Min-max
    normalised 1, 0.94, 0.88, 0 (the fused scores are linear in the dense ones): ``p``'s
    support at share 0.5 is 0.94 + 0.44 > 1, so ``p`` comes first; at share 0 it is second."""
    dense = [_row("a", "q", 0.9), _row("b", "p", 0.85), _row("c", "p", 0.8), _row("d", "r", 0.1)]
    question = QuestionLists([dense, []], frozenset({"p"}))
    assert supported_rank(question, 1.0, 0.0) == 2
    assert supported_rank(question, 1.0, 0.5) == 1
    scored = score_supports([question], 1.0, [0.0, 0.5, 1.0])
    assert scored[0.0]["hit@1"] == 0.0 and scored[0.5]["hit@1"] == 1.0 == scored[1.0]["hit@1"]
    assert choose_weight(scored, PageSupport.support) == 0.5  # tie 0.5 / 1: the default
    assert supported_rank(QuestionLists([dense, []], frozenset({"zzz"})), 1.0, 0.5) is None


def test_a_weight_that_wins_only_where_it_was_chosen_gives_way_to_the_default():
    """``confirmed_weight``: the training questions' best is kept only where it also beats the
    default on the held-out questions (the same objective); a tie keeps the default."""
    dense = [_row("a", "q", 0.9), _row("b", "p", 0.8), _row("c", "r", 0.1)]
    lexical = [_row("b", "p", 9.0), _row("a", "q", 1.0)]
    wants_lexical = QuestionLists([dense, lexical], frozenset({"p"}))  # b: lexical's first
    wants_dense = QuestionLists([dense, lexical], frozenset({"q"}))  # a: dense's first
    weights = sorted({0.0, HYBRID_DENSE_WEIGHT, 1.0})
    default = HYBRID_DENSE_WEIGHT
    held = score_weights([wants_dense], weights)  # the held-out questions disagree with 0
    assert confirmed_weight(0.0, default, held, 1) == default
    held = score_weights([wants_lexical], weights)  # they agree: 0 ranks b first, so does 0.5
    assert objective(held[0.0]) == objective(held[default])
    assert confirmed_weight(0.0, default, held, 1) == default  # a tie: the default stays
    held = score_weights([wants_dense, wants_dense], weights)
    assert objective(held[1.0]) > objective(held[default])
    assert confirmed_weight(1.0, default, held, 2) == 1.0
    assert confirmed_weight(0.0, default, {}, 0) == 0.0  # nothing held out: nothing to check
    assert confirmed_weight(default, default, {}, 0) == default


def test_quotes_masks_the_chunk_that_holds_the_question():
    row = {"text": "Intro.\nSorting HOW TO\n==============\nText.", "section": None}
    assert quotes(row, "sorting how-to")  # words, not punctuation
    assert not quotes(row, "sorting to")  # ... as a whole phrase of words, in order
    assert quotes({"text": "body", "section": ["Library", "Sorting Basics"]}, "Sorting Basics")
    assert not quotes({"text": "the resorting of lists", "section": None}, "sorting")


@pytest.fixture()
def store(tmp_path, smollm2_tokenizer):
    st = Store.at(tmp_path / "s").init()
    docs = _docs()
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    embed_stage(st, chunks, nuggets, docs, HashEmbedder(), "r1")
    publish(st, "r1", "build")
    return st, docs, chunks, nuggets


FUSION = {"dense_weight": 0.3, "method": FUSION_METHOD, "questions": 12}


def test_fusion_recorded_with_the_index_version_and_read_back(store, smollm2_tokenizer):
    st, docs, chunks, nuggets = store
    assert LanceIndex.open(st).meta.fusion is None
    # none chosen: the default of an index with nuggets
    assert dense_weight(LanceIndex.open(st)) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS
    before = st.published()
    reader = LanceIndex.open(st)  # opened before: keeps what it opened
    publish_fusion(st, "f1", "tune-fusion", FUSION)
    after = st.published()
    assert after["index"]["versions"] == before["index"]["versions"]
    assert after["index"]["fusion"] == FUSION and after["run_id"] == "f1"
    assert json.loads((st.index_dir / META_FILE).read_text())["fusion"] == FUSION
    assert dense_weight(LanceIndex.open(st)) == 0.3
    assert dense_weight(reader) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS
    # An incremental build with the same embedder keeps it; a new embedder drops it.
    embed_stage(st, chunks, nuggets, docs, HashEmbedder(), "r2")
    publish(st, "r2", "build")
    assert st.published()["index"]["fusion"] == FUSION
    assert dense_weight(LanceIndex.open(st)) == 0.3
    embed_stage(st, chunks, nuggets, docs, HashEmbedder(salt="b"), "r3")
    publish(st, "r3", "build")
    assert "fusion" not in st.published()["index"]
    assert dense_weight(LanceIndex.open(st)) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS


def test_a_weight_chosen_for_another_method_is_not_used(store):
    """A weight recorded for min-max fusion (earlier versions) weighs something else: the
    code's default applies until ``train fusion`` chooses again."""
    st = store[0]
    publish_fusion(st, "f1", "tune-fusion", {"dense_weight": 0.3, "method": "minmax-convex-v1"})
    assert dense_weight(LanceIndex.open(st)) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS
    publish_fusion(st, "f2", "tune-fusion", {"dense_weight": 0.3})  # no method: not used
    assert dense_weight(LanceIndex.open(st)) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS


def test_an_unconfirmed_choice_follows_the_default(store):
    """A record whose best weight the held-out questions did not confirm kept the default of its
    day (0.5 before an index with nuggets had its own): the code's default for the index
    applies; a confirmed one stays."""
    st = store[0]
    kept = {"dense_weight": 0.5, "best_on_train": 0.3, "method": FUSION_METHOD}
    publish_fusion(st, "f1", "tune-fusion", {**kept, "confirmed_on_held_out": False})
    assert dense_weight(LanceIndex.open(st)) == HYBRID_DENSE_WEIGHT_WITH_NUGGETS
    confirmed = {**kept, "dense_weight": 0.3, "confirmed_on_held_out": True}
    publish_fusion(st, "f2", "tune-fusion", confirmed)
    assert dense_weight(LanceIndex.open(st)) == 0.3


def test_the_default_weight_follows_the_dense_ranking(tmp_path, smollm2_tokenizer):
    """Where nothing was chosen, an index with nuggets (dense scores a chunk by its best
    window and best nugget) weighs dense 0.65, one without 0.5; ``train fusion`` compares its
    choice with that same default and records it."""
    # ids on fusion and report pages (tasks.retrieval.fusion.page_split), so a weight is chosen
    ids = {"birds": "birds-29", "rivers": "rivers-10", "volcanoes": "volcanoes-7"}
    ids["stars"] = "stars-4"
    docs = [replace(d, doc_id=ids[d.doc_id]) for d in _docs()]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    asked = [SyntheticQuestion(d.text.split(".")[0], d.doc_id, GENERATED_KIND) for d in docs]
    weights = {}
    for name, kept in (("with", nuggets), ("without", [])):
        st = Store.at(tmp_path / name).init()
        embed_stage(st, chunks, kept, docs, HashEmbedder(), "r1")
        publish(st, "r1", "build")
        weights[name] = dense_weight(LanceIndex.open(st))
        record = choose_fusion(LanceIndex.open(st), HashEmbedder(), [], generated=asked).record()
        assert record["default_weight"] == weights[name]
        assert record["questions"] == 2 and record["held_out_questions"] == 2
    assert weights == {"with": HYBRID_DENSE_WEIGHT_WITH_NUGGETS, "without": HYBRID_DENSE_WEIGHT}
    assert (HYBRID_DENSE_WEIGHT, HYBRID_DENSE_WEIGHT_WITH_NUGGETS) == (0.5, 0.65)


def test_bad_fusion_refused(store):
    st = store[0]
    with pytest.raises(ValueError, match="not in"):
        publish_fusion(st, "f1", "tune-fusion", {"dense_weight": 1.5})
    with pytest.raises(ValueError, match="page_support 1.5 is not in"):
        publish_fusion(st, "f1", "tune-fusion", {"dense_weight": 0.5, "page_support": 1.5})
    with pytest.raises(ValueError, match="outside"):
        PageSupport(-0.1)


def test_the_support_reranker_uses_the_recorded_share(store):
    """A share chosen for this fusion method and page support rule is what ``support``
    reorders with (through ``Retriever``, and in what an evaluation records of it); without one,
    or one chosen for another rule, the class's default."""
    st = store[0]
    assert recorded_support(LanceIndex.open(st)) is None
    plain = Retriever(st, HashEmbedder(), reranker=PageSupport())
    assert plain.reranker.support == PageSupport.support
    chosen = {"dense_weight": 0.5, "method": FUSION_METHOD, "page_support": 0.2}
    publish_fusion(st, "f1", "tune-fusion", {**chosen, "page_support_method": PageSupport.method})
    assert recorded_support(LanceIndex.open(st)) == 0.2
    retriever = Retriever(st, HashEmbedder(), reranker=PageSupport())
    assert retriever.reranker.support == 0.2 and retriever.reranker.record()["support"] == 0.2
    assert PageSupport.support == 0.5  # the class's default is untouched
    question = "penguins of Antarctica river water"
    top = Retriever(st, HashEmbedder()).chunks_only(question, kc=30).chunks
    expected = [h.chunk_id for h in PageSupport(0.2).rerank(question, top)][:3]
    assert [h.chunk_id for h in retriever.chunks_only(question, kc=3).chunks] == expected
    publish_fusion(st, "f2", "tune-fusion", {**chosen, "page_support_method": "other-v0"})
    assert recorded_support(LanceIndex.open(st)) is None
    publish_fusion(st, "f3", "tune-fusion", {**chosen, "method": "minmax-convex-v1"})
    assert recorded_support(LanceIndex.open(st)) is None


@pytest.mark.parametrize(("weight", "part"), [(1.0, DenseSearch), (0.0, LexicalSearch)])
def test_hybrid_uses_the_recorded_weight(store, weight, part):
    """Weight 1 ranks as dense alone, 0 as lexical alone, in both stages of two-stage retrieval
    and in document selection: the recorded weight is the one searched with."""
    st = store[0]
    publish_fusion(st, "f1", "tune-fusion", {"dense_weight": weight, "method": FUSION_METHOD})
    retriever = Retriever(st, HashEmbedder(), mode="hybrid")
    question = "penguins of Antarctica river water"
    index = retriever.index
    query = Query(question, retriever.embedder)

    def above_last(rows):  # the part's rows above its lowest (normalised 0: a tie with absent)
        low = min(r["score"] for r in rows)
        return [r for r in rows if r["score"] > low]

    alone = [r["chunk_id"] for r in above_last(part().rank(index, "chunks", query, 30))][:3]
    hybrid = [h.chunk_id for h in retriever.two_stage(question, kc=3, k=4).chunks]
    assert alone and hybrid[: len(alone)] == alone
    nuggets = above_last(part().rank(index, "nuggets", query, 30))[:4]
    fused = retriever.one_stage(question, k=4).evidence
    assert nuggets and {(e.chunk_id, e.tok_start) for e in fused} >= {
        (n["chunk_id"], n["tok_start"]) for n in nuggets
    }
    docs = [d["doc_id"] for d in retriever.documents(question, k=2)]
    assert docs[0] == part().documents(index, query, 2)[0]["doc_id"]


def test_question_lists_mask_verbatim(store):
    st = store[0]
    index = LanceIndex.open(st)
    query = Query("Amazon river", HashEmbedder())
    masked = question_lists(index, query, ["rivers"])
    plain = question_lists(index, query, ["rivers"], mask_verbatim=False)
    assert any(r["doc_id"] == "rivers" for r in plain.lists[1])
    assert not any("Amazon river" in r["text"] for ranking in masked.lists for r in ranking)


def test_fused_rows_carry_their_score_parts() -> None:
    """Each fused row says its rank and own score in each ranking, and its score is the
    weighted sum of the normalised parts."""
    from coinrag.inference.retrieval.retriever import fuse_rankings

    dense = [{"id": "a", "score": 0.9}, {"id": "b", "score": 0.5}, {"id": "c", "score": 0.1}]
    lexical = [{"id": "c", "score": 12.0}, {"id": "a", "score": 4.0}]
    rows = fuse_rankings([dense, lexical], "id", 3, 0.75)
    parts = {r["id"]: r["score_parts"] for r in rows}
    assert (parts["a"].dense_rank, parts["a"].lexical_rank) == (1, 2)
    assert (parts["b"].lexical_rank, parts["b"].lexical_score) == (None, None)
    assert (parts["c"].dense_score, parts["c"].lexical_score) == (0.1, 12.0)
    for r in rows:
        p = r["score_parts"]
        fused = p.dense_weight * p.dense_norm + (1 - p.dense_weight) * p.lexical_norm
        assert r["score"] == pytest.approx(fused, abs=1e-12)
