"""Start a local Prefect server, a process work pool, its worker and the LLM endpoint limit.

    python infra/prefect_server.py --home ~/.coinrag-prefect [--port 4200] [--pool coinrag]
        [--llm-limit 8] [--no-worker]

What it does, in order:

1. ``prefect server start`` on 127.0.0.1 (``--host`` to change), its SQLite database and
   settings under ``--home`` (``PREFECT_HOME``), analytics off; waits for ``/api/health``;
2. creates (or keeps) the ``process`` work pool ``--pool``;
3. sets the concurrency limit of the tag ``llm-endpoint`` to ``--llm-limit``. In Prefect 3.9
   a tag limit *is* a global concurrency limit named ``tag:llm-endpoint``: the task engine
   takes a slot of ``tag:<tag>`` for every tag of a task run, so this is the limit that
   throttles the build's extraction tasks across all flow runs on this server (a global limit
   named plain ``llm-endpoint`` would throttle nothing). Same as
   ``prefect concurrency-limit create llm-endpoint N``;
4. starts ``prefect worker start --pool POOL --type process`` (unless ``--no-worker``);
5. prints ``PREFECT_API_URL=...`` (export it in the shells that deploy or serve) and how to
   stop, then waits. Ctrl-C or SIGTERM stops the worker, then the server, each with its
   whole process tree (SIGTERM, then SIGKILL after ``--grace`` seconds); if either exits on
   its own the other is stopped too.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LLM_TAG = "llm-endpoint"
READY_MARK = "coinrag-prefect ready"


def server_env(home: Path, api_url: str) -> dict[str, str]:
    """The environment of every process of this server: its home, its URL, no analytics."""
    return {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }


def wait_healthy(api_url: str, server: subprocess.Popen, timeout: float) -> None:
    """Poll ``API/health`` until it answers 200; raise if the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout:.0f} s")


def configure(pool: str, llm_limit: int) -> None:
    """Create the process work pool (kept if it exists) and set the llm-endpoint tag limit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type=ProcessWorker.type,
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                )
            )
        except ObjectAlreadyExists:
            pass
        client.create_concurrency_limit(tag=LLM_TAG, concurrency_limit=llm_limit)


def stop_tree(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM ``proc`` and every descendant; SIGKILL whatever is left after ``grace`` s."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    proc.poll()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True, type=Path, help="PREFECT_HOME (SQLite db, logs).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4200)
    ap.add_argument("--pool", default="coinrag", help="Process work pool name.")
    ap.add_argument("--llm-limit", type=int, default=8, help="Concurrent llm-endpoint tasks.")
    ap.add_argument("--no-worker", action="store_true", help="Do not start a worker.")
    ap.add_argument("--grace", type=float, default=15.0, help="Seconds before SIGKILL on stop.")
    ap.add_argument("--timeout", type=float, default=120.0, help="Seconds to wait for health.")
    a = ap.parse_args(argv)
    if a.llm_limit < 1:
        ap.error(f"--llm-limit must be >= 1, got {a.llm_limit}")

    home = a.home.expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    api_url = f"http://{a.host}:{a.port}/api"
    env = server_env(home, api_url)
    os.environ.update(env)  # for the client used by configure()

    prefect = [sys.executable, "-m", "prefect"]
    children: list[subprocess.Popen] = []
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        server = subprocess.Popen(
            [*prefect, "server", "start", "--host", a.host, "--port", str(a.port)],
            env=env,
            start_new_session=True,  # Ctrl-C reaches this script, which stops the tree
        )
        children.append(server)
        wait_healthy(api_url, server, a.timeout)
        configure(a.pool, a.llm_limit)
        if not a.no_worker:
            worker = subprocess.Popen(
                [*prefect, "worker", "start", "--pool", a.pool, "--type", "process"],
                env=env,
                start_new_session=True,
            )
            children.append(worker)
        print(
            f"{READY_MARK}: PREFECT_API_URL={api_url} (UI http://{a.host}:{a.port}), "
            f"pool {a.pool!r}, tag limit {LLM_TAG}={a.llm_limit}, PREFECT_HOME={home}\n"
            f"  export PREFECT_API_URL={api_url}\n"
            f"  stop: Ctrl-C here, or kill {os.getpid()}",
            flush=True,
        )
        while not stopping and all(c.poll() is None for c in children):
            time.sleep(0.5)
        exited = [c.args[3] for c in children if c.poll() is not None]
        if exited and not stopping:
            print(f"coinrag-prefect: {', '.join(exited)} exited; stopping", file=sys.stderr)
            return 1
        return 0
    finally:
        for child in reversed(children):  # the worker (and its flow runs) before the server
            stop_tree(child, a.grace)
        print("coinrag-prefect: stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
