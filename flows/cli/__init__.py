"""The ``coinrag`` command line: one module per command group, each command thin (check its
arguments, call one flow or function, print).

- ``flows/cli/root.py``: the root command (``--debug``), the ONE mapping from an error to its
  exit status, ``main``;
- ``flows/cli/common.py``: the error line, :class:`~flows.cli.common.CommandError`, shared
  options;
- ``store.py`` (build, delete, gc, verify), ``query.py`` (query, eval), ``api.py``,
  ``lineage.py``, ``train.py`` (train cartridges | nuggets | kvlink), ``schedules.py`` (serve,
  watch).

Options are generated from ``schemas/settings.py`` (``flows/settings_options.py``): ``build`` and
``serve`` from ``BuildSettings``, ``query`` from ``QueryOptions`` (as the server's requests are),
``eval`` from ``EvalOptions``, the runtime and server settings from ``RuntimeSettings`` /
``ApiSettings``.

Exit codes: 0 done; 1 failed (nothing or not everything was built: the message says why);
2 usage error (unknown option, bad value); 3 built, but some documents were rejected (listed);
4 built, but some work failed and is retried by the next build (chunk texts the LLM endpoint
did not answer, or answered only malformed: one ``error:`` line each); with rejects too, 4.
Chunk texts abandoned (malformed in ``abandon_after`` builds) are one ``warning:`` line, exit 0.
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): both unwind, leaving no process behind.

What can be checked cheaply is checked before any work (``flows/preflight.py``: paths,
models, keys, the lock), so a mistake costs a second and one ``error:`` line; an unexpected
error is one ``error:`` line too, its traceback (and Prefect's) shown with ``--debug``.
"""

from __future__ import annotations

from coinrag.flows.cli import api, lineage, query, schedules, store, train
from coinrag.flows.cli.root import app, main
from coinrag.flows.cli_lists import ListOptionsCommand

# The command table, in the order `coinrag --help` lists it.
app.command()(store.build)
app.command()(query.query)
app.command(cls=ListOptionsCommand)(api.api)
app.command("eval", cls=ListOptionsCommand)(query.eval_cmd)
app.command()(lineage.lineage)
app.add_typer(train.train_app, name="train")
app.command()(schedules.serve)
app.command()(schedules.watch)
app.command()(store.delete)
app.command()(store.gc)
app.command()(store.verify)

__all__ = ["app", "main"]
