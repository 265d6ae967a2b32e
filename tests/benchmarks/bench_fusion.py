"""Hybrid fusion rules side by side on one built store: hit@kc of the answer's page for dense
alone, lexical alone, and the dense and lexical rankings fused by each score normaliser
(``inference/retrieval/normalise.py``) at each dense weight. Runnable alone::

    python tests/benchmarks/bench_fusion.py --store STORE --questions Q.jsonl [Q2.jsonl ...] \\
        [--normalisers dbsf minmax] [--weights 0.5 0.75] [--depths 30] [--json out.json]

Each question's two rankings are computed once, by the code hybrid search runs
(``HybridSearch.lists``, the store's own embedder, ``max(--depths)`` rows each), and every rule
then fuses their top ``depth`` rows with ``retriever.relative_scores``; so a rule's row equals
what ``coinrag eval --retrieval-only`` reports for hybrid search with that rule (no reranker),
and the rules differ by nothing else. A hit at kc: a chunk of a gold page (``doc_ids``) among
the first kc; MRR within 8. Prints one table per question file; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from coinrag.inference.retrieval.embedders import store_embedder_of  # noqa: E402
from coinrag.inference.retrieval.normalise import SCORE_NORMALISERS, score_normaliser  # noqa: E402
from coinrag.inference.retrieval.retriever import (  # noqa: E402
    FUSION_NORMALISER,
    HYBRID_DEPTH,
    HybridSearch,
    Query,
    default_dense_weight,
    relative_scores,
)
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.schemas.settings import settings_from_toml  # noqa: E402
from coinrag.storage.index.lance import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402

KCS = (1, 2, 4, 8)


def scores(ranks: list[int | None]) -> dict[str, float]:
    """hit@kc (%) for kc in KCS and MRR within 8 from each question's 1-based gold rank."""
    n = max(1, len(ranks))
    out = {f"hit@{kc}": 100.0 * sum(r is not None and r <= kc for r in ranks) / n for kc in KCS}
    out["mrr"] = sum(1.0 / r for r in ranks if r is not None and r <= max(KCS)) / n
    return out


def gold_rank(docs: list[str], gold: set[str]) -> int | None:
    return next((i + 1 for i, d in enumerate(docs) if d in gold), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--normalisers", nargs="+", default=list(SCORE_NORMALISERS))
    ap.add_argument("--weights", nargs="+", type=float, help="default: the index's default, 0.75")
    ap.add_argument("--depths", nargs="+", type=int, default=[HYBRID_DEPTH])
    ap.add_argument("--json")
    args = ap.parse_args()
    store = Store.at(args.store)
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    embedder = store_embedder_of(settings)
    index = LanceIndex.open(store)
    index.check(embedder.fingerprint)
    default_weight = default_dense_weight(index)  # 0.5, or 0.65 where the index has nuggets
    weights = args.weights or sorted({default_weight, 0.75})
    rows = []
    for path in args.questions:
        questions = [q for q in load_questions(path) if q.doc_ids]
        lists = []
        for q in questions:
            query = Query(q.question, embedder)
            found = HybridSearch().lists(index, "chunks", query, max(args.depths))
            lists.append(([[(r["chunk_id"], r["doc_id"], r["score"]) for r in f] for f in found],
                          set(q.doc_ids)))  # fmt: skip
        name = Path(path).stem
        for part, which in (("dense", 0), ("lexical", 1)):
            ranks = [gold_rank([d for _, d, _ in ls[which]], gold) for ls, gold in lists]
            rows.append({"questions": name, "rule": part, **scores(ranks)})
        for rule in args.normalisers:
            normaliser = score_normaliser(rule)
            for depth in args.depths:
                for weight in weights:
                    ranks = []
                    for ls, gold in lists:
                        doc = {c: d for ranking in ls for c, d, _ in ranking}
                        pair = [[(c, s) for c, _, s in ranking[:depth]] for ranking in ls]
                        fused = relative_scores(pair, [weight, 1 - weight], normaliser)
                        order = sorted(fused, key=lambda c: -fused[c])
                        ranks.append(gold_rank([doc[c] for c in order], gold))
                    default = rule == FUSION_NORMALISER.name and weight == default_weight
                    label = f"{rule} w={weight:g} depth {depth}" + (" (default)" * default)
                    rows.append({"questions": name, "rule": label, **scores(ranks)})
        print(f"\n{name} ({len(questions)} questions), {args.store}")
        print("| rule | hit@1 | hit@2 | hit@4 | hit@8 | MRR |\n|---|---|---|---|---|---|")
        for r in rows:
            if r["questions"] == name:
                hits = " | ".join(f"{r[f'hit@{kc}']:.1f}" for kc in KCS)
                print(f"| {r['rule']} | {hits} | {r['mrr']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
