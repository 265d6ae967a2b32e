"""The ``coinrag.source.changed`` Prefect event: a source differs from its store.

Event (one per detected change set)::

    event:    coinrag.source.changed
    resource: {"prefect.resource.id": "coinrag.source.<sha256(abs source path)[:16]>",
               "prefect.resource.name": "<abs source path>",
               "coinrag.store": "<abs store path>"}
    payload:  {"doc_ids": [...changed or new document ids...], "n_changed": N,
               "removed_doc_ids": [...live in the store, gone from the source...],
               "n_removed": M}

The build deployment of ``flows/deployments.py`` has a trigger on this event for its
source's resource id, so a watcher (``coinrag watch``) makes the server start an incremental
build (removed documents leave the store when the deployment's settings have ``prune = true``;
otherwise the event only reports them). Only ids reach the event, never document text.
"Changed" includes documents deleted from the store that the source still holds: a build
brings them back (``tasks.changes``). An event is reported sent only once the server has
confirmed it (:func:`emit_source_changed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Any

from coinrag.storage.store import Store

SOURCE_CHANGED_EVENT = "coinrag.source.changed"


def source_path(source: str) -> str:
    """The absolute path that names ``source`` in events and deployment parameters."""
    return str(Path(source).expanduser().resolve())


def source_resource_id(source: str) -> str:
    """``coinrag.source.<16 hex>``: the event resource id of a source (by absolute path)."""
    return "coinrag.source." + sha256(source_path(source).encode()).hexdigest()[:16]


class EventNotDelivered(RuntimeError):
    """The Prefect API did not confirm that it received an event (unreachable, refusing)."""


def emit_source_changed(
    source: str, store: str, doc_ids: list[str], removed: list[str] | None = None
) -> Any:
    """Send ``coinrag.source.changed`` for changed ``doc_ids`` and ``removed`` ids to the Prefect
    API and wait until the server has it; return the Event.

    Needs ``PREFECT_API_URL`` (``RuntimeError`` without it). Unlike ``prefect.events.emit_event``
    (a background worker that logs and drops what it cannot send), this sends on its own
    websocket and waits for the server's answer to a ping sent after the event (the events
    client's checkpoint): :class:`EventNotDelivered` if the server cannot be reached or does
    not answer.
    """
    from prefect.events import Event
    from prefect.events.clients import get_events_client
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.asyncutils import run_coro_as_sync

    api_url = PREFECT_API_URL.value()
    if not api_url:
        raise RuntimeError("PREFECT_API_URL is not set: events need a running Prefect server")
    event = Event(
        event=SOURCE_CHANGED_EVENT,
        resource={
            "prefect.resource.id": source_resource_id(source),
            "prefect.resource.name": source_path(source),
            "coinrag.store": Store.at(store).url,
        },
        payload={
            "doc_ids": list(doc_ids),
            "n_changed": len(doc_ids),
            "removed_doc_ids": list(removed or []),
            "n_removed": len(removed or []),
        },
    )

    async def deliver() -> None:
        # checkpoint_every=1: emit() pings after sending and waits for the pong, so a return
        # means the server read the event off the socket.
        async with get_events_client(reconnection_attempts=2, checkpoint_every=1) as client:
            await client.emit(event)

    # Prefect's own warning says what ours says, less precisely: one line is enough.
    client_log = logging.getLogger("prefect.events.clients")
    level = client_log.level
    client_log.setLevel(logging.ERROR)
    try:
        run_coro_as_sync(deliver())
    except Exception as exc:  # noqa: BLE001 - any failure means: not delivered
        raise EventNotDelivered(
            f"could not deliver {SOURCE_CHANGED_EVENT} to the Prefect API at {api_url} "
            f"({type(exc).__name__}: {exc}); is the server running (python "
            "infra/prefect_server.py) and PREFECT_API_URL right?"
        ) from exc
    finally:
        client_log.setLevel(level)
    return event


def watch_source(
    source: str,
    store: str,
    interval: float = 30.0,
    once: bool = False,
    report: Callable[[list[str], list[str]], None] | None = None,
) -> tuple[list[str], list[str]]:
    """Poll SOURCE every ``interval`` seconds; emit an event when its delta (changed ids,
    removed ids) is new.

    The same delta is announced once (the build it triggers empties it); a different one is
    announced again. ``once``: check a single time and return ``(changed, removed)``. Runs
    until interrupted otherwise; raises :class:`EventNotDelivered` when the server does not
    confirm an event (the caller says so and stops: nothing is announced that was not sent).
    """
    from coinrag.tasks.changes import source_delta

    announced: tuple[list[str], list[str]] = ([], [])
    while True:
        changed, removed = delta = source_delta(source, store)
        if (changed or removed) and delta != announced:
            emit_source_changed(source, store, changed, removed)
            if report:
                report(changed, removed)
        announced = delta
        if once:
            return delta
        time.sleep(interval)
