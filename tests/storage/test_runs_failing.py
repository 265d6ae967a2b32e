"""``storage.runs.failing_run``: the one place a flow records a run that raised (build, delete,
gc, self-study, cartridges, train nuggets, train kvlink). The ``runs`` row says failed with the
exception's type and message, scrubbed of secrets (``schemas.secrets``); the exception goes on.
Real Parquet ``runs`` table in a temporary store."""

from __future__ import annotations

import pytest

from coinrag.schemas.secrets import SECRET_ENV_VARS, scrub
from coinrag.schemas.tables import RunRow
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

KEY = "not-shaped-like-a-key-0123456789"


def _last(store: Store, run_id: str) -> RunRow:
    rows = [r for r in read_rows(store, RunRow) if r.run_id == run_id]
    return max(rows, key=lambda r: (r.ended_at is not None, r.ended_at or r.started_at))


def test_a_raising_block_records_failed_without_secrets(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEY)
    st = Store.at(tmp_path / "store").init()
    with st.write_lock("run-1"):
        run = start_run(st, "run-1", "build", {"source": "x"})
        with pytest.raises(RuntimeError, match="endpoint"), failing_run(st, run):
            raise RuntimeError(f"endpoint http://bob:hunter2@127.0.0.1:9/v1 said {KEY}")
    row = _last(st, "run-1")
    assert row.status == "failed" and row.ended_at is not None
    assert row.error == "RuntimeError: endpoint http://***@127.0.0.1:9/v1 said ***"
    assert KEY not in row.error and "hunter2" not in row.error


def test_ctrl_c_is_recorded_and_relock_takes_the_lock(tmp_path) -> None:
    st = Store.at(tmp_path / "store").init()
    with st.write_lock("run-2"):
        run = start_run(st, "run-2", "train-nuggets", {})
    with pytest.raises(KeyboardInterrupt), failing_run(st, run, relock=True):
        raise KeyboardInterrupt
    assert _last(st, "run-2").status == "failed"
    assert _last(st, "run-2").error.startswith("KeyboardInterrupt")
    st.check_unlocked()  # the lock taken to write the row is released


def test_a_block_that_succeeds_writes_nothing(tmp_path) -> None:
    st = Store.at(tmp_path / "store").init()
    with st.write_lock("run-3"):
        run = start_run(st, "run-3", "gc", {})
        with failing_run(st, run):
            pass
        finish_run(st, run, "completed")
    assert _last(st, "run-3").status == "completed"
    assert sorted(r.status for r in read_rows(st, RunRow)) == ["completed", "running"]


def test_scrub_covers_every_secret_env_var(monkeypatch) -> None:
    from coinrag.schemas.secrets import env_secrets

    for i, name in enumerate(SECRET_ENV_VARS):
        monkeypatch.setenv(name, f"value-{i}-{KEY}")
    text = " ".join(f"value-{i}-{KEY}" for i in range(len(SECRET_ENV_VARS)))
    assert scrub(text, env_secrets()) == " ".join(["***"] * len(SECRET_ENV_VARS))
    assert scrub("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    assert scrub("key sk-proj-abcdef123") == "key sk-***"
    assert (
        scrub('"GET /query?api_key=abc123&x=1 HTTP/1.1"') == '"GET /query?api_key=***&x=1 HTTP/1.1"'
    )


def test_recorded_fingerprints_are_those_the_run_ended_with(tmp_path) -> None:
    """What the store explorer compares assets with (``stale_assets``): the fingerprints the
    published build recorded; none for a run still running or unknown."""
    from coinrag.storage.runs import recorded_fingerprints

    st = Store.at(tmp_path / "store").init()
    with st.write_lock("run-3"):
        run = start_run(st, "run-3", "build", {})
        assert recorded_fingerprints(st, "run-3") == {}  # started, not ended
        finish_run(st, run, "completed", fingerprints={"chunker_fp": "c1", "model_fp": "m1"})
    assert recorded_fingerprints(st, "run-3") == {"chunker_fp": "c1", "model_fp": "m1"}
    assert recorded_fingerprints(st, "no-such-run") == {}
