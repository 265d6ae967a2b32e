"""`coinrag api` as users start it (a subprocess on a free port with an API key, stopped with
Ctrl-C), its one-line errors (a non-loopback address without a key among them), and the
``threads`` setting every model-running command takes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_harness import free_port, metric_values
from typer.testing import CliRunner

from coinrag.flows import preflight
from coinrag.flows.cli import app
from coinrag.inference.model import threads
from coinrag.schemas.settings import ApiSettings
from coinrag.storage.readers import fresh_leases
from coinrag.storage.store import Store

COINRAG = str(Path(sys.executable).with_name("coinrag"))
KEY = "coinrag-cli-test-key-3b9d0c"
NO_KEY = {"COINRAG_API_KEY": None}  # CliRunner: unset


def _ctrl_c(server: subprocess.Popen) -> int:
    """Stop a ``coinrag api`` subprocess as a user does; its exit code (killed after 120 s)."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        raise


@pytest.mark.heavy  # over 5 s: the second tier
def test_coinrag_api_serves_the_sample_store_until_ctrl_c(sample_store: Path) -> None:
    """The secure start of the README: the key in $COINRAG_API_KEY, sent as a bearer token."""
    port = free_port()
    cmd = [COINRAG, "api", "--store", str(sample_store), "--port", str(port), "--threads", "1"]
    cmd += ["--methods", "coinrag", "--max-new-tokens", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COINRAG_API_KEY": KEY}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "coinrag api never answered /health"
            try:
                health = httpx.get(f"{base}/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health.json() == {"status": "ok"}  # liveness only, without the key
        assert httpx.get(f"{base}/health", headers=auth).json()["methods"] == ["coinrag"]
        body = {"question": "Who directed 2001: A Space Odyssey?"}
        assert httpx.post(f"{base}/query", json=body, timeout=60).status_code == 401
        answer = httpx.post(f"{base}/query", json=body, headers=auth, timeout=300).json()
        assert answer["method"] == "coinrag" and answer["evidence"]
        assert 1 <= len(answer["answer"].split()) and answer["timings"]["ttft"] > 0
        bad = httpx.post(
            f"{base}/query", json={**body, "method": "turborag"}, headers=auth, timeout=60
        )
        assert bad.status_code == 422 and "not served" in bad.json()["error"]
        # the server holds a reader lease on the version it serves (gc keeps it)
        (lease,) = fresh_leases(Store.at(sample_store))
        assert lease.versions == [Store.at(sample_store).published()]
    finally:
        code = _ctrl_c(server)
    output = server.stdout.read().decode()
    assert code == 0, output
    assert "loaded and warmed" in output and "Shutting down" in output
    assert KEY not in output
    # the model libraries' progress bars stay off the console (issue 22): coinrag's lines only
    assert "Loading weights" not in output and "it/s]" not in output, output
    assert fresh_leases(Store.at(sample_store)) == []  # released on Ctrl-C
    assert not (sample_store / "readers").exists()


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--store", "/nonexistent/store"], 1, "/nonexistent/store"),
        (["--store", "STORE", "--queue-limit", "0"], 2, "queue_limit must be >= 1"),
        (["--store", "STORE", "--threads", "-1"], 2, "greater than or equal to 0"),
        (["--store", "STORE", "--methods", "nope"], 2, "--methods nope"),
        (["--store", "STORE", "--port", "0"], 2, "--port"),
        (["--store", "STORE", "--api-key", "short"], 2, "at least 16 printable"),
        (["--store", "STORE", "--api-key-file", "/nonexistent/keys"], 1, "unreadable"),
        (["--store", "STORE", "--client-queue-limit", "0"], 2, "client_queue_limit must be"),
        (["--store", "STORE", "--client-rate", "-1"], 2, "client_rate must be >= 0"),
        (["--store", "STORE", "--host", "0.0.0.0"], 2, "no API key is set"),
    ],
)
def test_coinrag_api_errors_are_one_line(tmp_path: Path, args, code, says) -> None:
    (tmp_path / "store").mkdir()
    args = [str(tmp_path / "store") if a == "STORE" else a for a in args]
    result = CliRunner().invoke(app, ["api", *args], env=NO_KEY)
    assert result.exit_code == code, result.output
    assert says in result.output and result.output.count("error:") <= 1, result.output


def test_a_non_loopback_bind_without_a_key_is_refused_before_binding(sample_store: Path) -> None:
    """On a servable store, with the port taken: the refusal comes first (no model loaded, no
    bind tried: that would fail with "address already in use")."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = ["api", "--store", str(sample_store), "--host", "0.0.0.0", "--port", port]
        result = CliRunner().invoke(app, args, env=NO_KEY)
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: --host 0.0.0.0 is reachable from other machines")
    assert "export COINRAG_API_KEY=" in line and "--api-key-file" in line and "--insecure" in line


def test_api_access_preflight(tmp_path: Path) -> None:
    """Loopback needs no key; any other address needs one or --insecure (a warning then); a
    keys file's bad line is named by number, never quoted."""
    plain = ApiSettings()
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert preflight.api_access(host, None, plain) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        with pytest.raises(preflight.Preflight) as refused:
            preflight.api_access(host, None, plain)
        assert refused.value.code == 2
        assert preflight.api_access(host, KEY, plain) is None
    warning = preflight.api_access("0.0.0.0", None, ApiSettings(insecure=True))
    assert warning and "--insecure" in warning and "0.0.0.0" in warning
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# ours\n{KEY}\nnot a key\n", encoding="utf-8")
    with pytest.raises(preflight.Preflight) as bad:
        preflight.api_access("0.0.0.0", None, ApiSettings(api_key_file=str(keys)))
    assert bad.value.code == 2 and "line 3" in str(bad.value)
    assert "not a key" not in str(bad.value)
    keys.write_text(f"{KEY}\n", encoding="utf-8")
    assert preflight.api_access("0.0.0.0", None, ApiSettings(api_key_file=str(keys))) is None


def test_insecure_is_logged_once_as_a_warning(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="coinrag.api")
    args = ["api", "--store", str(tmp_path / "absent"), "--host", "0.0.0.0", "--insecure"]
    result = CliRunner().invoke(app, args, env=NO_KEY)
    assert result.exit_code == 1, result.output  # then the store check fails: not served
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.name == "coinrag.api" and "--insecure" in warning.getMessage()


def test_threads_default_holds_on_shared_cores(monkeypatch) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    assert threads.resolve_threads(0) == 1
    monkeypatch.setattr(threads, "usable_cpus", lambda: 16)
    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    assert threads.resolve_threads(0) == 4
    monkeypatch.setattr(threads, "physical_cores", lambda: 3)
    assert threads.resolve_threads(0) == 3
    assert threads.resolve_threads(6) == 6
    with pytest.raises(ValueError):
        threads.resolve_threads(-1)


def test_set_process_threads_sets_torch_and_the_pools(monkeypatch) -> None:
    import numpy  # noqa: F401  (its OpenBLAS is loaded, with a pool started at import)
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> set[int]:
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    before = torch.get_num_threads()
    for name in threads.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    try:
        assert threads.set_process_threads(2) == 2
        assert torch.get_num_threads() == 2
        assert all(os.environ[name] == "2" for name in threads.ENV_VARS)
        threadpool_limits(limits=3, user_api="blas")  # a pool wider than asked, as numpy starts it
        assert blas_threads() == {3}
        assert threads.set_process_threads(1) == 1
        assert blas_threads() == {1}  # the pool already loaded follows, not only later ones
    finally:
        threads.set_process_threads(before)


def test_threads_is_an_option_of_build_query_eval_and_api() -> None:
    for command in (["build"], ["query"], ["eval"], ["api"]):
        result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
        assert "--threads" in result.output, command


@pytest.mark.heavy
def test_workers_report_one_metrics_view(sample_store: Path) -> None:
    """``--workers 2``: /metrics from whichever worker answers counts every worker's requests;
    every worker takes the ``--api-key`` of the command line."""
    port = free_port()
    cmd = [COINRAG, "api", "--store", str(sample_store), "--port", str(port), "--threads", "1"]
    cmd += ["--methods", "coinrag", "--max-new-tokens", "2", "--workers", "2", "--api-key", KEY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("COINRAG_API_KEY", None)
    auth = {"Authorization": f"Bearer {KEY}"}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        loaded = 0
        output = b""
        while loaded < 2:  # both workers loaded and warmed (each logs once)
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "the workers never loaded"
            line = server.stdout.readline()
            output += line
            loaded += b"loaded and warmed" in line
        # a worker listens once its app has started, a moment after it logs "loaded"
        while True:
            assert server.poll() is None and time.monotonic() < deadline, output.decode()
            try:
                httpx.get(f"{base}/health", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.2)
        body = {"question": "Who directed 2001: A Space Odyssey?"}
        pids, sent = set(), 0
        while len(pids) < 2:  # until both workers answered (a new connection each time)
            assert sent < 40, f"40 connections all went to worker {pids}"
            with httpx.Client(timeout=300, headers=auth) as client:
                assert httpx.post(f"{base}/query", json=body, timeout=60).status_code == 401
                response = client.post(f"{base}/query", json=body)
                assert response.status_code == 200, response.text
                sent += 1
                pids.add(client.get(f"{base}/health").json()["pid"])
        for _ in range(4):  # every worker's view is the same sum
            with httpx.Client(timeout=60) as client:
                assert client.get(f"{base}/metrics").status_code == 401
                values = metric_values(client.get(f"{base}/metrics", headers=auth).text)
            key = (
                "coinrag_requests_total",
                (("endpoint", "query"), ("method", "coinrag"), ("status", "200")),
            )
            assert values[key] == sent, values
            served = [v for (name, _), v in values.items() if name == "coinrag_served_run_info"]
            assert served == [1.0]
    finally:
        code = _ctrl_c(server)
    assert code == 0, (output + server.stdout.read()).decode()
