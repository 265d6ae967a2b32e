"""A process that reads an object store exits cleanly while reads run in other threads.

Arrow (through fsspec's handler) and DuckDB (through a registered fsspec filesystem) call into
Python from their own threads; a thread caught in such a call when the interpreter finalizes
aborts the process ("Fatal Python error: PyGILState_Release: thread state ... must be current
when releasing", exit 134), after all its work is done. ``storage/store.py``'s object store
therefore fetches Parquet bytes itself (Arrow scans memory), and the server's explorer warm-up
is a thread that an exit waits for (``inference/server/ui/pages.py``). Both checked here in
subprocesses, as users run them: a daemon thread scanning tables at exit, and ``coinrag api``
on an S3 store stopped with Ctrl-C while its explorer still opens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from api_harness import free_port

from coinrag.storage.location import object_filesystem

pytestmark = pytest.mark.heavy

BUCKET = "coinrag-exit-test"
COINRAG = str(Path(sys.executable).with_name("coinrag"))


@pytest.fixture(scope="module")
def s3_store(sample_store: Path):
    """The session's sample store in a bucket of a moto server on 127.0.0.1; the AWS variables
    (for the subprocesses) point at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "coinrag-exit-key",
        "AWS_SECRET_ACCESS_KEY": "coinrag-exit-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        object_filesystem.cache_clear()
        fs = object_filesystem("s3")
        fs.mkdir(BUCKET)
        for entry in sample_store.iterdir():  # not .lock: in a bucket it is a held lease
            if not entry.name.startswith("."):
                fs.put(str(entry), f"{BUCKET}/store/{entry.name}", recursive=entry.is_dir())
        yield f"s3://{BUCKET}/store", {**os.environ, **env, "OMP_NUM_THREADS": "1"}
        object_filesystem.cache_clear()
    server.stop()


SCANNING_AT_EXIT = textwrap.dedent(
    """
    import sys, threading, time
    from coinrag.schemas.tables import ChunkRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_table

    store = Store.at(sys.argv[1])
    read_table(store, ChunkRow)  # the store answers

    def scan_forever():
        while True:
            read_table(store, ChunkRow)

    threading.Thread(target=scan_forever, daemon=True).start()
    time.sleep(float(sys.argv[2]))
    print("exiting", flush=True)
    """
)


@pytest.mark.parametrize("seconds", [1.5, 2.5])
def test_exit_while_a_daemon_thread_scans_tables_of_an_s3_store(s3_store, seconds) -> None:
    """Before the fix this aborted in 2 of 3 runs (exit 134 after "exiting")."""
    url, env = s3_store
    done = subprocess.run(
        [sys.executable, "-c", SCANNING_AT_EXIT, url, str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "exiting" in done.stdout, done.stderr
    assert done.returncode == 0 and "Fatal Python error" not in done.stderr, done.stderr[-2000:]


def test_coinrag_api_on_an_s3_store_stops_cleanly_on_ctrl_c(s3_store) -> None:
    """Ctrl-C as soon as the server answers: its explorer is still opening the store's lineage
    over S3 (DuckDB reading through s3fs). Before the fix: exit 134 in 3 of 3 runs of the API
    test (``tests/inference/test_api_object_store.py``) run alone."""
    url, env = s3_store
    port = free_port()
    cmd = [COINRAG, "api", "--store", url, "--port", str(port), "--threads", "1"]
    cmd += ["--methods", "coinrag", "--max-new-tokens", "4"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "coinrag api never answered /health"
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=300)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    output = server.stdout.read().decode()
    assert code == 0 and "Fatal Python error" not in output, output[-3000:]
    assert "Shutting down" in output
