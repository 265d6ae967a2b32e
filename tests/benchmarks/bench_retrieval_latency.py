"""Where a question's retrieval and KV time goes, on a built store, one thread (issue 23, item 3).

    python tests/benchmarks/bench_retrieval_latency.py --store PATH --questions JSONL
        [--limit 40] [--kc 4] [--k 10] [--mode hybrid] [--json PATH]

Per question, interleaved so that every variant sees the same machine load, a two-stage
retrieval (``Retriever.two_stage``, the coinrag method's) with three index/embedder variants:

- ``lancedb``: every search by LanceDB (the reader keeps no table in memory:
  ``flat_max_bytes = 0``), the question embedded in float32;
- ``memory-fp32``: the reader's in-memory copies (``storage.index_ann.FlatTable``), the
  question embedded in float32;
- ``default``: in-memory copies and the question embedded in ``query_dtype = auto``.

For each: the total retrieval (embedding + both stages) mean / median / P99 ms, the embedding
alone, and the mean time of each kind of index call (the lexical half of a hybrid search runs
on a second thread, so the calls overlap and do not sum to the total). Then, with the store's
model and KV, the ``kv_load`` and ``assembly`` of coinrag's context (``StoredKvContext.build``)
for the default variant's evidence, mean / median / P99 ms. Finally how often the variants'
top-``kc`` chunks and evidence agree with ``lancedb``'s, and each one's hit rate of a gold
document (``doc_ids``) in the top ``kc`` chunks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(values: list[float]) -> str:
    mean, median = statistics.mean(values), statistics.median(values)
    return f"{mean:6.2f} {median:6.2f} {pct(values, 0.99):6.2f}"


def timed_index(index: Any, calls: dict[str, list[float]]) -> None:
    """Record the milliseconds of each search call of ``index`` under a name saying what it
    searched (table, filtered or not)."""
    for name in ("search_vector", "search_text", "rows_where"):
        method = getattr(index, name)

        @functools.wraps(method)
        def wrapper(*args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _m(*args, **kw)
            finally:
                where = kw.get("where") is not None or _n == "rows_where"
                key = f"{_n} {args[0]}{' (filtered)' if where else ''}"
                calls.setdefault(key, []).append((time.perf_counter() - t) * 1000)

        setattr(index, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--questions", required=True, type=Path)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--kc", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--mode", default="hybrid")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from coinrag.inference.threads import set_process_threads

    set_process_threads(1)
    from coinrag.inference.embedders import load_embedder
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.methods.assets import StoredNuggetKv
    from coinrag.inference.retrieve import Retriever
    from coinrag.storage.index import LanceIndex
    from coinrag.storage.store import Store

    lines = args.questions.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(x) for x in lines if x.strip()][: args.limit]
    store = Store.at(args.store)
    fp32, auto = load_embedder(None, query_dtype="float32"), load_embedder(None)
    variants: dict[str, tuple[Retriever, dict[str, list[float]]]] = {}
    for name, embedder, in_memory in (
        ("lancedb", fp32, False),
        ("memory-fp32", fp32, True),
        ("default", auto, True),
    ):
        index = LanceIndex.open(store)
        if not in_memory:
            index.flat_max_bytes = 0
        calls: dict[str, list[float]] = {}
        retriever = Retriever(store, embedder, index, mode=args.mode)
        t = time.perf_counter()
        retriever.two_stage(rows[0]["question"], args.kc, args.k)  # loads the copies
        print(f"{name}: first question (tables into memory) {time.perf_counter() - t:.2f} s")
        timed_index(index, calls)
        variants[name] = (retriever, calls)
    print(f"default query dtype: {auto.query_dtype}; load {os.getloadavg()[0]:.2f}")

    totals: dict[str, list[float]] = {n: [] for n in variants}
    embeds: dict[str, list[float]] = {n: [] for n in variants}
    results: dict[str, list[Any]] = {n: [] for n in variants}
    for row in rows:
        for name, (retriever, _) in variants.items():
            t = time.perf_counter()
            got = retriever.two_stage(row["question"], args.kc, args.k)
            totals[name].append((time.perf_counter() - t) * 1000)
            embeds[name].append(got.embed_ms)
            results[name].append(got)

    print(f"\n{len(rows)} questions, {args.mode}, kc {args.kc}, k {args.k}, one thread")
    print(f"{'variant':<12} {'ms: mean median P99':>21} | embedding mean median P99")
    for name in variants:
        print(f"{name:<12} {summary(totals[name])} | {summary(embeds[name])}")
    for name, (_, calls) in variants.items():
        print(f"  {name} index calls (mean ms, n):")
        for key, ms in sorted(calls.items()):
            print(f"    {key:<34} {statistics.mean(ms):6.2f}  {len(ms)}")

    def chunk_ids(r: Any) -> list[str]:
        return [h.chunk_id for h in r.chunks]

    def spans(r: Any) -> list[tuple[str, int, int]]:
        return r.triples

    print("\nagreement with lancedb (top-kc chunks, evidence) and gold-document hit@kc:")
    for name in variants:
        same_chunks = sum(
            chunk_ids(a) == chunk_ids(b)
            for a, b in zip(results[name], results["lancedb"], strict=True)
        )
        same_spans = sum(
            spans(a) == spans(b) for a, b in zip(results[name], results["lancedb"], strict=True)
        )
        hits = sum(
            bool({h.doc_id for h in r.chunks} & set(row.get("doc_ids", [])))
            for r, row in zip(results[name], rows, strict=True)
        )
        print(
            f"  {name:<12} chunks {same_chunks}/{len(rows)}  evidence {same_spans}/{len(rows)}"
            f"  hit@{args.kc} {hits / len(rows):.1%}"
        )

    engine = RagEngine.open(args.store, methods=["coinrag"])
    context = engine.asset(StoredNuggetKv)
    n_query = 25
    evidence = [r.evidence for r in results["default"]]
    for ev in evidence[:3]:
        context.build(ev, n_query)  # warm: file handles, caches
    load, assembly = [], []
    for ev in evidence:
        timings: dict[str, float] = {}
        context.build(ev, n_query, timings)
        load.append(timings["kv_load"])
        assembly.append(timings["assembly"])
    both = [a + b for a, b in zip(load, assembly, strict=True)]
    slices = statistics.mean(len(ev) for ev in evidence)
    tokens = statistics.mean(sum(e.tok_end - e.tok_start for e in ev) for ev in evidence)
    print(f"\ncoinrag context ({slices:.1f} slices, {tokens:.0f} tokens a question), ms:")
    print(f"  kv_load             {summary(load)}")
    print(f"  assembly            {summary(assembly)}")
    print(f"  kv_load + assembly  {summary(both)}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        out = {
            "totals": totals,
            "embeds": embeds,
            "calls": {n: c for n, (_, c) in variants.items()},
            "kv_load": load,
            "assembly": assembly,
        }
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
