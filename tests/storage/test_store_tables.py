"""The store: Parquet round trips, DuckDB views, the write lock, safe paths."""

from __future__ import annotations

import multiprocessing
from datetime import UTC, datetime
from pathlib import Path

import pytest

from coinrag.schemas.keys import CODE_VERSION, chunk_id, content_key, doc_version, nugget_id
from coinrag.schemas.tables import TABLES, DocumentRow, RunRow, arrow_schema
from coinrag.storage.runs import finish_run, start_run
from coinrag.storage.store import Store, StoreLocked, safe_component
from coinrag.storage.tables import append_rows, connect_duckdb, read_rows


def _doc(i: int, run_id: str = "run-1") -> DocumentRow:
    text = f"text {i}"
    return DocumentRow(
        f"d{i}", doc_version(text, {}), text, "{}", "src", len(text), run_id, CODE_VERSION
    )


def test_every_table_has_a_schema_with_run_id() -> None:
    for name, record in TABLES.items():
        assert "run_id" in arrow_schema(record).names, name


def test_rows_round_trip_through_parquet(tmp_path: Path) -> None:
    store = Store.at(tmp_path).init()
    rows = [_doc(i) for i in range(5)]
    append_rows(store, rows[:2], "run-1", "ingest")
    append_rows(store, rows[2:], "run-1", "ingest")
    assert sorted(read_rows(store, DocumentRow), key=lambda r: r.doc_id) == rows
    assert append_rows(store, [], "run-1", "ingest") is None


def test_duckdb_reads_every_table_even_empty_ones(tmp_path: Path) -> None:
    store = Store.at(tmp_path).init()
    append_rows(store, [_doc(1), _doc(2)], "run-1", "ingest")
    run = start_run(store, "run-1", "build", {"x": 1})
    finish_run(store, run, "completed", counts={"documents": 2}, cost_usd=0.5)
    con = connect_duckdb(store)
    assert con.execute("SELECT count(*) FROM documents").fetchone() == (2,)
    assert con.execute("SELECT count(*) FROM nuggets").fetchone() == (0,)
    status = con.execute(
        "SELECT status FROM runs WHERE run_id = 'run-1' ORDER BY ended_at DESC NULLS LAST LIMIT 1"
    ).fetchone()
    assert status == ("completed",)
    rows = read_rows(store, RunRow)
    assert {r.status for r in rows} == {"running", "completed"}
    assert all(isinstance(r.started_at, datetime) and r.started_at.tzinfo for r in rows)


def _hold_lock(root: str, ready, release) -> None:
    store = Store.at(root)
    with store.write_lock("holder-run"):
        ready.set()
        release.wait(30)


def test_second_writer_is_refused_and_lock_dies_with_its_holder(tmp_path: Path) -> None:
    store = Store.at(tmp_path).init()
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(StoreLocked, match="holder-run"):
            with store.write_lock("second-run"):
                pass
    finally:
        holder.kill()
        holder.join()
    with store.write_lock("third-run"):  # a killed holder leaves no stale lock
        pass


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "", ".hidden", "x" * 300])
def test_unsafe_path_components_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        safe_component(bad)


def test_keys_are_deterministic_and_distinct() -> None:
    assert doc_version("a", {"k": 1}) == doc_version("a", {"k": 1})
    assert doc_version("a", {"k": 1}) != doc_version("a", {"k": 2})
    assert chunk_id("dv", 0, "t", "c") != chunk_id("dv", 1, "t", "c")
    assert content_key("t", [1, 2, 3]) != content_key("t", [1, 23])
    assert nugget_id("ch", 1, 5) != nugget_id("ch", 1, 6)
    assert datetime.now(UTC)  # keys are not time dependent; runs are
