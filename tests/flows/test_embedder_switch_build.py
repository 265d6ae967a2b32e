"""A store built with another embedder setting end to end, for each setting that changes the
stored vectors: ``embedder = "mpnet"`` (the packaged all-mpnet-base-v2, 768 dimensions),
``embed_dtype = "bfloat16"`` and ``embed_window = 128``. The store records that embedder's
fingerprint, `eval --retrieval-only` and `query` search it with the matching embedder and find
the gold page, and a build back to the defaults re-embeds every text of the index (never a mixed
one; narrower windows are more texts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.schemas.tables import DocumentRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.heavy]  # ~20-40 s each


@dataclass(frozen=True)
class Switch:
    """Build ``settings`` that change the vectors, the embedder they load, the stored vectors'
    dimension, and the settings that go back to the defaults."""

    settings: dict
    embedder: dict
    dim: int
    back: dict


SWITCHES = [
    pytest.param(
        Switch(
            {"extractor": "none", "embedder": "mpnet"},
            {"ref": "mpnet"},
            768,
            {"extractor": "none", "embedder": "minilm"},
        ),
        id="mpnet",
    ),
    pytest.param(
        Switch(
            {"extractor": "rules", "embed_dtype": "bfloat16"},
            {"ref": None, "document_dtype": "bfloat16"},
            384,
            {"extractor": "rules", "embed_dtype": "float32"},
        ),
        id="bfloat16",
    ),
    pytest.param(
        Switch(
            {"extractor": "none", "embed_window": 128},
            {"ref": None, "max_length": 128},
            384,
            {"extractor": "none", "embed_window": 0},
        ),
        id="window",
    ),
]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _build(src: Path, store: Path, settings: dict) -> dict:
    from coinrag.flows.build import build_flow

    return build_flow(str(src), str(store), {"kv": False, **settings})


@pytest.mark.parametrize("switch", SWITCHES)
def test_a_store_builds_searches_and_switches_back(
    switch: Switch, tmp_path: Path, sample_corpus: Path
):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:4]))
    store = tmp_path / "store"
    first = _build(src, store, switch.settings)
    assert first["embedded"] > 0
    st = Store.at(store)
    embedder = load_embedder(**switch.embedder)
    index = LanceIndex.open(st)
    assert index.embedder_fp == embedder.fingerprint
    vectors = index.columns("chunks", ["vector"]).column("vector").combine_chunks()
    assert len(vectors[0]) == embedder.dim == switch.dim
    recorded = st.read_toml()["build"]
    assert all(recorded[name] == value for name, value in switch.settings.items())

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
    assert run["embedder_fp"] == embedder.fingerprint

    result = cli(
        "query", line["question"], "--store", str(store), "--method", "standard", "--kc", "1",
        "--k", "3", "--max-new-tokens", "2", "--json", "--retrieval", "dense",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert {e["doc_id"] for e in answer["evidence"]} == {kubrick}

    again = _build(src, store, switch.back)  # another fingerprint: every text again
    assert again["embedded"] > 0 and again["embeddings_cached"] == 0  # none of its vectors
    assert LanceIndex.open(st).embedder_fp == load_embedder(None).fingerprint
