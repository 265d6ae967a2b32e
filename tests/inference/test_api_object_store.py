"""`coinrag api` over an ``s3://`` store (a real S3 HTTP server on 127.0.0.1: moto), following a
`coinrag delete` published into the bucket."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from api_harness import serving
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.server.app import RUN_HEADER, ServerConfig
from coinrag.storage.location import object_filesystem
from coinrag.storage.readers import fresh_leases
from coinrag.storage.store import Store

pytestmark = pytest.mark.usefixtures("prefect_harness", "one_torch_thread")

BUCKET = "coinrag-api-test"
QUESTION = "Who directed 2001: A Space Odyssey?"


@pytest.fixture
def s3_store(monkeypatch, sample_store: Path) -> str:
    """The session's sample store copied into a bucket of a moto server on 127.0.0.1."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "coinrag-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "coinrag-test-secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    object_filesystem.cache_clear()
    fs = object_filesystem("s3")
    fs.mkdir(BUCKET)
    for entry in sample_store.iterdir():  # not .lock: in a bucket it would be a held lease
        if not entry.name.startswith("."):
            fs.put(str(entry), f"{BUCKET}/store/{entry.name}", recursive=entry.is_dir())
    try:
        yield f"s3://{BUCKET}/store"
    finally:
        object_filesystem.cache_clear()
        server.stop()


@pytest.mark.heavy  # over 10 s: the second tier
def test_api_serves_an_s3_store_and_follows_a_delete(s3_store: str) -> None:
    config = ServerConfig(
        store=s3_store,
        methods=("coinrag",),
        max_new_tokens=4,
        settings={"poll_interval": 0.3, "threads": 1},
    )
    st = Store.at(s3_store)
    with serving(config) as (base, _), httpx.Client(timeout=300) as client:
        first = client.post(f"{base}/query", json={"question": QUESTION, "kc": 4, "k": 10})
        assert first.status_code == 200, first.text
        assert first.headers[RUN_HEADER] == st.published()["run_id"]
        docs = {e["doc_id"] for e in first.json()["evidence"]}
        gone = sorted(docs - {"2001:-a-space-odyssey"})[0]
        result = CliRunner().invoke(app, ["delete", gone, "--store", s3_store])
        assert result.exit_code == 0, result.output
        run_id = st.published()["run_id"]
        deadline = time.monotonic() + 180
        while client.get(f"{base}/health").json()["run_id"] != run_id:
            assert time.monotonic() < deadline, "the server never served the delete"
            time.sleep(0.2)
        after = client.post(f"{base}/query", json={"question": QUESTION, "kc": 4, "k": 10})
        assert after.status_code == 200 and after.headers[RUN_HEADER] == run_id
        assert gone not in {e["doc_id"] for e in after.json()["evidence"]}
        assert after.json()["evidence"]
        # its reader lease lives in the bucket and names the version it serves now
        deadline = time.monotonic() + 60
        while [lease.versions for lease in fresh_leases(st)] != [[st.published()]]:
            assert time.monotonic() < deadline, fresh_leases(st)
            time.sleep(0.2)
    assert fresh_leases(st) == []  # released when the server stops
