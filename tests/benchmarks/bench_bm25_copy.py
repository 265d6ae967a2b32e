"""The reader's in-memory BM25 copy (``storage/index/bm25.py``) against LanceDB's full-text
index on a real store, read-only: exactness and per-query time. Runnable alone::

    OMP_NUM_THREADS=1 nice -n 19 python tests/benchmarks/bench_bm25_copy.py STORE Q.jsonl ...

For each of ``chunks`` and ``nuggets`` at the published versions: the copy's build time, then
for every question (``{"question": ...}`` per line of each file) the top-``--k`` of both,
unfiltered and (nuggets) prefiltered to the nuggets of LanceDB's top-``--kc`` chunks for that
question (the second stage of two-stage retrieval), and counts: identical top-k (ids in order),
identical up to the order (and the choice at the cut) among rows of equal scores within
float32 rounding (``storage.index.bm25.same_answers``), other, and how many return the same
set of ids; the largest relative score difference; the mean and median time per query of each
(LanceDB returning ids and scores only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from coinrag.storage.index.bm25 import Bm25Index, same_answers
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.index.search import IndexSearch
from coinrag.storage.index.tables import ID_COLUMNS, in_filter
from coinrag.storage.store import Store


def compare(index: LanceIndex, name: str, questions: list[str], k: int, kc: int) -> dict:
    tbl = index.table(name)
    id_col = ID_COLUMNS[name]
    columns = list(dict.fromkeys([id_col, "chunk_id", "text"]))
    data = tbl.search().select(columns).limit(None).to_arrow()
    ids = data.column(id_col).to_pylist()
    t = time.perf_counter()
    bm25 = Bm25Index(data.column("text").to_pylist())
    build_s = time.perf_counter() - t
    fts = [i for i in tbl.list_indices() if i.index_type == "FTS"][0].name
    unindexed = tbl.index_stats(fts).num_unindexed_rows
    chunk_of = np.asarray(data.column("chunk_id").to_pylist(), dtype=object)
    chunks = index.table("chunks")
    out = {"rows": len(ids), "build_s": round(build_s, 2), "unindexed": unindexed}
    for mode in ("all", "where") if name == "nuggets" else ("all",):
        same = ties = other = none = same_set = 0
        worst = 0.0
        t_lance: list[float] = []
        t_mem: list[float] = []
        for q in questions:
            where = positions = None
            if mode == "where":
                top = IndexSearch._fts_query(chunks, q, ["chunk_id"], None).limit(kc).to_arrow()
                cids = top.column("chunk_id").to_pylist()
                where = in_filter("chunk_id", cids)
                positions = np.flatnonzero(np.isin(chunk_of, cids))
            t = time.perf_counter()
            got = IndexSearch._fts_query(tbl, q, [id_col], where).limit(k).to_arrow()
            t_lance.append((time.perf_counter() - t) * 1000)
            scores = got.column("_score").to_pylist()
            lance = list(zip(got.column(id_col).to_pylist(), scores, strict=True))
            t = time.perf_counter()
            found = bm25.search(q, k, positions)
            t_mem.append((time.perf_counter() - t) * 1000)
            if found is None:
                none += 1
                continue
            mine = [(ids[p], float(s)) for p, s in zip(*found, strict=True)]
            ls = np.array([s for _, s in lance])
            ms = np.array([s for _, s in mine])
            if len(ls) == len(ms) and len(ls):
                worst = max(worst, float(np.max(np.abs(ls - ms) / np.abs(ls))))
            same_set += {i for i, _ in mine} == {i for i, _ in lance}
            if mine == lance:
                same += 1
            elif same_answers(lance, mine):
                ties += 1
            else:
                other += 1
                print(f"  differs: {name}/{mode} {q!r}\n    lance {lance}\n    copy  {mine}")
        out[mode] = {
            "queries": len(questions),
            "identical": same,
            "tie_order_only": ties,
            "same_id_set": same_set,
            "different": other,
            "fallback": none,
            "max_rel_score_diff": worst,
            "lance_ms_mean": round(statistics.mean(t_lance), 3),
            "lance_ms_p50": round(statistics.median(t_lance), 3),
            "copy_ms_mean": round(statistics.mean(t_mem), 3),
            "copy_ms_p50": round(statistics.median(t_mem), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("store")
    ap.add_argument("questions", nargs="+")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--kc", type=int, default=4)
    args = ap.parse_args()
    questions = [
        json.loads(line)["question"]
        for path in args.questions
        for line in open(path, encoding="utf-8")
        if line.strip()
    ]
    index = LanceIndex.open(Store.at(args.store))
    print(f"{args.store}: {len(questions)} questions, load {os.getloadavg()[0]:.2f}")
    for name in ("chunks", "nuggets"):
        print(name, json.dumps(compare(index, name, questions, args.k, args.kc), indent=1))
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
