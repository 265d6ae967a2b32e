"""Prefect's temporary API server, bound to the life of the ``coinrag`` process that needs it.

Without ``PREFECT_API_URL``, Prefect 3.9 starts a temporary server for a flow run: the first
client that finds no URL calls ``SubprocessASGIServer().start()`` (``prefect/server/api/
server.py``), a ``python -m uvicorn ... prefect.server.api.server:create_app`` child, and stops
it from ``atexit``. ``atexit`` never runs when the process is killed (SIGKILL, or SIGTERM with
its default action), so the server outlived every killed build as an orphan of PID 1.

:func:`bind_temporary_server` fixes both ends:

- **SIGKILL** (nothing runs in the dying process): the server is started *here, now, in the
  main thread* as :class:`BoundServer`, whose child asks the kernel for ``SIGKILL`` when its
  parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, set between fork and exec; the signal follows
  the death of the thread that forked it, hence the main thread). It is registered as
  ``SubprocessASGIServer``'s default instance, as ``prefect.testing.utilities.
  prefect_test_harness`` registers its own, so every Prefect client of this process uses it
  and none starts another. SQLite keeps the server's database consistent through a kill.
- **SIGTERM**: :func:`exit_on_sigterm` turns it into ``SystemExit(143)``, a normal unwinding:
  ``finally`` blocks run (the run is recorded as failed, the lock released) and ``atexit``
  stops the server (Prefect's ``stop``: terminate, then kill after 5 s). Inside a flow run,
  Prefect's own SIGTERM bridge (``capture_sigterm``) marks the run crashed, restores this
  handler and re-sends the signal, which lands here.

Ctrl-C was already clean (KeyboardInterrupt unwinds the same way).

:func:`hide_prefect_tracebacks` keeps Prefect's console log lines without their tracebacks (the
``coinrag`` CLI without ``--debug``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from functools import partial
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SIGTERM_EXIT = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM


def _die_with_parent(parent: int, libc: Any) -> None:
    """In the forked child, before exec: be killed when ``parent`` dies (Linux)."""
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _libc() -> Any:
    """libc, loaded in the parent (the child only calls it); None off Linux."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _server_class() -> type:
    from prefect.server.api.server import SubprocessASGIServer

    class BoundServer(SubprocessASGIServer):
        """Prefect's temporary server, whose process dies with this one (see the module doc)."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect 3.9's SubprocessASGIServer._run_uvicorn_command, plus preexec_fn
            # (tests/test_prefect_api.py checks the command and environment stay Prefect's).
            import prefect
            from prefect.settings import get_current_settings

            server_env = {
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
            }
            return subprocess.Popen(
                args=[
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    **server_env,
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                preexec_fn=partial(_die_with_parent, os.getpid(), _libc()),
            )

    return BoundServer


def bind_temporary_server() -> Any | None:
    """Start the temporary server now, bound to this process, when Prefect would start one
    (no ``PREFECT_API_URL``, no server registered yet); return it (None: nothing to do). Call
    it from the main thread, before the first flow run."""
    import threading

    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or None in SubprocessASGIServer._instances:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None  # the death signal would follow this thread, not the process
    server = _server_class()()  # registers itself as the default (port None) instance
    server.start()
    return server


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(SIGTERM_EXIT)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind this process like Ctrl-C does (``finally``, ``atexit``), exit 143."""
    signal.signal(signal.SIGTERM, _raise_exit)


def hide_prefect_tracebacks() -> None:
    """Prefect logs a failed flow or task with its traceback on the console: keep the
    message, and say where the traceback is (records sent to the Prefect API keep it)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and handler.formatter is not None:
            handler.setFormatter(WithoutTraceback(handler.formatter))


class WithoutTraceback:
    """A log formatter that formats a record as ``inner`` does, without its traceback (the
    API handler may have rendered it into the record already: ``exc_text``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def format(self, record: Any) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            text = self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        if saved[0] is not None:
            text += "  (its traceback: coinrag --debug ...)"
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
