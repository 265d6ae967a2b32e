"""The commit point of a build or a deletion: what readers see.

A writing run works on the tables' and the index's latest state; readers see only what the last
completed run **published**: ``[published]`` in ``STORE/coinrag.toml``, written in one atomic
rename together with the settings of that build (``[build]``)::

    [published]
    run_id = "build-20261129T221500-1a2b3c4d"   # this run's rows now count (storage/corpus.py)
    flow = "build"
    time = "2026-11-29T22:15:09+00:00"
    [published.index]                            # LanceIndex.open checks these versions out
    embedder_fp = "embedder-..."
    dim = 384
    [published.index.versions]
    chunks = 12
    nuggets = 14
    documents = 9

A run killed before this write leaves the previous file, hence the previous corpus view and
index versions; KV entries and cache rows it finished stay valid (they are keyed by content) and
the next run reuses them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store


def begin(store: Store) -> None:
    """Before a fresh store's first write: publish "nothing yet", so that readers of a store
    whose first build was killed get a clear "not built" rather than half an index. A store
    that already has an index but no ``[published]`` table (older code) is left as it is."""
    if store.published() is None and LanceIndex.read_meta(store) is None:
        store.write_settings(None, {"run_id": "", "flow": "", "time": ""})


def publish(
    store: Store, run_id: str, flow: str, settings: dict[str, Any] | None = None, index: bool = True
) -> dict[str, Any]:
    """Publish the index's latest versions (``index=False``: keep the published ones) and make
    ``run_id`` committed, with ``settings`` as ``[build]`` (None: keep them). Returns the record.
    """
    previous = store.published() or {}
    record: dict[str, Any] = {
        "run_id": run_id,
        "flow": flow,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    latest = LanceIndex.open_latest(store) if index else None
    if latest is not None:
        record["index"] = latest.published_state()
    elif previous.get("index"):
        record["index"] = previous["index"]
    store.write_settings(settings, record)
    return record


def publish_fusion(store: Store, run_id: str, flow: str, fusion: dict[str, Any]) -> dict[str, Any]:
    """Record ``fusion`` with the published index version: in ``coinrag-index.json`` (kept by
    later builds with the same embedder) and in ``[published.index]`` (what readers open), the
    table versions unchanged. The caller holds the write lock. Returns the record."""
    previous = store.published() or {}
    if not previous.get("index"):
        raise ValueError(
            f"{store.uri(store.index_dir)}: no published index to record a fusion with; "
            "run `coinrag build` first"
        )
    latest = LanceIndex.open_latest(store)
    if latest is not None and latest.meta.embedder_fp == previous["index"]["embedder_fp"]:
        latest.record_fusion(fusion)
    record = {
        "run_id": run_id,
        "flow": flow,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "index": {**previous["index"], "fusion": dict(fusion)},
    }
    store.write_settings(None, record)
    return record
