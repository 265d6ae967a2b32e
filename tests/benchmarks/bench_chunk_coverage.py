"""Whole-chunk coverage of dense chunk search, and the fusion of dense with lexical search.

The default embedder (all-MiniLM-L6-v2) keeps 256 word pieces, about a third of a 512-token chunk
of the generation model (~700 word pieces of the Python docs), so a chunk's one vector says
nothing about most of its text. The index therefore holds each chunk's windows (the ``windows``
table, ``inference/retrieval/windows.py``: pieces the embedder sees whole, covering the chunk). This
benchmark compares, on a built store (its index: chunk, window and nugget vectors, the
full-text index) and question files with gold ``doc_ids`` (hit@kc: a chunk of a gold document
among the top ``kc``), the chunk scores:

- ``first``: the chunk's vector (its search text as the embedder truncates it);
- ``windows``: the best cosine of the chunk's windows (what dense search uses); ``wmean``: the
  cosine of the mean of its window vectors;
- ``nuggets``: the best cosine of the chunk's nuggets (a chunk without nuggets keeps ``first``);
- ``avg(a,b)`` / ``max(a,b)``: the mean / larger of two of those;
- ``lexical``: BM25 over the whole search text (the index's full-text index);
- ``hybrid-<dense>``: that dense ranking and lexical's (each its top ``--depth`` rows) fused as
  hybrid search fuses them (``inference.retrieval.retriever.relative_scores``: each ranking
  normalised by ``FUSION_NORMALISER``, dense weighted as the store's hybrid search weighs it,
  ``dense_weight(index)``: 0.5, or 0.65 where the store has nuggets, unless one was chosen);
  ``hybrid-<dense>-a<w>``: with dense weighted ``w`` (``--weights``); ``rrf-<dense>``:
  equal-weight reciprocal rank fusion (k 60), the fusion hybrid search used first, and
  ``rrf-<dense>-wL<w>`` with lexical weighted ``w``.

Variants that need a table the store lacks (nuggets of an ``extractor = "none"`` store, windows
of an index written before them) are left out. Cosines are exact (numpy), as a reader's
in-memory search. Runnable alone::

    python tests/benchmarks/bench_chunk_coverage.py --store STORE \\
        --questions faq/questions.jsonl infra/python_natural_questions.jsonl

``--embedder DIR`` (an embedder folder, e.g. one ``bench_retriever_pairs.py`` or ``coinrag
train retriever --no-reembed`` wrote) scores the same store with that embedder instead of the
store's vectors: the chunks' and windows' ``search_text`` are embedded again with it (in the
store's ``embed_dtype``; ``--vectors PATH.npz`` keeps them for the next run) and the nuggets are
left out (a store with nuggets holds 20-30 of them a chunk: embedding them is the hour a
re-embedding build spends), so compare its ``windows`` and ``hybrid-windows`` rows with the
store's own embedder's (``--embedder minilm``: the packaged default, embedded the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from coinrag.inference.retrieval.embedders import store_embedder_of  # noqa: E402
from coinrag.inference.retrieval.retriever import (  # noqa: E402
    HYBRID_DEPTH,
    dense_weight,
    relative_scores,
)
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.schemas.settings import settings_from_toml  # noqa: E402
from coinrag.storage.index.lance import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402


def matrix(table, column: str = "vector") -> np.ndarray:
    vec = table.column(column).combine_chunks()
    dim = len(vec[0]) if len(vec) else 0
    return vec.flatten().to_numpy().astype(np.float32).reshape(-1, dim)


def top(scores: np.ndarray, depth: int) -> list[int]:
    depth = min(depth, len(scores))
    idx = np.argpartition(-scores, depth - 1)[:depth]
    return [int(i) for i in idx[np.argsort(-scores[idx])]]


RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al. 2009; LanceDB's RRFReranker)


def fused(scores: dict[int, float]) -> list[int]:
    return sorted(scores, key=lambda item: -scores[item])


def rrf(rankings: list[list[int]], weights: list[float], k: int = RRF_K) -> list[int]:
    """Weighted reciprocal rank fusion: ``sum(w / (k + rank))`` over the rankings."""
    scores: dict[int, float] = {}
    for ranking, w in zip(rankings, weights, strict=True):
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + w / (k + rank)
    return sorted(scores, key=lambda item: -scores[item])


def best_of(owner: np.ndarray, scores: np.ndarray, n: int) -> np.ndarray:
    """Per chunk (``owner``: each row's chunk position) the best of its rows' scores; -2 for
    a chunk without rows."""
    best = np.full(n, -2.0, dtype=np.float32)
    np.maximum.at(best, owner, scores)
    return best


def owners(index: LanceIndex, table: str, row_of: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """A table's vectors and each row's chunk position (empty if the table is absent)."""
    if index.table(table) is None or index.count(table) == 0:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    data = index.columns(table, ["chunk_id", "vector"])
    owner = np.array([row_of[c] for c in data.column("chunk_id").to_pylist()], np.int64)
    return matrix(data), owner


def embedded_again(
    index: LanceIndex, embedder, row_of: dict[str, int], cache: Path | None
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The chunks' vectors ``(n, dim)`` and the windows' (vectors, chunk positions), their
    ``search_text`` embedded by ``embedder`` (read from / written to ``cache``, an .npz with the
    embedder's fingerprint: another embedder's file is refused); no nuggets."""
    chunks = index.columns("chunks", ["chunk_id", "search_text"])
    windows = index.columns("windows", ["chunk_id", "search_text"])
    if cache is not None and cache.exists():
        saved = np.load(cache)
        if str(saved.get("fingerprint", "")) != embedder.fingerprint:
            raise SystemExit(
                f"error: {cache} holds another embedder's vectors (not {embedder.fingerprint}); "
                "delete it or name another --vectors file"
            )
        first, wvec = saved["chunks"], saved["windows"]
    else:
        first = np.asarray(embedder.embed_documents(chunks.column("search_text").to_pylist()))
        wvec = np.asarray(embedder.embed_documents(windows.column("search_text").to_pylist()))
        if cache is not None:
            np.savez(cache, chunks=first, windows=wvec, fingerprint=embedder.fingerprint)
    order = [row_of[c] for c in chunks.column("chunk_id").to_pylist()]
    placed = np.zeros_like(first, dtype=np.float32)
    placed[order] = first
    owner = np.array([row_of[c] for c in windows.column("chunk_id").to_pylist()], np.int64)
    empty = (np.zeros((0, 0), np.float32), np.zeros(0, np.int64))
    return placed, {"windows": (wvec.astype(np.float32), owner), "nuggets": empty}


def dense_scores(
    q: np.ndarray, first: np.ndarray, tables: dict[str, tuple[np.ndarray, np.ndarray]], n: int
) -> dict[str, np.ndarray]:
    """Every dense chunk score of the module docstring for query vector ``q``."""
    own = first @ q
    scores = {"first": own}
    wvec, wowner = tables["windows"]
    if len(wvec):
        scores["windows"] = best_of(wowner, wvec @ q, n)
        scores["wmean"] = tables["wmean"][0] @ q
    nvec, nowner = tables["nuggets"]
    if len(nvec):
        best = best_of(nowner, nvec @ q, n)
        for name in [k for k in ("first", "windows") if k in scores]:
            base = scores[name]
            nug = np.where(best > -2.0, best, base)
            scores.setdefault("nuggets", nug)
            scores[f"avg({name},nuggets)"] = (base + nug) / 2
            scores[f"max({name},nuggets)"] = np.maximum(base, nug)
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--kc", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--depth", type=int, default=HYBRID_DEPTH, help="rows per ranking fused")
    ap.add_argument("--weights", nargs="*", type=float, default=[], help="dense weights tried")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--embedder", default=None, help="score with this embedder (docstring)")
    ap.add_argument("--vectors", type=Path, default=None, help="--embedder's vectors (.npz)")
    args = ap.parse_args()

    store = Store.at(args.store)
    index = LanceIndex.open(store)
    chunks = index.columns("chunks", ["chunk_id", "doc_id", "vector"])
    ids = chunks.column("chunk_id").to_pylist()
    docs = chunks.column("doc_id").to_pylist()
    first = matrix(chunks)
    row_of = {c: i for i, c in enumerate(ids)}
    n = len(ids)
    tables = {name: owners(index, name, row_of) for name in ("windows", "nuggets")}
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    embedder = store_embedder_of(settings, args.embedder)  # the store's dtype and width
    if args.embedder:
        first, tables = embedded_again(index, embedder, row_of, args.vectors)
    wvec, wowner = tables["windows"]
    if len(wvec):
        mean = np.zeros_like(first)
        np.add.at(mean, wowner, wvec)
        tables["wmean"] = (mean / np.linalg.norm(mean, axis=1, keepdims=True), wowner)
    print(
        f"{n} chunks, {len(wvec)} windows ({len(wvec) / n:.2f} per chunk), "
        f"{len(tables['nuggets'][0])} nuggets"
    )
    depth = max(args.depth, max(args.kc))
    weight = dense_weight(index)  # as the store's hybrid search weighs dense
    results = {}
    for qpath in args.questions:
        questions = [q for q in load_questions(qpath) if q.doc_ids]
        qv = embedder.embed_queries([q.question for q in questions])
        hits: dict[str, dict[int, list[float]]] = {}
        for qi, q in enumerate(questions):
            gold = set(q.doc_ids)
            scores = dense_scores(qv[qi], first, tables, n)
            ranks = {name: top(s, depth) for name, s in scores.items()}
            lexical = index.search_text("chunks", q.question, depth)
            lex = [(row_of[r["chunk_id"]], r["score"]) for r in lexical]
            for name, s in scores.items():
                dense = [(i, float(s[i])) for i in ranks[name][: args.depth]]
                pair = [dense, lex[: args.depth]]
                ranks[f"hybrid-{name}"] = fused(relative_scores(pair, [weight, 1 - weight]))
                for w in args.weights:
                    ranks[f"hybrid-{name}-a{w}"] = fused(relative_scores(pair, [w, 1 - w]))
                ids = [[i for i, _ in ranking] for ranking in pair]
                ranks[f"rrf-{name}"] = rrf(ids, [1.0, 1.0])
                ranks[f"rrf-{name}-wL0.5"] = rrf(ids, [1.0, 0.5])
            ranks["lexical"] = [i for i, _ in lex]
            for name, order in ranks.items():
                for kc in args.kc:
                    hit = any(docs[i] in gold for i in order[:kc])
                    hits.setdefault(name, {}).setdefault(kc, []).append(float(hit))
        print(f"\n{qpath} ({len(questions)} questions): hit@kc %")
        print(f"{'variant':<34}" + "".join(f"{'@' + str(k):>8}" for k in args.kc))
        table = {}
        for name, per in hits.items():
            table[name] = {k: 100 * float(np.mean(v)) for k, v in per.items()}
            print(f"{name:<34}" + "".join(f"{table[name][k]:>8.1f}" for k in args.kc))
        results[qpath] = table
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
