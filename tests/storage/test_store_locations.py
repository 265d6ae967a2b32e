"""Store locations as subclasses: a local folder (:class:`LocalStore`) and an object-storage
prefix (:class:`ObjectStore`, against a real S3-compatible HTTP server on 127.0.0.1, moto's)
answer the same file operations the same way; one ``store_settings`` and one ``file_sha256``."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from coinrag.storage.cache import file_sha256
from coinrag.storage.location import object_filesystem
from coinrag.storage.store import LocalStore, ObjectStore, Store, StoreLocationError

BUCKET = "coinrag-locations"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; the AWS variables point at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "coinrag-test-key")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "coinrag-test-secret")
        mp.setenv("AWS_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        object_filesystem.cache_clear()
        object_filesystem("s3").mkdir(BUCKET)
        yield
        object_filesystem.cache_clear()
    server.stop()


def test_store_at_picks_the_location_subclass(tmp_path):
    local, remote = Store.at(tmp_path / "a"), Store.at(f"s3://{BUCKET}/p/")
    assert type(local) is LocalStore and local.is_local and local.root == tmp_path / "a"
    assert type(remote) is ObjectStore and not remote.is_local
    assert (remote.url, remote.uri(remote.index_dir)) == (
        f"s3://{BUCKET}/p",
        f"s3://{BUCKET}/p/index",
    )
    for st in (local, remote):  # workers receive stores pickled
        assert pickle.loads(pickle.dumps(st)) == st
    assert local != LocalStore(tmp_path / "b")
    with pytest.raises(TypeError):
        Store(tmp_path)  # the location is chosen by subclass


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "s3":
        request.getfixturevalue("s3")
        return Store.at(f"s3://{BUCKET}/ops-{tmp_path.name}")
    return Store.at(tmp_path / "store")


def test_both_locations_answer_the_file_operations_alike(store, tmp_path):
    store.init()
    settings = store.settings_path
    store.write_bytes_atomic(settings, b"[build]\n")
    assert store.is_file(settings) and store.read_bytes(settings) == b"[build]\n"
    assert store.exists() and store.list_names(store.root / "nothing") == []

    table = pa.table({"x": [1, 2, 3]})
    path = store.table_dir("t") / "run.stage.parquet"
    store.write_parquet(path, table)
    assert store.list_names(store.table_dir("t")) == ["run.stage.parquet"]  # no temporary file
    read = store.parquet_dataset([path], pa.schema([("x", pa.int64()), ("y", pa.string())]))
    assert read.to_table().equals(table.append_column("y", pa.nulls(3, pa.string())))
    assert store.tree_bytes(store.table_dir("t")) == store.tree_bytes(path) > 0

    import duckdb

    con = duckdb.connect(":memory:")
    store.register_with_duckdb(con)
    uri = store.absolute_uri(path)
    assert con.execute(f"SELECT sum(x) FROM read_parquet('{uri}')").fetchone() == (6,)

    store.write_bytes_atomic(store.index_dir / "data" / "a.lance", b"written once")
    store.write_bytes_atomic(store.index_dir / "meta.json", b"{}")
    dest = tmp_path / "copy"
    store.download(store.index_dir, dest, link_under=("data",))
    assert (dest / "data" / "a.lance").read_bytes() == b"written once"
    assert (dest / "meta.json").read_bytes() == b"{}"
    if store.is_local:  # immutable files are hard links, the rest copies
        assert (dest / "data" / "a.lance").stat().st_ino == Path(
            store.index_dir / "data" / "a.lance"
        ).stat().st_ino
        assert (dest / "meta.json").stat().st_nlink == 1

    folder = store.root / "readers"
    store.write_bytes_atomic(folder / "lease", b"1")
    store.remove_empty_folder(folder)  # still holds a file: stays
    assert store.list_names(folder) == ["lease"]
    store.remove(folder / "lease")
    store.remove_empty_folder(folder)
    assert store.list_names(store.root / "readers") == []
    if store.is_local:
        assert not Path(folder).exists()

    store.remove(store.table_dir("t"))
    assert store.tree_bytes(store.table_dir("t")) == 0 and not store.is_file(path)


def test_temporary_files_are_a_local_folders_only(tmp_path, s3):
    local = Store.at(tmp_path / "store").init()
    (Path(local.root) / "tables" / "t").mkdir()
    leftover = Path(local.root) / "tables" / "t" / ".x.parquet.tmp"
    leftover.write_bytes(b"")
    assert local.temp_files(["tables/*/.*.tmp", "kv/.tmp-*"]) == [leftover]
    assert local.scratch_base == Path(local.root)
    remote = Store.at(f"s3://{BUCKET}/temp")
    assert remote.temp_files(["tables/*/.*.tmp"]) == []
    assert remote.scratch_base != Path(local.root)


def test_one_store_settings():
    from coinrag.inference.methods import base
    from coinrag.storage import store
    from coinrag.tasks import fingerprints

    assert fingerprints.store_settings is base.store_settings is store.store_settings


def test_file_sha256_is_cached_until_the_file_changes(tmp_path, monkeypatch):
    """One file_sha256 (models' GGUFs, training data, eval questions): hashed once per (size,
    mtime), re-hashed when the file is rewritten in place."""
    monkeypatch.setenv("COINRAG_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"first version")
    assert file_sha256(str(path)) == hashlib.sha256(b"first version").hexdigest()
    assert len(list((tmp_path / "cache" / "sha256").iterdir())) == 1  # the sidecar
    path.write_bytes(b"other version")  # same size, new contents
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert file_sha256(path) == hashlib.sha256(b"other version").hexdigest()

    from coinrag.inference.model import loading as models
    from coinrag.training import finetune

    assert models.file_sha256 is finetune.file_sha256 is file_sha256


def test_where_a_build_may_write_is_checked_for_a_local_folder_only(tmp_path, s3):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    local = Store.at(tmp_path / "new" / "store")
    local.check_creatable("--store new")  # a folder to create
    local.check_not_a_file("--store new")
    with pytest.raises(StoreLocationError, match=r"^--store f is a file, not a folder: give"):
        Store.at(a_file).check_creatable("--store f")
    with pytest.raises(StoreLocationError, match=f"^--store s: {a_file} is a file, so no"):
        Store.at(a_file / "sub").check_creatable("--store s")
    with pytest.raises(StoreLocationError, match=r"^--store f is a file, not a coinrag store"):
        Store.at(a_file).check_not_a_file("--store f")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "read-only"
        locked.mkdir(mode=0o500)
        with pytest.raises(StoreLocationError, match="read-only is not writable by this user"):
            Store.at(locked / "store").check_creatable("--store r")
    remote = Store.at(f"s3://{BUCKET}/where")
    remote.check_creatable("--store s3")  # a prefix is made by writing under it
    remote.check_not_a_file("--store s3")
    assert not remote.exists()


def test_a_failed_first_build_leaves_no_empty_local_folder(tmp_path, s3):
    def fail_in(store: Store, write: bytes | None = None) -> None:
        with pytest.raises(RuntimeError, match="build failed"), store.removed_if_left_empty():
            store.init()
            with store.write_lock("run-1"):
                if write is not None:
                    store.write_bytes_atomic(store.settings_path, write)
                raise RuntimeError("build failed")

    new = Store.at(tmp_path / "new")
    fail_in(new)  # only empty folders and the lock file: removed
    assert not (tmp_path / "new").exists()
    fail_in(Store.at(tmp_path / "written"), b"[build]\n")  # it holds a file: kept
    assert (tmp_path / "written" / "coinrag.toml").is_file()
    Path(tmp_path / "old").mkdir()
    fail_in(Store.at(tmp_path / "old"))  # it was there before: kept
    assert (tmp_path / "old" / "tables").is_dir()
    with new.removed_if_left_empty():  # a build that succeeds keeps its store
        new.init()
    assert new.exists()

    remote = Store.at(f"s3://{BUCKET}/failed")
    fail_in(remote, b"[build]\n")  # no folders in object storage: nothing removed
    assert remote.exists()


def test_the_repair_command_names_a_local_stores_settings_file(tmp_path, s3):
    from coinrag.inference.methods import repair_command

    local = Store.at(tmp_path / "store").init()
    assert local.local_path(local.settings_path) == tmp_path / "store" / "coinrag.toml"
    assert repair_command(local) == (
        f"`coinrag build SOURCE --store {local.url} --config {local.root}/coinrag.toml`"
    )
    remote = Store.at(f"s3://{BUCKET}/repair")
    assert remote.local_path(remote.settings_path) is None  # --config takes a local file
    assert repair_command(remote) == f"`coinrag build SOURCE --store s3://{BUCKET}/repair`"
