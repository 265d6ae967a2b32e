"""The page rerankers (``inference/retrieval/rerank.py``): ``pages`` (:class:`OnePerPage`): its
order on made-up hits, the property that makes it safe (a gold page in the search's top ``kc``
stays in the top ``kc``, and no earlier), and a real store searched through ``Retriever`` and
``eval --retrieval-only`` (LanceDB, the packaged MiniLM): the same chunks as the plain search
reordered page by page, each mode's kc 1 unchanged, hit@kc never lower, and the run's record.
``support`` (:class:`PageSupport`): its worked example, its rounds and page order against a
direct computation on random hits, and the same store searched through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coinrag.inference.retrieval.rerank import OnePerPage, PageSupport, Reranker
from coinrag.inference.retrieval.retriever import ChunkHit

QUESTION = "unused: the order depends on the pages alone"


def _hits(pages: list[str]) -> list[ChunkHit]:
    """Hits in search order, chunk ``c<i>`` of page ``pages[i]``, scores falling."""
    return [
        ChunkHit(f"c{i}", page, f"k{i}", 10, "text", 1.0 - i / 100, i)
        for i, page in enumerate(pages)
    ]


def _first_gold(hits: list[ChunkHit], gold: set[str]) -> int | None:
    return next((i for i, h in enumerate(hits) if h.doc_id in gold), None)


def test_each_pages_best_chunk_comes_before_any_pages_second() -> None:
    hits = _hits(["a", "a", "b", "a", "c", "b"])
    ranked = OnePerPage().rerank(QUESTION, hits)
    assert [h.chunk_id for h in ranked] == ["c0", "c2", "c4", "c1", "c5", "c3"]
    assert [h.rank for h in ranked] == list(range(6))
    assert [h.score for h in ranked] == [hits[i].score for i in (0, 2, 4, 1, 5, 3)]  # kept
    distinct = _hits(["a", "b", "c"])
    assert OnePerPage().rerank(QUESTION, distinct) == distinct  # nothing to reorder
    assert Reranker.registry["pages"] is OnePerPage
    assert OnePerPage().record() == {"name": "pages", "depth": 30, "weight": 1.0}


@given(
    st.lists(st.sampled_from("abcdef"), min_size=1, max_size=30),
    st.sets(st.sampled_from("abcdefg"), min_size=1),
)
def test_a_gold_page_never_moves_later(pages: list[str], gold: set[str]) -> None:
    """The first gold chunk's place never grows (so hit@kc never falls and MRR never falls),
    kc 1 is the search's, and the reordered list is the same chunks."""
    hits = _hits(pages)
    ranked = OnePerPage().rerank(QUESTION, hits)
    assert sorted(h.chunk_id for h in ranked) == sorted(h.chunk_id for h in hits)
    assert ranked[0].chunk_id == hits[0].chunk_id
    before, after = _first_gold(hits, gold), _first_gold(ranked, gold)
    assert (before is None) == (after is None)
    if before is not None:
        assert after <= before
    for kc in range(1, len(hits) + 1):  # as many pages as the top rows hold, up to kc
        assert len({h.doc_id for h in ranked[:kc]}) == min(kc, len(set(pages)))


def test_pages_by_support_worked_example() -> None:
    """The docstring's: normalised ``a 1.0, b 0.9, b 0.8, c 0.1`` -> b (0.9 + 0.5 * 0.8), a, c,
    then b's second; the scores kept, the ranks renumbered, the record names the share."""
    hits = [
        ChunkHit(f"c{i}", page, f"k{i}", 10, "text", score, i)
        for i, (page, score) in enumerate([("a", 3.0), ("b", 2.8), ("b", 2.6), ("c", 1.2)])
    ]  # min-max: 1.0, 0.9, 0.8, 0.1 (any scale: the search mode's own)
    ranked = PageSupport().rerank(QUESTION, hits)
    assert [h.chunk_id for h in ranked] == ["c1", "c0", "c3", "c2"]
    assert [h.rank for h in ranked] == [0, 1, 2, 3]
    assert [h.score for h in ranked] == [2.8, 3.0, 1.2, 2.6]
    assert Reranker.registry["support"] is PageSupport
    record = {"name": "support", "depth": 30, "weight": 1.0, "support": 0.5}
    assert PageSupport().record() == record
    alone = [ChunkHit("c0", "a", "k0", 10, "t", 3.0, 0), ChunkHit("c1", "b", "k1", 10, "t", 2.0, 1)]
    assert PageSupport().rerank(QUESTION, alone) == alone  # one chunk a page: the search's order


class _NoSupport(PageSupport, name="probe-no-support"):
    support = 0.0


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 50)), min_size=1, max_size=30))
def test_pages_by_support_against_a_direct_computation(rows: list[tuple[str, int]]) -> None:
    """Every page's best chunk comes before any page's second (as ``pages``); within the first
    round the pages fall by best + 0.5 * second best of their min-max normalised scores; the
    same chunks; with no support its first round is ``pages``' (later rounds also go by the
    pages' support, where ``pages`` keeps the search's order)."""
    rows = sorted(rows, key=lambda r: -r[1])  # a search's order: scores falling
    hits = [ChunkHit(f"c{i}", p, f"k{i}", 10, "t", float(s), i) for i, (p, s) in enumerate(rows)]
    ranked = PageSupport().rerank(QUESTION, hits)
    assert sorted(h.chunk_id for h in ranked) == sorted(h.chunk_id for h in hits)
    pages = list(dict.fromkeys(h.doc_id for h in hits))
    assert [h.doc_id for h in ranked[: len(pages)]] == sorted(
        pages, key=lambda p: -_support(hits, p)
    ) or _ties(hits, pages)
    assert len({h.doc_id for h in ranked[: len(pages)]}) == len(pages)
    first = len(pages)
    assert (
        _NoSupport().rerank(QUESTION, hits)[:first] == OnePerPage().rerank(QUESTION, hits)[:first]
    )


def _support(hits: list[ChunkHit], page: str) -> float:
    low, high = min(h.score for h in hits), max(h.score for h in hits)
    scores = [
        (h.score - low) / (high - low) if high > low else 1.0 for h in hits if h.doc_id == page
    ]
    return scores[0] + 0.5 * (scores[1] if len(scores) > 1 else 0.0)


def _ties(hits: list[ChunkHit], pages: list[str]) -> bool:
    """Whether two pages' supports tie (then the search's order decides, not the sort above)."""
    supports = [round(_support(hits, p), 9) for p in pages]
    return len(set(supports)) < len(supports)


@pytest.fixture(scope="module", autouse=True)
def _unregister_probe():
    yield
    del Reranker.registry["probe-no-support"]


@pytest.fixture(scope="module")
def paged_store(tmp_path_factory, sample_corpus: Path, prefect_harness) -> tuple[Path, Path]:
    """A store (no nuggets, no KV, 64-token chunks) of the sample texts, each page two of them
    (so a page has several chunks about two subjects), and a question file: a few words of each
    text, gold its page."""
    from coinrag.flows.build import build_flow

    root = tmp_path_factory.mktemp("pages")
    texts = [json.loads(line)["text"] for line in sample_corpus.read_text().splitlines()]
    texts = [t for t in texts if len(t.split()) >= 60][:8]
    pages = {f"page-{i // 2}": [] for i in range(len(texts))}
    for i, text in enumerate(texts):
        pages[f"page-{i // 2}"].append(text)
    src = root / "docs.jsonl"
    src.write_text(
        "".join(json.dumps({"id": p, "text": "\n\n".join(t)}) + "\n" for p, t in pages.items())
    )
    store = root / "store"
    build_flow(str(src), str(store), {"extractor": "none", "kv": False, "chunk_size": 64})
    questions = root / "q.jsonl"
    rows = [
        {"question": " ".join(t.split()[5:30:3]), "answers": ["x"], "doc_ids": [f"page-{i // 2}"]}
        for i, t in enumerate(texts)
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return store, questions


def _reranked_searches(paged_store, reranker: Reranker):
    """Per question of the paged store and search mode: the plain search's top
    ``reranker.depth`` chunks, their chunk ids as ``reranker`` orders them, and the top 4 a
    ``Retriever`` with ``reranker`` finds."""
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.qa import load_questions
    from coinrag.storage.store import Store

    store_path, questions_path = paged_store
    store = Store.at(store_path)
    plain = Retriever(store, load_embedder(None))
    reordering = Retriever(store, plain.embedder, index=plain.index, reranker=reranker)
    for q in load_questions(questions_path):
        for mode in ("dense", "lexical", "hybrid"):
            top = plain.chunks_only(q.question, kc=reranker.depth, mode=mode).chunks
            expected = [h.chunk_id for h in reranker.rerank(q.question, top)]
            yield top, expected, reordering.chunks_only(q.question, kc=4, mode=mode).chunks


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_store_searched_one_chunk_a_page_first(paged_store, tmp_path: Path) -> None:
    from coinrag.inference.evaluation.retrieval_only import evaluate_retrieval

    store_path, questions_path = paged_store
    reordered = 0
    for top, expected, found in _reranked_searches(paged_store, OnePerPage()):
        assert [h.chunk_id for h in found] == expected[:4]
        assert len({h.doc_id for h in found}) == min(4, len({h.doc_id for h in top}))
        reordered += expected[:4] != [h.chunk_id for h in top[:4]]
    assert reordered > 0  # the store has pages whose chunks crowd the top: the test bites

    results = {}
    for rerank in ("none", "pages"):
        out = tmp_path / rerank
        table = evaluate_retrieval(
            store_path,
            questions_path,
            out,
            kcs=(1, 2, 4),
            ks=(2,),
            evidence=("chunks",),
            rerank=rerank,
        )
        results[rerank] = {
            (r["retrieval"], r["kc"]): (r["hit"], r["mrr"]) for r in table.to_pylist()
        }
    record = json.loads((tmp_path / "pages" / "eval_run.json").read_text())["rerank"]
    assert record == {"name": "pages", "depth": 30, "weight": 1.0}
    for key, (hit, mrr) in results["pages"].items():
        plain_hit, plain_mrr = results["none"][key]
        assert hit >= plain_hit and mrr >= plain_mrr - 1e-12, key
        if key[1] == 1:
            assert hit == plain_hit, key


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_store_searched_pages_by_support(paged_store, tmp_path: Path) -> None:
    """``support`` through ``Retriever`` (every mode: its scores' own scale) is the reranker
    applied to the plain search's top 30, it moves some question's chunks, and
    ``eval --retrieval-only --rerank support`` records it with its share."""
    from coinrag.inference.evaluation.retrieval_only import evaluate_retrieval

    store_path, questions_path = paged_store
    reordered = 0
    for top, expected, found in _reranked_searches(paged_store, PageSupport()):
        assert [h.chunk_id for h in found] == expected[:4]
        reordered += expected[:4] != [h.chunk_id for h in top[:4]]
    assert reordered > 0
    out = tmp_path / "support"
    table = evaluate_retrieval(
        store_path, questions_path, out, kcs=(1, 4), ks=(2,), evidence=("chunks",), rerank="support"
    )
    assert {r["retrieval"] for r in table.to_pylist()} == {"dense", "lexical", "hybrid"}
    record = json.loads((out / "eval_run.json").read_text())["rerank"]
    assert record == {"name": "support", "depth": 30, "weight": 1.0, "support": 0.5}


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_eval_answers_from_the_chunks_its_rerank_option_orders(paged_store, tmp_path: Path) -> None:
    """``coinrag eval --rerank`` reaches the generation eval's engine (not only
    ``--retrieval-only``): standard RAG's evidence is the reranked top kc, and the run records
    the reranker."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from coinrag.flows.cli import app
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.qa import load_questions
    from coinrag.storage.store import Store

    store_path, questions_path = paged_store
    store = Store.at(store_path)
    plain = Retriever(store, load_embedder(None))
    paged = Retriever(store, plain.embedder, index=plain.index, reranker=OnePerPage())
    questions = load_questions(questions_path)
    evidence = {}
    for rerank, retriever in (("none", plain), ("pages", paged)):
        out = tmp_path / rerank
        args = ["eval", str(questions_path), "--store", str(store_path), "--out", str(out)]
        args += ["--methods", "standard", "--kc", "4", "--max-new-tokens", "2"]
        result = CliRunner().invoke(app, [*args, "--rerank", rerank])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "eval_run.json").read_text())["rerank"] == rerank
        rows = sorted(
            pq.read_table(out / "per_question.parquet").to_pylist(), key=lambda r: r["qid"]
        )
        evidence[rerank] = [list(r["evidence_doc_ids"]) for r in rows]
        chunks = [retriever.chunks_only(q.question, kc=4).chunks for q in questions]
        # the evidence's pages, each once, in the order of the chunks
        assert evidence[rerank] == [list(dict.fromkeys(h.doc_id for h in c)) for c in chunks]
    assert evidence["pages"] != evidence["none"]  # some question's chunks were reordered
