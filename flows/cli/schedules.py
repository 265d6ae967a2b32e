"""``coinrag serve`` (the build as a Prefect deployment, on a schedule and on change) and
``coinrag watch`` (the change events); both need a Prefect server (PREFECT_API_URL)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from coinrag.flows.cli import common
from coinrag.flows.cli.common import ConfigOption, WritableStore, console, fail
from coinrag.flows.settings_options import with_settings_options
from coinrag.schemas.settings import BuildSettings


@with_settings_options(BuildSettings)
def serve(
    source: Annotated[
        str, typer.Argument(help="What to build (as for `coinrag build`), or 'sample'.")
    ],
    store: WritableStore,
    cron: Annotated[
        str | None,
        typer.Option(help='Cron schedule, e.g. "0 3 * * *" (UTC); none: on change only.'),
    ] = None,
    name: Annotated[str, typer.Option(help="Deployment name.")] = "coinrag-build-scheduled",
    train_data: Annotated[
        Path | None,
        typer.Option("--train-data", help="QA JSONL: also fine-tune after each build."),
    ] = None,
    train_out: Annotated[
        Path | None, typer.Option("--train-out", help="Folder of the fine-tuned model.")
    ] = None,
    config: ConfigOption = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Serve the build as a Prefect deployment: on --cron, and on `coinrag watch` events.

    Long-running (needs PREFECT_API_URL, see infra/prefect_server.py); Ctrl-C stops it and
    pauses its schedule. Deployment construction: flows/deployments.py.
    """
    from coinrag.flows import deployments, preflight
    from coinrag.schemas.settings import load_settings

    source = common.source_path(source)
    preflight.prefect_api("serve")
    preflight.source(source)
    st = preflight.store_to_write(store, False)
    if (train_data is None) != (train_out is None):
        fail("--train-data and --train-out go together", 2)
    if train_data is not None and not train_data.is_file():
        fail(f"--train-data {train_data} does not exist", 1)
    settings = load_settings(config, overrides)
    preflight.build_settings(settings)
    with common.exit_on(2, ValueError):  # a bad cron
        made = deployments.make_serve_deployments(
            str(Path(source).expanduser().resolve()),
            st.url,
            settings.to_dict(),
            cron=cron,
            name=name,
            train_data=str(train_data.resolve()) if train_data else None,
            train_out=str(train_out.expanduser().resolve()) if train_out else None,
        )
    with common.exit_on(1, RuntimeError):
        deployments.serve_build(made)


def watch(
    source: Annotated[str, typer.Argument(help="The source a served build deployment builds.")],
    store: Annotated[str, typer.Option("--store", help="Its store (folder or s3:// URL).")],
    interval: Annotated[float, typer.Option(help="Seconds between checks.")] = 30.0,
    once: Annotated[bool, typer.Option("--once", help="Check once and exit.")] = False,
) -> None:
    """Emit `coinrag.source.changed` (Prefect event) when SOURCE holds documents a build would
    (re)build (new, edited, or deleted from STORE) or STORE holds live documents SOURCE no
    longer has.

    A deployment served by `coinrag serve` for SOURCE rebuilds on that event (and drops the
    removed documents when its settings have prune = true). Needs PREFECT_API_URL; exits 1 when
    the server does not confirm it received the event.
    """
    from coinrag.flows import preflight

    source = common.source_path(source)
    if interval <= 0:
        fail("--interval must be > 0", 2)
    preflight.prefect_api("watch")
    preflight.source(source)
    preflight.store_to_write(store, False)

    from coinrag.flows.source_events import watch_source
    from coinrag.tasks.changes import deleted_doc_ids

    def report(ids: list[str], removed: list[str]) -> None:
        text = f"coinrag.source.changed: {len(ids)} document(s): {', '.join(ids[:10])}"
        back = deleted_doc_ids(str(store), ids)
        if back:
            text += (
                f" ({len(back)} deleted from the store but still in SOURCE: a build brings "
                f"them back: {', '.join(back[:10])})"
            )
        if removed:
            text += f"; {len(removed)} removed: {', '.join(removed[:10])}"
        console.print(text, soft_wrap=True, markup=False)

    with common.exit_on(1, RuntimeError):
        changed, removed = watch_source(
            source, str(store), interval=interval, once=once, report=report
        )
    if not changed and not removed:
        console.print("no changed documents")
