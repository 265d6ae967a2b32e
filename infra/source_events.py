"""The ``coinrag.source.changed`` Prefect event: a source differs from its store.

Event (one per detected change set)::

    event:    coinrag.source.changed
    resource: {"prefect.resource.id": "coinrag.source.<sha256(abs source path)[:16]>",
               "prefect.resource.name": "<abs source path>",
               "coinrag.store": "<abs store path>"}
    payload:  {"doc_ids": [...changed or new document ids...], "n_changed": N,
               "removed_doc_ids": [...live in the store, gone from the source...],
               "n_removed": M}

The build deployment of ``infra/build_deployment.py`` has a trigger on this event for its
source's resource id, so a watcher (``coinrag watch``) makes the server start an incremental
build (removed documents leave the store when the deployment's settings have ``prune = true``;
otherwise the event only reports them). Only ids reach the event, never document text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Any

from storage.store import Store

SOURCE_CHANGED_EVENT = "coinrag.source.changed"


def source_path(source: str) -> str:
    """The absolute path that names ``source`` in events and deployment parameters."""
    return str(Path(source).expanduser().resolve())


def source_resource_id(source: str) -> str:
    """``coinrag.source.<16 hex>``: the event resource id of a source (by absolute path)."""
    return "coinrag.source." + sha256(source_path(source).encode()).hexdigest()[:16]


def emit_source_changed(
    source: str, store: str, doc_ids: list[str], removed: list[str] | None = None
) -> Any:
    """Emit ``coinrag.source.changed`` for changed ``doc_ids`` and ``removed`` ids; return the
    Event (None if not sent).

    Needs ``PREFECT_API_URL`` (events go to that server); raises ``RuntimeError`` without it.
    """
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RuntimeError("PREFECT_API_URL is not set: events need a running Prefect server")
    return emit_event(
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
    until interrupted otherwise.
    """
    from prefect.events.worker import EventsWorker

    from tasks.changes import source_delta

    announced: tuple[list[str], list[str]] = ([], [])
    while True:
        changed, removed = delta = source_delta(source, store)
        if (changed or removed) and delta != announced:
            emit_source_changed(source, store, changed, removed)
            EventsWorker.drain_all()
            if report:
                report(changed, removed)
        announced = delta
        if once:
            return delta
        time.sleep(interval)
