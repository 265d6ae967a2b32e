"""``coinrag query --method cartridge`` in text mode (issue 12, item 6), blank questions refused by
the cartridge engine (item 5), and ``train nuggets`` reading the eval format (item 12): a store
built with a tiny random Llama, whose documents get cartridges trained by the real flow (the
self-study questions come from the fake OpenAI server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.schemas.tables import CartridgeManifestRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness")

API_KEY = "sk-test-SECRET-cartridge-cli-0123456789"
QUESTIONS = '["Which film is about space?", "Who made the film about light?"]'


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sample_corpus: Path, smollm2_tokenizer) -> dict:
    from coinrag.flows.cartridges import train_cartridges

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cartridge-cli")
    model = save_tiny_llama(root / "tiny", smollm2_tokenizer, seed=0)
    docs = sample_docs(sample_corpus, 2)
    src = write_corpus(root / "docs.jsonl", docs)
    store = root / "store"
    build_flow(str(src), str(store), {"extractor": "rules", "model": str(model), "chunk_size": 64})
    mp = pytest.MonkeyPatch()
    try:
        with FakeOpenAI(api_key=API_KEY) as fake:
            fake.script_chat(*[Action.raw_content(QUESTIONS)] * 2)
            mp.setenv("OPENAI_API_KEY", API_KEY)
            train_cartridges(
                store,
                None,
                2,
                model=str(model),
                base_url=fake.base_url,
                n_calls=1,
                n_questions=2,
                max_new_tokens=4,
                p=3,
                checkpoint_every=2,
            )
    finally:
        mp.undo()
    return {"store": store, "model": model, "docs": docs}


def test_cartridge_query_prints_text(trained: dict) -> None:
    store = str(trained["store"])
    cartridges = {
        r.doc_id: r.cartridge_id for r in read_rows(Store.at(store), CartridgeManifestRow)
    }
    assert set(cartridges) == {d["id"] for d in trained["docs"]}
    base = ["query", "Which film is about space?", "--store", store, "--method", "cartridge"]
    text = CliRunner().invoke(app, [*base, "--k", "2", "--max-new-tokens", "3"])
    assert text.exit_code == 0, text.output
    assert text.exception is None
    assert "method cartridge" in text.stdout
    for doc_id, cartridge_id in cartridges.items():
        assert f"{doc_id} cartridge {cartridge_id}" in text.stdout
    as_json = CliRunner().invoke(app, [*base, "--k", "2", "--max-new-tokens", "3", "--json"])
    assert as_json.exit_code == 0, as_json.output
    got = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert {e["doc_id"] for e in got["evidence"]} == set(cartridges)
    doc = trained["docs"][1]["id"]
    oracle = CliRunner().invoke(app, [*base, "--oracle-doc", doc, "--max-new-tokens", "2"])
    assert oracle.exit_code == 0, oracle.output
    assert f"{doc} cartridge {cartridges[doc]}" in oracle.stdout


def test_the_cartridge_engine_refuses_blank_questions(trained: dict) -> None:
    from coinrag.inference.methods.cartridge import CartridgeRag
    from coinrag.inference.model.loading import load_model

    rag = CartridgeRag(Store.at(trained["store"]), load_model(str(trained["model"])))
    doc = trained["docs"][0]["id"]
    for blank in ("", " \n ", "\u200b"):
        with pytest.raises(ValueError, match="blank"):
            rag.answer(blank, [doc], max_new_tokens=2)
        with pytest.raises(ValueError, match="blank"):
            rag.oracle(blank, doc, max_new_tokens=2)
    assert rag.oracle("Which film?", doc, max_new_tokens=2).doc_ids == [doc]


def test_train_nuggets_reads_the_eval_format(trained: dict, tmp_path: Path) -> None:
    docs = trained["docs"]
    data = tmp_path / "qa.jsonl"
    lines = [
        {"question": "Who directed the film?", "answers": ["Stanley Kubrick", "Kubrick"],
         "doc_ids": [docs[0]["id"]]},
        {"question": "How fast is light?", "answer": "fast", "doc_ids": [docs[1]["id"]]},
    ]  # fmt: skip
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "model"
    result = CliRunner().invoke(
        app,
        ["train", "nuggets", "--store", str(trained["store"]), "--data", str(data),
         "--out", str(out), "--max-steps", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["counts"]["examples"] == summary["counts"]["usable"] == 2, summary
    assert (out / "config.json").is_file()
    # a malformed line is refused before any model loads, naming the line
    data.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"question": "Q?"}) + "\n")
    bad = CliRunner().invoke(
        app,
        ["train", "nuggets", "--store", str(trained["store"]), "--data", str(data),
         "--out", str(tmp_path / "m2")],
    )  # fmt: skip
    assert bad.exit_code == 2 and f"{data}:2" in " ".join(bad.output.split())


def test_eval_and_the_engine_run_cartridges_like_any_method(trained: dict, tmp_path: Path) -> None:
    """The cartridge method goes through the registry: `eval --methods cartridge` runs it once
    per --k (kc recorded as 0, --kc ignored), and one engine streams its answer tokens."""
    import pyarrow.parquet as pq

    from coinrag.inference.methods import RagEngine

    store = str(trained["store"])
    docs = trained["docs"]
    questions = tmp_path / "questions.jsonl"
    lines = [
        {"question": "Which film is about space?", "answers": ["2001"], "doc_ids": [docs[0]["id"]]},
        {"question": "Who made the film about light?", "answers": ["x"]},
    ]
    questions.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        ["eval", str(questions), "--store", store, "--out", str(out), "--methods", "cartridge",
         "--kc", "1", "2", "--k", "1", "2", "--max-new-tokens", "2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    got = {(r["method"], r["kc"], r["k"]) for r in rows}
    assert got == {("cartridge", 0, 1), ("cartridge", 0, 2)}
    assert all(r["n"] == 2 for r in rows)

    engine = RagEngine.open(store, max_new_tokens=3, methods=["cartridge"])
    streamed: list[int] = []
    answer = engine.answer("Which film is about space?", "cartridge", k=2, on_token=streamed.append)
    assert streamed == answer.token_ids and answer.kc == 0 and answer.k == 2
    assert {e["doc_id"] for e in answer.evidence} == {d["id"] for d in docs}
