"""``embedder = "mpnet"`` end to end: a store built with the packaged all-mpnet-base-v2 records
its fingerprint (768-dimensional vectors), `eval --retrieval-only` and `query` search it with
that embedder and find the gold page, and a build back to the default MiniLM re-embeds every
text (never a mixed index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.schemas.tables import DocumentRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.heavy]  # ~40 s


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _build(src: Path, store: Path, embedder: str) -> dict:
    from coinrag.flows.build import build_flow

    settings = {"extractor": "none", "kv": False, "embedder": embedder}
    return build_flow(str(src), str(store), settings)


def test_an_mpnet_store_builds_searches_and_switches_back(tmp_path: Path, sample_corpus: Path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:4]))
    store = tmp_path / "store"
    first = _build(src, store, "mpnet")
    st = Store.at(store)
    mpnet = load_embedder("mpnet")
    index = LanceIndex.open(st)
    assert index.embedder_fp == mpnet.fingerprint
    vectors = index.columns("chunks", ["vector"]).column("vector").combine_chunks()
    assert len(vectors[0]) == 768
    assert st.read_toml()["build"]["embedder"] == "mpnet"

    kubrick = next(d.doc_id for d in read_rows(st, DocumentRow) if "Kubrick" in d.text)
    questions = tmp_path / "q.jsonl"
    line = {"question": "Who made the film 2001: A Space Odyssey?", "answers": ["Stanley Kubrick"]}
    questions.write_text(json.dumps({**line, "doc_ids": [kubrick]}) + "\n")
    out = tmp_path / "eval"
    result = cli(
        "eval", str(questions), "--store", str(store), "--out", str(out), "--retrieval-only",
        "--kc", "1", "--k", "3", "--retrieval", "dense",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads((out / "eval_run.json").read_text())
    assert run["embedder_fp"] == mpnet.fingerprint

    result = cli(
        "query", line["question"], "--store", str(store), "--method", "standard", "--kc", "1",
        "--k", "3", "--max-new-tokens", "2", "--json", "--retrieval", "dense",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert {e["doc_id"] for e in answer["evidence"]} == {kubrick}

    again = _build(src, store, "minilm")  # another embedder: every text again
    assert again["embedded"] == first["embedded"] > 0
    assert LanceIndex.open(st).embedder_fp == load_embedder(None).fingerprint
