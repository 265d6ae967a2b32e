"""The comparison's methods through the CLI on one tiny store (a random-weight 2-layer Llama
with SmolLM2's tokenizer, two sample documents, 64-token chunks): ``coinrag query --method``
for CacheBlend (K and V), the three CoinRAG ablations and KVLink (refused without trained link
tokens, naming the command that trains them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app

pytestmark = pytest.mark.usefixtures("prefect_harness", "one_torch_thread")

QUESTION = "Who directed 2001: A Space Odyssey?"


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, sample_corpus: Path, smollm2_tokenizer) -> dict:
    root = tmp_path_factory.mktemp("eval-methods")
    model = save_tiny_llama(root / "tiny", smollm2_tokenizer, seed=0)
    src = write_corpus(root / "docs.jsonl", sample_docs(sample_corpus, 2))
    store = root / "store"
    build_flow(str(src), str(store), {"extractor": "rules", "model": str(model), "chunk_size": 64})
    return {"store": store, "model": model, "root": root}


def query(store: Path, method: str, *extra: str, code: int = 0) -> dict | str:
    result = CliRunner().invoke(
        app,
        ["query", QUESTION, "--store", str(store), "--method", method, "--kc", "2", "--k", "3"]
        + ["--max-new-tokens", "4", "--json", *extra],
    )
    assert result.exit_code == code, result.output
    if code:
        return " ".join(result.output.split())
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "method", ["cacheblend", "cacheblend-v", "coinrag-isolated", "coinrag-noalign"]
)
def test_the_new_methods_answer_through_query(tiny_store: dict, method: str) -> None:
    out = query(tiny_store["store"], method)
    assert out["method"] == method and out["timings"]["ttft"] > 0
    assert out["evidence"] and out["active_tokens"] > 0
    turbo = query(tiny_store["store"], "turborag")
    coin = query(tiny_store["store"], "coinrag")
    same_as = turbo if method.startswith("cacheblend") else coin
    # the same retrieval as the method they are measured against
    strip = [(e["chunk_id"], e["tok_start"], e["tok_end"]) for e in same_as["evidence"]]
    assert [(e["chunk_id"], e["tok_start"], e["tok_end"]) for e in out["evidence"]] == strip
    assert out["active_tokens"] == same_as["active_tokens"]


def test_onestage_searches_every_nugget(tiny_store: dict) -> None:
    out = query(tiny_store["store"], "coinrag-onestage")
    assert out["method"] == "coinrag-onestage" and out["kc"] == 2 and len(out["evidence"]) == 3
    refused = query(tiny_store["store"], "coinrag-onestage", "--oracle-doc", "x", code=1)
    assert "error:" in refused and "whole nugget index" in refused


def test_kvlink_without_trained_links_names_the_training_command(tiny_store: dict) -> None:
    refused = query(tiny_store["store"], "kvlink", code=1)
    assert "error:" in refused and "coinrag train kvlink" in refused


@pytest.fixture(scope="module")
def trained_links(tiny_store: dict, sample_corpus: Path) -> Path:
    """Link tokens trained for 2 steps by ``coinrag train kvlink`` on the tiny store."""
    docs = sample_docs(sample_corpus, 2)
    data = tiny_store["root"] / "qa.jsonl"
    lines = [
        {"question": QUESTION, "answer": "Stanley Kubrick", "doc_ids": [docs[0]["id"]]},
        {"question": "What is it about?", "answer": "a voyage", "doc_ids": [d["id"] for d in docs]},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tiny_store["root"] / "links"
    args = ["train", "kvlink", "--store", str(tiny_store["store"]), "--data", str(data)]
    args += ["--out", str(out), "--kc", "2", "--batch-size", "2", "--epochs", "3"]
    args += ["--max-steps", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_train_kvlink_then_answer_with_its_links(tiny_store: dict, trained_links: Path) -> None:
    from coinrag.inference.context.link import load_link_adapter
    from coinrag.schemas.tables import RunRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    out = trained_links
    links, info = load_link_adapter(out)
    summary = json.loads((out / "coinrag-training.json").read_text())
    losses = [
        json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()
    ]
    assert summary["steps"] == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert summary["trainable_params"] == links.weight.numel()  # only the links trained
    # the rows of the slots used (kc = 2, 5 links each) moved off their initial value (every
    # row starts equal); the unused slots' rows did not
    start = links.weight[-1]
    assert not torch.equal(links.weight[0], start) and torch.equal(links.weight[10], start)
    assert info.kvlink_fp.startswith("kvlink-") and info.kvlink_fp == summary["kvlink_fp"]
    runs = read_rows(Store.at(tiny_store["store"]), RunRow)
    done = [r for r in runs if (r.flow, r.status) == ("train-kvlink", "completed")]
    assert done and json.loads(done[-1].fingerprints_json)["kvlink_fp"] == info.kvlink_fp

    answer = query(tiny_store["store"], "kvlink", "--model", str(out))
    assert answer["method"] == "kvlink" and answer["model_fp"] == info.kvlink_fp
    turbo = query(tiny_store["store"], "turborag")
    assert [e["chunk_id"] for e in answer["evidence"]] == [e["chunk_id"] for e in turbo["evidence"]]
    assert answer["active_tokens"] == turbo["active_tokens"] + info.n_link * len(turbo["evidence"])
    too_many = query(tiny_store["store"], "kvlink", "--model", str(out), "--kc", "17", code=1)
    assert "at most 16 documents" in too_many


def test_eval_compares_every_method_and_model_in_table3_and_figure4(
    tiny_store: dict, trained_links: Path
) -> None:
    import pyarrow.parquet as pq

    root, store = tiny_store["root"], tiny_store["store"]
    questions = root / "faq.jsonl"
    lines = [
        {
            "question": QUESTION,
            "answers": ["Stanley Kubrick"],
            "doc_ids": ["2001:-a-space-odyssey"],
        },
        {"question": "What is the speed of light?", "answers": ["299,792 km/s"]},
        {"question": "Who was Marie Curie?", "answers": ["a physicist"]},
    ]
    questions.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = root / "eval"
    methods = ["standard", "turborag", "cacheblend", "cacheblend-v", "coinrag"]
    methods += ["coinrag-isolated", "coinrag-noalign", "coinrag-onestage"]
    methods += ["kvlink@links", "coinrag@links"]
    args = ["eval", str(questions), "--store", str(store), "--out", str(out)]
    args += ["--model", "default", f"links={trained_links}", "--methods", *methods]
    args += ["--kc", "1", "2", "--k", "3", "--max-new-tokens", "3"]
    args += ["--limit-for", "cacheblend-v=1", "standard@default=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    # labels on stdout as in table3.md ("[links]" is text, not console markup)
    assert "kvlink [links]" in result.stdout and "coinrag [links]" in result.stdout
    results = pq.read_table(out / "results.parquet").to_pylist()
    n = {(r["model"], r["method"], r["kc"], r["k"]): r["n"] for r in results}
    assert n[("default", "cacheblend-v", 1, 0)] == 1 and n[("default", "standard", 2, 0)] == 2
    assert n[("default", "coinrag-onestage", 0, 3)] == 3  # one-stage: kc not used
    assert n[("links", "kvlink", 2, 0)] == 3 and n[("links", "coinrag", 1, 3)] == 3
    assert {r["dataset"] for r in results} == {"faq"}
    table3 = pq.read_table(out / "table3.parquet").to_pylist()
    labels = {r["label"] for r in table3}
    expected = set(methods[:8]) | {"kvlink [links]", "coinrag [links]"}
    assert labels == expected
    markdown = (out / "table3.md").read_text()
    assert all(f"| {label} |" in markdown for label in expected)
    for name in ("f1_vs_p99_ttft.png", "f1_vs_active_tokens.png", "f1_vs_budget.png"):
        assert (out / name).stat().st_size > 1000
    assert (out / "ablation_f1.png").stat().st_size > 1000  # coinrag, its ablations, [links]

    wrong = CliRunner().invoke(app, [*args[:8], "--methods", "coinrag@nope"])
    assert wrong.exit_code == 2 and "no model labelled 'nope'" in " ".join(wrong.output.split())
