"""The build flow end to end on a real Prefect API, real Parquet files and a real HTTP endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from fake_openai_server import Action, FakeOpenAI
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.schemas.tables import ChunkRow, ExtractionCallRow, ExtractionRow, NuggetRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.extractors.factory import make_extractor

API_KEY = "sk-test-SECRET-do-not-store-0123456789"

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _corpus(tmp_path: Path, sample_corpus: Path, n: int = 4) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:n]))
    return src


def test_rules_build_then_unchanged_rebuild_does_no_work(tmp_path, sample_corpus) -> None:
    src = _corpus(tmp_path, sample_corpus)
    store = tmp_path / "store"
    first = build_flow(str(src), str(store), {"extractor": "rules"})
    assert first["documents_new"] == 4 and first["chunks_new"] == first["chunks"] >= 4
    assert first["extract_ok"] == first["chunks"] and first["nuggets_exact"] > 10
    stages = ["ingest", "prune", "chunk", "extract", "recover", "kv", "embed_index"]
    assert list(first["stage_seconds"]) == stages
    assert all(v >= 0 for v in first["stage_seconds"].values())
    assert first["stage_seconds"]["embed_index"] > 0  # the default build embeds
    second = build_flow(str(src), str(store), {"extractor": "rules"})
    assert second["documents_new"] == 0 and second["chunks_new"] == 0
    assert second["extract_requested"] == 0 and second["extract_cached"] == first["chunks"]
    assert second["nuggets_exact"] == 0  # nothing recomputed, nothing duplicated
    con = duckdb.connect()
    tables = store / "tables"
    n_nuggets = con.execute(f"SELECT count(*) FROM read_parquet('{tables}/nuggets/*.parquet')")
    assert n_nuggets.fetchone()[0] == first["nuggets_exact"] + first["nuggets_fuzzy"]
    runs = con.execute(
        f"SELECT status, count(*) FROM read_parquet('{tables}/runs/*.parquet') "
        "GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert runs == [("completed", 2), ("running", 2)]
    recorded = con.execute(
        f"SELECT counts_json FROM read_parquet('{tables}/runs/*.parquet') "
        f"WHERE status = 'completed' AND run_id = '{first['run_id']}'"
    ).fetchone()[0]
    assert json.loads(recorded)["stage_seconds"] == first["stage_seconds"]
    for nugget in read_rows(Store.at(store), NuggetRow):
        assert nugget.run_id == first["run_id"] and nugget.extractor_fp.startswith("extractor-")


@pytest.mark.heavy  # over 5 s: the second tier
def test_openai_default_from_env_ledger_failures_and_no_secrets(
    tmp_path, sample_corpus, monkeypatch
) -> None:
    src = _corpus(tmp_path, sample_corpus)
    store = tmp_path / "store"
    with FakeOpenAI(api_key=API_KEY) as fake:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        make_extractor.cache_clear()
        # One chunk keeps getting malformed answers (its repair request too): it must fail
        # loudly, as a content failure (malformed), not come back empty.
        fake.script_chat(*[Action.raw_content('{"nuggets": ["cut off')] * 2, match="Everest")
        settings = {"max_attempts": 2}
        first = build_flow(str(src), str(store), settings)
        assert first["extract_malformed"] == 1 and first["extract_failed"] == 0
        assert first["extract_ok"] == first["chunks"] - 1 and first["extract_abandoned"] == 0
        assert first["llm_calls"] == len(fake.chat_requests()) == first["chunks"] + 1
        assert first["cost_usd"] > 0 and len(first["failures"]) == 1
        rows = read_rows(Store.at(store), ExtractionRow)
        (failed,) = [r for r in rows if r.status == "malformed"]
        assert failed.candidates == [] and "JSON" in failed.error
        calls = read_rows(Store.at(store), ExtractionCallRow)
        assert {c.status for c in calls} == {"ok", "malformed"}
        # The rebuild retries only the failed chunk, and pays nothing for the rest.
        second = build_flow(str(src), str(store), settings)
        assert second["extract_requested"] == 1 and second["extract_ok"] == 1
        assert len(fake.chat_requests()) == first["chunks"] + 2
        make_extractor.cache_clear()
    for path in store.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


def test_cli_exit_codes_and_rejects(tmp_path, sample_corpus) -> None:
    runner = CliRunner()
    store = tmp_path / "store"
    bad = runner.invoke(app, ["build", str(sample_corpus), "--store", str(store), "--bogus"])
    assert bad.exit_code == 2 and "bogus" in bad.output
    missing = runner.invoke(app, ["build", str(tmp_path / "nope"), "--store", str(store)])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    bad_value = runner.invoke(
        app, ["build", str(sample_corpus), "--store", str(store), "--extractor", "gpt"]
    )
    assert bad_value.exit_code == 2 and "gpt" in bad_value.output
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(
        b'{"id": "a", "text": "Alpha is the first letter of the Greek alphabet."}\n'
        b'{"id": "a", "text": "A duplicate id."}\n'
        b'{"id": "b", "text": ""}\n'
        b'{"id": "../../escape", "text": "Ids are data, never paths."}\n'
    )
    result = runner.invoke(app, ["build", str(src), "--store", str(store), "--extractor", "rules"])
    assert result.exit_code == 3, result.output
    assert "duplicate_id" in result.output and "empty_text" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.jsonl", "store"]
    con = duckdb.connect()
    docs = con.execute(
        f"SELECT doc_id FROM read_parquet('{store}/tables/documents/*.parquet') ORDER BY 1"
    ).fetchall()
    assert docs == [("../../escape",), ("a",)]
    rejects = con.execute(
        f"SELECT reason FROM read_parquet('{store}/tables/rejects/*.parquet') ORDER BY 1"
    ).fetchall()
    assert rejects == [("duplicate_id",), ("empty_text",)]
    settings = (store / "coinrag.toml").read_text()
    assert 'extractor = "rules"' in settings


def test_config_file_settings_and_cli_override(tmp_path, sample_corpus) -> None:
    src = _corpus(tmp_path, sample_corpus, n=2)
    config = tmp_path / "coinrag.toml"
    config.write_text('[build]\nextractor = "none"\nchunk_size = 64\nchunker = "sentence"\n')
    store = tmp_path / "store"
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["build", str(src), "--store", str(store), "--config", str(config), "--chunk-size", "96"],
    )
    assert result.exit_code == 0, result.output
    st = Store.at(store)
    max_tokens = max(c.n_tokens for c in read_rows(st, ChunkRow))
    n_nuggets = len(read_rows(st, NuggetRow))
    con = duckdb.connect()
    assert 64 < max_tokens <= 96 and n_nuggets == 0
    params = con.execute(
        f"SELECT parameters_json FROM read_parquet('{store}/tables/runs/*.parquet') LIMIT 1"
    ).fetchone()[0]
    assert json.loads(params)["chunk_size"] == 96
    unknown = tmp_path / "bad.toml"
    unknown.write_text("[build]\nchunk_sise = 64\n")
    bad = runner.invoke(app, ["build", str(src), "--store", str(store), "--config", str(unknown)])
    assert bad.exit_code == 2 and "chunk_sise" in bad.output
