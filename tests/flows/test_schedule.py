"""Scheduled and event-triggered builds against a real Prefect server.

One ``infra/prefect_server.py`` (``prefect server start`` on 127.0.0.1, SQLite in a temporary
PREFECT_HOME, a process work pool and worker, the ``llm-endpoint`` tag limit) serves the module;
``coinrag serve`` (a runner) and ``prefect deploy`` of ``prefect.yaml`` (the worker) each run a
real build of a two-document JSONL corpus with the ``rules`` extractor, no KV, no index.
Every process started here is stopped at the end, and checked to be gone, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from store_fixtures import REPO, load_script

READY_MARK = load_script(REPO / "infra" / "prefect_server.py").READY_MARK
LLM_LIMIT = 3
CRON = "0 3 * * *"
FAST_RULES = {"extractor": "rules", "kv": False, "index": False}
DOCS = [
    {"id": "alpha", "text": "Alpha is the first letter. It starts the Greek alphabet."},
    {"id": "beta", "text": "Beta is the second letter of the alphabet. It follows alpha."},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(check: Callable[[], Any], timeout: float, what: str, logs: list[Path]) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the logs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def _family(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(family: list[psutil.Process]) -> list[psutil.Process]:
    """Processes of ``family`` still running (zombies count as gone)."""
    alive = []
    for p in family:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _ctrl_c_enabled() -> None:
    """In the child, before exec: SIGINT back to its default, so Python turns Ctrl-C into
    KeyboardInterrupt even when the tests run as a background job of a non-interactive shell
    (such a shell starts them with SIGINT ignored, and children inherit the ignore)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen, timeout: float) -> tuple[int | None, list[str]]:
    """Ctrl-C ``proc`` (SIGINT, again after ``timeout / 2``) and wait; then SIGKILL whatever of
    its tree is left.

    Returns (exit code or None if it had to be killed, the processes that were left over).
    """
    family = _family(proc)
    rc: int | None = None
    # A second Ctrl-C, as a person would press it, if the first one landed while Prefect's
    # runner was busy reaping a flow-run process (seen once under load: no shutdown in 60 s).
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout / 2)
            break
        except subprocess.TimeoutExpired:
            rc = None
    deadline = time.monotonic() + 10
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(family)
    names = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.poll()
    return rc, names


def _write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


def _doc_ids(store: Path) -> set[str]:
    from coinrag.schemas.tables import DocumentRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import column_values

    return column_values(Store.at(store), DocumentRow, "doc_id")


def _n_nuggets(store: Path) -> int:
    from coinrag.schemas.tables import NuggetRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_table

    return read_table(Store.at(store), NuggetRow, columns=["nugget_id"]).num_rows


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """infra/prefect_server.py on a free port; the test process's client points at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("prefect-server")
    home, port, log = root / "home", _free_port(), root / "server.log"
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "OMP_NUM_THREADS": "1",
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "infra" / "prefect_server.py"), "--home", str(home)]
            + ["--port", str(port), "--llm-limit", str(LLM_LIMIT), "--grace", "10"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            preexec_fn=_ctrl_c_enabled,
        )
    try:
        _wait_for(
            lambda: proc.poll() is not None or READY_MARK in log.read_text(),
            150,
            "the Prefect server",
            [log],
        )
        assert proc.poll() is None, log.read_text()
        with temporary_settings({PREFECT_API_URL: api_url}):
            yield {"env": env, "root": root, "log": log, "api_url": api_url}
    finally:
        # Ctrl-C the script: it stops the worker (and its flow runs), then the server.
        rc, left = _interrupt(proc, 60)
    assert rc == 0, f"prefect_server.py exited with {rc}\n{log.read_text()[-3000:]}"
    assert "coinrag-prefect: stopped" in log.read_text()
    assert not left, f"left running after the server script stopped: {left}"


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _runs_of(deployment_id, state_types: list[str] | None = None) -> list:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    flow_run_filter = (
        FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=state_types)))
        if state_types
        else None
    )
    with _client() as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            flow_run_filter=flow_run_filter,
        )


def _deployment(name: str):
    from prefect.exceptions import ObjectNotFound

    with _client() as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


def _final_run(run_id, logs: list[Path], timeout: float = 240):
    def final():
        with _client() as client:
            run = client.read_flow_run(run_id)
        return run if run.state and run.state.is_final() else None

    run = _wait_for(final, timeout, f"flow run {run_id} to finish", logs)
    assert run.state.is_completed(), f"{run.state}\n" + "\n".join(p.read_text() for p in logs)
    return run


def _assert_cron_scheduled(dep, logs: list[Path]) -> None:
    """The cron schedule is stored and the server's scheduler made runs at 03:00 UTC."""
    assert [s.schedule.cron for s in dep.schedules] == [CRON]
    assert dep.schedules[0].active
    runs = _wait_for(lambda: _runs_of(dep.id, ["SCHEDULED"]), 60, "scheduled runs", logs)
    times = {(r.expected_start_time.hour, r.expected_start_time.minute) for r in runs}
    assert times == {(3, 0)}, times


@pytest.mark.heavy
def test_llm_endpoint_tag_limit_exists(server):
    with _client() as client:
        limit = client.read_global_concurrency_limit_by_name("tag:llm-endpoint")
    assert limit.limit == LLM_LIMIT and limit.active


@pytest.mark.heavy
def test_serve_cron_run_and_source_changed_event(server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.events.filters import EventFilter, EventNameFilter

    from coinrag.tasks.changes import source_changes

    env = server["env"]
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    store = tmp_path / "store"
    config = tmp_path / "build.toml"
    config.write_text('[build]\nextractor = "rules"\nkv = false\nindex = false\n')
    log = tmp_path / "serve.log"
    logs = [log, server["log"]]
    with log.open("w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "coinrag.flows.cli", "serve", str(source), "--store", str(store)]
            + ["--cron", CRON, "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            preexec_fn=_ctrl_c_enabled,
        )
    try:
        dep = _wait_for(
            lambda: _deployment("coinrag-build/coinrag-build-scheduled"),
            120,
            "the served deployment",
            logs,
        )
        assert dep.parameters["source"] == str(source)
        assert dep.parameters["store"] == str(store)
        assert dep.parameters["settings"]["extractor"] == "rules"
        _assert_cron_scheduled(dep, logs)

        manual = run_deployment(dep.id, timeout=0)
        _final_run(manual.id, logs)
        assert _doc_ids(store) == {"alpha", "beta"}
        assert _n_nuggets(store) > 0

        # The extraction task (tag llm-endpoint) took a slot of the tag:llm-endpoint limit.
        def acquired():
            with _client() as client:
                page = client.read_events(
                    filter=EventFilter(
                        event=EventNameFilter(name=["prefect.concurrency-limit.acquired"])
                    ),
                    limit=50,  # the server's maximum (the client's default, 100, is refused)
                )
            return [
                e
                for e in page.events
                if e.resource.get("prefect.resource.name") == "tag:llm-endpoint"
            ]

        events = _wait_for(acquired, 60, "a tag:llm-endpoint acquisition event", logs)
        assert events[0].resource["limit"] == str(LLM_LIMIT)

        # A changed source: `coinrag watch` emits coinrag.source.changed; the trigger rebuilds.
        _write_jsonl(source, [*DOCS, {"id": "gamma", "text": "Gamma is the third letter."}])
        watch = [
            sys.executable,
            "-m",
            "coinrag.flows.cli",
            "watch",
            str(source),
            "--store",
            str(store),
        ]
        got = subprocess.run([*watch, "--once"], env=env, capture_output=True, text=True)
        assert got.returncode == 0, got.stderr
        assert "1 document(s): gamma" in got.stderr

        def triggered():
            done = _runs_of(dep.id, ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"])
            return [r for r in done if r.id != manual.id]

        (event_run,) = _wait_for(triggered, 240, "the run triggered by the event", logs)
        assert event_run.state.is_completed(), event_run.state
        assert _doc_ids(store) == {"alpha", "beta", "gamma"}
        assert source_changes(source, store) == []

        # Ctrl-C: clean exit, nothing left running, schedule paused.
        rc, left = _interrupt(serve, 120)
        assert rc == 0, log.read_text()[-3000:]
        assert not left, f"left running after coinrag serve stopped: {left}"
        assert _deployment("coinrag-build/coinrag-build-scheduled").paused
    finally:
        if serve.poll() is None:
            _interrupt(serve, 30)


@pytest.mark.heavy
def test_prefect_yaml_deploys_and_the_worker_runs_it(server, tmp_path):
    from prefect.deployments import run_deployment

    source = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    store = tmp_path / "store"
    logs = [server["log"]]
    env = {
        **server["env"],
        "COINRAG_SOURCE": str(source),
        "COINRAG_STORE": str(store),
        "COINRAG_TRAIN_DATA": str(tmp_path / "qa.jsonl"),
        "COINRAG_TRAIN_OUT": str(tmp_path / "ft"),
    }
    deploy = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy"]
        + ["--name", "coinrag-build-nightly", "--name", "coinrag-train-after-build"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    build = _deployment("coinrag-build/coinrag-build-nightly")
    train = _deployment("coinrag-train-nuggets/coinrag-train-after-build")
    assert build.work_pool_name == "coinrag" and train.work_pool_name == "coinrag"
    assert build.parameters["source"] == str(source)
    assert train.parameters["data"] == str(tmp_path / "qa.jsonl")
    _assert_cron_scheduled(build, logs)
    # Keep the worker off training (its data does not exist); its trigger still makes a run.
    with _client() as client:
        queue = client.read_work_queue_by_name("train", work_pool_name="coinrag")
        client.update_work_queue(queue.id, is_paused=True)

    run = run_deployment(build.id, parameters={"settings": FAST_RULES}, timeout=0)
    _final_run(run.id, logs)
    assert _doc_ids(store) == {"alpha", "beta"}
    assert _n_nuggets(store) > 0
    (after,) = _wait_for(lambda: _runs_of(train.id), 60, "the after-build training run", logs)
    assert after.parameters["store"] == str(store)
    assert not after.state.is_final()  # queued on the paused queue, never run here


def test_serve_deployments_construct(tmp_path):
    from coinrag.flows.deployments import make_build_deployment, make_serve_deployments
    from coinrag.flows.source_events import source_resource_id
    from coinrag.schemas.settings import SettingsError

    build, train = make_serve_deployments(
        "/data/docs", "/data/store", FAST_RULES, cron=CRON, train_data="/q.jsonl", train_out="/o"
    )
    assert build.parameters == {
        "source": "/data/docs",
        "store": "/data/store",
        "settings": FAST_RULES,
    }
    assert build.triggers[0].match.root["prefect.resource.id"] == source_resource_id("/data/docs")
    related = train.triggers[0].match_related.root
    assert related == {"prefect.resource.role": "deployment", "prefect.resource.name": build.name}
    with pytest.raises(ValueError, match="go together"):
        make_serve_deployments("/d", "/s", train_data="/q.jsonl")
    with pytest.raises(SettingsError, match="chunker"):
        make_build_deployment("/d", "/s", {"chunker": "paragraph"})


def test_source_changes(tmp_path, sample_corpus):
    from coinrag.tasks.changes import source_changes

    source = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    assert source_changes(source, tmp_path / "no-store") == ["alpha", "beta"]
    assert len(source_changes(sample_corpus, tmp_path / "no-store")) == 11


def test_removed_doc_ids_keep_rejected_records():
    from types import SimpleNamespace

    from coinrag.tasks.changes import removed_doc_ids

    docs = [SimpleNamespace(doc_id="a"), SimpleNamespace(doc_id="b")]
    assert removed_doc_ids(docs, ["a", "c", "r"]) == ["c", "r"]
    assert removed_doc_ids(docs, ["a", "c", "r"], rejected_ids=["r", None]) == ["c"]
