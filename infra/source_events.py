"""The ``coinrag.source.changed`` Prefect event: a source holds documents the store lacks.

Event (one per detected change set)::

    event:    coinrag.source.changed
    resource: {"prefect.resource.id": "coinrag.source.<sha256(abs source path)[:16]>",
               "prefect.resource.name": "<abs source path>",
               "coinrag.store": "<abs store path>"}
    payload:  {"doc_ids": [...changed or new document ids...], "n_changed": N}

The build deployment of ``infra/build_deployment.py`` has a trigger on this event for its
source's resource id, so a watcher (``coinrag watch``) makes the server start an incremental
build. Only ids reach the event, never document text.
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


def emit_source_changed(source: str, store: str, doc_ids: list[str]) -> Any:
    """Emit ``coinrag.source.changed`` for ``doc_ids``; return the Event (None if not sent).

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
        payload={"doc_ids": list(doc_ids), "n_changed": len(doc_ids)},
    )


def watch_source(
    source: str,
    store: str,
    interval: float = 30.0,
    once: bool = False,
    report: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Poll SOURCE every ``interval`` seconds; emit an event when its change set is new.

    The same set of changed ids is announced once (the build it triggers empties it); a
    different set is announced again. ``once``: check a single time and return the ids.
    Runs until interrupted otherwise.
    """
    from prefect.events.worker import EventsWorker

    from tasks.changes import source_changes

    announced: list[str] = []
    while True:
        changed = source_changes(source, store)
        if changed and changed != announced:
            emit_source_changed(source, store, changed)
            EventsWorker.drain_all()
            if report:
                report(changed)
        announced = changed
        if once:
            return changed
        time.sleep(interval)
