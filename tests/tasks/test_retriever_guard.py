"""``train retriever``'s guard (``tasks/retrieval/retriever_guard.py``): the ranks and scores it
computes, which pages and questions it asks, and its verdict on a real store (LanceDB windows
written by a build): the store's own embedder loaded again is adopted (the same MRR), the same
weights with noise added (a real embedder that finds less) is not, and a store with no
held-out question adopts unjudged."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from store_fixtures import held_and_retriever_pages

from coinrag.tasks.retrieval.fusion import GENERATED_KIND, SyntheticQuestion, page_split
from coinrag.tasks.retrieval.retriever_guard import (
    MAX_GUARD_QUESTIONS,
    asked_questions,
    gold_ranks,
    held_out_pages,
    judge_adapted,
    rank_scores,
)


def _q(text: str, doc: str, kind: str = GENERATED_KIND) -> SyntheticQuestion:
    return SyntheticQuestion(text, doc, kind, "")


def test_gold_ranks_take_a_chunks_best_window_and_skip_masked_chunks() -> None:
    # windows: chunk a (pages A) twice, chunk b (page B), chunk c (page C); unit vectors
    w = np.array([[1, 0, 0], [0.6, 0.8, 0], [0, 1, 0], [0, 0, 1]], dtype=np.float32)
    chunks, docs = ["a", "a", "b", "c"], ["A", "A", "B", "C"]
    q = np.array([[0, 1, 0]], dtype=np.float32)  # b's window 1.0, a's second window 0.8
    assert gold_ranks(q, w, chunks, docs, ["B"], [set()]) == [1]
    assert gold_ranks(q, w, chunks, docs, ["A"], [set()]) == [2]
    assert gold_ranks(q, w, chunks, docs, ["A"], [{"b"}]) == [1]
    assert gold_ranks(q, w, chunks, docs, ["C"], [set()], depth=2) == [None]
    assert rank_scores([1, 2, None, 8]) == {
        "hit@1": 0.25,
        "hit@2": 0.5,
        "hit@4": 0.5,
        "hit@8": 0.75,
        "mrr": round((1 + 0.5 + 0.125) / 4, 4),
    }


def test_only_held_out_pages_are_asked_generated_questions_first_and_capped() -> None:
    held, trained = held_and_retriever_pages(6, 3)
    questions = [_q(f"nugget {i}", held[i % 6], "nugget") for i in range(900)]
    questions += [_q(f"asked {p}", p) for p in held + trained]
    pages = held_out_pages(questions, 4, seed=0)
    assert len(pages) == 4 and set(pages) <= set(held)
    assert held_out_pages(questions, 4, seed=0) == pages  # seeded
    asked = asked_questions(questions, pages, seed=0)
    assert len(asked) == MAX_GUARD_QUESTIONS and {q.doc_id for q in asked} <= set(pages)
    assert [q.kind for q in asked[:4]] == [GENERATED_KIND] * 4
    assert {q.kind for q in asked[4:]} == {"nugget"}


@pytest.fixture(scope="module")
def guard_store(tmp_path_factory, sample_corpus, prefect_harness):
    """A store (no nuggets, no KV) of 10 sample texts under held-out and retriever page ids, and
    one question a held-out page: every second word of its first 24 (no chunk quotes it)."""
    from coinrag.flows.build import build_flow

    root = tmp_path_factory.mktemp("guard")
    texts = [json.loads(line)["text"] for line in sample_corpus.read_text().splitlines()]
    texts = [t for t in texts if len(t.split()) >= 40][:10]
    held, trained = held_and_retriever_pages(7, 3)
    ids = held + trained
    src = root / "docs.jsonl"
    lines = [json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True)]
    src.write_text("".join(lines))
    store = root / "store"
    build_flow(str(src), str(store), {"extractor": "none", "kv": False})
    questions = [_q(" ".join(t.split()[:24:2]), i) for i, t in zip(held, texts[:7], strict=True)]
    return store, questions


def _noised(tmp_path, scale: float):
    """The packaged MiniLM with Gaussian noise of ``scale`` times each tensor's own standard
    deviation added to every weight: a real embedder, worse than its base."""
    import torch
    from safetensors.torch import load_file, save_file

    from coinrag.inference.retrieval.embedders import locate_embedder

    out = tmp_path / "noised"
    shutil.copytree(locate_embedder(None), out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=gen) * float(t.std()) * scale
            weights[name] = (t + noise).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_verdict_on_a_real_store(guard_store, tmp_path) -> None:
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.index.lance import LanceIndex
    from coinrag.storage.store import Store

    store, questions = guard_store
    st = Store.at(store)
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    index = LanceIndex.open(st)
    base = store_embedder_of(settings)

    same = judge_adapted(index, base, store_embedder_of(settings), questions, pages=3)
    assert same.adopted and same.adapted == same.base and same.base["hit@4"] > 0.5
    assert same.questions == 3 and same.pages == 3 and same.kind == GENERATED_KIND
    assert same.windows >= 6  # the 3 pages' windows and 3 distractor pages'

    worse = judge_adapted(
        index, base, store_embedder_of(settings, _noised(tmp_path, 1.0)), questions, pages=7
    )
    assert not worse.adopted and worse.adapted["mrr"] < worse.base["mrr"], worse

    trained_only = [q for q in questions if page_split(q.doc_id) == "retriever"]
    unjudged = judge_adapted(index, base, base, trained_only, pages=3)
    assert unjudged.adopted and unjudged.questions == 0 and unjudged.kind == "none"
