"""Lineage views and `coinrag lineage` on a real store: two builds (one document edited in
between), self-study and cartridge training against a local OpenAI-compatible endpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import TINY_DIMS
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.tables import (
    ChunkRow,
    DocumentRow,
    ExtractionCallRow,
    KvManifestRow,
    NuggetRow,
    RunRow,
    arrow_schema,
    column_names,
)
from coinrag.schemas.views import PRODUCERS, VIEWS
from coinrag.storage.corpus import live_documents, live_versions
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import parse_location
from coinrag.storage.lineage import LineageError, open_lineage, run_query, walk
from coinrag.storage.runs import finish_run, start_run
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows, replace_fields
from coinrag.tasks.extractors.rules import RULES_VERSION
from coinrag.tasks.fingerprints import current_producers, store_settings

pytestmark = pytest.mark.usefixtures("prefect_harness")

API_KEY = "sk-test-SECRET-lineage-0123456789"
EDITED = 0  # index of the document edited between the two builds
ADDED = " It was restored in 2024 and is now shown in a new wing of the museum."
# Self-study answers: each question shares a content word with both trained documents.
QUESTIONS = '["Which film shows the speed of light?", "Who made the film about light speed?"]'


def _tiny_model(path: Path, tokenizer, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        **TINY_DIMS,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cli(*args: str):
    return CliRunner().invoke(app, ["lineage", *args])


@pytest.fixture(scope="module")
def built(tmp_path_factory, sample_corpus: Path, smollm2_tokenizer, monkeypatch_module) -> dict:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lineage")
    model = _tiny_model(root / "tiny", smollm2_tokenizer, seed=0)
    lines = [json.loads(x) for x in sample_corpus.read_text(encoding="utf-8").splitlines()[:5]]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    store = root / "store"
    settings = {"extractor": "rules", "model": str(model), "chunk_size": 64}
    first = build_flow(str(src), str(store), settings)
    lines[EDITED]["text"] += ADDED
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    second = build_flow(str(src), str(store), settings)

    from coinrag.flows.cartridges import train_cartridges

    doc_ids = [lines[EDITED]["id"], lines[1]["id"]]
    with FakeOpenAI(api_key=API_KEY) as fake:
        fake.script_chat(*[Action.raw_content(QUESTIONS)] * 2)
        monkeypatch_module.setenv("OPENAI_API_KEY", API_KEY)
        cartridges = train_cartridges(
            store,
            doc_ids,
            2,
            model=str(model),
            base_url=fake.base_url,
            n_calls=1,
            n_questions=2,
            max_new_tokens=4,
            p=3,
            checkpoint_every=2,
        )
        monkeypatch_module.delenv("OPENAI_API_KEY")
    return {
        "root": root,
        "store": store,
        "model": model,
        "first": first,
        "second": second,
        "cartridges": cartridges,
        "edited": lines[EDITED]["id"],
        "trained": doc_ids,
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def con(built):
    return open_lineage(Store.at(built["store"]))


def _rows(con, sql: str, **params) -> list[dict]:
    return con.sql(sql, params=params or None).to_arrow_table().to_pylist()


# ---------------------------------------------------------------------------- views


def test_views_have_the_columns_of_their_schema(con) -> None:
    for name, record in VIEWS.items():
        table = run_query(con, f"SELECT * FROM {name} LIMIT 0")
        assert table.column_names == column_names(record), name
    index_cols = run_query(con, "SELECT * FROM index_nuggets LIMIT 0").column_names
    assert "vector" not in index_cols and "nugget_id" in index_cols


def test_live_documents_take_the_edit(built, con) -> None:
    store = Store.at(built["store"])
    versions = _rows(con, "SELECT doc_version FROM documents WHERE doc_id = $d", d=built["edited"])
    assert len(versions) == 2
    live = _rows(con, "SELECT doc_id, doc_version, run_id, text FROM live_documents")
    assert len(live) == 5
    (edited,) = [r for r in live if r["doc_id"] == built["edited"]]
    assert edited["run_id"] == built["second"]["run_id"] and edited["text"].endswith(ADDED)
    chunks = read_rows(store, ChunkRow)
    live_versions = {r["doc_version"] for r in live}
    n_live = sum(c.doc_version in live_versions for c in chunks)
    flags = _rows(con, "SELECT live, count(*) AS n FROM lineage_chunks GROUP BY live")
    assert {r["live"]: r["n"] for r in flags} == {True: n_live, False: len(chunks) - n_live}


def _live_in_lineage(store: Store) -> dict[str, tuple[str, str]]:
    """``doc_id -> (doc_version, run_id)`` of lineage's ``live_documents``."""
    rows = _rows(open_lineage(store), "SELECT doc_id, doc_version, run_id FROM live_documents")
    return {r["doc_id"]: (r["doc_version"], r["run_id"]) for r in rows}


def _corpus_live(store: Store) -> dict[str, tuple[str, str]]:
    return {d: (r.doc_version, r.run_id) for d, r in live_documents(store).items()}


def test_live_documents_follow_the_corpus_after_delete_and_killed_build(built, tmp_path) -> None:
    """lineage's live_documents is storage.corpus's answer: after `coinrag delete`, while a
    killed build's rows (a run that never completed) sit in the tables and in the index's
    unpublished versions, and after a later committed run reads the deleted document again."""
    shutil.copytree(built["store"], tmp_path / "store")
    st = Store.at(tmp_path / "store")
    gone, edited = built["trained"][1], built["edited"]
    deleted = CliRunner().invoke(app, ["delete", gone, "--store", str(st.root)])
    assert deleted.exit_code == 0, deleted.output
    after_delete = _corpus_live(st)
    assert gone not in after_delete and len(after_delete) == 4
    assert _live_in_lineage(st) == after_delete
    assert {d: v for d, (v, _) in after_delete.items()} == live_versions(st)
    con = open_lineage(st)
    assert not _rows(con, "SELECT * FROM lineage_chunks WHERE doc_id = $d AND live", d=gone)
    (cartridge,) = _rows(con, "SELECT live FROM lineage_cartridges WHERE doc_id = $d", d=gone)
    assert cartridge["live"] is False
    assert not any(r["live"] for r in walk(con, "doc", gone)["document"].to_pylist())

    # A killed build: its run row stays `running`; it read a new version of `edited` and the
    # deleted document again, and took `edited` out of the index's latest versions.
    killed = new_run_id("build")
    start_run(st, killed, "build", {})
    by_id = {r.doc_id: r for r in read_rows(st, DocumentRow)}
    new_text = by_id[edited].text + " Killed before it finished."
    append_rows(
        st,
        [
            replace_fields(by_id[edited], doc_version="dv-killed", text=new_text, run_id=killed),
            replace_fields(by_id[gone], run_id=killed),
        ],
        killed,
        "ingest",
    )
    LanceIndex.open_latest(st).delete_documents([edited])
    assert _corpus_live(st) == after_delete
    assert _live_in_lineage(st) == after_delete
    con = open_lineage(st)
    index_docs = _rows(con, "SELECT doc_id, doc_version FROM index_documents")
    assert {r["doc_id"]: r["doc_version"] for r in index_docs} == live_versions(st)
    doc_walk = walk(con, "doc", edited)["document"].to_pylist()
    assert [r["doc_version"] for r in doc_walk if r["live"]] == [after_delete[edited][0]]

    # A committed run reads the deleted document again (the same version): live again, from
    # that run's row, not the killed run's nor the first build's.
    readd = new_run_id("build")
    run = start_run(st, readd, "build", {})
    append_rows(st, [replace_fields(by_id[gone], run_id=readd)], readd, "ingest")
    finish_run(st, run, "completed")
    back = _corpus_live(st)
    assert back[gone] == (by_id[gone].doc_version, readd)
    assert _live_in_lineage(st) == back


def test_only_a_completed_build_changes_which_chunks_and_nuggets_are_live(built, tmp_path) -> None:
    """A killed build that cut the live documents with another chunker and recovered nuggets
    with another extractor changes nothing live; once a build with those producers completes,
    its chunks and nuggets are the live ones."""
    shutil.copytree(built["store"], tmp_path / "store")
    st = Store.at(tmp_path / "store")
    live_chunks = "SELECT chunk_id FROM lineage_chunks WHERE live ORDER BY 1"
    live_nuggets = "SELECT nugget_id FROM lineage_nuggets WHERE live ORDER BY 1"
    con = open_lineage(st)
    chunks_before, nuggets_before = _rows(con, live_chunks), _rows(con, live_nuggets)
    assert chunks_before and nuggets_before
    ids = {r["chunk_id"] for r in chunks_before}
    chunks = [c for c in read_rows(st, ChunkRow) if c.chunk_id in ids]
    chunks = list({c.chunk_id: c for c in chunks}.values())
    nuggets = [n for n in read_rows(st, NuggetRow) if n.chunk_id in ids]

    other = new_run_id("build")
    run = start_run(st, other, "build", {})
    append_rows(
        st,
        [
            replace_fields(c, chunk_id=c.chunk_id + "-k", chunker_fp="chunker-k", run_id=other)
            for c in chunks
        ],
        other,
        "chunk",
    )
    append_rows(
        st,
        [replace_fields(n, extractor_fp="extractor-k", run_id=other) for n in nuggets],
        other,
        "recover",
    )
    con = open_lineage(st)
    assert _rows(con, live_chunks) == chunks_before
    assert _rows(con, live_nuggets) == nuggets_before

    fps = json.loads(
        next(r for r in read_rows(st, RunRow) if r.status == "completed").fingerprints_json
    )
    finish_run(st, run, "completed", fingerprints=fps | {"chunker_fp": "chunker-k"})
    con = open_lineage(st)
    assert {r["chunk_id"] for r in _rows(con, live_chunks)} == {c + "-k" for c in ids}


def test_walk_down_from_a_document(built) -> None:
    result = _cli("--store", str(built["store"]), "--doc", built["edited"], "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    versions = got["document"]
    assert [v["live"] for v in versions] == [True, False]
    live_version = versions[0]["doc_version"]
    live_chunks = [c for c in got["chunks"] if c["doc_version"] == live_version]
    assert live_chunks and all(c["live"] for c in live_chunks)
    manifest = {r.content_key: r for r in read_rows(Store.at(built["store"]), KvManifestRow)}
    for c in live_chunks:  # every live chunk has its KV entry and its index row
        assert c["kv_location"] == manifest[c["content_key"]].location
        assert c["index_run_id"] and c["index_embedder_fp"].startswith("embedder-")
    live_nuggets = [n for n in got["nuggets"] if n["doc_version"] == live_version]
    assert live_nuggets and {n["chunk_id"] for n in live_nuggets} <= {
        c["chunk_id"] for c in live_chunks
    }
    assert all(n["index_run_id"] for n in live_nuggets)
    # The old version's rows are still there (append-only), marked not live, out of the index.
    old = [c for c in got["chunks"] if c["doc_version"] != live_version]
    assert old and not any(c["live"] for c in old)
    (doc_index,) = got["index_document"]
    assert doc_index["doc_version"] == live_version
    (cartridge,) = got["cartridges"]
    assert cartridge["doc_version"] == live_version and cartridge["run_flow"] == "train-cartridges"
    run_ids = {r["run_id"] for r in got["runs"]}
    assert {built["first"]["run_id"], built["second"]["run_id"]} <= run_ids
    assert built["cartridges"]["run_id"] in run_ids
    # The cartridge run trained on the model that built the KV: a training run of that model.
    assert built["cartridges"]["run_id"] in {r["run_id"] for r in got["training_runs"]}


def test_walk_up_from_a_nugget(built, con) -> None:
    store = Store.at(built["store"])
    nugget = next(n for n in read_rows(store, NuggetRow) if n.doc_id == built["trained"][1])
    got = walk(con, "nugget", nugget.nugget_id)
    (row,) = got["nugget"].to_pylist()
    (chunk,) = got["chunk"].to_pylist()
    (document,) = got["document"].to_pylist()
    assert row["chunk_id"] == chunk["chunk_id"] == nugget.chunk_id
    assert row["doc_version"] == chunk["doc_version"] == document["doc_version"]
    assert row["backend"] == "rules" and row["prompt_version"] == RULES_VERSION
    assert row["extraction_status"] == "ok" and row["extraction_run_id"] == row["run_id"]
    assert (row["tok_start"], row["tok_end"]) == (nugget.tok_start, nugget.tok_end)
    # The KV entry: of the chunk's content, built by the model the build run recorded.
    runs = {r.run_id: r for r in read_rows(store, RunRow) if r.status == "completed"}
    fps = json.loads(runs[row["kv_run_id"]].fingerprints_json)
    assert parse_location(row["kv_location"])[0] == fps["kv_fp"]
    assert row["kv_model_fp"] == fps["model_fp"] and fps["prompt_version"] == RULES_VERSION
    assert row["index_embedder_fp"] == fps["embedder_fp"]
    assert len(got["cartridges"]) == 1 and got["runs"].num_rows >= 2


def test_last_edit_recomputed_only_the_changed_chunks(built, con) -> None:
    second = built["second"]["run_id"]
    rows = _rows(
        con,
        "SELECT c.ordinal, c.kv_run_id = c.run_id AS kv_new, c.embedding_run_id = c.run_id "
        "AS embedded_new FROM lineage_chunks c JOIN live_documents d USING (doc_id, doc_version) "
        "WHERE c.doc_id = $d ORDER BY c.ordinal",
        d=built["edited"],
    )
    assert len(rows) >= 2
    # The edit appended a sentence: the first chunks keep their content, hence their KV.
    assert not rows[0]["kv_new"] and rows[-1]["kv_new"]
    recomputed = _rows(
        con,
        "SELECT count(DISTINCT content_key) AS n FROM lineage_chunks WHERE kv_run_id = $r",
        r=second,
    )
    assert recomputed[0]["n"] == built["second"]["kv_computed"] >= 1


def test_cost_per_run_matches_the_ledger(built, con) -> None:
    store = Store.at(built["store"])
    costs = {r["run_id"]: r for r in _rows(con, "SELECT * FROM run_costs")}
    assert set(costs) == {r.run_id for r in read_rows(store, RunRow)}
    calls = read_rows(store, ExtractionCallRow)
    cart = costs[built["cartridges"]["run_id"]]
    mine = [c for c in calls if c.run_id == cart["run_id"]]
    assert cart["flow"] == "train-cartridges" and cart["ledger_calls"] == len(mine) == 2
    assert cart["ledger_cost_usd"] == pytest.approx(sum(c.cost_usd for c in mine))
    assert cart["ledger_cost_usd"] > 0
    assert cart["cost_usd"] == pytest.approx(cart["ledger_cost_usd"])
    assert cart["ledger_tokens_in"] == sum(c.tokens_in for c in mine)
    assert cart["cartridges"] >= 2
    first = costs[built["first"]["run_id"]]
    assert first["cost_usd"] == first["ledger_cost_usd"] == 0.0  # rules: no LLM
    assert first["chunks"] == built["first"]["chunks_new"] and first["documents"] == 5
    assert costs[built["second"]["run_id"]]["documents"] == 1


def test_current_producers_are_what_the_build_recorded(built) -> None:
    store = Store.at(built["store"])
    current = current_producers(store_settings(store))
    assert tuple(current) == PRODUCERS
    runs = [r for r in read_rows(store, RunRow) if r.run_id == built["second"]["run_id"]]
    recorded = json.loads(next(r for r in runs if r.status == "completed").fingerprints_json)
    # The cartridges' model is the one the train-cartridges run recorded.
    cart = [r for r in read_rows(store, RunRow) if r.run_id == built["cartridges"]["run_id"]]
    cart_fps = json.loads(next(r for r in cart if r.status == "completed").fingerprints_json)
    recorded["cartridge_model_fp"] = cart_fps["model_fp"]
    for name in PRODUCERS:
        if name != "tau":
            assert current[name] == recorded[name], name
    assert float(current["tau"]) == store_settings(store).tau
    result = _cli("--store", str(built["store"]), "--stale", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []


@pytest.mark.heavy  # over 10 s: the second tier
def test_stale_after_a_settings_change_then_a_rebuild(built, smollm2_tokenizer, tmp_path) -> None:
    store = tmp_path / "store"
    shutil.copytree(built["store"], store)
    other = _tiny_model(tmp_path / "other", smollm2_tokenizer, seed=1)
    toml = (store / "coinrag.toml").read_text()
    toml = toml.replace("chunk_size = 64", "chunk_size = 96").replace("tau = 0.7", "tau = 0.8")
    toml = toml.replace(json.dumps(str(built["model"])), json.dumps(str(other)))
    (store / "coinrag.toml").write_text(toml)
    result = _cli("--store", str(store), "--stale", "--json")
    assert result.exit_code == 0, result.output
    stale = json.loads(result.stdout)
    kinds = {(s["asset"], s["producer"]) for s in stale}
    assert kinds == {
        ("chunk", "chunker_fp"),
        ("nugget", "tau"),
        ("kv_entry", "model_fp"),
        ("cartridge", "cartridge_model_fp"),
    }
    con = open_lineage(Store.at(store))
    n_live_chunks = _rows(con, "SELECT count(*) AS n FROM lineage_chunks WHERE live")[0]["n"]
    assert sum(s["asset"] == "chunk" for s in stale) == n_live_chunks
    assert {s["current"] for s in stale if s["producer"] == "tau"} == {"0.8"}
    assert sum(s["asset"] == "cartridge" for s in stale) == 2
    # CSV: a header and one line per stale asset.
    csv_out = _cli("--store", str(store), "--stale", "--csv")
    assert csv_out.exit_code == 0 and csv_out.stdout.splitlines()[0].startswith("asset,asset_id")
    assert len(csv_out.stdout.splitlines()) == len(stale) + 1

    # Building with those settings supersedes the stale chunks, nuggets and KV entries;
    # the cartridges stay stale until trained again for the new model.
    source = json.loads(
        next(r for r in read_rows(Store.at(store), RunRow) if r.flow == "build").parameters_json
    )["source"]
    build_flow(
        source,
        str(store),
        {"extractor": "rules", "model": str(other), "chunk_size": 96, "tau": 0.8},
    )
    again = json.loads(_cli("--store", str(store), "--stale", "--json").stdout)
    assert {(s["asset"], s["producer"]) for s in again} == {("cartridge", "cartridge_model_fp")}


# ---------------------------------------------------------------------------- CLI


def test_cli_sql_formats_and_errors(built, tmp_path) -> None:
    store = str(built["store"])
    ok = _cli("--store", store, "SELECT run_id, flow, cost_usd FROM run_costs ORDER BY run_id")
    assert ok.exit_code == 0, ok.output
    assert "run_id" in ok.stdout and "train-cartridges" in ok.stdout and "3 row(s)" in ok.stdout
    as_json = _cli("--store", store, "SELECT flow FROM latest_runs ORDER BY flow", "--json")
    assert [r["flow"] for r in json.loads(as_json.stdout)] == ["build", "build", "train-cartridges"]
    listing = _cli("--store", store)
    assert listing.exit_code == 0 and "lineage_nuggets" in listing.stdout

    bad = _cli("--store", store, "SELECT nope FROM lineage_nuggets")
    assert bad.exit_code == 2 and "nope" in bad.output
    assert _cli("--store", store, "SELEC 1").exit_code == 2
    write = _cli("--store", store, "COPY runs TO 'x.csv'")
    assert write.exit_code == 2 and "only queries" in write.output
    two = _cli("--store", store, "SELECT 1; SELECT 2")
    assert two.exit_code == 2 and "one SQL statement" in two.output
    unknown = _cli("--store", store, "--nugget", "ng-000")
    assert unknown.exit_code == 1 and "no nugget 'ng-000'" in unknown.output
    assert _cli("--store", store, "--chunk", "ch-000").exit_code == 1
    assert _cli("--store", store, "--doc", "x", "--stale").exit_code == 2
    assert _cli("--store", store, "--doc", "x", "--csv").exit_code == 2
    missing = _cli("--store", str(tmp_path / "nothing"), "SELECT 1")
    assert missing.exit_code == 1 and "not a coinrag store" in missing.output


def test_cli_reads_while_a_build_holds_the_lock(built) -> None:
    store = Store.at(built["store"])
    chunk_id = read_rows(store, ChunkRow)[0].chunk_id
    with store.write_lock("test-holder"):
        result = _cli("--store", str(store.root), "--chunk", chunk_id)
        assert result.exit_code == 0, result.output
        assert chunk_id in result.stdout and "nuggets" in result.stdout
        sql = _cli("--store", str(store.root), "SELECT count(*) AS n FROM kv_entries", "--json")
        assert sql.exit_code == 0 and json.loads(sql.stdout)[0]["n"] >= 1


def test_bad_sql_raises_lineage_error(con) -> None:
    with pytest.raises(LineageError, match="only queries"):
        run_query(con, "CREATE TABLE t AS SELECT 1")
    with pytest.raises(LineageError, match="no doc"):
        walk(con, "doc", "no-such-document")
    assert arrow_schema(VIEWS["stale_assets"]).names == column_names(VIEWS["stale_assets"])
