"""What the ``upr`` reranker costs a question, on a built store, one thread (issue 35, item 3).

    python tests/benchmarks/bench_rerank.py --store PATH --questions JSONL
        [--limit 30] [--kc 4] [--mode hybrid] [--threads 1] [--json PATH]

Per question (each asked once, so no score is memoised): the retrieval without a reranker
(``Retriever.chunks_only``, top ``kc``), then with the store's ``upr`` reranker (the search's
top ``QueryLikelihood.depth`` chunks scored and reordered, the first ``kc`` kept), each timed;
``rerank_ms`` is the reranker's share (``RetrievalResult.rerank_ms``). The chunks' KV is the
store's where it keeps whole chunks' KV (``kv = true``, ``kv_keep = "chunks"``: only the cue
and the question are prefilled per candidate), else encoded per question
(``LiveKvContext``); the output says which. The model is loaded and the first question
answered once, untimed, before the timed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.mean(values), 2),
        "median": round(statistics.median(values), 2),
        "p99": round(pct(values, 0.99), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--kc", type=int, default=4)
    parser.add_argument("--mode", default="hybrid")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from coinrag.inference.context.builders import StoredKvContext
    from coinrag.inference.context.rerank import store_reranker
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.qa import load_questions
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.store import Store

    store = Store.at(args.store)
    settings = settings_from_toml(store.read_toml(), args.store)
    questions = [q.question for q in load_questions(args.questions)][: args.limit + 1]
    embedder = store_embedder_of(settings)
    plain = Retriever(store, embedder, mode=args.mode)
    reranker = store_reranker("upr", store, settings)
    ranked = Retriever(store, embedder, plain.index, mode=args.mode, reranker=reranker)
    ranked.chunks_only(questions[0], kc=args.kc)  # untimed: model, index and KV files load
    plain.chunks_only(questions[0], kc=args.kc)
    search, total, rerank = [], [], []
    for question in questions[1:]:
        t = time.perf_counter()
        plain.chunks_only(question, kc=args.kc)
        search.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        found = ranked.chunks_only(question, kc=args.kc)
        total.append((time.perf_counter() - t) * 1000)
        rerank.append(found.rerank_ms)
    kv = "stored" if isinstance(reranker.context, StoredKvContext) else "live"
    report = {
        "store": args.store,
        "questions": len(search),
        "kc": args.kc,
        "depth": reranker.depth,
        "mode": args.mode,
        "threads": args.threads,
        "chunk_kv": kv,
        "retrieval_ms": summary(search),
        "retrieval_with_rerank_ms": summary(total),
        "rerank_ms": summary(rerank),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
