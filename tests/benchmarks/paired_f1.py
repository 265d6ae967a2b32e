"""Two `coinrag eval` outputs of the same questions compared question by question: the mean F1
difference (B minus A, points) with a paired bootstrap 95% interval, and how many answers are
word for word the same.

    python tests/benchmarks/paired_f1.py OUT_A OUT_B [--methods coinrag turborag]
        [--resamples 10000] [--seed 0]

Each OUT is an eval's output folder (its ``per_question.parquet``); only the questions both
answered with a method are compared. The bootstrap resamples the per-question differences
with replacement (``--resamples`` times) and reports the 2.5th and 97.5th percentiles of their
means: an interval across zero is a difference within the noise of these questions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def per_question(out: Path, method: str) -> dict[str, dict]:
    """``qid`` -> the row of ``method`` in ``out/per_question.parquet``."""
    rows = pq.read_table(out / "per_question.parquet").to_pylist()
    return {str(r["qid"]): r for r in rows if r["method"] == method}


def compare(a: Path, b: Path, method: str, resamples: int, seed: int) -> str:
    """One line: both means, the difference in points and its interval, identical answers."""
    rows_a, rows_b = per_question(a, method), per_question(b, method)
    keys = sorted(set(rows_a) & set(rows_b))
    if not keys:
        return f"{method}: no question answered in both"
    f1_a = np.array([rows_a[k]["f1"] for k in keys])
    f1_b = np.array([rows_b[k]["f1"] for k in keys])
    diff = f1_b - f1_a
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (resamples, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5]) * 100
    same = sum(rows_a[k].get("answer") == rows_b[k].get("answer") for k in keys)
    return (
        f"{method}: n {len(keys)}  A {f1_a.mean():.4f}  B {f1_b.mean():.4f}  "
        f"B-A {100 * diff.mean():+.2f} points, 95% [{low:+.2f}, {high:+.2f}]  "
        f"identical answers {same}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="eval output folder A (the reference)")
    ap.add_argument("b", type=Path, help="eval output folder B")
    ap.add_argument("--methods", nargs="+", default=["coinrag", "turborag"])
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for method in args.methods:
        print(compare(args.a, args.b, method, args.resamples, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
