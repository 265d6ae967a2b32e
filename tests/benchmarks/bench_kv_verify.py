"""What it costs the build to check the KV entries it reuses, per check level.

Run alone: ``python tests/benchmarks/bench_kv_verify.py [--gib 1.0] [--repeats 3] [--json out]``.

Writes a KV store of about ``--gib`` GiB of entries in a temporary folder (``--dir``; SmolLM2-
135M's float32 layout: 30 layers, 3 KV heads, head dim 64, i.e. 46,080 bytes per token; 512-token
entries of random values, 64 MiB shards, written by ``KvStore.write_entries`` as the build writes
them), then times ``KvStore.entry_problems(all keys, level)`` for each level:

- ``stat``: shard metadata and file sizes (what the build did before issue 12);
- ``crc32c``: also every block of every entry and each shard index read and crc32c-checked (the
  build's default);
- ``sha256``: every entry read through Zarr and its sha256 checked.

Each level is timed warm (the shard files in the page cache: the usual case right after a build
or a query) and cold (the files dropped from the page cache first with
``posix_fadvise(DONTNEED)``, per file: nothing else on the machine is touched), best of
``--repeats``. Reported: seconds and milliseconds per GiB of entries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KvLayout, KvStore
from coinrag.storage.store import Store

LEVELS = ("stat", "crc32c", "sha256")


def chunk(i: int, n: int) -> ChunkRow:
    return ChunkRow(
        chunk_id=f"ch-{i}",
        doc_id="d",
        doc_version="dv",
        ordinal=i,
        text="",
        n_tokens=n,
        char_start=0,
        char_end=0,
        tok_start=0,
        tok_end=n,
        token_ids=[],
        token_spans=[],
        content_key=f"ck-{i:06d}",
        text_hash="th",
        tokenizer_fp="tok",
        chunker_fp="chunker",
        run_id="r",
        code_version="v",
    )


def drop_cache(root: Path) -> None:
    """Evict the store's files from the page cache (this process's files only)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of KV entries to write")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per entry")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the store (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    layout = KvLayout(
        model_fp="bench", prefix_sha="bench", layers=30, kv_heads=3, head_dim=64, dtype="float32"
    )
    n_entries = max(1, int(args.gib * 2**30 / layout.entry_bytes(args.tokens)))
    root = Path(tempfile.mkdtemp(prefix="bench-kv-verify-", dir=args.dir))
    try:
        store = Store.at(root / "store").init()
        kv = KvStore.create(store, layout)
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        shape = layout.entry_shape(args.tokens)
        for start in range(0, n_entries, layout.slots_per_shard):
            group = [
                (chunk(i, args.tokens), torch.randn(shape, generator=gen))
                for i in range(start, min(n_entries, start + layout.slots_per_shard))
            ]
            kv.write_entries(group, "bench")
        write_s = time.perf_counter() - t0
        gib = kv.write_stats.logical_bytes / 2**30
        keys = list(kv.manifest())
        results: dict[str, dict[str, float]] = {}
        for level in LEVELS:
            for cache in ("warm", "cold"):
                best = float("inf")
                for _ in range(args.repeats):
                    if cache == "cold":
                        drop_cache(Path(kv.root))
                    else:
                        KvStore.open(store, layout.kv_fp).entry_problems(keys, "crc32c")
                    fresh = KvStore.open(store, layout.kv_fp)  # no cached shard metadata
                    t0 = time.perf_counter()
                    problems = fresh.entry_problems(keys, level)
                    best = min(best, time.perf_counter() - t0)
                    assert not problems, problems
                results[f"{level}/{cache}"] = {
                    "seconds": round(best, 4),
                    "ms_per_gib": round(1000 * best / gib, 1),
                }
        out = {
            "entries": len(keys),
            "tokens_per_entry": args.tokens,
            "gib": round(gib, 3),
            "shards": kv.write_stats.shards,
            "write_seconds": round(write_s, 2),
            "check": results,
        }
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
