"""``--kv-keep nuggets``: a store that keeps only the KV of nugget spans, end to end where the
user meets it (build, query, eval, lineage, gc, delete, an extractor change, frozen training).

The oracle: a store of whole chunks built the same way (same corpus, model, dtype, batches).
The coinrag context assembled from the nuggets store is bit for bit the one assembled from it,
and so are the answers. Small real parts: a random-weight 2-layer Llama with SmolLM2's tokenizer,
the ``rules`` extractor (and the fake OpenAI server at the network edge for a second extractor),
MiniLM, a real Prefect harness, Zarr, LanceDB and DuckDB files in a temporary folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.evaluation.evaluate import evaluate
from coinrag.inference.methods import MissingAssets, RagEngine
from coinrag.inference.methods.assets import StoredNuggetKv
from coinrag.schemas.tables import ChunkRow, KvManifestRow, NuggetRow
from coinrag.storage.gc import kv_fps
from coinrag.storage.kv import KeptRanges, KvStore, entry_key, parse_location
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.extractors.factory import make_extractor

pytestmark = pytest.mark.usefixtures("prefect_harness")
API_KEY = "sk-kv-keep-test"
QUESTION = "Who directed 2001: A Space Odyssey?"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama", smollm2_tokenizer, 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory, sample_corpus, tiny_model) -> dict:
    """The same corpus built twice: whole chunks (``build_flow``) and nugget spans (the CLI's
    ``--kv-keep nuggets``, the rest from a TOML file), bfloat16 KV, one chunk per forward (so
    each entry is the chunk's own forward, whatever else the build computes: a nuggets build
    computes no chunk without a nugget)."""
    root = tmp_path_factory.mktemp("kv-keep")
    docs = sample_docs(sample_corpus, 4)
    src = write_corpus(root / "docs.jsonl", docs)
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 64}
    settings |= {"kv_dtype": "bfloat16", "kv_batch_size": 1}
    chunks = build_flow(str(src), str(root / "chunks"), settings)
    config = root / "build.toml"
    config.write_text(
        "[build]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    )
    result = cli(
        "build", str(src), "--store", str(root / "nuggets"), "--config", str(config),
        "--kv-keep", "nuggets",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return {"root": root, "src": src, "docs": docs, "settings": settings, "chunks": chunks}


def _kv(store: Path) -> KvStore:
    (fp,) = kv_fps(Store.at(store))
    return KvStore.open(Store.at(store), fp)


def test_nuggets_store_serves_coinrag_the_same_bits(built, tiny_model):
    root = built["root"]
    full, kept = _kv(root / "chunks"), _kv(root / "nuggets")
    st = Store.at(root / "nuggets")
    # the setting is recorded: settings, the run's parameters, the KV identity
    assert st.read_toml()["build"]["kv_keep"] == "nuggets"
    assert (kept.layout.keep, full.layout.keep) == ("nuggets", "chunks")
    assert kept.kv_fp != full.kv_fp and kept.layout.model_fp == full.layout.model_fp
    # chunks without a nugget have no entry (nothing to keep: not even computed)
    nuggets = read_rows(st, NuggetRow)
    with_nuggets = {n.content_key for n in nuggets}
    assert {r.content_key for r in kept.manifest().values()} == with_nuggets
    assert len(with_nuggets) < len(full.manifest()) == built["chunks"]["kv_computed"]

    # Each entry keeps exactly its nuggets' ranges; bytes are those tokens' only.
    chunks = {c.chunk_id: c for c in read_rows(st, ChunkRow)}
    for row in kept.manifest().values():
        spans = [(n.tok_start, n.tok_end) for n in nuggets if n.content_key == row.content_key]
        ranges = KeptRanges.of_spans(spans)
        assert row.kept == ranges.flat() and row.tokens == chunks[row.chunk_id].n_tokens
        assert row.bytes == ranges.stored * kept.layout.token_bytes
    stored = sum(r.bytes for r in kept.manifest().values())
    whole = sum(r.bytes for r in full.manifest().values())
    assert 0 < stored < whole

    # Every nugget's slice: the same bits (bfloat16) as the whole chunk's.
    requests = [(n.content_key, n.tok_start, n.tok_end) for n in nuggets]
    for a, b in zip(kept.read_slices(requests), full.read_slices(requests), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)

    # The assembled coinrag context and the answer: the same bits.
    engines = [RagEngine.open(str(root / s), max_new_tokens=4) for s in ("nuggets", "chunks")]
    retrieval = engines[0].retrieve(QUESTION, "coinrag", kc=3, k=6)
    assert retrieval.evidence
    (ctx_a, n_a), (ctx_b, n_b) = (
        e.asset(StoredNuggetKv).build(retrieval.evidence, 9) for e in engines
    )
    assert n_a == n_b and ctx_a.dtype == torch.bfloat16 and torch.equal(ctx_a, ctx_b)
    a, b = (e.answer(QUESTION, "coinrag", kc=3, k=6) for e in engines)
    assert a.evidence == b.evidence and a.token_ids == b.token_ids

    # turborag needs whole chunks: refused by the engine, naming the setting
    with pytest.raises(MissingAssets, match=r'kv_keep = "nuggets"'):
        engines[0].answer(QUESTION, "turborag", kc=2)


def test_cli_query_eval_and_lineage_on_a_nuggets_store(built, tmp_path):
    store = str(built["root"] / "nuggets")
    got = cli("query", QUESTION, "--store", store, "--json", "--max-new-tokens", "3")
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["evidence"]
    # standard prefills text: it needs no KV and works
    got = cli("query", QUESTION, "--store", store, "--method", "standard", "--max-new-tokens", "3")
    assert got.exit_code == 0, got.output
    # turborag: one error line naming the setting, before any model loads
    got = cli("query", QUESTION, "--store", store, "--method", "turborag")
    assert got.exit_code == 1, got.output
    assert got.output.count("error:") == 1 and 'kv_keep = "nuggets"' in got.output
    assert "--kv-keep chunks" in got.output

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": QUESTION, "answers": ["Kubrick"]}) + "\n")
    bad = cli("eval", str(questions), "--store", store, "--out", str(tmp_path / "o1"),
              "--methods", "coinrag", "turborag")  # fmt: skip
    assert bad.exit_code == 1 and 'kv_keep = "nuggets"' in bad.output
    assert not (tmp_path / "o1" / "results.parquet").exists()
    ok = cli("eval", str(questions), "--store", store, "--out", str(tmp_path / "o2"),
             "--max-new-tokens", "2")  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "note: turborag left out" in ok.output
    import pyarrow.parquet as pq

    methods = set(pq.read_table(tmp_path / "o2" / "results.parquet").column("method").to_pylist())
    assert methods == {"coinrag", "standard"}
    # the Python API's default methods are the store's too (it ran turborag and failed before)
    results = evaluate(store, questions, tmp_path / "o3", max_new_tokens=2, quiet=True)
    assert set(results.column("method").to_pylist()) == {"coinrag", "standard"}

    # lineage: which ranges each entry holds, and the nugget's entry holds its span
    sql = "SELECT kv_kept, tok_start, tok_end FROM lineage_nuggets"
    rows = json.loads(cli("lineage", "--store", store, sql, "--json").stdout)
    assert rows and all(r["kv_kept"] for r in rows)
    for r in rows:
        kept = KeptRanges.from_flat(r["kv_kept"])
        assert kept.locate(r["tok_start"], r["tok_end"]) is not None
    full = json.loads(
        cli("lineage", "--store", str(built["root"] / "chunks"), sql, "--json").stdout
    )
    assert len(full) == len(rows) and all(r["kv_kept"] is None for r in full)


@pytest.fixture()
def fake(monkeypatch):
    with FakeOpenAI(api_key=API_KEY) as server:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        make_extractor.cache_clear()
        yield server
        make_extractor.cache_clear()


@pytest.mark.heavy  # over 5 s: the second tier
def test_new_spans_recompute_exactly_their_chunk_and_gc_reclaims_the_old(
    tmp_path, built, tiny_model, fake
):
    """Extractor A, then extractor B that finds other spans in one chunk only: the build
    computes exactly that chunk's entry; until gc the old entry still serves readers of the
    published index; lineage shows both; gc drops the old one, and a deleted document's."""
    store = tmp_path / "store"
    st = Store.at(store)
    settings = {**built["settings"], "extractor": "openai", "kv_keep": "nuggets"}
    first = build_flow(str(built["src"]), str(store), {**settings, "llm_model": "fake-a"})
    assert first["kv_computed"] == len(_kv(store).manifest()) > 4

    # B answers like A, but for one chunk text it finds another clause of it.
    chunk = max(read_rows(st, ChunkRow), key=lambda c: len(c.text))
    clause = [p.strip() for p in chunk.text.replace(";", ".").split(".") if p.strip()][-1]
    fake.script_chat(Action.raw_content(json.dumps({"nuggets": [clause]})), match=clause)
    second = build_flow(str(built["src"]), str(store), {**settings, "llm_model": "fake-b"})
    assert second["kv_computed"] == 1 and second["kv_reused"] == first["kv_computed"] - 1
    kv = _kv(store)
    (new,) = [r for r in kv.manifest().values() if r.run_id == second["run_id"]]
    assert new.content_key == chunk.content_key
    assert len(kv.entries_of(chunk.content_key)) == 2  # the old one serves the old index

    lineage = json.loads(
        cli("lineage", "--store", str(store), "--chunk", chunk.chunk_id, "--json").stdout
    )
    entries = {tuple(r["kv_kept"]): r["kv_run_id"] for r in lineage["chunk"]}
    assert entries == {
        tuple(new.kept): second["run_id"],
        tuple(next(r.kept for r in kv.manifest().values() if r.run_id == first["run_id"]
                   and r.content_key == chunk.content_key)): first["run_id"],
    }  # fmt: skip

    dry = cli("gc", "--store", str(store), "--dry-run")
    assert dry.exit_code == 0 and "would reclaim 1 KV entries" in dry.output, dry.output
    done = cli("gc", "--store", str(store))
    assert done.exit_code == 0 and "reclaimed 1 KV entries" in done.output, done.output
    kv = _kv(store)
    assert kv.entries_of(chunk.content_key) == [
        entry_key(new.content_key, KeptRanges.from_flat(new.kept))
    ]
    assert all(kv.verify_entry(key) for key in kv.manifest())
    answer = RagEngine.open(str(store), max_new_tokens=2).answer(QUESTION, kc=4, k=10)
    assert answer.evidence

    # delete a document: gc reclaims its entries (not shared with another document)
    gone = built["docs"][0]["id"]
    assert cli("delete", gone, "--store", str(store)).exit_code == 0
    chunks = read_rows(st, ChunkRow, filter=pc.field("run_id") == first["run_id"])
    dead = {c.content_key for c in chunks if c.doc_id == gone}
    dead -= {c.content_key for c in chunks if c.doc_id != gone}
    dead &= {r.content_key for r in _kv(store).manifest().values()}  # chunks with nuggets
    done = cli("gc", "--store", str(store))
    assert f"reclaimed {len(dead)} KV entries" in done.output, done.output
    left = {r.content_key for r in _kv(store).manifest().values()}
    assert dead and not dead & left


@pytest.mark.heavy  # over 5 s: the second tier
def test_unchanged_rebuild_and_frozen_training_on_a_nuggets_store(built, tmp_path, tiny_model):
    store = tmp_path / "store"
    shutil.copytree(built["root"] / "nuggets", store)
    again = build_flow(str(built["src"]), str(store), {**built["settings"], "kv_keep": "nuggets"})
    n = built["chunks"]["kv_computed"]
    assert (again["kv_computed"], again["kv_reused"] + again["kv_nothing_kept"]) == (0, n)
    assert again["kv_nothing_kept"] > 0 and again["kv_keep"] == "nuggets"
    rows = read_rows(Store.at(store), KvManifestRow)
    assert again["run_id"] not in {r.run_id for r in rows}  # nothing written

    # A flipped byte in an entry of kept ranges: verify names its chunk, a build rebuilds it.
    kv = _kv(store)
    key, row = min(kv.manifest().items(), key=lambda item: item[1].location)
    before = kv.read_entry(key)
    _, shard, slot = parse_location(row.location)
    assert slot == 0
    with (store / "kv" / kv.kv_fp / shard / "c/0/0/0/0/0/0").open("r+b") as f:  # block 0 first
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    checked = cli("verify", "--store", str(store))
    assert checked.exit_code == 1 and row.chunk_id in checked.output, checked.output
    repaired = build_flow(
        str(built["src"]), str(store), {**built["settings"], "kv_keep": "nuggets"}
    )
    assert (repaired["kv_rebuilt"], repaired["kv_computed"]) == (1, 1)
    assert cli("verify", "--store", str(store)).exit_code == 0
    assert torch.equal(_kv(store).read_entry(key), before)

    data = tmp_path / "qa.jsonl"
    ids = [d["id"] for d in built["docs"]]
    data.write_text(
        json.dumps({"question": QUESTION, "answer": "Stanley Kubrick", "doc_ids": ids[:2]}) + "\n"
    )
    out = tmp_path / "ft"
    got = cli("train", "nuggets", "--store", str(store), "--data", str(data), "--out", str(out),
              "--mode", "frozen", "--max-steps", "1")  # fmt: skip
    assert got.exit_code == 0, got.output
    assert (out / "coinrag-training.json").exists()
