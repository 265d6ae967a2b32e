"""Evaluation: token-level F1 / exact match, retrieval recall, TTFT and active prefix tokens.

The paper's measures, on a JSONL of questions, for every method x ``(kc, k)`` of a sweep:

- **F1 / EM**: SQuAD / LongBench answer normalisation (lowercase, drop punctuation, drop the
  articles a/an/the, collapse whitespace), token-level F1 and exact match, each the **max over the
  gold answers** of a question; the means are reported as fractions in ``[0, 1]`` (the printed
  table and the plots show percent, like the paper's tables).
- **recall**: per question, the fraction of its gold ``doc_ids`` found among the documents of the
  evidence the method actually used (CoinRAG: the documents of the selected nuggets; TurboRAG and
  standard: the documents of the top-``kc`` chunks). With one gold document this is hit@kc. Null
  for questions without gold ids; the mean is over questions that have them (null if none).
- **TTFT**: ``Answer.timings['ttft']`` (retrieval + KV load + assembly + query prefill, ms); mean
  and P99 (numpy's linear-interpolation percentile).
- **active tokens**: context tokens after the cached prompt prefix (KV-memory proxy), mean.

A method runs once per distinct value of what its retrieval uses (``RagMethod.uses_kc``,
``uses_k``) and records ``0`` for the other ("not applicable"): CoinRAG per (kc, k), TurboRAG and
standard RAG once per kc with ``k = 0``, cartridge RAG once per k with ``kc = 0``. Retrieval is
computed once per question and retrieval key (``RagMethod.retrieval_key``): once per (question,
kc) for the chunk methods (``chunks_only``, shared by turborag and standard), once per
(question, kc, k) for CoinRAG (``two_stage``); each method's TTFT includes the retrieval time of
the result it used. Before measuring, every method answers the first question once, untimed, so
lazy loading (weights, index, KV files) is not in the first measurement.

Outputs under ``out_dir``: ``results.parquet`` (one row per method and (kc, k)),
``per_question.parquet``, ``best_under_budget.parquet`` (the paper's Table 3 form: best F1 per
method among sweep points whose P99 TTFT <= budget) and the plots ``f1_vs_p99_ttft.png`` and
``f1_vs_active_tokens.png`` (the paper's Figures 2 and 3).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coinrag.schemas.qa import load_questions
from coinrag.schemas.settings import DEFAULT_RAG_METHODS

if TYPE_CHECKING:
    from coinrag.inference.methods import RagMethod

DEFAULT_METHODS = DEFAULT_RAG_METHODS
DEFAULT_SWEEP = ((4, 10),)
DEFAULT_BUDGETS_MS = (100.0, 200.0, 500.0, 1000.0, 2000.0, math.inf)

# ---------------------------------------------------------------------------- answer metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / LongBench normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def _f1_one(prediction: str, gold: str) -> float:
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    if not pred or not ref:  # SQuAD v2 convention: 1 only when both are empty
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Token-level F1 after normalisation; the max over several gold answers (0 if none)."""
    return max((_f1_one(prediction, g) for g in _as_list(gold)), default=0.0)


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(g)) for g in _as_list(gold)), default=0.0)


def doc_recall(evidence_doc_ids: Iterable[str], gold_doc_ids: Sequence[str] | None) -> float | None:
    """Fraction of the gold documents among the evidence documents; None without gold ids."""
    if not gold_doc_ids:
        return None
    found = set(evidence_doc_ids)
    gold = list(dict.fromkeys(gold_doc_ids))
    return sum(g in found for g in gold) / len(gold)


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (numpy linear interpolation); NaN for no values."""
    return percentile(values, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# ---------------------------------------------------------------------------- aggregation

RESULTS_SCHEMA = pa.schema(
    [
        ("method", pa.string()),
        ("kc", pa.int32()),
        ("k", pa.int32()),
        ("f1", pa.float64()),
        ("em", pa.float64()),
        ("recall", pa.float64()),
        ("ttft_mean_ms", pa.float64()),
        ("ttft_p99_ms", pa.float64()),
        ("active_tokens", pa.float64()),
        ("n", pa.int32()),
    ]
)

BUDGET_SCHEMA = pa.schema(
    [
        ("method", pa.string()),
        ("budget_ms", pa.float64()),
        ("f1", pa.float64()),  # null: no sweep point meets the budget
        ("kc", pa.int32()),
        ("k", pa.int32()),
        ("em", pa.float64()),
        ("recall", pa.float64()),
        ("ttft_mean_ms", pa.float64()),
        ("ttft_p99_ms", pa.float64()),
        ("active_tokens", pa.float64()),
    ]
)


def aggregate(rows: list[dict[str, Any]]) -> pa.Table:
    """Per-question rows (method, kc, k, f1, em, recall, ttft_ms, active_tokens) -> results."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["kc"], r["k"]), []).append(r)
    out = []
    for (method, kc, k), rs in groups.items():
        recalls = [r["recall"] for r in rs if r["recall"] is not None]
        ttft = [r["ttft_ms"] for r in rs]
        out.append(
            {
                "method": method,
                "kc": kc,
                "k": k,
                "f1": float(np.mean([r["f1"] for r in rs])),
                "em": float(np.mean([r["em"] for r in rs])),
                "recall": float(np.mean(recalls)) if recalls else None,
                "ttft_mean_ms": float(np.mean(ttft)),
                "ttft_p99_ms": p99(ttft),
                "active_tokens": float(np.mean([r["active_tokens"] for r in rs])),
                "n": len(rs),
            }
        )
    return pa.Table.from_pylist(out, schema=RESULTS_SCHEMA)


def best_under_budget(results: pa.Table, budgets_ms: Sequence[float]) -> pa.Table:
    """Table 3: per method and budget, the sweep point with the best F1 among those whose
    P99 TTFT <= budget (ties: lower P99, then fewer active tokens). A budget no point meets
    gives a row with null F1 and null configuration."""
    rows = results.to_pylist()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        for budget in budgets_ms:
            ok = [r for r in mine if r["ttft_p99_ms"] <= budget]
            best = (
                min(ok, key=lambda r: (-r["f1"], r["ttft_p99_ms"], r["active_tokens"]))
                if ok
                else None
            )
            row: dict[str, Any] = {"method": method, "budget_ms": float(budget)}
            for col in BUDGET_SCHEMA.names[2:]:
                row[col] = best[col] if best else None
            out.append(row)
    return pa.Table.from_pylist(out, schema=BUDGET_SCHEMA)


def results_text(results: pa.Table) -> str:
    """A fixed-width table: F1 / EM / recall in percent, TTFT in ms."""
    head = (
        f"{'method':<9} {'kc':>3} {'k':>3} {'n':>4} {'recall':>7} {'F1':>6} {'EM':>6} "
        f"{'TTFT mean':>10} {'TTFT P99':>9} {'active':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results.to_pylist():
        recall = "-" if r["recall"] is None else f"{100 * r['recall']:.1f}"
        lines.append(
            f"{r['method']:<9} {r['kc']:>3} {r['k']:>3} {r['n']:>4} {recall:>7} "
            f"{100 * r['f1']:>6.1f} {100 * r['em']:>6.1f} {r['ttft_mean_ms']:>10.1f} "
            f"{r['ttft_p99_ms']:>9.1f} {r['active_tokens']:>7.1f}"
        )
    return "\n".join(lines)


def budget_text(table: pa.Table) -> str:
    lines = [f"{'method':<9} {'P99 budget':>10} {'best F1':>8} {'kc':>3} {'k':>3} {'P99':>8}"]
    for r in table.to_pylist():
        budget = "none" if math.isinf(r["budget_ms"]) else f"{r['budget_ms']:.0f} ms"
        if r["f1"] is None:
            lines.append(f"{r['method']:<9} {budget:>10} {'-':>8}")
        else:
            lines.append(
                f"{r['method']:<9} {budget:>10} {100 * r['f1']:>8.1f} {r['kc']:>3} {r['k']:>3} "
                f"{r['ttft_p99_ms']:>8.1f}"
            )
    return "\n".join(lines)


def plot_results(results: pa.Table, out_dir: str | Path) -> list[Path]:
    """Figures 2 and 3: F1 vs P99 TTFT and F1 vs active tokens, one series per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    rows = results.to_pylist()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    paths = []
    for x_col, x_label, name in (
        ("ttft_p99_ms", "P99 TTFT (ms)", "f1_vs_p99_ttft.png"),
        ("active_tokens", "active prefix tokens (mean)", "f1_vs_active_tokens.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for method in methods:
            pts = sorted(
                (r[x_col], 100 * r["f1"], r["kc"], r["k"]) for r in rows if r["method"] == method
            )
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=method)
            for x, y, kc, k in pts:
                ax.annotate(
                    f"kc={kc}" + (f",k={k}" if k else ""),
                    (x, y),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
        ax.set_xlabel(x_label)
        ax.set_ylabel("token F1 (%)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------- the run


def _configs(
    methods: Sequence[RagMethod], sweep: Sequence[tuple[int, int]]
) -> list[tuple[str, int, int]]:
    """(method, kc, k) to run, for opened methods (``RagMethod``): each once per distinct value
    of what it uses, 0 for what it does not (coinrag per (kc, k); the chunk methods once per kc
    with k = 0; cartridge once per k with kc = 0)."""
    out: list[tuple[str, int, int]] = []
    for method in methods:
        seen: set[tuple[int, int]] = set()
        for kc, k in sweep:
            key = (kc if method.uses_kc else 0, k if method.uses_k else 0)
            if key not in seen:
                seen.add(key)
                out.append((method.name, *key))
    return out


def evaluate(
    store_path: str | Path,
    questions_path: str | Path,
    out_dir: str | Path,
    methods: Sequence[str] = DEFAULT_METHODS,
    sweep: Sequence[tuple[int, int]] = DEFAULT_SWEEP,
    max_new_tokens: int = 32,
    budgets_ms: Sequence[float] = DEFAULT_BUDGETS_MS,
    *,
    model: str | None = None,
    limit: int | None = None,
    engine: Any = None,
    quiet: bool = False,
) -> pa.Table:
    """Run every method x (kc, k) on the questions; write the outputs; return ``results``.

    ``limit``: use only the first ``limit`` questions. ``engine``: an already opened
    :class:`~inference.methods.RagEngine` (then ``store_path``, ``model`` and ``max_new_tokens``
    are taken from it). ``quiet``: no progress bar and no printed tables. The tables go to
    stdout, progress and log lines to stderr.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from coinrag.inference.methods import METHODS, RagEngine

    methods = list(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be among {', '.join(METHODS)}; got {methods}")
    sweep = [(int(kc), int(k)) for kc, k in sweep]
    if not sweep or any(kc < 1 or k < 1 for kc, k in sweep):
        raise ValueError(f"sweep must be non-empty (kc, k) pairs with kc, k >= 1; got {sweep}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    questions = load_questions(questions_path)
    if limit is not None:
        questions = questions[:limit]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=quiet)

    if engine is None:
        console.log(f"loading the model and the store {store_path}")
        engine = RagEngine.open(
            str(store_path), model=model, max_new_tokens=max_new_tokens, methods=methods
        )
    configs = _configs([engine.method(m) for m in methods], sweep)

    # Warm-up: one untimed answer per method, on the first question.
    kc0, k0 = sweep[0]
    for method in methods:
        engine.answer(questions[0].question, method=method, kc=kc0, k=k0)

    rows: list[dict[str, Any]] = []
    total = len(questions) * len(configs)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    ) as progress:
        task = progress.add_task("evaluating", total=total)
        for qi, q in enumerate(questions):
            cache: dict[Any, Any] = {}  # retrieval key -> result, shared between methods
            for method, kc, k in configs:
                rag = engine.method(method)
                key = rag.retrieval_key(kc, k)
                if key not in cache:
                    cache[key] = rag.retrieve(q.question, kc, k)
                ans = rag.run(q.question, cache[key], kc, k)
                ev_docs = list(dict.fromkeys(e["doc_id"] for e in ans.evidence))
                rows.append(
                    {
                        "qid": qi,
                        "line": q.line,
                        "method": method,
                        "kc": kc,
                        "k": k,
                        "question": q.question,
                        "answer": ans.answer,
                        "gold": q.answers,
                        "gold_doc_ids": q.doc_ids,
                        "f1": token_f1(ans.answer, q.answers),
                        "em": exact_match(ans.answer, q.answers),
                        "recall": doc_recall(ev_docs, q.doc_ids),
                        "ttft_ms": float(ans.timings["ttft"]),
                        "timings": [(n, float(v)) for n, v in ans.timings.items()],
                        "active_tokens": int(ans.active_tokens),
                        "evidence_doc_ids": ev_docs,
                    }
                )
                progress.advance(task)
            if not console.is_terminal and ((qi + 1) % 5 == 0 or qi + 1 == len(questions)):
                console.log(f"{qi + 1}/{len(questions)} questions done")  # log lines off a tty

    per_question = pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("qid", pa.int32()),
                ("line", pa.int32()),
                ("method", pa.string()),
                ("kc", pa.int32()),
                ("k", pa.int32()),
                ("question", pa.string()),
                ("answer", pa.string()),
                ("gold", pa.list_(pa.string())),
                ("gold_doc_ids", pa.list_(pa.string())),
                ("f1", pa.float64()),
                ("em", pa.float64()),
                ("recall", pa.float64()),
                ("ttft_ms", pa.float64()),
                ("timings", pa.map_(pa.string(), pa.float64())),
                ("active_tokens", pa.int64()),
                ("evidence_doc_ids", pa.list_(pa.string())),
            ]
        ),
    )
    results = aggregate(rows)
    budgets = best_under_budget(results, budgets_ms)
    pq.write_table(per_question, out / "per_question.parquet")
    pq.write_table(results, out / "results.parquet")
    pq.write_table(budgets, out / "best_under_budget.parquet")
    plot_results(results, out)
    report = Console(quiet=quiet)  # the report on stdout (as `coinrag query` prints answers)
    report.print(results_text(results), highlight=False, soft_wrap=True)
    report.print(budget_text(budgets), highlight=False, soft_wrap=True)
    console.log(
        f"wrote {out}/results.parquet, per_question.parquet, best_under_budget.parquet, PNGs"
    )
    return results
