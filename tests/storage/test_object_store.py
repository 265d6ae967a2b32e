"""Stores in object storage (``--store s3://bucket/prefix``): the whole life of a store (build,
unchanged rebuild, query, lineage, delete, gc, the lock) against a real S3-compatible HTTP
server on 127.0.0.1 (moto's server: the fake sits at the network edge; s3fs, Zarr, LanceDB and
DuckDB talk S3 to it exactly as they would to AWS, MinIO or Ceph), and every asset compared
with a local build of the same corpus.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from store_fixtures import (
    nugget_spans,
    sample_docs,
    save_tiny_llama,
    synthetic_chunk,
    write_corpus,
)
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.methods import RagEngine
from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.inference.retrieval.retriever import Retriever
from coinrag.schemas.tables import ChunkRow, DocumentRow, EmbeddingRow, KvManifestRow, NuggetRow
from coinrag.storage.corpus import live_versions
from coinrag.storage.gc import kv_fps
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import CorruptKvEntry, KvLayout, KvStore
from coinrag.storage.location import StoreUrlError, object_filesystem, split_store_url
from coinrag.storage.object_lock import LockContention, LockLost, ObjectLock
from coinrag.storage.store import LocalStoreRequired, Store, StoreLocked
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness")

REPO = Path(__file__).resolve().parents[2]
BUCKET = "coinrag-test"
SECRET = "s3-secret-never-logged-0123456789"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def s3(monkeypatch_module):
    """A moto S3 server on 127.0.0.1 with one bucket; the AWS variables point at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "coinrag-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        monkeypatch_module.setenv(name, value)
    object_filesystem.cache_clear()
    fs = object_filesystem("s3")
    fs.mkdir(BUCKET)
    yield fs
    object_filesystem.cache_clear()
    server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama", smollm2_tokenizer, 0)


@pytest.fixture(scope="module")
def minilm():
    return load_embedder("minilm")


def test_store_urls():
    assert split_store_url("/data/store") == ("", "/data/store")
    assert split_store_url("file:///data/store") == ("", "/data/store")
    assert split_store_url("s3://bucket/a/b/") == ("s3", "bucket/a/b")
    assert split_store_url("s3://bucket") == ("s3", "bucket")
    for bad, why in [
        ("s3://key:secret@bucket/x", "credentials"),
        ("gs://bucket/x", "unsupported"),
        ("s3:///x", "no bucket"),
        ("s3://bucket/x?versionId=1", "query"),
    ]:
        with pytest.raises(StoreUrlError, match=why):
            split_store_url(bad)
    st = Store.at("s3://bucket/stores/a")
    assert (st.url, str(st.kv_dir("kv-1")), st.is_local) == (
        "s3://bucket/stores/a",
        "bucket/stores/a/kv/kv-1",
        False,
    )
    with pytest.raises(LocalStoreRequired, match="training cartridges needs a local store"):
        st.cartridges_dir("m")
    for command in (["train", "cartridges"], ["query", "q", "--method", "cartridge"]):
        result = CliRunner().invoke(app, [*command, "--store", "s3://bucket/stores/a"])
        assert result.exit_code == 1 and "needs a local store" in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def rows(st: Store, record: type, key: str) -> list[dict]:
    """A table's rows without their run ids (two builds of one corpus differ only there)."""
    out = []
    for row in read_rows(st, record):
        data = dataclasses.asdict(row)
        data.pop("run_id")
        out.append(data)
    return sorted(out, key=lambda r: (r[key], json.dumps(r, sort_keys=True, default=str)))


@pytest.mark.heavy
def test_object_store_lifecycle_matches_a_local_store(
    tmp_path, s3, sample_corpus, tiny_model, minilm
):
    docs = sample_docs(sample_corpus, 4)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    url = f"s3://{BUCKET}/stores/e2e"
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 64}
    remote = build_flow(str(src), url, settings)
    local = build_flow(str(src), str(tmp_path / "local"), settings)
    st, lt = Store.at(url), Store.at(tmp_path / "local")
    for key in ("documents_new", "chunks_new", "nuggets_exact", "kv_computed", "embedded"):
        assert remote[key] == local[key] > 0, key

    # Everything is in the bucket: tables, KV (Zarr), index (Lance), settings; no temporaries.
    objects = s3.find(f"{BUCKET}/stores/e2e")
    for part in ("/tables/chunks/", "/kv/kv-", "/index/chunks.lance/", "/coinrag.toml"):
        assert any(part in o for o in objects), part
    assert not [o for o in objects if "/.tmp-" in o or o.endswith(".tmp")]
    for name in [o for o in objects if "/tables/" in o or o.endswith(".toml")]:
        data = s3.cat_file(name)  # no credential reaches a table or the settings
        assert SECRET.encode() not in data and b"coinrag-test-key" not in data, name

    # The same assets as the local build: rows, KV bytes, index vectors.
    for record, key in [
        (DocumentRow, "doc_id"),
        (ChunkRow, "chunk_id"),
        (NuggetRow, "nugget_id"),
        (EmbeddingRow, "text_hash"),
        (KvManifestRow, "chunk_id"),
    ]:
        assert rows(st, record, key) == rows(lt, record, key), record
    (fp,) = kv_fps(lt)
    assert kv_fps(st) == [fp]
    remote_kv, local_kv = KvStore.open(st, fp), KvStore.open(lt, fp)
    assert set(remote_kv.manifest()) == set(local_kv.manifest())
    for ck in local_kv.manifest():
        assert torch.equal(remote_kv.read_entry(ck), local_kv.read_entry(ck)), ck
    some = next(iter(local_kv.manifest()))
    assert torch.equal(
        remote_kv.read_slices([(some, 3, 20)])[0], local_kv.read_slices([(some, 3, 20)])[0]
    )
    assert torch.equal(remote_kv.read_prefix()[0], local_kv.read_prefix()[0])
    for table, id_column in (("chunks", "chunk_id"), ("nuggets", "nugget_id")):
        r = LanceIndex.open(st).columns(table, [id_column, "vector"]).sort_by(id_column)
        loc = LanceIndex.open(lt).columns(table, [id_column, "vector"]).sort_by(id_column)
        assert r.equals(loc), table

    # An unchanged rebuild does no work at all.
    again = build_flow(str(src), url, settings)
    for key in ("documents_new", "chunks_new", "extract_requested", "kv_computed", "embedded"):
        assert again[key] == 0, key
    assert again["kv_reused"] == remote["kv_computed"]

    # Queries: retrieval and a RAG answer (KV slices read by ranged GETs) as on the local copy.
    question = docs[2]["text"][:160]
    hits = Retriever(st, minilm).two_stage(question).evidence
    assert [h.chunk_id for h in hits] == [
        h.chunk_id for h in Retriever(lt, minilm).two_stage(question).evidence
    ]
    answer = RagEngine.open(url, max_new_tokens=3).answer(question, method="coinrag", kc=2, k=4)
    answer_local = RagEngine.open(str(tmp_path / "local"), max_new_tokens=3).answer(
        question, method="coinrag", kc=2, k=4
    )
    assert answer.evidence and answer.evidence == answer_local.evidence
    assert answer.token_ids == answer_local.token_ids and answer.active_tokens > 0
    # The full-text index lives in the bucket too: lexical and hybrid search as on the local copy.
    for mode in ("lexical", "hybrid"):
        got = Retriever(st, minilm, mode=mode).two_stage(question).evidence
        want = Retriever(lt, minilm, mode=mode).two_stage(question).evidence
        assert got and [h.chunk_id for h in got] == [h.chunk_id for h in want], mode
    words = docs[1]["text"][:200]
    found = Retriever(st, minilm, mode="lexical").chunks_only(words, kc=3).chunks
    assert docs[1]["id"] in {h.doc_id for h in found}

    # Lineage over the bucket's Parquet files (DuckDB through s3fs).
    runner = CliRunner()
    sql = "SELECT count(*) AS n FROM kv_entries"
    got = runner.invoke(app, ["lineage", "--store", url, sql, "--json"])
    want = runner.invoke(app, ["lineage", "--store", str(tmp_path / "local"), sql, "--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.output) == json.loads(want.output) and json.loads(got.output)[0]["n"]
    chain = runner.invoke(app, ["lineage", "--store", url, "--doc", docs[0]["id"]])
    assert chain.exit_code == 0 and docs[0]["id"] in chain.output

    # The lock: a second writer is refused while the first holds it.
    with st.write_lock("build-holder"):
        with pytest.raises(StoreLocked, match="build-holder"):
            build_flow(str(src), url, settings)

    # Delete a document, then gc: its KV leaves the bucket, the rest stays readable.
    gone = docs[1]["id"]
    deleted = runner.invoke(app, ["delete", gone, "--store", url])
    assert deleted.exit_code == 0, deleted.output
    assert gone not in live_versions(st)
    index = LanceIndex.open(st)
    assert gone not in set(index.columns("chunks", ["doc_id"]).column(0).to_pylist())
    chunks = read_rows(st, ChunkRow)
    dead = {c.content_key for c in chunks if c.doc_id == gone}
    dead -= {c.content_key for c in chunks if c.doc_id != gone}
    kv_bytes = s3.du(f"{BUCKET}/stores/e2e/kv", total=True)
    dry = runner.invoke(app, ["gc", "--store", url, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert s3.du(f"{BUCKET}/stores/e2e/kv", total=True) == kv_bytes
    done = runner.invoke(app, ["gc", "--store", url])
    assert done.exit_code == 0, done.output
    assert f"reclaimed {len(dead)} KV entries" in done.output
    # the dry run said what the run did: entries, index versions, leftovers and bytes
    would = dry.output.split("would reclaim ")[-1].strip()
    assert done.output.split("reclaimed ")[-1].strip() == would
    assert s3.du(f"{BUCKET}/stores/e2e/kv", total=True) < kv_bytes
    found = Retriever(st, minilm, mode="lexical").chunks_only(words, kc=3).chunks
    assert found and gone not in {h.doc_id for h in found}  # never found by its words again
    kv = KvStore.open(st, fp)
    assert not dead & set(kv.manifest(refresh=True))
    assert all(kv.verify_entry(ck) for ck in kv.manifest())
    assert kv.garbage() == []


def test_object_lock_lease_takeover_and_fencing(s3):
    path = f"{BUCKET}/locks/.lock"
    first = ObjectLock(s3, path, "first", ttl_s=1.0)
    first.acquire()
    second = ObjectLock(s3, path, "second", ttl_s=1.0)
    time.sleep(1.6)  # the heartbeat (every ttl/4) keeps the lease fresh
    with pytest.raises(LockContention, match="first"):
        second.acquire()
    first.check()  # still ours: a commit point may go ahead
    first._stop.set()  # the holder freezes: no more heartbeats
    first._thread.join()
    time.sleep(2.3)  # ttl + the second LastModified may round away
    second.acquire()  # the lease expired: taken over
    assert json.loads(s3.cat_file(path))["holder"] == "second"
    with pytest.raises(LockLost):  # the frozen holder wakes up: its renewal is refused
        first.check()
    first.release()  # does not delete the new holder's lock
    assert json.loads(s3.cat_file(path))["holder"] == "second"
    # A write of ours whose response was lost (the object changed, our ETag did not): kept.
    bucket, _, key = path.partition("/")
    s3.call_s3("put_object", Bucket=bucket, Key=key, Body=second._body(), IfMatch=second.etag)
    second._sent_at = 0.0  # force a renewal at the next commit point
    second.check()
    second.release()
    assert not s3.exists(path)


def test_object_lock_honours_the_holders_ttl(s3):
    """A contender with a short ttl still waits for the holder's longer one."""
    path = f"{BUCKET}/locks/ttl.lock"
    holder = ObjectLock(s3, path, "slow holder", ttl_s=6.0)
    holder.acquire()
    holder._stop.set()  # no heartbeat for a while (it beats every 1.5 s when alive)
    holder._thread.join()
    time.sleep(1.2)
    with pytest.raises(LockContention, match="slow holder"):
        ObjectLock(s3, path, "hasty", ttl_s=0.5).acquire()
    holder._stop.clear()
    holder.release()
    assert not s3.exists(path)


@pytest.mark.heavy
def test_dask_workers_stage_kv_shards_into_the_bucket(tmp_path, s3, sample_corpus):
    """Scale-out on an object store: Dask worker processes (they inherit the AWS variables)
    stage their KV shards straight into the bucket, the flow publishes them; the assets are the
    default runner's on a local store, and nothing staged is left behind."""
    src = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    settings = {"extractor": "rules", "chunk_size": 64, "kv_batch_size": 2, "embed_batch_size": 16}
    url = f"s3://{BUCKET}/stores/dask"
    remote = build_flow(str(src), url, settings | {"runner": "dask", "workers": 2})
    local = build_flow(str(src), str(tmp_path / "local"), settings)
    assert remote["kv_computed"] == local["kv_computed"] > 4  # more than one shard group
    st, lt = Store.at(url), Store.at(tmp_path / "local")
    for record, key in [(ChunkRow, "chunk_id"), (KvManifestRow, "chunk_id")]:
        assert rows(st, record, key) == rows(lt, record, key), record
    (fp,) = kv_fps(lt)
    remote_kv, local_kv = KvStore.open(st, fp), KvStore.open(lt, fp)
    assert len(remote_kv.shard_names()) > 1
    for ck in local_kv.manifest():
        assert torch.equal(remote_kv.read_entry(ck), local_kv.read_entry(ck)), ck
    assert remote_kv.garbage() == []
    assert not [o for o in s3.find(f"{BUCKET}/stores/dask") if "/.tmp-" in o]


@pytest.mark.heavy
def test_killed_build_on_s3_keeps_the_published_version_and_its_lease_expires(
    tmp_path, s3, sample_corpus, tiny_model, minilm, monkeypatch
):
    """SIGKILL a build while it writes KV into the bucket: readers keep the previous version;
    the dead build's lease refuses the next writer until it expires (COINRAG_LOCK_TTL_S), then
    the next build takes it over and finishes the work, reusing the shards the killed one
    published."""
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("COINRAG_LOCK_TTL_S", "12")  # heartbeats every 3 s
    docs = sample_docs(sample_corpus)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    url = f"s3://{BUCKET}/stores/crash"
    st = Store.at(url)
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 16}
    first = build_flow(str(src), url, settings)
    v1 = live_versions(st)
    v1_chunks = set(LanceIndex.open(st).columns("chunks", ["chunk_id"]).column(0).to_pylist())

    write_corpus(src, [{**d, "text": "Revised entry. " + d["text"]} for d in docs])
    manifest = f"{BUCKET}/stores/crash/tables/kv_manifest"
    seen_before = set(s3.ls(manifest, detail=False))
    script = (
        "import json, sys\n"
        "from flows.build import build_flow\n"
        "build_flow(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))\n"
    )
    env = dict(os.environ) | {
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(src), url, json.dumps(settings)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if set(s3.ls(manifest, detail=False)) - seen_before:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the build ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The dead build's lease still stands (refreshed at most 3 s before the kill): refused.
    with pytest.raises(StoreLocked, match="heartbeat"):
        with st.write_lock("too-early"):
            pass

    # Readers see the previous version, whole.
    assert st.published()["run_id"] == first["run_id"]
    assert live_versions(st) == v1
    assert set(LanceIndex.open(st).columns("chunks", ["chunk_id"]).column(0).to_pylist()) == (
        v1_chunks
    )
    answer = RagEngine.open(url, max_new_tokens=2).answer(docs[2]["text"][:120], kc=3, k=6)
    assert answer.evidence and {e["chunk_id"] for e in answer.evidence} <= v1_chunks

    # Once the lease has expired, the next build takes it over and finishes the work.
    assert s3.exists(f"{BUCKET}/stores/crash/.lock")
    time.sleep(max(0.0, 13.5 - (time.monotonic() - killed_at)))  # ttl + LastModified's second
    killed_keys = {
        r.content_key for r in read_rows(st, KvManifestRow) if r.run_id != first["run_id"]
    }
    resumed = build_flow(str(src), url, settings)
    assert killed_keys and resumed["chunks_new"] == 0 and resumed["extract_requested"] == 0
    assert resumed["kv_reused"] >= len(killed_keys)
    assert st.published()["run_id"] == resumed["run_id"]
    assert not set(live_versions(st).values()) & set(v1.values())
    kv = KvStore.open(st, kv_fps(st)[0])
    assert all(kv.verify_entry(ck) for ck in kv.manifest(refresh=True))
    assert not s3.exists(f"{BUCKET}/stores/crash/.lock")
    # What the killed build left half-done (a staged shard, a claimed number) goes with gc.
    done = CliRunner().invoke(app, ["gc", "--store", url])
    assert done.exit_code == 0, done.output
    assert KvStore.open(st, kv_fps(st)[0]).garbage() == []
    assert not [o for o in s3.find(f"{BUCKET}/stores/crash") if "/.tmp-" in o]


@pytest.mark.parametrize("encoder", ["direct", "zarr"])
def test_kv_slices_from_s3_are_the_written_tensors(s3, encoder):
    """KV slices read from the bucket (ranged GETs decoded by coinrag; shards written by Zarr's
    own encoder too, whose blocks may not lie in order) equal the written tensors: blocks inside,
    across and at the padded end of entries, many at once, on multi-slot shards. A flipped byte
    in the object is caught by the block's crc32c."""
    layers, heads, dim = 3, 2, 8
    lengths = [37, 40, 5, 33, 16, 64, 1]
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, n), torch.randn(layers, 2, heads, n, dim).to(torch.bfloat16))
        for i, n in enumerate(lengths)
    ]
    layout = KvLayout(
        model_fp="model-x",
        prefix_sha="ps-x",
        layers=layers,
        kv_heads=heads,
        head_dim=dim,
        dtype="bfloat16",
        block_tokens=8,
        slots_per_shard=3,
    )
    st = Store.at(f"s3://{BUCKET}/kv-{encoder}")
    writer = KvStore.create(st, layout, encoder=encoder)
    writer.write_entries(entries, "run-e")
    kv = KvStore.open(st, layout.kv_fp)
    assert len(kv.shard_names()) == 3
    requests, expected = [], []
    for chunk, tensor in entries:
        n = chunk.n_tokens
        for s, e in {(0, n), (0, 1), (n - 1, n), (3, 5), (7, 9), (n // 2, n), (8, 16)}:
            if 0 <= s <= e <= n:
                requests.append((chunk.content_key, s, e))
                expected.append(tensor[..., s:e, :])
    got = kv.read_slices(requests)
    assert len(got) == len(expected)
    for r, a, b in zip(requests, got, expected, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), r
    for chunk, tensor in entries:
        assert torch.equal(kv.read_entry(chunk.content_key), tensor)
    gets = kv.last_read.store_gets
    one = KvStore.open(st, layout.kv_fp)
    one.read_slices([(entries[1][0].content_key, 3, 30)])  # 4 blocks
    first_gets = one.last_read.store_gets
    one.read_slices([(entries[1][0].content_key, 3, 30)])
    if encoder == "direct":  # one GET for the 4 blocks: where they lie follows from the tokens
        assert first_gets == one.last_read.store_gets == 1
        assert gets < len(requests)
    else:  # Zarr wrote it: its index is read once per reader, then kept
        assert first_gets == one.last_read.store_gets + 1
    # A flipped byte in the middle of the first shard's data: the block holding it fails.
    (first, *_) = kv.shard_names()
    data_key = f"{st.kv_dir(layout.kv_fp)}/{first}/c/0/0/0/0/0/0"
    raw = bytearray(s3.cat_file(data_key))
    raw[len(raw) // 3] ^= 0xFF
    s3.pipe_file(data_key, bytes(raw))
    fresh = KvStore.open(st, layout.kv_fp)
    with pytest.raises(CorruptKvEntry):
        for chunk, _ in entries[:3]:
            fresh.read_slices([(chunk.content_key, 0, chunk.n_tokens)])


def test_k10_nugget_slices_from_s3_read_near_what_they_need(s3, tmp_path) -> None:
    """Issue 13 item 4 on ``s3://``: k = 10 nugget slices of 12 tokens, read by a fresh reader
    (no index GET: where the blocks lie follows from the token counts), fetch at most 1.3x the
    bytes they need, one ranged GET per slice; an int4 store reads what the local one reads
    and a flipped byte in it is caught by the block's crc32c, on every read path (slices,
    entries, the crc32c and sha256 checks)."""
    lay = KvLayout("m", "p", 8, 2, 32, "bfloat16", slots_per_shard=3)
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, 512), torch.randn(8, 2, 2, 512, 32).to(torch.bfloat16))
        for i in range(6)
    ]
    keys = [c.content_key for c, _ in entries]
    KvStore.create(Store.at(f"s3://{BUCKET}/ratio"), lay).write_entries(entries, "run-r")
    fresh = KvStore.open(Store.at(f"s3://{BUCKET}/ratio"), lay.kv_fp)
    spans = nugget_spans(keys[:5], seed=1)
    got = fresh.read_slices(spans)
    for (ck, s, e), tensor in zip(spans, got, strict=True):
        assert torch.equal(tensor, entries[keys.index(ck)][1][..., s:e, :])
    stats = fresh.last_read
    assert stats.amplification <= 1.3 and stats.store_gets == 10, stats
    # int4: the same reads as from local disk
    q = dataclasses.replace(lay, kv_codec="int4", block_tokens=0)
    remote = KvStore.create(Store.at(f"s3://{BUCKET}/int4"), q)
    remote.write_entries(entries, "run-q")
    local = KvStore.create(Store.at(tmp_path / "int4").init(), q)
    local.write_entries(entries, "run-q")
    remote = KvStore.open(Store.at(f"s3://{BUCKET}/int4"), q.kv_fp)
    for a, b in zip(remote.read_slices(spans), local.read_slices(spans), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(remote.read_entry(keys[0]), local.read_entry(keys[0]))
    assert remote.entry_problems(keys, "crc32c") == {} == remote.entry_problems(keys, "sha256")
    (first, *_) = remote.shard_names()
    data_key = f"{Store.at(f's3://{BUCKET}/int4').kv_dir(q.kv_fp)}/{first}/c/0/0/0"
    raw = bytearray(s3.cat_file(data_key))
    raw[100] ^= 0xFF  # slot 0, block 0
    s3.pipe_file(data_key, bytes(raw))
    damaged = KvStore.open(Store.at(f"s3://{BUCKET}/int4"), q.kv_fp)
    with pytest.raises(CorruptKvEntry, match="block 0 fails its crc32c"):
        damaged.read_slices([(keys[0], 0, 3)])
    with pytest.raises(CorruptKvEntry, match="block 0 fails its crc32c"):
        damaged.read_entry(keys[0])
    assert set(damaged.entry_problems(keys, "crc32c")) == {keys[0]}


def test_staged_answers_move_into_an_object_store_table_once(s3) -> None:
    """LLM answers staged one object each (as a worker writes them) are moved into the table by
    the writer, each once, and the staged objects removed; a second writer (the next build) finds
    nothing left to move."""
    from datetime import UTC, datetime

    from coinrag.inference.llm.client import CallRecord
    from coinrag.schemas.tables import ExtractionCallRow, ExtractionRow
    from coinrag.storage.tables import staged_files
    from coinrag.tasks.extract import ExtractCounts, ExtractionWriter, stage_result
    from coinrag.tasks.extractors.base import ExtractionResult
    from coinrag.tasks.extractors.rules import RulesExtractor

    st = Store.at(f"s3://{BUCKET}/staging-test")
    run_id = "build-20260101T000000-staging"
    for i in range(3):
        call = CallRecord(f"call-{i}", f"th-{i}", 1, "ok", 10, 5, 0.001, 12.0, datetime.now(UTC))
        result = ExtractionResult(f"th-{i}", "ok", [f"nugget {i}"], calls=[call])
        stage_result(st, RulesExtractor(), run_id, result)
    assert len(staged_files(st, ExtractionRow, run_id)) == 3
    counts = ExtractCounts(requested=3)
    writer = ExtractionWriter(st, run_id, counts)
    assert writer.answered() == 3
    assert writer.flush() == 3 and counts.ok == 3 and counts.calls == 3
    assert staged_files(st, ExtractionRow) == [] and staged_files(st, ExtractionCallRow) == []
    assert sorted(r.text_hash for r in read_rows(st, ExtractionRow)) == ["th-0", "th-1", "th-2"]
    assert len(read_rows(st, ExtractionCallRow)) == 3
    assert ExtractionWriter(st, "build-next", ExtractCounts()).flush() == 0
