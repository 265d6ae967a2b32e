"""The RAG methods behind one interface (``inference/methods/``): the registry and the names the
CLI checks, what each method declares, and one engine answering with each (streamed tokens,
oracle retrieval) on the session's sample store."""

from __future__ import annotations

from pathlib import Path

import pytest

from coinrag.inference.methods import METHODS, RagEngine, RagMethod
from coinrag.inference.methods.cartridge import Cartridges
from coinrag.inference.methods.coinrag import CoinRag
from coinrag.schemas.settings import DEFAULT_RAG_METHODS, LOCAL_STORE_METHODS, RAG_METHODS

QUESTION = "Who directed 2001: A Space Odyssey?"


def test_the_registry_holds_the_names_the_cli_checks() -> None:
    assert set(METHODS) == set(RAG_METHODS)
    assert set(DEFAULT_RAG_METHODS) <= set(RAG_METHODS)
    # the CLI refuses an object store before loading anything for exactly these methods
    local_only = {name for name, cls in METHODS.items() if Cartridges in cls.needs}
    assert local_only == set(LOCAL_STORE_METHODS)
    assert all(issubclass(cls, RagMethod) and cls.name == n for n, cls in METHODS.items())


def test_methods_declare_what_their_retrieval_uses() -> None:
    uses = {n: (c.retrieval.uses_kc, c.retrieval.uses_k) for n, c in METHODS.items()}
    assert uses == {
        "coinrag": (True, True),
        "turborag": (True, False),
        "standard": (True, False),
        "cartridge": (False, True),
        "cacheblend": (True, False),
        "cacheblend-v": (True, False),
        "kvlink": (True, False),
        "coinrag-isolated": (True, True),
        "coinrag-noalign": (True, True),
        "coinrag-onestage": (False, True),
    }
    key = {n: c.retrieval.key(4, 10) for n, c in METHODS.items()}
    assert key["turborag"] == key["standard"]  # one shared retrieval (eval retrieves once)
    assert len({key["turborag"], key["coinrag"], key["cartridge"], key["coinrag-onestage"]}) == 4
    # the baselines share turborag's chunks, the ablations coinrag's two-stage nuggets
    assert key["cacheblend"] == key["cacheblend-v"] == key["kvlink"] == key["turborag"]
    assert key["coinrag-isolated"] == key["coinrag-noalign"] == key["coinrag"]
    assert METHODS["turborag"].retrieval.key(4, 10) == METHODS["turborag"].retrieval.key(4, 3)


def test_a_subclass_registers_by_name_and_a_name_is_taken_once() -> None:
    class Ablation(CoinRag, name="coinrag-ablation-probe"):
        pass

    try:
        assert METHODS["coinrag-ablation-probe"] is Ablation
        assert Ablation.needs == CoinRag.needs and Ablation.name == "coinrag-ablation-probe"
    finally:
        del METHODS["coinrag-ablation-probe"]
    with pytest.raises(ValueError, match="two RAG methods named 'coinrag'"):

        class Again(CoinRag, name="coinrag"):
            pass


@pytest.fixture(scope="module")
def engine(sample_store: Path) -> RagEngine:
    return RagEngine.open(str(sample_store), max_new_tokens=4)


@pytest.mark.parametrize("method", ["coinrag", "turborag", "standard"])
def test_answer_tokens_stream_as_they_are_decoded(engine: RagEngine, method: str) -> None:
    streamed: list[int] = []
    answer = engine.answer(QUESTION, method, kc=2, k=4, on_token=streamed.append)
    assert answer.method == method and answer.token_ids
    assert streamed == answer.token_ids
    assert answer.model_fp == engine.loaded.model_fp


def test_oracle_documents_restrict_every_methods_retrieval(
    engine: RagEngine, sample_store: Path
) -> None:
    from coinrag.schemas.tables import DocumentRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    top = {e["doc_id"] for e in engine.answer(QUESTION, "turborag", kc=2, k=4).evidence}
    other = sorted({d.doc_id for d in read_rows(Store.at(sample_store), DocumentRow)} - top)[0]
    for method in ("coinrag", "turborag", "standard"):
        answer = engine.answer(QUESTION, method, kc=2, k=4, doc_ids=[other])
        assert answer.evidence and {e["doc_id"] for e in answer.evidence} == {other}, method


def test_unknown_methods_are_refused_naming_the_known_ones(engine: RagEngine) -> None:
    with pytest.raises(ValueError, match="method 'magic' is not one of .*coinrag"):
        engine.answer(QUESTION, "magic")
