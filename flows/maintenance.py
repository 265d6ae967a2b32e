"""Store maintenance: ``coinrag delete`` and ``coinrag gc``.

Each is a plain function (what the CLI runs: no Prefect server needed for a deletion) and a
Prefect flow of the same name for deployments and schedules. Both hold the store's write lock,
record a ``runs`` row, and change what readers see only at their commit point
(``storage.publish``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow

from coinrag.schemas.keys import new_run_id
from coinrag.storage.gc import GcReport, collect_garbage
from coinrag.storage.publish import publish
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.tasks.delete import delete_stage


def delete_documents(store: str, doc_ids: list[str]) -> dict[str, str]:
    """Tombstone live documents and take them out of the index; return ``{doc_id: version}``.

    Raises ``tasks.delete.UnknownDocuments`` (nothing written) if an id is not live, and
    ``storage.store.StoreLocked`` if a build holds the store.
    """
    st = Store.at(store)
    if not st.exists():
        raise FileNotFoundError(f"{st} is not a coinrag store")
    run_id = new_run_id("delete")
    with st.write_lock(run_id):
        run = start_run(st, run_id, "delete", {"doc_ids": list(doc_ids)})
        with failing_run(st, run):
            deleted = delete_stage(st, doc_ids, run_id)
            publish(st, run_id, "delete")
        finish_run(st, run, "completed", counts={"deleted": len(deleted)})
    return deleted


def gc_store(store: str, dry_run: bool = False) -> GcReport:
    """Reclaim dead KV entries, old index versions and leftovers of killed writes."""
    st = Store.at(store)
    if not st.exists():
        raise FileNotFoundError(f"{st} is not a coinrag store")
    run_id = new_run_id("gc")
    with st.write_lock(run_id):
        run = start_run(st, run_id, "gc", {"dry_run": dry_run})
        with failing_run(st, run):
            report = collect_garbage(st, run_id, dry_run=dry_run)
        finish_run(st, run, "completed", counts=gc_counts(report))
    return report


def gc_counts(report: GcReport) -> dict[str, Any]:
    """A report as flat counts (for the ``runs`` row and the CLI)."""
    return {
        "dry_run": report.dry_run,
        "live_content_keys": report.live_content_keys,
        "kv_entries_dropped": report.kv_entries_dropped,
        "kv_entries_moved": sum(k.entries_moved for k in report.kv),
        "kv_shards_compacted": sum(k.shards_compacted for k in report.kv),
        "kv_bytes_freed": sum(k.bytes_freed for k in report.kv),
        "kv_bytes_written": sum(k.bytes_written for k in report.kv),
        "index_versions_removed": sum(report.index_versions_removed.values()),
        "index_bytes_freed": report.index_bytes_freed,
        "temp_paths_removed": report.temp_paths_removed,
        "temp_bytes_freed": report.temp_bytes_freed,
        "reader_versions_kept": report.reader_versions_kept,
        "bytes_reclaimed": report.bytes_reclaimed,
        "kv": [asdict(k) for k in report.kv],
    }


@flow(name="coinrag-delete")
def delete_flow(store: str, doc_ids: list[str]) -> dict[str, str]:
    """:func:`delete_documents` as a Prefect flow."""
    return delete_documents(store, doc_ids)


@flow(name="coinrag-gc")
def gc_flow(store: str, dry_run: bool = False) -> dict[str, Any]:
    """:func:`gc_store` as a Prefect flow (e.g. scheduled after builds)."""
    return gc_counts(gc_store(store, dry_run))
