"""``kv_keep = "nuggets"`` on an ``s3://`` store (moto's S3 server on 127.0.0.1, the fake at the
network edge), built by Dask workers that stage their shards into the bucket: the same entries,
kept ranges and bytes as a default build on local disk; coinrag answers from ranged reads of
the kept slices as from the local copy; delete and gc reclaim in the bucket.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.methods import RagEngine
from coinrag.schemas.tables import ChunkRow, KvManifestRow
from coinrag.storage.gc import kv_fps
from coinrag.storage.kv import KvStore
from coinrag.storage.location import object_filesystem
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]
BUCKET = "coinrag-kv-keep"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; the AWS variables point at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "kv-keep-key",
            "AWS_SECRET_ACCESS_KEY": "kv-keep-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }.items():
            mp.setenv(name, value)
        object_filesystem.cache_clear()
        fs = object_filesystem("s3")
        fs.mkdir(BUCKET)
        yield fs
        object_filesystem.cache_clear()
    server.stop()


def _rows(st: Store) -> list[dict]:
    out = [dataclasses.asdict(r) | {"run_id": ""} for r in read_rows(st, KvManifestRow)]
    return sorted(out, key=lambda r: r["location"])


@pytest.mark.heavy
def test_nuggets_store_on_s3_built_by_dask_workers(
    tmp_path, s3, sample_corpus, smollm2_tokenizer
) -> None:
    model = save_tiny_llama(tmp_path / "llama", smollm2_tokenizer, 0)
    docs = sample_docs(sample_corpus, 4)
    src = write_corpus(tmp_path / "docs.jsonl", docs)
    settings = {"extractor": "rules", "model": str(model), "chunk_size": 64}
    settings |= {"kv_keep": "nuggets", "kv_batch_size": 2, "embed_batch_size": 16}
    url = f"s3://{BUCKET}/stores/nuggets"
    remote = build_flow(str(src), url, settings | {"runner": "dask", "workers": 2})
    local = build_flow(str(src), str(tmp_path / "local"), settings)
    assert remote["kv_computed"] == local["kv_computed"] > 4  # several shard groups
    assert remote["kv_nothing_kept"] == local["kv_nothing_kept"]
    st, lt = Store.at(url), Store.at(tmp_path / "local")
    assert _rows(st) == _rows(lt) and all(r["kept"] for r in _rows(st))
    (fp,) = kv_fps(lt)
    assert kv_fps(st) == [fp]
    remote_kv, local_kv = KvStore.open(st, fp), KvStore.open(lt, fp)
    assert remote_kv.layout.keep == "nuggets"
    for key in local_kv.manifest():
        assert torch.equal(remote_kv.read_entry(key), local_kv.read_entry(key)), key
    assert not [o for o in s3.find(f"{BUCKET}/stores/nuggets") if "/.tmp-" in o]

    question = "Who directed 2001: A Space Odyssey?"
    answers = [
        RagEngine.open(where, max_new_tokens=3).answer(question, kc=3, k=6)
        for where in (url, str(tmp_path / "local"))
    ]
    assert answers[0].evidence and answers[0].evidence == answers[1].evidence
    assert answers[0].token_ids == answers[1].token_ids
    refused = CliRunner().invoke(app, ["query", question, "--store", url, "--method", "turborag"])
    assert refused.exit_code == 1 and 'kv_keep = "nuggets"' in refused.output

    gone = docs[1]["id"]
    assert CliRunner().invoke(app, ["delete", gone, "--store", url]).exit_code == 0
    chunks = read_rows(st, ChunkRow)
    dead = {c.content_key for c in chunks if c.doc_id == gone}
    dead -= {c.content_key for c in chunks if c.doc_id != gone}
    dead &= {r.content_key for r in remote_kv.manifest().values()}
    done = CliRunner().invoke(app, ["gc", "--store", url])
    assert f"reclaimed {len(dead)} KV entries" in done.output, done.output
    kv = KvStore.open(st, fp)
    assert dead and not dead & {r.content_key for r in kv.manifest().values()}
    assert all(kv.verify_entry(key) for key in kv.manifest()) and kv.garbage() == []
    lineage = CliRunner().invoke(
        app, ["lineage", "--store", url, "SELECT count(*) AS n FROM kv_entries", "--json"]
    )
    assert json.loads(lineage.stdout)[0]["n"] == len(kv.manifest())
