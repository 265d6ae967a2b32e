"""Slice reads near the limit: bytes read / bytes needed and latency of k nugget slices, per
codec and block size, on local disk and on an S3-compatible server (moto, on 127.0.0.1).

    python tests/benchmarks/bench_kv_slices.py [--chunks 8] [--queries 30] [--k 10]
        [--nugget-tokens 12] [--blocks 2,4,8,16,32] [--codecs none,int8,int4] [--no-s3]
        [--json PATH]

Entries: ``--chunks`` entries of 512 tokens with SmolLM2-135M's dims (30 layers, 3 KV heads,
head dim 64) in bfloat16, random values (bytes and latency do not depend on them; the codecs'
errors are measured in ``bench_kv_codecs.py``), written as the KV stage writes them.

For each codec and block size: bytes per token on disk relative to raw bfloat16 (23,040 B),
then ``--queries`` reads of ``--k`` slices of ``--nugget-tokens`` tokens at seeded random
places (one ``read_slices`` call each, as ``coinrag`` reads its nuggets), on a reader opened
fresh (cold: shard metadata and, where read at all, shard indexes) and then warm:

- ``amplification``: bytes read / bytes needed (the tokens' share of the stored bytes), summed
  over the queries (warm); ``cold``: the first query on a fresh reader, and the index bytes it
  read on top of the same query warm (nuggets that overlap or share blocks are read once, so
  a query's ratio can fall below 1);
- ``gets``: byte ranges (or Zarr reads) per query;
- ``slice_ms``: median latency of one query (warm: page cache, metadata cached);
- ``entry_ms``: median latency of ``read_entry`` (sha256-checked) of one whole entry.

``before``: codec none, 16-token blocks, read through Zarr's own reader on local disk (the
read path before issue 13 item 4) and, on S3, the ranged path with the index read once per
reader. Numbers on a shared machine are noisy: the lead runs this on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from store_fixtures import synthetic_chunk  # noqa: E402

from coinrag.storage.kv import KvLayout, KvStore  # noqa: E402
from coinrag.storage.kv.transport import LocalTransport  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402

DIMS = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M
TOKENS = 512


class ZarrLocal(LocalTransport):
    """The read path before: local disk through Zarr's reader (index read on every read)."""

    ranged_slice_reads = False


def start_s3() -> Any:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    from coinrag.storage.location import object_filesystem

    object_filesystem.cache_clear()
    object_filesystem("s3").mkdir("bench")
    return server


def queries(
    keys: list[str], n: int, k: int, length: int, seed: int
) -> list[list[tuple[str, int, int]]]:
    """``n`` queries of ``k`` spans of ``length`` tokens at seeded random places."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        spans = []
        for _ in range(k):
            start = rng.randrange(0, TOKENS - length)
            spans.append((rng.choice(keys), start, start + length))
        out.append(spans)
    return out


def measure(
    kv: KvStore, qs: list[list[tuple[str, int, int]]], keys: list[str], transport: Any = None
) -> dict[str, Any]:
    fresh = KvStore.open(kv.store, kv.kv_fp)
    if transport is not None:
        fresh.transport = transport(kv.store)
    fresh.read_slices(qs[0])  # cold: shard metadata and (where read at all) indexes
    cold = fresh.last_read
    fresh.read_slices(qs[0])
    index_bytes = cold.bytes_read - fresh.last_read.bytes_read
    read = needed = gets = 0
    times = []
    for spans in qs:
        t0 = time.perf_counter()
        fresh.read_slices(spans)
        times.append(time.perf_counter() - t0)
        read += fresh.last_read.bytes_read
        needed += fresh.last_read.bytes_needed
        gets += fresh.last_read.store_gets
    entry = []
    for ck in keys[:4]:
        t0 = time.perf_counter()
        fresh.read_entry(ck)
        entry.append(time.perf_counter() - t0)
    return {
        "amplification": round(read / needed, 4),
        "amplification_cold": round(cold.amplification, 4),
        "cold_index_bytes": index_bytes,
        "gets_per_query": round(gets / len(qs), 1),
        "slice_ms": round(1000 * statistics.median(times), 2),
        "entry_ms": round(1000 * statistics.median(entry), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--nugget-tokens", type=int, default=12)
    ap.add_argument("--blocks", default="2,4,8,16,32")
    ap.add_argument("--codecs", default="none,int8,int4")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    entries = [
        (synthetic_chunk(i, TOKENS), torch.randn(30, 2, 3, TOKENS, 64).to(torch.bfloat16))
        for i in range(args.chunks)
    ]
    keys = [c.content_key for c, _ in entries]
    qs = queries(keys, args.queries, args.k, args.nugget_tokens, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-kv-slices-"))
    server = None if args.no_s3 else start_s3()
    raw = KvLayout("m", "p", dtype="bfloat16", **DIMS).raw_token_bytes
    rows: list[dict[str, Any]] = []
    configs = [("before", "none", 16)]
    configs += [("now", c, int(b)) for c in args.codecs.split(",") for b in args.blocks.split(",")]
    where = {"local": lambda name: Store.at(work / name).init()}
    if server is not None:
        where["s3"] = lambda name: Store.at(f"s3://bench/{name}")
    print(
        f"{args.chunks} entries x {TOKENS} tokens (SmolLM2 dims, bfloat16: {raw:,} B/token raw); "
        f"{args.queries} queries of k = {args.k} slices of {args.nugget_tokens} tokens"
    )
    print(
        f"{'':6} {'codec':5} {'block':>5} {'where':5} {'disk/raw':>8} {'ampl':>6} "
        f"{'cold':>6} {'index B':>8} {'gets':>5} {'slice ms':>8} {'entry ms':>8}"
    )
    for label, codec, block in configs:
        layout = KvLayout("m", "p", dtype="bfloat16", block_tokens=block, kv_codec=codec, **DIMS)
        for place, make in where.items():
            name = f"{label}-{codec}-{block}"
            kv = KvStore.create(make(name), layout)
            kv.write_entries(entries, "bench")
            disk = kv.write_stats.disk_bytes / (args.chunks * TOKENS * raw)
            transport = ZarrLocal if (label, place) == ("before", "local") else None
            row = {"config": label, "codec": codec, "block_tokens": block, "where": place}
            row |= {"disk_over_raw_bf16": round(disk, 4), **measure(kv, qs, keys, transport)}
            rows.append(row)
            print(
                f"{label:6} {codec:5} {block:5d} {place:5} {disk:8.3f} "
                f"{row['amplification']:6.3f} {row['amplification_cold']:6.3f} "
                f"{row['cold_index_bytes']:8d} {row['gets_per_query']:5.1f} "
                f"{row['slice_ms']:8.2f} {row['entry_ms']:8.2f}",
                flush=True,
            )
    if server is not None:
        server.stop()
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
