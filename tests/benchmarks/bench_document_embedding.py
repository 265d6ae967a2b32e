"""Stored texts embedded in float32 and in bfloat16 (``embed_dtype``), side by side in one run:
texts and word pieces a second of ``Embedder.embed_documents`` (the build's own path: sorted by
length, batches of 32) on a sample of a store's index texts (its nuggets and windows, as the
build embeds them), and the smallest cosine of the bfloat16 vectors to the float32 ones.

The two dtypes alternate ``--rounds`` times on the same texts; each line is one timing, the
summary the best of the rounds. Runnable alone::

    python tests/benchmarks/bench_document_embedding.py --store S --threads 2 \\
        [--nuggets 2000] [--windows 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store

DTYPES = ("float32", "bfloat16")


def sample_texts(index: LanceIndex, table: str, n: int, seed: int) -> list[str]:
    """``n`` texts (at most all) of ``table``'s ``search_text``: what the build embedded."""
    if n <= 0 or not index.count(table):
        return []
    texts = index.columns(table, ["search_text"]).column("search_text").to_pylist()
    picked = np.random.default_rng(seed).choice(len(texts), min(n, len(texts)), replace=False)
    return [texts[i] for i in picked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a built store (its index texts)")
    ap.add_argument("--nuggets", type=int, default=2000)
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    index = LanceIndex.open(Store.at(args.store))
    embedders = {dtype: load_embedder(None, document_dtype=dtype) for dtype in DTYPES}
    tokenizer = embedders["float32"].tokenizer
    limit = embedders["float32"].max_length
    for table, n in (("nuggets", args.nuggets), ("windows", args.windows)):
        texts = sample_texts(index, table, n, args.seed)
        if not texts:
            continue
        pieces = sum(min(limit, len(ids)) for ids in tokenizer(texts)["input_ids"])
        best: dict[str, float] = {}
        vectors: dict[str, np.ndarray] = {}
        for r in range(args.rounds):
            for dtype in DTYPES:
                t0 = time.perf_counter()
                vectors[dtype] = embedders[dtype].embed_documents(texts)
                seconds = time.perf_counter() - t0
                best[dtype] = min(best.get(dtype, seconds), seconds)
                print(f"{table} round {r} {dtype}: {seconds:.2f} s", flush=True)
        cosine = float((vectors["float32"] * vectors["bfloat16"]).sum(axis=1).min())
        for dtype in DTYPES:
            print(
                f"{table:8s} {len(texts):6d} texts {pieces:8d} pieces, {args.threads} thread(s), "
                f"{dtype:8s}: {len(texts) / best[dtype]:7.1f} texts/s "
                f"{pieces / best[dtype]:7.0f} pieces/s"
            )
        ratio = best["float32"] / best["bfloat16"]
        print(f"{table}: bfloat16 {ratio:.2f}x float32's rate; smallest cosine {cosine:.6f}")


if __name__ == "__main__":
    main()
