"""Deletion (`build --prune`, `coinrag delete`), `coinrag gc`, and crash safety: a build killed
at any point leaves the previous version readable, and the next build finishes its work.

Real Prefect harness, real Parquet/Zarr/LanceDB files, a tiny real generation model; the crash
test SIGKILLs a real `build_flow` subprocess while it writes, with no hook in production code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.methods import RagEngine
from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.inference.retrieval.retriever import Retriever
from coinrag.schemas.tables import ChunkRow, DeletionRow, KvManifestRow
from coinrag.storage.corpus import live_versions
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import KvStore
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.changes import source_delta

pytestmark = pytest.mark.usefixtures("one_torch_thread", "prefect_harness")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama", smollm2_tokenizer, 0)


@pytest.fixture(scope="module")
def minilm():
    return load_embedder("minilm")


def index_doc_ids(st: Store) -> dict[str, set[str]]:
    index = LanceIndex.open(st)
    return {t: set(index.columns(t, ["doc_id"]).column(0).to_pylist()) for t in index.versions}


def kv_keys(st: Store) -> set[str]:
    keys: set[str] = set()
    for path in (st.root / "kv").glob("kv-*"):
        keys |= set(KvStore.open(st, path.name).manifest(refresh=True))
    return keys


def assert_all_kv_readable(st: Store) -> None:
    for path in (st.root / "kv").glob("kv-*"):
        kv = KvStore.open(st, path.name)
        for ck in kv.manifest(refresh=True):
            assert kv.verify_entry(ck), ck


@pytest.mark.heavy  # over 5 s: the second tier
def test_delete_prune_gc_and_readd(tmp_path, sample_corpus, tiny_model, minilm):
    docs = sample_docs(sample_corpus, 5)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    store = tmp_path / "store"
    st = Store.at(store)
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 64}
    first = build_flow(str(src), str(store), settings)
    gone, pruned = docs[1]["id"], docs[3]["id"]
    hits = Retriever(st, minilm).chunks_only(docs[1]["text"][:200], kc=3).evidence
    assert hits[0].doc_id == gone
    runner = CliRunner()

    # An unknown id: a clear error, exit 1, nothing written.
    bad = runner.invoke(app, ["delete", gone, "no-such-doc", "--store", str(store)])
    assert bad.exit_code == 1 and "no-such-doc" in bad.output and "nothing" in bad.output
    assert read_rows(st, DeletionRow) == [] and gone in live_versions(st)

    ok = runner.invoke(app, ["delete", gone, "--store", str(store)])
    assert ok.exit_code == 0, ok.output
    (tomb,) = read_rows(st, DeletionRow)
    assert (tomb.doc_id, tomb.reason, tomb.doc_version) == (
        gone,
        "deleted",
        live_versions_at(first, st, gone),
    )
    assert gone not in live_versions(st) and len(live_versions(st)) == 4
    in_index = index_doc_ids(st)
    assert all(gone not in ids for ids in in_index.values()) and len(in_index["documents"]) == 4
    for method in ("chunks_only", "two_stage"):
        result = getattr(Retriever(st, minilm), method)(docs[1]["text"][:200])
        assert result.evidence and gone not in {e.doc_id for e in result.evidence}
    again = runner.invoke(app, ["delete", gone, "--store", str(store)])
    assert again.exit_code == 1 and "not a live document" in again.output

    # --prune: live documents absent from SOURCE are tombstoned and leave the index. Before,
    # the watcher's delta reports the one live document the source lost (not the deleted one).
    write_corpus(src, [d for d in docs if d["id"] not in (gone, pruned)])
    assert source_delta(src, store) == ([], [pruned])
    result = runner.invoke(
        app,
        [
            "build",
            str(src),
            "--store",
            str(store),
            "--prune",
            "--extractor",
            "rules",
            "--model",
            str(tiny_model),
            "--chunk-size",
            "64",
        ],
    )
    assert result.exit_code == 0, result.output
    tombs = {r.doc_id: r.reason for r in read_rows(st, DeletionRow)}
    assert tombs == {gone: "deleted", pruned: "pruned"}
    assert set(live_versions(st)) == {d["id"] for d in docs} - {gone, pruned}
    assert all(pruned not in ids for ids in index_doc_ids(st).values())
    assert source_delta(src, store) == ([], [])

    # gc: the dead documents' KV entries go (bytes reclaimed), every other entry stays readable.
    chunks = read_rows(st, ChunkRow)
    dead = {c.content_key for c in chunks if c.doc_id in (gone, pruned)}
    dead -= {c.content_key for c in chunks if c.doc_id not in (gone, pruned)}
    assert dead and dead <= kv_keys(st)
    dry = runner.invoke(app, ["gc", "--store", str(store), "--dry-run"])
    assert dry.exit_code == 0 and f"would reclaim {len(dead)} KV entries" in dry.output
    assert dead <= kv_keys(st)  # a dry run changes nothing
    before = sum(p.stat().st_size for p in (store / "kv").rglob("*") if p.is_file())
    done = runner.invoke(app, ["gc", "--store", str(store)])
    assert done.exit_code == 0, done.output
    assert f"reclaimed {len(dead)} KV entries" in done.output
    after = sum(p.stat().st_size for p in (store / "kv").rglob("*") if p.is_file())
    assert after < before
    reclaimed = int(done.output.rsplit(":", 1)[1].split()[0])
    assert reclaimed > 0
    assert not dead & kv_keys(st)
    assert not dead & {r.content_key for r in read_rows(st, KvManifestRow)}
    assert_all_kv_readable(st)
    engine = RagEngine.open(str(store), max_new_tokens=2)
    answer = engine.answer(docs[0]["text"][:100], method="coinrag", kc=2, k=4)
    assert answer.evidence and {e["doc_id"] for e in answer.evidence} <= set(live_versions(st))
    nothing = runner.invoke(app, ["gc", "--store", str(store)])
    assert "reclaimed 0 KV entries" in nothing.output

    # A deleted document read again comes back (its extraction is cached, its KV rebuilt).
    write_corpus(src, docs)
    back = build_flow(str(src), str(store), settings)
    assert back["documents_new"] == 2 and back["extract_requested"] == 0
    assert back["kv_computed"] == len(dead)
    assert set(live_versions(st)) == {d["id"] for d in docs}
    assert {gone, pruned} <= index_doc_ids(st)["chunks"]


def live_versions_at(summary: dict, st: Store, doc_id: str) -> str:
    """The version the first build recorded for ``doc_id``."""
    from coinrag.schemas.tables import DocumentRow

    rows = read_rows(st, DocumentRow, filter=pc.field("run_id") == summary["run_id"])
    return {r.doc_id: r.doc_version for r in rows}[doc_id]


@pytest.mark.heavy  # over 5 s: the second tier
def test_failed_index_update_leaves_the_published_index(tmp_path, sample_corpus, tiny_model):
    """The embed stage deletes stale rows before it writes new ones: a build that dies between
    the two has changed only the latest versions, never the published ones."""
    from coinrag.tasks.embed import embed_stage
    from coinrag.tasks.ingest import ingest

    docs = sample_docs(sample_corpus, 3)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    store = tmp_path / "store"
    st = Store.at(store)
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 64, "kv": False}
    build_flow(str(src), str(store), settings)
    published = {t: LanceIndex.open(st).count(t) for t in ("chunks", "nuggets", "documents")}
    chunk_ids = set(LanceIndex.open(st).columns("chunks", ["chunk_id"]).column(0).to_pylist())

    class Unreachable:  # an embedder whose backend is gone (raises when asked to embed)
        fingerprint, dim, name, max_length = LanceIndex.open(st).embedder_fp, 384, "x", 256

        def embed_documents(self, texts, progress=None):
            raise ConnectionError("embedding backend unreachable")

    edited = [{**d, "text": "Revised. " + d["text"]} for d in docs]
    write_corpus(src, edited)
    new_docs = ingest(src).documents
    with pytest.raises(ConnectionError):
        embed_stage(st, [], [], new_docs, Unreachable(), "killed-run")
    latest = LanceIndex.open_latest(st)
    assert latest.count("chunks") == 0  # the stale rows went from the latest version...
    reader = LanceIndex.open(st)
    assert {t: reader.count(t) for t in published} == published  # ...not from the published
    assert set(reader.columns("chunks", ["chunk_id"]).column(0).to_pylist()) == chunk_ids
    after = build_flow(str(src), str(store), settings)  # the next build completes the update
    reader = LanceIndex.open(st)
    assert reader.count("documents") == 3 and after["chunks_new"] == reader.count("chunks")
    assert not chunk_ids & set(reader.columns("chunks", ["chunk_id"]).column(0).to_pylist())


def _prefect_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.heavy
def test_killed_build_leaves_previous_version_and_next_build_resumes(
    tmp_path, sample_corpus, tiny_model, minilm
):
    docs = sample_docs(sample_corpus)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    store = tmp_path / "store"
    st = Store.at(store)
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 16}
    first = build_flow(str(src), str(store), settings)
    v1 = live_versions(st)
    v1_chunks = set(LanceIndex.open(st).columns("chunks", ["chunk_id"]).column(0).to_pylist())

    # Every document changes; the build is killed once its first KV shard is valid (its
    # manifest rows appear), while it computes the next ones (over 64 entries: two shards).
    write_corpus(src, [{**d, "text": "Revised entry. " + d["text"]} for d in docs])
    manifest_dir = store / "tables" / "kv_manifest"
    seen_before = set(manifest_dir.glob("*.parquet"))
    script = (
        "import json, sys\n"
        "from flows.build import build_flow\n"
        "build_flow(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(src), str(store), json.dumps(settings)],
        env=_prefect_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if set(manifest_dir.glob("*.parquet")) - seen_before:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the build ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    # The previous version is whole: corpus view, published index, KV, and a query.
    assert st.published()["run_id"] == first["run_id"]
    assert live_versions(st) == v1
    reader = LanceIndex.open(st)
    assert set(reader.columns("chunks", ["chunk_id"]).column(0).to_pylist()) == v1_chunks
    assert set(reader.columns("documents", ["doc_version"]).column(0).to_pylist()) == set(
        v1.values()
    )
    engine = RagEngine.open(str(store), max_new_tokens=2)
    answer = engine.answer(docs[2]["text"][:120], method="coinrag", kc=3, k=6)
    assert answer.evidence and {e["chunk_id"] for e in answer.evidence} <= v1_chunks
    assert engine.answer(docs[2]["text"][:120], method="turborag", kc=2).evidence

    # The next build completes, reusing what the killed run finished.
    killed_rows = [r for r in read_rows(st, KvManifestRow) if r.run_id != first["run_id"]]
    resumed = build_flow(str(src), str(store), settings)
    assert resumed["chunks_new"] == 0  # the killed run had chunked everything before its KV
    assert resumed["extract_requested"] == 0
    killed_keys = {r.content_key for r in killed_rows}
    assert killed_keys  # the killed run had finished a shard
    computed = read_rows(st, KvManifestRow, filter=pc.field("run_id") == resumed["run_id"])
    assert not killed_keys & {r.content_key for r in computed}  # nothing finished is redone
    assert resumed["kv_computed"] == len(computed)
    assert resumed["kv_reused"] >= len(killed_keys)
    assert st.published()["run_id"] == resumed["run_id"]
    v2 = live_versions(st)
    assert set(v2) == set(v1) and not set(v2.values()) & set(v1.values())
    v2_keys = {c.content_key for c in read_rows(st, ChunkRow) if c.doc_version in v2.values()}
    assert resumed["kv_computed"] + resumed["kv_reused"] == len(v2_keys)
    reader = LanceIndex.open(st)
    assert set(reader.columns("documents", ["doc_version"]).column(0).to_pylist()) == set(
        v2.values()
    )
    assert not v1_chunks & set(reader.columns("chunks", ["chunk_id"]).column(0).to_pylist())
    assert_all_kv_readable(st)


def test_a_second_writer_is_refused(tmp_path, sample_corpus):
    src = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 1))
    store = tmp_path / "store"
    st = Store.at(store).init()
    runner = CliRunner()
    with st.write_lock("build-holder"):
        built = runner.invoke(
            app, ["build", str(src), "--store", str(store), "--extractor", "none"]
        )
        message = " ".join(built.output.split())  # the console wraps long lines
        assert built.exit_code == 1 and "being written by another build" in message
        assert "build-holder" in message
        gc = runner.invoke(app, ["gc", "--store", str(store)])
        assert gc.exit_code == 1 and "build-holder" in " ".join(gc.output.split())
        deleted = runner.invoke(app, ["delete", "x", "--store", str(store)])
        assert deleted.exit_code == 1 and "build-holder" in " ".join(deleted.output.split())
    assert not (store / "tables" / "documents").exists()
