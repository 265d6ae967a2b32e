"""`coinrag lineage` SQL is confined to the store: its tables, views and index rows, and no other
file, URL or extension (read_text, read_csv, read_parquet elsewhere, COPY TO, ATTACH, INSTALL,
httpfs), on a local store (built by the CLI) and on an s3:// store (moto on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from store_fixtures import sample_docs, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.tables import DocumentRow
from coinrag.storage.lineage import LineageError, open_lineage, run_query
from coinrag.storage.location import object_filesystem
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows

NOT_ALLOWED = "not allowed: lineage SQL reads only this store's tables and views"


@pytest.fixture(scope="module")
def built(tmp_path_factory, sample_corpus: Path, prefect_harness) -> Path:
    """A store of two sample documents built by the CLI (rules, no KV, MiniLM index)."""
    root = tmp_path_factory.mktemp("confined")
    src = write_corpus(root / "docs.jsonl", sample_docs(sample_corpus, 2))
    config = root / "build.toml"
    config.write_text("[build]\nkv = false\n", encoding="utf-8")
    store = root / "store"
    command = ["build", str(src), "--store", str(store), "--extractor", "rules"]
    result = CliRunner().invoke(app, [*command, "--config", str(config)])
    assert result.exit_code == 0, result.output
    return store


class _Counting(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Counting.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"a,b\n1,2\n")

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def http_server():
    """An HTTP server on 127.0.0.1 that counts the requests it gets (there must be none)."""
    _Counting.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _lineage(store: Path, sql: str):
    return CliRunner().invoke(app, ["lineage", "--store", str(store), sql, "--json"])


def test_normal_lineage_queries_still_work(built: Path) -> None:
    for sql, check in [
        ("SELECT count(*) AS n FROM nuggets", lambda rows: rows[0]["n"] > 0),
        ("SELECT count(*) AS n FROM index_chunks", lambda rows: rows[0]["n"] > 0),
        ("SELECT count(*) AS n FROM index_nuggets", lambda rows: rows[0]["n"] > 0),
        ("SELECT count(*) AS n FROM lineage_nuggets WHERE live", lambda rows: rows[0]["n"] > 0),
        ("SELECT doc_id FROM live_documents", lambda rows: len(rows) == 2),
        ("SELECT flow, status FROM latest_runs", lambda rows: rows[0]["status"] == "completed"),
    ]:
        result = _lineage(built, sql)
        assert result.exit_code == 0, (sql, result.output)
        assert check(json.loads(result.stdout)), (sql, result.stdout)
    walk = CliRunner().invoke(app, ["lineage", "--store", str(built), "--doc", "speed-of-light"])
    assert walk.exit_code == 0, walk.output


def test_sql_reads_no_other_file(built: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.parquet"
    pq.write_table(pa.table({"secret": ["s3cr3t"]}), outside)
    (tmp_path / "outside.csv").write_text("secret\ns3cr3t\n")
    in_store = next((built / "tables" / "nuggets").glob("*.parquet"))
    for sql in [
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM read_blob('/etc/passwd')",
        f"SELECT * FROM read_csv('{tmp_path / 'outside.csv'}')",
        f"SELECT * FROM '{tmp_path / 'outside.csv'}'",  # a replacement scan
        f"SELECT * FROM read_parquet('{outside}')",
        f"SELECT * FROM read_text('{built / 'coinrag.toml'}')",  # the store's, but not a table
        f"SELECT * FROM read_text('{in_store.parent}/../../coinrag.toml')",
        f"SELECT * FROM glob('{built}/**')",
        f"SELECT * FROM read_json('{built}/index/*')",
    ]:
        result = _lineage(built, sql)
        assert result.exit_code == 2, (sql, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert NOT_ALLOWED in lines[0] and "s3cr3t" not in result.output, result.output


def test_sql_reaches_no_network(built: Path, http_server: str) -> None:
    for sql in [
        f"SELECT * FROM read_csv('{http_server}/x.csv')",
        f"SELECT * FROM read_parquet('{http_server}/x.parquet')",
        "SELECT * FROM read_parquet('s3://some-bucket/x.parquet')",
    ]:
        result = _lineage(built, sql)
        assert result.exit_code == 2 and NOT_ALLOWED in result.output, (sql, result.output)
    assert _Counting.hits == []


def test_connection_refuses_writes_attach_extensions_and_settings(built: Path, tmp_path) -> None:
    """Below the one-SELECT check of the CLI: the connection itself refuses."""
    con = open_lineage(Store.at(built))
    target = tmp_path / "copy.csv"
    for sql in [
        f"COPY (SELECT * FROM nuggets) TO '{target}'",
        f"COPY (SELECT 1) TO '{built / 'tables' / 'nuggets' / 'x.csv'}'",
        f"ATTACH '{tmp_path / 'other.duckdb'}' AS other",
        "INSTALL httpfs",
        "LOAD httpfs",
        f"CREATE TABLE t AS SELECT * FROM read_text('{built / 'coinrag.toml'}')",
    ]:
        with pytest.raises(duckdb.PermissionException):
            con.execute(sql)
    for sql in [
        "SET enable_external_access = true",
        "SET allowed_directories = ['/']",
        "SET allowed_paths = ['/etc/hostname']",
        "RESET enable_external_access",
    ]:
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute(sql)
    assert not target.exists() and not (tmp_path / "other.duckdb").exists()
    with pytest.raises(LineageError, match="only queries are allowed"):
        run_query(con, f"COPY (SELECT 1) TO '{target}'")
    assert run_query(con, "SELECT count(*) AS n FROM chunks").column("n")[0].as_py() > 0


def test_s3_store_reads_its_tables_and_nothing_else(monkeypatch) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in {
            "AWS_ACCESS_KEY_ID": "coinrag-test-key",
            "AWS_SECRET_ACCESS_KEY": "coinrag-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }.items():
            monkeypatch.setenv(name, value)
        object_filesystem.cache_clear()
        fs = object_filesystem("s3")
        fs.mkdir("confined-store")
        fs.mkdir("confined-other")
        fs.pipe("confined-other/secret.csv", b"secret\ns3cr3t\n")
        fs.pipe("confined-store/s/coinrag.toml", b"[build]\n")
        st = Store.at("s3://confined-store/s")
        row = DocumentRow(
            doc_id="d1", doc_version="v1", text="hello", metadata_json="{}", source="t",
            n_chars=5, run_id="run-1", code_version="c",
        )  # fmt: skip
        append_rows(st, [row], "run-1", "ingest")
        con = open_lineage(st)
        assert run_query(con, "SELECT doc_id FROM documents").to_pylist() == [{"doc_id": "d1"}]
        for sql in [
            "SELECT * FROM read_csv('s3://confined-other/secret.csv')",
            "SELECT * FROM read_text('s3://confined-store/s/coinrag.toml')",
            "SELECT * FROM glob('s3://confined-store/**')",
        ]:
            with pytest.raises(LineageError, match=NOT_ALLOWED):
                run_query(con, sql)
        with pytest.raises(duckdb.PermissionException):
            con.execute("COPY (SELECT 1) TO 's3://confined-store/s/tables/documents/x.parquet'")
        assert not fs.exists("confined-store/s/tables/documents/x.parquet")
    finally:
        object_filesystem.cache_clear()
        server.stop()
