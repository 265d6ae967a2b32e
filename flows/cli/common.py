"""What every command of the ``coinrag`` CLI shares: the error line, the usage errors a command
raises itself (:class:`CommandError`), the options several commands declare alike, and the
start of Prefect before a command's first flow run.

A command stays thin: it checks its own arguments (raising :class:`CommandError`), runs the
checks of ``flows/preflight.py`` (their :class:`~flows.preflight.Preflight` carries the exit
status), calls one flow or function and prints. Every error that declares an ``exit_code``
(``Preflight``, ``SettingsError``, ``MissingAssets``, ``StoreLocked``, ...) becomes one
``error:`` line and that exit status in ONE place, ``flows/cli/root.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

console = Console(stderr=True)
SAMPLE = Path(__file__).parent.parent / "sample" / "wiki_sample.jsonl"
DEBUG = {"on": False}  # --debug: tracebacks of unexpected errors, Prefect's included


class CommandError(Exception):
    """A command's own refusal of its arguments or inputs: the message and the exit status
    (2: a value that can never work; 1: something missing or failed)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def error(message: str) -> None:
    """One ``error:`` line on stderr (never wrapped: paths stay whole and greppable)."""
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def fail(message: str, exit_code: int = 1) -> None:
    """Stop the command: ``message`` as its error line, exit ``exit_code``."""
    raise CommandError(message, exit_code)


@contextmanager
def exit_on(exit_code: int, *kinds: type[BaseException]) -> Iterator[None]:
    """Inside, a built-in error of ``kinds`` (``ValueError``, ``LookupError``, ``OSError``:
    what a called library raises for a bad input) stops the command with its message and
    ``exit_code``; an error that declares its own ``exit_code`` keeps it."""
    try:
        yield
    except kinds as exc:
        if isinstance(getattr(exc, "exit_code", None), int):
            raise
        raise CommandError(str(exc), exit_code) from exc


def given(overrides: dict[str, Any]) -> dict[str, Any]:
    """The generated settings options that were given (``None``: not given)."""
    return {name: value for name, value in overrides.items() if value is not None}


def source_path(source: str) -> str:
    """SOURCE as given, or the bundled sample corpus for ``sample``."""
    return str(SAMPLE) if source == "sample" else source


def prefect_run() -> None:
    """Before a command's first flow run: Prefect's temporary server bound to this process
    (``flows/prefect_api.py``), and Prefect's console tracebacks only with --debug."""
    from coinrag.flows.prefect_api import bind_temporary_server, hide_prefect_tracebacks

    if not DEBUG["on"]:
        hide_prefect_tracebacks()
    bind_temporary_server()


def require_local(store: str, what: str) -> None:
    """Fail (exit 1, ``LocalStoreRequired``) before any work when ``what`` is asked of an
    object store."""
    from coinrag.flows.preflight import store_at

    store_at(store).require_local(what)


def print_json(summary: Any) -> None:
    """A flow's summary as JSON on stdout."""
    import json

    Console().print_json(json.dumps(summary, default=str))


# Options several commands declare alike.
BuiltStore = Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")]
LocalStore = Annotated[str, typer.Option("--store", help="A built store (a local folder).")]
WritableStore = Annotated[
    str,
    typer.Option("--store", help="The store: a folder (created if absent) or s3://bucket/prefix."),
]
ModelOption = Annotated[str | None, typer.Option(help="Generation model (default: the store's).")]
# None: the [build] table of --config, else the default.
ConfigOption = Annotated[
    Path | None, typer.Option(help="TOML file with a \\[build] table of the same settings.")
]
