"""No process outlives a killed build (issue 12, item 4): Prefect's temporary API server is bound
to the ``coinrag`` process that started it (``flows/prefect_api.py``).

The real ``coinrag build`` runs in a subprocess with its own PREFECT_HOME; every process whose
environment carries that PREFECT_HOME is the build or one of its descendants (the uvicorn
server among them). Once the flow run has begun, the build is killed with SIGKILL or SIGTERM,
and no such process may remain a few seconds later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

COINRAG = str(Path(sys.executable).parent / "coinrag")
REPO = Path(__file__).resolve().parents[2]


def processes_with_home(home: Path) -> dict[int, str]:
    """``{pid: command line}`` of the live (not zombie) processes whose environment has
    ``PREFECT_HOME=home``."""
    marker = f"PREFECT_HOME={home}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found[int(entry.name)] = cmdline
    return found


def wait_for(predicate, timeout: float, step: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.heavy
def test_a_killed_build_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    home = tmp_path / "prefect-home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_LOGGING_LEVEL="INFO", OMP_NUM_THREADS="1")
    log = tmp_path / "build.log"
    with log.open("w") as err:
        build = subprocess.Popen(
            [
                COINRAG,
                "build",
                "sample",
                "--store",
                str(tmp_path / "store"),
                "--extractor",
                "rules",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    try:
        begun = wait_for(
            lambda: "Beginning flow run" in log.read_text() or build.poll() is not None, 600
        )
        assert begun and build.poll() is None, log.read_text()
        time.sleep(1.0)  # inside the flow, with the server in use
        others = {p: c for p, c in processes_with_home(home).items() if p != build.pid}
        assert any("uvicorn" in c for c in others.values()), others  # the temporary server
        build.send_signal(sig)
        code = build.wait(timeout=120)
    finally:
        if build.poll() is None:
            build.kill()
            build.wait()
    # SIGKILL: the kernel kills the server with its parent; SIGTERM: a clean exit, whose
    # atexit stops the server (Prefect's stop: terminate, kill after 5 s).
    gone = wait_for(lambda: not processes_with_home(home), 15)
    left = processes_with_home(home)
    for pid in left:  # never leave them running, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert gone, left
    assert code == -sig if sig == signal.SIGKILL else code == 128 + sig, (code, log.read_text())
    if sig == signal.SIGTERM:
        assert "Traceback" not in log.read_text()


def test_the_bound_server_runs_prefects_own_command(monkeypatch) -> None:
    """:class:`BoundServer` starts exactly Prefect's uvicorn command and environment, plus the
    death signal (so a Prefect upgrade that changes the command is noticed here)."""
    from prefect.server.api.server import SubprocessASGIServer

    from coinrag.flows.prefect_api import _server_class

    calls: list[dict] = []

    class Recorder:
        def __init__(self, **kwargs) -> None:
            calls.append(kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    theirs = SubprocessASGIServer(port=18765)
    ours = _server_class()(port=18766)
    try:
        theirs._run_uvicorn_command()
        ours._run_uvicorn_command()
    finally:
        SubprocessASGIServer._instances.pop(18765, None)
        SubprocessASGIServer._instances.pop(18766, None)
    mine = calls[1]
    assert callable(mine.pop("preexec_fn"))
    assert [a.replace("18766", "18765") for a in mine["args"]] == calls[0]["args"]
    assert mine["env"] == calls[0]["env"] and set(mine) == set(calls[0])
