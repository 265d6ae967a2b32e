"""The reranking stage (``inference/retrieval/rerank.py``, ``inference/context/rerank.py``): the
registry and the settings' names, the combined order, how a retriever keeps ``kc`` of the
reordered chunks, and the ``upr`` reranker's scores against a plain forward of the whole prompt
(from the stored KV and encoded live) on the session's sample store, through the engine (query,
api) and ``eval --retrieval-only``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from coinrag.inference.retrieval.rerank import (
    Reranker,
    combined,
    normalised,
    open_reranker,
)
from coinrag.inference.retrieval.retriever import ChunkHit
from coinrag.schemas.settings import RERANKERS, BuildSettings, SettingsError

QUESTION = "Who directed 2001: A Space Odyssey?"


def _hit(i: int, score: float, text: str) -> ChunkHit:
    return ChunkHit(f"ch-{i}", f"doc-{i}", f"ck-{i}", len(text), text, score, i)


class _ByLength(Reranker, name="probe-length"):
    """A probe plug-in: the longer a chunk's text, the better."""

    depth = 3
    weight = 0.5

    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        return [float(len(h.text)) for h in hits]


@pytest.fixture(scope="module", autouse=True)
def _unregister_probe():
    yield
    del Reranker.registry["probe-length"]


def test_the_registry_holds_the_names_the_settings_declare() -> None:
    assert [n for n in Reranker.registry.known() if n in RERANKERS] == list(RERANKERS)
    for name in RERANKERS:
        assert Reranker.registry[name].name == name  # "upr" imported on first look-up
    with pytest.raises(
        SettingsError, match="rerank 'fuzzy' is not one of none, pages, support, upr"
    ):
        BuildSettings(rerank="fuzzy").validate()


def test_combined_scores_worked_example() -> None:
    assert normalised([3.0, 1.0, 2.0]) == [1.0, 0.0, 0.5]
    assert normalised([2.0, 2.0]) == [1.0, 1.0]
    assert combined([0.9, 0.6, 0.3], [-3.0, -2.0, -2.5], 0.5) == pytest.approx([0.5, 0.75, 0.25])
    assert combined([0.9, 0.6], [-3.0, -2.0], 0.0) == pytest.approx([1.0, 0.0])  # search only


def test_rerank_orders_by_the_combined_score_and_renumbers_the_ranks() -> None:
    hits = [_hit(0, 0.9, "aa"), _hit(1, 0.6, "aaaaaa"), _hit(2, 0.3, "aaaa")]
    # search [1, .5, 0] and length [0, 1, .5], halved: [.5, .75, .25]
    ranked = _ByLength().rerank(QUESTION, hits)
    assert [h.chunk_id for h in ranked] == ["ch-1", "ch-0", "ch-2"]
    assert [h.rank for h in ranked] == [0, 1, 2]
    assert [h.score for h in ranked] == [0.6, 0.9, 0.3]  # the search's scores are kept
    tied = [_hit(0, 0.9, "aa"), _hit(1, 0.6, "aaaaaaaaaaaa")]  # .5 each: the search's order
    assert [h.chunk_id for h in _ByLength().rerank(QUESTION, tied)] == ["ch-0", "ch-1"]
    assert _ByLength().rerank(QUESTION, hits[:1]) == hits[:1]


def test_none_opens_nothing_and_loads_nothing() -> None:
    def context() -> None:
        raise AssertionError("a reranker that reads no KV asked for it")

    assert open_reranker("none", context) is None
    assert isinstance(open_reranker("probe-length", context), _ByLength)


# ---------------------------------------------------------------------------- the upr reranker
# on the session's sample store (SmolLM2, its KV)


def _plain_logprob(loaded, prompt, token_ids: list[int], question: str) -> float:
    """Mean log-prob of the question's tokens by one plain forward of the whole prompt."""
    import torch

    from coinrag.inference.context.rerank import QUESTION_HEADER

    tok = loaded.tokenizer
    cue = tok.encode(QUESTION_HEADER, add_special_tokens=False)
    q = tok.encode(question, add_special_tokens=False)
    ids = [*prompt.prefix_ids, *token_ids, *cue, *q]
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(ids) - len(q) - 1 : -1], dim=-1)
    return float(logp.gather(1, torch.tensor(q)[:, None]).mean())


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_upr_scores_equal_a_plain_forward_from_stored_and_live_kv(sample_store: Path) -> None:
    from coinrag.inference.context.builders import LiveKvContext, StoredKvContext
    from coinrag.inference.context.rerank import QueryLikelihood, rerank_context
    from coinrag.inference.model.kv_dtype import resolve_kv_dtype
    from coinrag.inference.model.loading import load_model
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.store import Store

    store = Store.at(sample_store)
    settings = settings_from_toml(store.read_toml(), str(sample_store))
    dtype = resolve_kv_dtype(settings.kv_dtype, "cpu").dtype
    loaded = load_model(settings.model, dtype=dtype)
    stored = rerank_context(store, settings, loaded)
    assert isinstance(stored, StoredKvContext)  # the store keeps whole chunks' KV
    live = rerank_context(store, settings.__class__(kv=False), loaded)
    assert isinstance(live, LiveKvContext)
    hits = Retriever(store, load_embedder("minilm")).chunks_only(QUESTION, kc=4).chunks
    assert len({h.n_tokens for h in hits}) > 1 or len(hits) >= 2  # a padded batch
    tokens = stored.chunk_token_ids([h.chunk_id for h in hits])
    plain = [_plain_logprob(loaded, stored.prompt, tokens[h.chunk_id], QUESTION) for h in hits]
    from_stored = QueryLikelihood(stored).scores(QUESTION, hits)
    from_live = QueryLikelihood(live).scores(QUESTION, hits)
    # bf16 (this CPU's KV dtype): other matmul shapes round differently in the last bits
    tolerance = 0.05 if dtype == "bfloat16" else 1e-3
    assert from_stored == pytest.approx(plain, abs=tolerance)
    assert from_live == pytest.approx(plain, abs=tolerance)
    spread = max(plain) - min(plain)
    assert spread > 4 * tolerance  # the candidates' scores differ by more than the rounding


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_the_engine_and_retrieval_eval_rerank_as_the_setting_says(
    sample_store: Path, tmp_path: Path
) -> None:
    from coinrag.inference.context.rerank import QueryLikelihood
    from coinrag.inference.evaluation.retrieval_only import evaluate_retrieval
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.methods.assets import Index
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.storage.store import Store

    engine = RagEngine.open(str(sample_store), max_new_tokens=2, methods=["turborag"])
    assert engine.rerank == "none" and engine.asset(Index).reranker is None
    engine = RagEngine(
        Store.at(sample_store), engine.loaded, "minilm", methods=["turborag"], rerank="upr"
    )
    retriever = engine.asset(Index)
    assert isinstance(retriever.reranker, QueryLikelihood)
    found = retriever.chunks_only(QUESTION, kc=2)
    assert found.rerank_ms > 0 and len(found.chunks) == 2
    # kc 2 of the reranked top `depth`: the reranker's own order of the search's top chunks
    plain = Retriever(Store.at(sample_store), load_embedder("minilm"))
    top = plain.chunks_only(QUESTION, kc=QueryLikelihood.depth).chunks
    expected = [h.chunk_id for h in retriever.reranker.rerank(QUESTION, top)][:2]
    assert [h.chunk_id for h in found.chunks] == expected
    answer = engine.answer(QUESTION, "turborag", 2, 0)
    assert [e["chunk_id"] for e in answer.evidence] == expected  # the answer reads them

    questions = tmp_path / "q.jsonl"
    row = {"question": QUESTION, "answers": ["Stanley Kubrick"], "doc_ids": [top[0].doc_id]}
    questions.write_text(json.dumps(row) + "\n")
    out = tmp_path / "eval"
    evaluate_retrieval(
        sample_store, questions, out, kcs=(1,), ks=(2,), evidence=("chunks",), rerank="upr"
    )
    record = json.loads((out / "eval_run.json").read_text())["rerank"]
    assert record == {
        "name": "upr",
        "depth": QueryLikelihood.depth,
        "weight": QueryLikelihood.weight,
    }
