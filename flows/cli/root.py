"""The ``coinrag`` application: the root command (``--debug``), the ONE place an error becomes
an exit status, and ``main``.

An exception that declares an integer ``exit_code`` (``flows/preflight.Preflight``,
``CommandError``, ``schemas.settings.SettingsError``, ``inference.methods.MissingAssets``,
``storage.store.StoreLocked``, ...) is one ``error:`` line and that status
(:class:`CoinragGroup`; so also under ``typer.testing.CliRunner``). Anything else is
unexpected: ``main`` prints it as one ``error:`` line naming its type, exit 1 (its traceback
with ``--debug``). Ctrl-C exits 130, SIGTERM 143, both unwinding.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from coinrag.flows.cli.common import DEBUG, console, error
from coinrag.inference.model.quiet import quiet_libraries

# Typer's own ways out (help, usage errors, typer.Exit): Typer reports them.
TYPER_EXITS = (typer.exceptions.TyperException, typer.Exit, typer.Abort)


def exit_code_of(exc: BaseException) -> int | None:
    """The exit status ``exc`` declares (None: an unexpected error). Typer's own exits and
    usage errors keep theirs: Typer reports them."""
    if isinstance(exc, TYPER_EXITS):
        return None
    code = getattr(exc, "exit_code", None)
    return code if isinstance(code, int) and not isinstance(code, bool) else None


class CoinragGroup(TyperGroup):
    """The root command: runs the subcommand and maps a declared error to its exit status."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:  # the CLI's boundary: a declared error is one line
            code = exit_code_of(exc)
            if code is None:
                raise
            error(str(exc))
            raise typer.Exit(code) from exc


app = typer.Typer(
    cls=CoinragGroup,
    help="coinrag: the offline asset factory for KV-cache-reuse RAG.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option("--debug", help="Show tracebacks, and model libraries' progress bars."),
    ] = False,
) -> None:
    """coinrag: the offline asset factory for KV-cache-reuse RAG."""
    DEBUG["on"] = debug
    if not debug:  # the model libraries' progress bars and self-talk: --debug shows them
        quiet_libraries()


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect's temporary API server gets 20 s to start by default: too little on a loaded
    # machine (seen: a build failing with "Timed out while attempting to connect").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from coinrag.flows.prefect_api import exit_on_sigterm

    exit_on_sigterm()  # SIGTERM unwinds like Ctrl-C: no orphan server, the run marked failed
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # the CLI's boundary: an unexpected error is one line too
        if DEBUG["on"] or "--debug" in sys.argv[1:]:
            raise
        text = " ".join(str(exc).split()) or "(no message)"
        console.print(
            f"[bold red]error:[/] {escape(type(exc).__name__)}: {escape(text)} "
            "(coinrag --debug ... shows the traceback)",
            soft_wrap=True,
        )
        sys.exit(1)
