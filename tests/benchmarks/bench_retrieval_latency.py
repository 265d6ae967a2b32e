"""Where a question's retrieval and KV time goes, on a built store, one thread (issue 23, item 3).

    python tests/benchmarks/bench_retrieval_latency.py --store PATH --questions JSONL
        [--limit 40] [--kc 4] [--k 10] [--mode hybrid] [--rounds 2] [--threads 1]
        [--whole-chunks] [--json PATH]

Per question, a two-stage retrieval (``Retriever.two_stage``, the coinrag method's) with three
index/embedder variants, each variant's questions in a block (its model and tables stay in the
caches, as in a process that serves one of them) and the blocks alternated ``--rounds`` times
(default 2) so that every variant sees the same machine load:

- ``lancedb``: every search by LanceDB (the reader keeps no table in memory:
  ``flat_max_bytes = 0``), the question embedded in float32;
- ``dense-memory``: the reader's in-memory vector copies (``storage.index.ann.FlatTable``),
  words searched by LanceDB, the question embedded in ``query_dtype = auto``;
- ``default``: vectors and words in memory (``storage.index.bm25.Bm25Index``), the question
  embedded in ``query_dtype = auto``.

For each: the total retrieval (embedding + both stages) mean / median / P99 ms, the embedding
alone, and the mean time of each kind of index call (where LanceDB searches words, the lexical
half of a hybrid search runs on a second thread, so the calls overlap and do not sum to the
total). Then, with the store's model and KV, the ``kv_load`` and ``assembly`` of coinrag's
context for the default variant's evidence, mean / median / P99 ms, two ways (alternated
blocks again): ``StoredKvContext.build`` (slices decoded into the context, one rotation) and
the general ``ContextBuilder.build`` (a tensor per slice, placed one by one). Finally how often the
variants' top-``kc`` chunks and evidence agree with ``lancedb``'s, and each one's hit rate of
a gold document (``doc_ids``) in the top ``kc`` chunks. ``--threads``: torch's threads
(default 1); ``--whole-chunks``: the context is turborag's (the top ``kc`` chunks whole).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from functools import partial
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
    for name in ("search_vector", "best_of_groups", "search_text", "rows_where"):
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


def print_timings(
    args: argparse.Namespace,
    n_questions: int,
    totals: dict[str, list[float]],
    embeds: dict[str, list[float]],
    calls_by_variant: dict[str, dict[str, list[float]]],
) -> None:
    """Each variant's retrieval and embedding ms (mean, median, P99) and its index calls."""
    setting = f"{args.mode}, kc {args.kc}, k {args.k}, {args.threads} thread(s)"
    print(f"\n{n_questions} questions, {setting}")
    print(f"{'variant':<12} {'ms: mean median P99':>21} | embedding mean median P99")
    for name in totals:
        print(f"{name:<12} {summary(totals[name])} | {summary(embeds[name])}")
    for name, calls in calls_by_variant.items():
        print(f"  {name} index calls (mean ms, n):")
        for key, ms in sorted(calls.items()):
            print(f"    {key:<34} {statistics.mean(ms):6.2f}  {len(ms)}")


def print_agreement(
    args: argparse.Namespace, rows: list[dict[str, Any]], results: dict[str, list[Any]]
) -> None:
    """How often each variant's top-``kc`` chunks and evidence equal ``lancedb``'s, and its
    hit rate of a gold document in the top ``kc`` chunks."""

    def chunk_ids(r: Any) -> list[str]:
        return [h.chunk_id for h in r.chunks]

    def spans(r: Any) -> list[tuple[str, int, int]]:
        return r.triples

    print("\nagreement with lancedb (top-kc chunks, evidence) and gold-document hit@kc:")
    for name in results:
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


def context_timings(
    args: argparse.Namespace, results: dict[str, list[Any]]
) -> dict[str, dict[str, list[float]]]:
    """``kv_load`` and ``assembly`` ms of coinrag's (or turborag's) context for the default
    variant's evidence, two builds in alternated blocks; ``{}`` where the store holds no KV."""
    from coinrag.inference.context.builders import ContextBuilder
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.methods.assets import StoredNuggetKv
    from coinrag.inference.methods.base import MissingAssets
    from coinrag.inference.retrieval.retriever import Evidence

    try:
        engine = RagEngine.open(args.store, methods=["coinrag"])
    except MissingAssets as exc:
        print(f"\ncontext timings skipped: {exc}")
        return {}
    context = engine.asset(StoredNuggetKv)
    n_query = 25
    evidence = [r.evidence for r in results["default"]]
    if args.whole_chunks:  # turborag's context: the top-kc chunks whole
        evidence = [
            [
                Evidence(h.chunk_id, h.doc_id, h.content_key, 0, h.n_tokens, h.text, h.score)
                for h in r.chunks
            ]
            for r in results["default"]
        ]
    builds = {"into-context": context.build, "general": partial(ContextBuilder.build, context)}
    for build in builds.values():
        for ev in evidence:  # warm: file handles, the page cache (the same for both builds)
            build(ev, n_query)
    parts: dict[str, dict[str, list[float]]] = {n: {"kv_load": [], "assembly": []} for n in builds}
    for _ in range(args.rounds):
        for name, build in builds.items():
            for ev in evidence:
                timings: dict[str, float] = {}
                build(ev, n_query, timings)
                for part in ("kv_load", "assembly"):
                    parts[name][part].append(timings[part])
    slices = statistics.mean(len(ev) for ev in evidence)
    tokens = statistics.mean(sum(e.tok_end - e.tok_start for e in ev) for ev in evidence)
    method = "turborag" if args.whole_chunks else "coinrag"
    print(f"\n{method} context ({slices:.1f} slices, {tokens:.0f} tokens a question), ms:")
    for name, got in parts.items():
        both = [a + b for a, b in zip(got["kv_load"], got["assembly"], strict=True)]
        print(f"  {name}")
        print(f"    kv_load             {summary(got['kv_load'])}")
        print(f"    assembly            {summary(got['assembly'])}")
        print(f"    kv_load + assembly  {summary(both)}")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--questions", required=True, type=Path)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--kc", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--mode", default="hybrid")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--whole-chunks", action="store_true")
    args = parser.parse_args()

    from coinrag.inference.model.threads import set_process_threads

    set_process_threads(args.threads)
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.index.ann import fastest_ranking_dtype
    from coinrag.storage.index.lance import LanceIndex
    from coinrag.storage.store import Store

    lines = args.questions.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(x) for x in lines if x.strip()][: args.limit]
    store = Store.at(args.store)
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    fp32 = store_embedder_of(settings, query_dtype="float32")
    auto = store_embedder_of(settings)
    variants: dict[str, tuple[Retriever, dict[str, list[float]]]] = {}
    for name, embedder, in_memory in (
        ("lancedb", fp32, ()),
        ("dense-memory", auto, ("vectors",)),
        ("default", auto, ("vectors", "words")),
    ):
        index = LanceIndex.open(store)
        if "vectors" not in in_memory:
            index.flat_max_bytes = 0
        if "words" not in in_memory:
            index._text_tables.update(chunks=None, nuggets=None)
        calls: dict[str, list[float]] = {}
        retriever = Retriever(store, embedder, index, mode=args.mode)
        t = time.perf_counter()
        retriever.two_stage(rows[0]["question"], args.kc, args.k)  # loads the copies
        print(f"{name}: first question (tables into memory) {time.perf_counter() - t:.2f} s")
        timed_index(index, calls)
        variants[name] = (retriever, calls)
    ranking = fastest_ranking_dtype()
    print(f"default query dtype: {auto.query_dtype}; large tables ranked in {ranking}")
    print(f"load average {os.getloadavg()[0]:.2f}")

    totals: dict[str, list[float]] = {n: [] for n in variants}
    embeds: dict[str, list[float]] = {n: [] for n in variants}
    results: dict[str, list[Any]] = {n: [] for n in variants}
    for round_ in range(args.rounds):  # each variant's questions in a block (its model and
        # tables stay in the caches, as in a process serving one of them), blocks alternated
        for name, (retriever, _) in variants.items():
            for row in rows:
                t = time.perf_counter()
                got = retriever.two_stage(row["question"], args.kc, args.k)
                totals[name].append((time.perf_counter() - t) * 1000)
                embeds[name].append(got.embed_ms)
                if round_ == 0:
                    results[name].append(got)

    print_timings(args, len(rows), totals, embeds, {n: c for n, (_, c) in variants.items()})
    print_agreement(args, rows, results)
    parts = context_timings(args, results)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        out = {
            "totals": totals,
            "embeds": embeds,
            "calls": {n: c for n, (_, c) in variants.items()},
            "context": parts,
        }
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
