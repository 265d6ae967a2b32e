"""The ``runs`` table: one row when a run starts, one when it ends (latest row wins)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc

from coinrag.schemas.keys import CODE_VERSION, canonical_json
from coinrag.schemas.secrets import env_secrets, scrub
from coinrag.schemas.tables import RunRow
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows


def start_run(store: Store, run_id: str, flow: str, parameters: dict[str, Any]) -> RunRow:
    """Record a run as ``running``; ``parameters`` must hold no secrets."""
    row = RunRow(
        run_id=run_id,
        flow=flow,
        status="running",
        started_at=datetime.now(UTC),
        ended_at=None,
        parameters_json=canonical_json(parameters),
        code_version=CODE_VERSION,
        fingerprints_json="{}",
        counts_json="{}",
        cost_usd=0.0,
        error=None,
    )
    append_rows(store, [row], run_id, "run-start")
    return row


def finish_run(
    store: Store,
    started: RunRow,
    status: str,
    *,
    fingerprints: dict[str, str] | None = None,
    counts: dict[str, Any] | None = None,
    cost_usd: float = 0.0,
    error: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> RunRow:
    """Record the end of a run (``completed`` or ``failed``); ``parameters`` replaces the
    start row's where the run resolved a setting (e.g. ``kv_dtype = "auto"``)."""
    row = replace(
        started,
        status=status,
        parameters_json=(
            started.parameters_json if parameters is None else canonical_json(parameters)
        ),
        ended_at=datetime.now(UTC),
        fingerprints_json=canonical_json(fingerprints or {}),
        counts_json=canonical_json(counts or {}),
        cost_usd=cost_usd,
        error=error,
    )
    append_rows(store, [row], started.run_id, "run-end")
    return row


def recorded_fingerprints(store: Store, run_id: str) -> dict[str, str]:
    """The fingerprints run ``run_id`` recorded when it ended (``{}``: none, or no such run)."""
    import json

    rows = read_rows(store, RunRow, filter=pc.field("run_id") == run_id)
    ended = [r for r in rows if r.ended_at is not None]
    return json.loads(ended[-1].fingerprints_json) if ended else {}


def run_error(exc: BaseException) -> str:
    """What the ``runs`` row's ``error`` says about ``exc``: its type and message, scrubbed of
    secrets (``schemas.secrets``)."""
    return scrub(f"{type(exc).__name__}: {exc}", env_secrets())


@contextmanager
def failing_run(store: Store, run: RunRow, relock: bool = False) -> Iterator[None]:
    """Record ``run`` as failed (:func:`run_error`) if the block raises, then re-raise (a
    Ctrl-C or SIGTERM included). ``relock``: take the store's write lock to write the row (a
    block that ran without it, e.g. training)."""
    try:
        yield
    except BaseException as exc:
        with store.write_lock(run.run_id) if relock else nullcontext():
            finish_run(store, run, "failed", error=run_error(exc))
        raise
