"""``coinrag watch`` tells the truth: an event it could not deliver is an error, and a document
deleted from the store that SOURCE still holds is a change (a build brings it back).

The real ``coinrag`` command in a subprocess, against a real Prefect server (the session's
``prefect_test_harness``: ``prefect server`` in its own process) or a closed port, over a real
store built with the rules extractor.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.flows.source_events import SOURCE_CHANGED_EVENT, source_resource_id
from coinrag.tasks.changes import source_changes, source_delta

pytestmark = pytest.mark.usefixtures("prefect_harness")

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    {"id": "alpha", "text": "Alpha is the first letter. It starts the Greek alphabet."},
    {"id": "beta", "text": "Beta is the second letter of the alphabet. It follows alpha."},
]


def _watch(source: Path, store: Path, api_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "coinrag.flows.cli", "watch", str(source), "--store", str(store)]
    return subprocess.run(
        [*cmd, "--once"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events_for(source: Path) -> list:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(
            filter=EventFilter(event=EventNameFilter(name=[SOURCE_CHANGED_EVENT])), limit=50
        )
    return [e for e in page.events if e.resource.id == source_resource_id(str(source))]


def _wait_events(source: Path, n: int, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _events_for(source)
        if len(got) >= n:
            return got
        time.sleep(0.5)
    pytest.fail(f"the server did not record {n} {SOURCE_CHANGED_EVENT} event(s) for {source}")


@pytest.mark.heavy  # over 10 s: the second tier
def test_watch_delivers_or_fails_and_reports_deleted_documents(tmp_path) -> None:
    from prefect.settings import PREFECT_API_URL

    api_url = str(PREFECT_API_URL.value())
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    store = tmp_path / "store"
    build_flow(str(source), str(store), {"extractor": "rules", "kv": False, "index": False})
    assert source_delta(source, store) == ([], [])

    # A new document, but no server listening: an error, not "delivered".
    with source.open("a") as out:
        out.write(json.dumps({"id": "gamma", "text": "Gamma is the third letter."}) + "\n")
    dead = _watch(source, store, f"http://127.0.0.1:{_closed_port()}/api")
    assert dead.returncode == 1, dead.stderr
    errors = [line for line in dead.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: could not deliver"), dead.stderr
    assert "coinrag.source.changed: 1 document" not in dead.stderr

    # The same change with the server up: delivered, and the server has it.
    live = _watch(source, store, api_url)
    assert live.returncode == 0, live.stderr
    assert "coinrag.source.changed: 1 document(s): gamma" in live.stderr
    (event,) = _wait_events(source, 1)
    assert event.payload["doc_ids"] == ["gamma"]

    # Build it, then delete a document that SOURCE still holds: a build would bring it back,
    # so the watcher reports it as changed (and says why).
    build_flow(str(source), str(store), {"extractor": "rules", "kv": False, "index": False})
    assert source_changes(source, store) == []
    deleted = CliRunner().invoke(app, ["delete", "beta", "--store", str(store)])
    assert deleted.exit_code == 0, deleted.output
    assert source_delta(source, store) == (["beta"], [])
    after = _watch(source, store, api_url)
    assert after.returncode == 0, after.stderr
    assert "no changed documents" not in after.stderr
    assert "coinrag.source.changed: 1 document(s): beta" in after.stderr
    assert "deleted from the store but still in SOURCE: a build brings them back" in after.stderr
    events = _wait_events(source, 2)
    assert sorted(e.payload["doc_ids"] for e in events) == [["beta"], ["gamma"]]
