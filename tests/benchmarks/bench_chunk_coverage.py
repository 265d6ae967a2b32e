"""Whole-chunk coverage of dense chunk search: which chunk score finds the evidence best.

The default embedder (all-MiniLM-L6-v2) keeps 256 word pieces, about a third of a 512-token chunk
of the generation model (~700 word pieces of the Python docs), so a chunk's one vector says
nothing about most of its text. This benchmark compares, on a built store (its index: chunk and
nugget vectors, the full-text index) and question files with gold ``doc_ids`` (hit@kc: a chunk of
a gold document among the top ``kc``), the chunk scores:

- ``first``: the chunk's vector (its text as the embedder truncates it: what the index holds);
- ``nuggets``: the best cosine of the chunk's nuggets (they cover the chunk end to end; a chunk
  without nuggets keeps ``first``);
- ``first+nuggets``: the larger of the two; ``avg``: their mean; ``rrf(first,nuggets)``: the
  two rankings fused by reciprocal rank;
- with ``--windows`` (costly: the embedder runs over every chunk again): ``mean`` / ``max`` of
  the chunk cut into windows of the embedder's length (:func:`text_windows`);
- ``lexical``: BM25 over the whole chunk text (the index's full-text index);
- ``hybrid-<dense>``: reciprocal rank fusion (``inference.retrieve.rrf_fuse``, depth
  ``--depth``) of that dense score and lexical; ``hybrid-3way``: of ``first``, ``nuggets`` and
  lexical (three rankings).

Cosines are exact (numpy), as the chunk table's flat search; the nugget table's ANN index
returns the exact top-10 (``bench_retrieval.py``). Runnable alone::

    python tests/benchmarks/bench_chunk_coverage.py --store STORE \\
        --questions faq/questions.jsonl infra/python_natural_questions.jsonl [--windows]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from coinrag.inference.embedders import load_embedder  # noqa: E402
from coinrag.inference.retrieve import HYBRID_DEPTH, rrf_fuse  # noqa: E402
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.storage.index import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402


def matrix(table, column: str = "vector") -> np.ndarray:
    vec = table.column(column).combine_chunks()
    dim = len(vec[0]) if len(vec) else 0
    return vec.flatten().to_numpy().astype(np.float32).reshape(-1, dim)


def top(scores: np.ndarray, depth: int) -> list[int]:
    depth = min(depth, len(scores))
    idx = np.argpartition(-scores, depth - 1)[:depth]
    return [int(i) for i in idx[np.argsort(-scores[idx])]]


def text_windows(tokenizer: Any, text: str, max_length: int, min_tail: float = 0.5) -> list[str]:
    """``text`` cut into consecutive windows of at most ``max_length - 2`` tokens of
    ``tokenizer`` (the room an encoder has besides its two special tokens), as substrings of
    ``text`` cut at token boundaries. A text that fits is one window (itself). A last window
    shorter than ``min_tail`` of a window is moved back to end at the text's end (it then
    overlaps the one before), so every window carries about a window of text.

    E.g. with one token per word and ``max_length`` 5 (3 tokens a window), ``"a b c d e"``
    gives ``["a b c", "c d e"]``: the tail ``"d e"`` is moved back.
    """
    width = max(1, int(max_length) - 2)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [o for o in enc["offset_mapping"] if o[1] > o[0]]
    if len(offsets) <= width:
        return [text]
    starts = list(range(0, len(offsets), width))
    if len(offsets) - starts[-1] < min_tail * width:
        starts[-1] = len(offsets) - width
    return [text[offsets[s][0] : offsets[min(s + width, len(offsets)) - 1][1]] for s in starts]


def window_vectors(embedder, texts: list[str], cache: Path | None):
    if cache is not None and cache.exists():
        data = np.load(cache)
        if int(data["n"]) == len(texts):
            return data["windows"], data["owner"]
    windows = [text_windows(embedder.tokenizer, t, embedder.max_length) for t in texts]
    flat = [w for ws in windows for w in ws]
    owner = np.array([i for i, ws in enumerate(windows) for _ in ws], dtype=np.int64)
    vec = embedder.embed_documents(flat)
    if cache is not None:
        np.savez(cache, windows=vec, owner=owner, n=np.array(len(texts)))
    return vec, owner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--kc", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--depth", type=int, default=HYBRID_DEPTH, help="rows per ranking fused")
    ap.add_argument("--windows", action="store_true", help="also embed every chunk's windows")
    ap.add_argument("--cache", type=Path, default=None, help=".npz of the window vectors")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    store = Store.at(args.store)
    index = LanceIndex.open(store)
    chunks = index.columns("chunks", ["chunk_id", "doc_id", "text", "vector"])
    ids = chunks.column("chunk_id").to_pylist()
    docs = chunks.column("doc_id").to_pylist()
    first = matrix(chunks)
    row_of = {c: i for i, c in enumerate(ids)}
    nuggets = index.columns("nuggets", ["chunk_id", "vector"])
    nvec = matrix(nuggets)
    nowner = np.array([row_of[c] for c in nuggets.column("chunk_id").to_pylist()], np.int64)
    n = len(ids)
    embedder = load_embedder(None)
    variants = ["first", "nuggets", "first+nuggets", "avg"]
    wvec = wowner = None
    if args.windows:
        wvec, wowner = window_vectors(embedder, chunks.column("text").to_pylist(), args.cache)
        variants += ["mean", "max"]
        mean = np.zeros_like(first)
        np.add.at(mean, wowner, wvec)
        mean /= np.linalg.norm(mean, axis=1, keepdims=True)
    print(f"{n} chunks, {len(nvec)} nuggets ({len(nvec) / n:.1f} per chunk)")

    results = {}
    for qpath in args.questions:
        questions = [q for q in load_questions(qpath) if q.doc_ids]
        qv = embedder.embed_queries([q.question for q in questions])
        hits: dict[str, dict[int, list[float]]] = {}
        for qi, q in enumerate(questions):
            gold = set(q.doc_ids)
            chunk_cos = first @ qv[qi]
            best_nugget = np.full(n, -2.0, dtype=np.float32)
            np.maximum.at(best_nugget, nowner, nvec @ qv[qi])
            scores = {
                "first": chunk_cos,
                "nuggets": np.where(best_nugget > -2.0, best_nugget, chunk_cos),
                "first+nuggets": np.maximum(chunk_cos, best_nugget),
                "avg": (chunk_cos + np.where(best_nugget > -2.0, best_nugget, chunk_cos)) / 2,
            }
            if wvec is not None:
                best_window = np.full(n, -2.0, dtype=np.float32)
                np.maximum.at(best_window, wowner, wvec @ qv[qi])
                scores["mean"] = mean @ qv[qi]
                scores["max"] = best_window
            depth = max(args.depth, max(args.kc))
            ranks = {name: top(s, depth) for name, s in scores.items()}
            lexical = index.search_text("chunks", q.question, depth)
            ranks["lexical"] = [row_of[r["chunk_id"]] for r in lexical]
            for name in variants:
                ranks[f"hybrid-{name}"] = rrf_fuse([ranks[name][: args.depth], ranks["lexical"]])
            first_nuggets = [ranks["first"][: args.depth], ranks["nuggets"][: args.depth]]
            ranks["rrf(first,nuggets)"] = rrf_fuse(first_nuggets)
            ranks["hybrid-3way"] = rrf_fuse([*first_nuggets, ranks["lexical"]])
            for name, order in ranks.items():
                for kc in args.kc:
                    hit = any(docs[i] in gold for i in order[:kc])
                    hits.setdefault(name, {}).setdefault(kc, []).append(float(hit))
        print(f"\n{qpath} ({len(questions)} questions): hit@kc %")
        print(f"{'variant':<22}" + "".join(f"{'@' + str(k):>8}" for k in args.kc))
        table = {}
        for name, per in hits.items():
            table[name] = {k: 100 * float(np.mean(v)) for k, v in per.items()}
            print(f"{name:<22}" + "".join(f"{table[name][k]:>8.1f}" for k in args.kc))
        results[qpath] = table
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
