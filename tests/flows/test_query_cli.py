"""`coinrag query` end to end: a real build (KV in Zarr, LanceDB indexes), three methods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.schemas.tables import ChunkRow, KvManifestRow, NuggetRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness")

TIMINGS = {"retrieval", "kv_load", "assembly", "prefill", "ttft", "decode"}


@pytest.fixture(scope="module")
def built_store(tmp_path_factory, sample_corpus: Path, sample_store: Path) -> Path:
    """The session's sample store, rebuilt from the same source: nothing to recompute."""
    src = tmp_path_factory.mktemp("query") / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:5]))
    chunks = len(read_rows(Store.at(sample_store), ChunkRow))
    again = build_flow(str(src), str(sample_store), {"extractor": "rules"})
    assert again["kv_computed"] == 0 and again["kv_reused"] == chunks
    assert again["embedded"] == 0
    return sample_store


def _query(store: Path, method: str, *extra: str) -> dict:
    result = CliRunner().invoke(
        app,
        [
            "query",
            "Who directed 2001: A Space Odyssey?",
            "--store",
            str(store),
            "--method",
            method,
            "--kc",
            "2",
            "--k",
            "4",
            "--max-new-tokens",
            "8",
            "--json",
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_three_methods_answer_from_the_same_assets(built_store: Path) -> None:
    st = Store.at(built_store)
    chunks = {c.chunk_id: c for c in read_rows(st, ChunkRow)}
    nuggets = {(n.chunk_id, n.tok_start, n.tok_end) for n in read_rows(st, NuggetRow)}
    assert {r.content_key for r in read_rows(st, KvManifestRow)} == {
        c.content_key for c in chunks.values()
    }
    out = {m: _query(built_store, m) for m in ("coinrag", "turborag", "standard")}
    for method, got in out.items():
        assert got["method"] == method and isinstance(got["answer"], str)
        assert set(got["timings"]) == TIMINGS
        assert got["timings"]["ttft"] >= got["timings"]["prefill"] > 0
        for e in got["evidence"]:
            chunk = chunks[e["chunk_id"]]
            assert (
                e["doc_id"] == chunk.doc_id and 0 <= e["tok_start"] < e["tok_end"] <= chunk.n_tokens
            )
    coin, turbo, std = out["coinrag"], out["turborag"], out["standard"]
    # Two-stage: every nugget lies inside one of the turborag (stage-1) chunks.
    stage1 = {e["chunk_id"] for e in turbo["evidence"]}
    assert coin["evidence"] and all(e["chunk_id"] in stage1 for e in coin["evidence"])
    assert all((e["chunk_id"], e["tok_start"], e["tok_end"]) in nuggets for e in coin["evidence"])
    assert coin["active_tokens"] == sum(e["tok_end"] - e["tok_start"] for e in coin["evidence"])
    assert turbo["active_tokens"] == std["active_tokens"] > coin["active_tokens"]
    assert std["timings"]["kv_load"] == 0.0


def test_query_errors(built_store: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["query", "q", "--store", str(built_store), "--method", "magic"])
    assert bad.exit_code == 2 and "magic" in bad.output
    missing = runner.invoke(app, ["query", "q", "--store", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "not a coinrag" in " ".join(missing.output.split())
    fast = runner.invoke(app, ["query", "q", "--store", str(built_store), "--forward", "fast"])
    said = " ".join(fast.output.split())
    assert fast.exit_code == 2 and "forward must be one of auto, eager, compiled" in said


def test_the_forward_setting_keeps_the_answer(built_store: Path) -> None:
    """``--forward eager`` (the static KV buffer) answers what ``auto`` does on a CPU; the
    one-shot query never compiles unless asked."""
    from coinrag.inference.model.forward import _DEFAULT

    auto = _query(built_store, "coinrag")
    assert _DEFAULT == {"setting": "auto", "serving": False}
    eager = _query(built_store, "coinrag", "--forward", "eager")
    assert eager["answer"] == auto["answer"] and eager["evidence"] == auto["evidence"]
