"""Corrupt KV is found, reported in one line, and repaired by the next build (issue 12, item 3).

Storage level: the ``crc32c`` check (the build's default on reuse) finds a flipped byte in any
block of an entry and in a shard index, which the ``stat`` check (sizes only) cannot see.
CLI level, on a real store built by ``coinrag build`` (tiny random-weight Llama, three sample
documents): a flipped byte in a shard, a truncated shard and a flipped byte in the prompt
prefix's KV each make ``coinrag query`` fail with one ``error:`` line (no traceback) naming what
is corrupt and the build that repairs it; running that build recomputes exactly the damaged
entries, and the repaired KV equals the original bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path, PurePath

import numpy as np
import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, synthetic_chunk, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.tables import ChunkRow, KvManifestRow, RunRow
from coinrag.storage.kv import KvLayout, KvStore, parse_location
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

# ---------------------------------------------------------------------------- storage level


DATA_FILE = "c/0/0/0/0/0/0"  # a shard array's one Zarr shard (the whole array)


def shard_index(kv: KvStore, name: str) -> tuple[np.ndarray, PurePath]:
    """A shard's index, read here per the Zarr v3 sharding spec: at the end of the data file,
    uint64 ``(offset, nbytes)`` per inner chunk in C order over the chunk grid, then a crc32c.
    Returns ``(slots, blocks, 2)`` and the data file's path."""
    meta = json.loads(kv.store.read_bytes(kv.root / name / "zarr.json"))
    shape = meta["shape"]  # (slots, layers, 2, kv_heads, width, head_dim)
    block = meta["codecs"][0]["configuration"]["chunk_shape"][4]
    slots, blocks = shape[0], shape[4] // block
    path = kv.root / name / DATA_FILE
    raw = kv.store.read_bytes(path)[-(slots * blocks * 16 + 4) : -4]
    return np.frombuffer(raw, dtype="<u8").reshape(slots, blocks, 2), path


def flip(store: Store, path: PurePath, offset: int) -> None:
    """Flip one bit of a file of the store (``offset`` < 0: from its end)."""
    data = bytearray(store.read_bytes(path))
    data[offset] ^= 0x01
    store.write_bytes_atomic(path, bytes(data))


@pytest.fixture(scope="module")
def s3_root():
    """A bucket on a moto S3 server on 127.0.0.1 (the AWS variables point at it)."""
    from moto.server import ThreadedMotoServer

    from coinrag.storage.location import object_filesystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "kv-repair-test")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "kv-repair-secret")
        mp.setenv("AWS_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        object_filesystem.cache_clear()
        object_filesystem("s3").mkdir("kv-repair")
        yield "s3://kv-repair"
        object_filesystem.cache_clear()
    server.stop()


@pytest.mark.parametrize(
    "where, encoder", [("local", "direct"), ("local", "zarr"), ("s3", "direct")]
)
def test_crc32c_check_finds_flipped_bytes_that_stat_misses(
    tmp_path: Path, request, where: str, encoder: str
) -> None:
    lengths = [40, 40, 33, 40, 9]  # two shards of 3 and 2 slots; short entries are padded
    layout = KvLayout(
        model_fp="model-x",
        prefix_sha="ps-x",
        layers=2,
        kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        block_tokens=8,
        slots_per_shard=3,
    )
    root = f"{request.getfixturevalue('s3_root')}/{encoder}" if where == "s3" else tmp_path
    store = Store.at(root).init()
    kv = KvStore.create(store, layout, encoder=encoder)
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, n), torch.randn(2, 2, 2, n, 8).to(torch.bfloat16))
        for i, n in enumerate(lengths)
    ]
    kv.write_entries(entries, "run-1")
    keys = [c.content_key for c, _ in entries]
    for level in ("stat", "crc32c", "sha256"):
        assert kv.entry_problems(keys, level) == {}

    # A flipped byte inside block 2 of slot 1 (entry 1) of the first shard.
    first = parse_location(kv.manifest()[keys[1]].location)[1]
    index, path = shard_index(kv, first)
    flip(store, path, int(index[1, 2, 0]) + 17)
    fresh = KvStore.open(store, layout.kv_fp)
    assert fresh.entry_problems(keys, "stat") == {}  # same size: invisible to stat
    problems = fresh.entry_problems(keys, "crc32c")
    assert list(problems) == [keys[1]]
    assert problems[keys[1]].startswith("block 2 fails its crc32c") and first in problems[keys[1]]
    assert set(fresh.entry_problems(keys, "sha256")) == {keys[1]}

    # A flipped byte in the second shard's index: both of its entries are bad.
    second = parse_location(kv.manifest()[keys[3]].location)[1]
    _, path = shard_index(kv, second)
    flip(store, path, -10)
    fresh = KvStore.open(store, layout.kv_fp)
    problems = fresh.entry_problems(keys, "crc32c")
    assert set(problems) == {keys[1], keys[3], keys[4]}
    assert "shard index fails its crc32c" in problems[keys[3]]
    # Only the keys asked about are checked and reported.
    assert set(fresh.entry_problems(keys[:1], "crc32c")) == set()


# ---------------------------------------------------------------------------- CLI level


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory, sample_corpus: Path, smollm2_tokenizer, prefect_harness) -> dict:
    """A store built by the CLI; each test works on its own copy."""
    root = tmp_path_factory.mktemp("kv-repair")
    model = save_tiny_llama(root / "llama", smollm2_tokenizer, 0)
    src = write_corpus(root / "docs.jsonl", sample_docs(sample_corpus, 3))
    store = root / "store"
    args = ["--model", str(model), "--extractor", "rules", "--chunk-size", "64"]
    result = CliRunner().invoke(app, ["build", str(src), "--store", str(store), *args])
    assert result.exit_code == 0, result.output
    return {"store": store, "src": src, "args": args}


def copy_store(built: dict, tmp_path: Path) -> tuple[Path, Store, dict[str, torch.Tensor]]:
    """A copy of the built store, and its KV entries before any damage."""
    store = tmp_path / "store"
    shutil.copytree(built["store"], store)
    st = Store.at(store)
    kv = only_kv(st)
    return store, st, {ck: kv.read_entry(ck) for ck in kv.manifest()}


def only_kv(st: Store) -> KvStore:
    (path,) = (Path(st.root) / "kv").glob("kv-*")
    return KvStore.open(st, path.name)


def query(store: Path, n_chunks: int) -> tuple[int, str]:
    """``coinrag query`` retrieving every chunk (so every entry is read)."""
    result = CliRunner().invoke(
        app,
        [
            "query",
            "Who directed 2001: A Space Odyssey?",
            "--store",
            str(store),
            "--method",
            "turborag",
            "--kc",
            str(n_chunks),
            "--max-new-tokens",
            "4",
        ],
    )
    return result.exit_code, result.output


def one_error_line(output: str) -> str:
    """The output's only ``error:`` line; no traceback anywhere."""
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def last_build_counts(st: Store) -> dict:
    runs = [r for r in read_rows(st, RunRow) if r.flow == "build" and r.status == "completed"]
    return json.loads(max(runs, key=lambda r: r.started_at).counts_json)


@pytest.mark.usefixtures("prefect_harness")
def test_flipped_byte_query_says_which_chunk_and_build_repairs_it(built, tmp_path):
    store, st, originals = copy_store(built, tmp_path)
    chunks = read_rows(st, ChunkRow)
    kv = only_kv(st)
    victim = chunks[0]
    row = kv.manifest()[victim.content_key]
    index, path = shard_index(kv, parse_location(row.location)[1])
    flip(st, path, int(index[parse_location(row.location)[2], 0, 0]) + 100)

    code, output = query(store, len(chunks))
    line = one_error_line(output)
    assert code == 1
    assert victim.chunk_id in line and victim.doc_id in line and "corrupt" in line
    assert "block 0 fails its crc32c" in line

    # `coinrag verify` finds the same entry without building anything.
    checked = CliRunner().invoke(app, ["verify", "--store", str(store)])
    assert checked.exit_code == 1
    corrupt = [line for line in checked.output.splitlines() if line.startswith("corrupt:")]
    assert len(corrupt) == 1 and victim.chunk_id in corrupt[0] and "crc32c" in corrupt[0]

    # The line says what to run: run exactly that (the store's last source and settings).
    command = line.split("`")[1].split()
    assert command[:2] == ["coinrag", "build"] and str(store) in command
    result = CliRunner().invoke(app, command[1:])
    assert result.exit_code == 0, result.output
    counts = last_build_counts(st)
    assert (counts["kv_rebuilt"], counts["kv_computed"]) == (1, 1)
    assert counts["kv_reused"] == len(originals) - 1
    repaired = only_kv(st)
    assert repaired.manifest()[victim.content_key].location != row.location
    for ck, original in originals.items():
        assert torch.equal(repaired.read_entry(ck), original), ck  # bit for bit
    code, output = query(store, len(chunks))
    assert code == 0, output
    checked = CliRunner().invoke(app, ["verify", "--store", str(store), "--level", "sha256"])
    assert checked.exit_code == 0 and "0 corrupt" in checked.output, checked.output


@pytest.mark.usefixtures("prefect_harness")
def test_truncated_shard_and_corrupt_prefix_are_rebuilt(built, tmp_path):
    store, st, originals = copy_store(built, tmp_path)
    kv = only_kv(st)
    prefix, prefix_ids = kv.read_prefix()
    shards = {parse_location(r.location)[1] for r in read_rows(st, KvManifestRow)}
    (name,) = shards  # the tiny model's entries all fit in one shard
    data = Path(kv.root) / name / DATA_FILE
    os.truncate(data, data.stat().st_size - 1000)
    prefix_dir = Path(kv.root) / "prefix"
    (prefix_file,) = (p for p in prefix_dir.rglob("*") if p.is_file() and p.name != "zarr.json")
    flip(st, prefix_file, 40)

    n_chunks = len(read_rows(st, ChunkRow))
    code, output = query(store, n_chunks)
    line = one_error_line(output)
    assert code == 1 and "prompt prefix" in line and "coinrag build" in line

    args = ["build", str(built["src"]), "--store", str(store), *built["args"]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    counts = last_build_counts(st)
    assert counts["kv_rebuilt"] == counts["kv_computed"] == len(originals)
    repaired = only_kv(st)
    again, ids = repaired.read_prefix()
    assert ids == prefix_ids and torch.equal(again, prefix)
    for ck, original in originals.items():
        assert torch.equal(repaired.read_entry(ck), original), ck
    code, output = query(store, n_chunks)
    assert code == 0, output


@pytest.mark.usefixtures("prefect_harness")
def test_a_prefix_that_cannot_be_reproduced_rebuilds_every_entry(built, tmp_path):
    """The damaged prefix's recorded sha256 is not what the model computes now (here: the
    record itself is damaged): the entries were computed against other bits, so all are
    rebuilt against the new prefix."""
    store, st, originals = copy_store(built, tmp_path)
    kv = only_kv(st)
    meta_path = Path(kv.root) / "prefix" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["coinrag_kv"]["sha256"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    assert kv.corrupt_prefix() == "sha256 differs"

    args = ["build", str(built["src"]), "--store", str(store), *built["args"]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    counts = last_build_counts(st)
    assert counts["kv_rebuilt"] == counts["kv_computed"] == len(originals)
    repaired = only_kv(st)
    assert repaired.corrupt_prefix() is None
    for ck, original in originals.items():  # the model is deterministic: the same bits again
        assert torch.equal(repaired.read_entry(ck), original), ck
