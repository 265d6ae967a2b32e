"""The disk-space check before the KV stage (issue 12, item 8).

- The projection is the bytes the KV stage really writes: :meth:`KvLayout.disk_bytes` of some
  entries equals the shard files ``write_entries`` makes for them, plus the stated overhead
  per shard (folders, metadata).
- The issue's case: 3,428 chunks of 512 tokens, float32 SmolLM2-135M (46,080 bytes per token),
  ~81 GB against 71 GB free, is refused with the numbers and what shrinks it.
- CLI: a build whose projected KV does not fit on the store's file system is refused with exit
  1 and one ``error:`` line naming the projected and free bytes, after chunking and before any
  LLM call or forward pass (no extraction rows, no KV); ``kv_space_check = false`` builds
  anyway, and what it writes is within the projection. The free space is the real one
  (``shutil.disk_usage``); the test asks to keep the whole disk free (``kv_min_free_bytes`` =
  the file system's size), so the KV cannot fit whatever the machine has free.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, synthetic_chunk, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.settings import load_settings
from coinrag.schemas.tables import ExtractionRow, KvManifestRow, RunRow
from coinrag.storage.kv import SHARD_OVERHEAD_BYTES, KvLayout, KvStore
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.kv_space import MARGIN, KvSpaceError, build_layout, estimate_kv_space


def layout(dtype: str = "bfloat16", **kwargs) -> KvLayout:
    return KvLayout(
        model_fp="model-x",
        prefix_sha="ps-x",
        layers=2,
        kv_heads=2,
        head_dim=8,
        dtype=dtype,
        **kwargs,
    )


@pytest.mark.parametrize(
    "lengths, slots",
    [([64, 64, 64, 50, 17, 1], 4), ([40], 4), ([33, 32, 31, 16, 16], 2)],
    ids=["two-shards", "one-entry", "padded"],
)
def test_projection_is_what_the_stage_writes(tmp_path: Path, lengths, slots) -> None:
    lay = layout(block_tokens=16, slots_per_shard=slots)
    kv = KvStore.create(Store.at(tmp_path / "s").init(), lay)
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, n), torch.randn(2, 2, 2, n, 8).to(torch.bfloat16))
        for i, n in enumerate(sorted(lengths, reverse=True))  # the stage writes longest first
    ]
    kv.write_entries(entries, "run-1")
    shards = -(-len(lengths) // slots)
    written = sum(p.stat().st_size for p in Path(kv.root).rglob("c/*/*/*/*/*/*") if p.is_file())
    assert written == kv.write_stats.disk_bytes
    assert lay.disk_bytes(lengths) == written + shards * SHARD_OVERHEAD_BYTES


def test_the_issues_case_is_refused_with_the_numbers() -> None:
    smollm2 = KvLayout(
        model_fp="m", prefix_sha="p", layers=30, kv_heads=3, head_dim=64, dtype="float32"
    )
    assert smollm2.token_bytes == 46_080
    chunks = [synthetic_chunk(i, 512) for i in range(3428)]
    estimate = estimate_kv_space(chunks, smollm2, stored=set(), free_bytes=71_000_000_000)
    assert (estimate.entries, estimate.tokens) == (3428, 3428 * 512)
    data = 3428 * 512 * 46_080  # 80.9 GB of K and V
    assert (
        data < estimate.projected_bytes <= (data * 1.001 + 64 * SHARD_OVERHEAD_BYTES) * (1 + MARGIN)
    )
    assert not estimate.fits
    message = str(KvSpaceError(estimate, "the file system of /data/store"))
    assert f"{estimate.projected_bytes:,} bytes" in message and "85.0 GB" in message
    assert "71,000,000,000 bytes (71.0 GB) free" in message
    assert "kv = false" in message and "--model" in message and "kv_space_check = false" in message
    # Entries already stored cost nothing; a store with room for the rest takes them.
    half = estimate_kv_space(
        chunks, smollm2, {c.content_key for c in chunks[:1714]}, free_bytes=71_000_000_000
    )
    assert half.entries == 1714 and half.fits
    assert not estimate_kv_space(
        chunks[:1714], smollm2, set(), 71_000_000_000, min_free_bytes=30_000_000_000
    ).fits


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.heavy  # over 5 s: the second tier
def test_a_build_whose_kv_does_not_fit_is_refused_before_extraction(
    tmp_path: Path, sample_corpus: Path, smollm2_tokenizer
) -> None:
    model = save_tiny_llama(tmp_path / "llama", smollm2_tokenizer, 0)
    src = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    store = tmp_path / "store"
    whole_disk = shutil.disk_usage(tmp_path).total
    config = tmp_path / "build.toml"
    settings = f'model = "{model}"\nextractor = "rules"\nchunk_size = 64\n'
    config.write_text(f"[build]\n{settings}kv_min_free_bytes = {whole_disk}\n")
    args = ["build", str(src), "--store", str(store), "--config", str(config)]

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    line = errors[0]
    assert "not enough disk space for the KV cache" in line
    projected = int(re.search(r"project ([\d,]+) bytes", line)[1].replace(",", ""))
    free = int(re.search(r"has ([\d,]+) bytes", line)[1].replace(",", ""))
    assert 0 < free <= whole_disk and projected > 0
    assert f"{whole_disk:,}" in line and "kv_space_check = false" in line
    # Refused after chunking, before any extraction or forward pass.
    st = Store.at(store)
    assert read_rows(st, ExtractionRow) == [] and read_rows(st, KvManifestRow) == []
    assert not [p for p in (store / "kv").rglob("*") if p.is_file()]  # no shard, no prefix
    (run,) = [r for r in read_rows(st, RunRow) if r.status == "failed"]
    assert "KvSpaceError" in (run.error or "")

    # The override: the same build with the check off; what it writes is within the projection.
    config.write_text(
        f"[build]\n{settings}kv_min_free_bytes = {whole_disk}\nkv_space_check = false\n"
    )
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = [r for r in read_rows(st, RunRow) if r.status == "completed"]
    counts = json.loads(runs[0].counts_json)
    assert counts["kv_computed"] == counts["chunks"] > 0
    (kv_dir,) = (store / "kv").glob("kv-*")
    # The projection used the layout the KV stage wrote (same kv_fp: model, kv_dtype, prefix).
    built = load_settings(config)
    assert build_layout(built, smollm2_tokenizer).kv_fp == kv_dir.name
    shards = len(list(kv_dir.glob("shard-*")))
    assert counts["kv_disk_bytes"] < projected
    assert projected <= (counts["kv_disk_bytes"] + shards * SHARD_OVERHEAD_BYTES) * (1 + MARGIN)
