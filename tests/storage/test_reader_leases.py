"""Reader leases (``storage/readers.py``): a published version a reader still reads (the
``coinrag api`` server during and after a swap) survives ``coinrag gc`` and a build's index
compaction while its lease is fresh; once the lease is released or expires, gc reclaims it.

Real parts: a copy of the session's sample store (LanceDB, Zarr KV, Parquet), the CLI's
``delete`` and ``gc``, the index's own compaction (what the embed stage of a build runs).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.leases import ReaderLease
from coinrag.storage.gc import kv_fps
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import KvStore
from coinrag.storage.readers import (
    ReaderLeaseHolder,
    fresh_leases,
    lease_path,
    readers_dir,
    stale_lease_paths,
)
from coinrag.storage.store import Store

pytestmark = pytest.mark.usefixtures("prefect_harness")

RECORD = {"run_id": "r1", "time": "t", "index": {"versions": {"chunks": 3, "nuggets": 4}}}


def test_a_lease_is_written_renewed_and_released(tmp_path: Path) -> None:
    st = Store.at(tmp_path / "store")
    holder = ReaderLeaseHolder(st, lambda: [RECORD], ttl_s=0.6)
    holder.hold()
    (lease,) = fresh_leases(st)
    assert lease.reader == holder.reader and lease.versions == [RECORD]
    assert lease.index_versions() == [{"chunks": 3, "nuggets": 4}]
    time.sleep(0.45)  # one beat (ttl / 3) at least
    (renewed,) = fresh_leases(st)
    assert renewed.expires_unix > lease.expires_unix
    # a version about to be opened is leased before it is read, beside the held ones
    other = {"run_id": "r2", "index": {"versions": {"chunks": 5}}}
    assert holder.renew(extra=[other]).versions == [RECORD, other]
    holder.release()
    assert fresh_leases(st) == [] and not Path(readers_dir(st)).exists()


def test_expired_and_unreadable_leases_are_stale(tmp_path: Path) -> None:
    st = Store.at(tmp_path / "store")
    dead = ReaderLease("dead", "host", 1, expires_unix=time.time() - 1, versions=[RECORD])
    alive = ReaderLease("alive", "host", 2, expires_unix=time.time() + 60, versions=[RECORD])
    for lease in (dead, alive):
        st.write_bytes_atomic(lease_path(st, lease.reader), lease.to_json())
    st.write_bytes_atomic(lease_path(st, "cut"), b'{"reader": "cut", "expi')
    assert [lease.reader for lease in fresh_leases(st)] == ["alive"]
    assert sorted(Path(p).stem for p in stale_lease_paths(st)) == ["cut", "dead"]
    with pytest.raises(ValueError, match="ttl_s > 0"):
        ReaderLeaseHolder(st, list, ttl_s=0)


def _gc(store: Path) -> dict[str, int]:
    """The measures of ``coinrag gc``'s table (``measure  value`` rows)."""
    result = CliRunner().invoke(app, ["gc", "--store", str(store)])
    assert result.exit_code == 0, result.output
    out = {}
    for line in result.output.splitlines():
        m = re.match(r"^\W*([a-z_]+)\W+(\d+)\W*$", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def _index_rows(st: Store, record: dict) -> dict[str, str]:
    """chunk_id -> content_key of the index at a published version (raises if it is gone)."""
    table = LanceIndex.open(st, record).table("chunks").to_arrow()
    ids, keys = table.column("chunk_id").to_pylist(), table.column("content_key").to_pylist()
    return dict(zip(ids, keys, strict=True))


def test_gc_and_compaction_keep_what_a_reader_holds(tmp_path: Path, sample_store: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    st = Store.at(store)
    held = st.published()
    rows = _index_rows(st, held)
    table = LanceIndex.open(st, held).table("chunks").to_arrow()
    gone = table.column("doc_id")[0].as_py()
    gone_keys = {
        key
        for doc, key in zip(
            table.column("doc_id").to_pylist(), table.column("content_key").to_pylist(), strict=True
        )
        if doc == gone
    }
    assert gone_keys
    (fp,) = kv_fps(st)
    reader = ReaderLeaseHolder(st, lambda: [held], ttl_s=600)  # as `coinrag api` holds it
    reader.hold()
    try:
        result = CliRunner().invoke(app, ["delete", gone, "--store", str(store)])
        assert result.exit_code == 0, result.output
        assert st.published()["run_id"] != held["run_id"]
        LanceIndex.open_latest(st).ensure_indexes()  # a build's compaction and pruning
        report = _gc(store)
        assert report["reader_versions_kept"] == 1
        # the held version reads as before: its index rows and its KV entries
        assert _index_rows(st, held) == rows
        kv = KvStore.open(st, fp)
        assert gone_keys <= {r.content_key for r in kv.manifest().values()}
        for key in gone_keys:
            (kv_slice,) = kv.read_slices([(key, 0, 1)])
            assert kv_slice.numel() > 0
    finally:
        reader.release()
    # released: the next gc reclaims the version and the deleted document's KV
    report = _gc(store)
    assert report["reader_versions_kept"] == 0 and report["kv_entries_dropped"] >= len(gone_keys)
    with pytest.raises(Exception):  # noqa: B017 (Lance's error for a pruned version)
        _index_rows(st, held)
    kv = KvStore.open(st, fp)
    assert not gone_keys & {r.content_key for r in kv.manifest().values()}
    assert not Path(readers_dir(st)).exists()


def test_gc_removes_the_lease_of_a_dead_reader(tmp_path: Path, sample_store: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    st = Store.at(store)
    dead = ReaderLease("dead", "host", 1, expires_unix=time.time() - 1, versions=[st.published()])
    st.write_bytes_atomic(lease_path(st, dead.reader), dead.to_json())
    report = _gc(store)
    assert report["reader_versions_kept"] == 0 and report["temp_paths_removed"] >= 1
    assert not st.is_file(lease_path(st, dead.reader))


def test_a_lease_on_a_version_already_gone_does_not_stop_pruning(
    tmp_path: Path, sample_store: Path
) -> None:
    """A lease naming versions the tables no longer have (pruned before the reader leased
    them) keeps nothing: gc still prunes up to the published version."""
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    st = Store.at(store)
    docs = LanceIndex.open(st).table("chunks").to_arrow().column("doc_id").to_pylist()
    first, second = sorted(set(docs))[:2]
    time.sleep(1.5)  # pruning keeps versions within a second of the published one
    result = CliRunner().invoke(app, ["delete", first, "--store", str(store)])
    assert result.exit_code == 0, result.output
    _gc(store)  # the build's versions go (older than the published one)
    latest = LanceIndex.open_latest(st)
    gone = {name: 1 for name in ("chunks", "nuggets", "documents")}
    for name in gone:
        assert 1 not in {v["version"] for v in latest.table(name).list_versions()}
    published = st.published()
    record = {**published, "run_id": "old", "index": {**published["index"], "versions": gone}}
    dead = ReaderLease("late", "host", 1, expires_unix=time.time() + 600, versions=[record])
    st.write_bytes_atomic(lease_path(st, dead.reader), dead.to_json())
    time.sleep(1.5)  # pruning keeps versions within a second of the published one
    result = CliRunner().invoke(app, ["delete", second, "--store", str(store)])
    assert result.exit_code == 0, result.output
    report = _gc(store)
    assert report["reader_versions_kept"] == 0
    assert report["index_versions_removed"] > 0, report
