"""What ``coinrag eval`` reports: the aggregated sweep, the paper's Table 3 and its figures.

Input: per-question rows (``inference/evaluation/evaluate.py``), each with its ``dataset`` (question
set), ``model`` (label of the model that answered), ``method``, ``kc``, ``k``, ``f1``, ``em``,
``recall``, ``ttft_ms`` and ``active_tokens``. A method's **label** in tables and figures is its
name on the first model of the run and ``name [model]`` on another one (``coinrag [base]``:
the no-fine-tuning ablation next to a fine-tuned ``coinrag``).

The tables' columns are :mod:`schemas.evaluation`'s.

- :func:`aggregate` -> ``results``: one row per (dataset, model, method, kc, k): means of F1,
  EM, recall (over questions with gold documents), active tokens; mean and P99 TTFT; ``n``.
- :func:`best_under_budget` -> Table 3 (``table3.parquet``): per (dataset, model, method) and
  P99 TTFT budget, the sweep point with the best F1 among those whose P99 <= budget (ties:
  lower P99, then fewer active tokens), with its EM, recall, TTFT, active tokens, ``(kc, k)``
  and ``n``; null F1 where no point meets the budget. :func:`table3_markdown` renders it
  (``table3.md``): one block per budget, one row per label, ``F1 / EM`` and ``(kc, k)`` per
  dataset.
- Figures (PNG): :func:`plot_pareto` (``f1_vs_p99_ttft.png``, log TTFT axis, and
  ``f1_vs_active_tokens.png``: the paper's Figures 2-3 as points), :func:`plot_budget_curve`
  (``f1_vs_budget.png``: best F1 under a P99 budget, log axis), :func:`plot_ablation`
  (``ablation_f1.png``, the paper's Figure 4: full CoinRAG next to each ``coinrag-*`` ablation
  and ``coinrag`` on the other models, per dataset, at the tightest budget full CoinRAG meets
  and unconstrained).

F1 / EM / recall are fractions in ``[0, 1]``; tables and figures print percent. TTFT in ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.schemas.evaluation import RESULTS_SCHEMA, TABLE3_SCHEMA

FULL_METHOD = "coinrag"  # the method the ablations are measured against
ABLATION_PREFIX = "coinrag-"  # coinrag-isolated, coinrag-noalign, coinrag-onestage, ...


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolation percentile; NaN for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (numpy linear interpolation); NaN for no values."""
    return percentile(values, 99.0)


def aggregate(rows: Sequence[dict[str, Any]]) -> pa.Table:
    """Per-question rows -> ``results`` (:data:`RESULTS_SCHEMA`), in first-seen order. Rows
    without ``dataset`` / ``model`` count as dataset ``questions`` and model ``default``."""
    groups: dict[tuple[str, str, str, str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        key = (
            r.get("dataset", "questions"),
            r.get("model", "default"),
            r["method"],
            r.get("retrieval") or "",
            r["kc"],
            r["k"],
        )
        groups.setdefault(key, []).append(r)
    out = []
    for (dataset, model, method, retrieval, kc, k), rs in groups.items():
        recalls = [r["recall"] for r in rs if r["recall"] is not None]
        ttft = [r["ttft_ms"] for r in rs]
        out.append(
            {
                "dataset": dataset,
                "model": model,
                "method": method,
                "retrieval": retrieval,
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


def primary_model(results: pa.Table) -> str:
    """The first model of the run (its methods are labelled by name alone)."""
    models = results.column("model").to_pylist()
    return models[0] if models else "default"


def method_label(method: str, model: str, primary: str, retrieval: str = "") -> str:
    """``coinrag`` on the primary model, ``coinrag [base]`` on model ``base``; with
    ``retrieval`` (a run comparing search modes) ``coinrag (lexical)``."""
    label = method if model == primary else f"{method} [{model}]"
    return f"{label} ({retrieval})" if retrieval else label


def row_labeller(results: pa.Table) -> Any:
    """``row -> label`` (:func:`method_label`) for the rows of ``results``: the retrieval shown
    only when the run compares more than one search mode."""
    primary = primary_model(results)
    several = len(set(results.column("retrieval").to_pylist())) > 1 if results.num_rows else False

    def label(r: dict[str, Any]) -> str:
        return method_label(r["method"], r["model"], primary, r["retrieval"] if several else "")

    return label


def best_under_budget(results: pa.Table, budgets_ms: Sequence[float]) -> pa.Table:
    """Table 3 (:data:`TABLE3_SCHEMA`): per (dataset, model, method) and budget, the sweep point
    with the best F1 among those whose P99 TTFT <= budget (ties: lower P99, then fewer active
    tokens); null F1 and configuration where none meets the budget."""
    rows = results.to_pylist()
    label = row_labeller(results)
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["model"], r["method"], r["retrieval"]), []).append(r)
    out = []
    for (dataset, model, method, retrieval), mine in groups.items():
        for budget in budgets_ms:
            ok = [r for r in mine if r["ttft_p99_ms"] <= budget]
            best = (
                min(ok, key=lambda r: (-r["f1"], r["ttft_p99_ms"], r["active_tokens"]))
                if ok
                else None
            )
            row: dict[str, Any] = {
                "dataset": dataset,
                "model": model,
                "method": method,
                "retrieval": retrieval,
                "label": label(mine[0]),
                "budget_ms": float(budget),
            }
            for col in TABLE3_SCHEMA.names[len(row) :]:
                row[col] = best[col] if best else None
            out.append(row)
    return pa.Table.from_pylist(out, schema=TABLE3_SCHEMA)


# ---------------------------------------------------------------------------- text


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def budget_name(budget_ms: float) -> str:
    return "none" if math.isinf(budget_ms) else f"{budget_ms:g} ms"


def results_text(results: pa.Table) -> str:
    """A fixed-width table of ``results``: F1 / EM / recall in percent, TTFT in ms."""
    rows = results.to_pylist()
    label = row_labeller(results)
    labels = [label(r) for r in rows]
    width = max([len("method"), *map(len, labels)])
    datasets = len({r["dataset"] for r in rows}) > 1
    head = (
        (f"{'dataset':<12} " if datasets else "")
        + f"{'method':<{width}} {'kc':>3} {'k':>3} {'n':>4} {'recall':>7} {'F1':>6} {'EM':>6} "
        f"{'TTFT mean':>10} {'TTFT P99':>9} {'active':>7}"
    )
    lines = [head, "-" * len(head)]
    for r, label in zip(rows, labels, strict=True):
        lines.append(
            (f"{r['dataset'][:12]:<12} " if datasets else "")
            + f"{label:<{width}} {r['kc']:>3} {r['k']:>3} {r['n']:>4} {_pct(r['recall']):>7} "
            f"{100 * r['f1']:>6.1f} {100 * r['em']:>6.1f} {r['ttft_mean_ms']:>10.1f} "
            f"{r['ttft_p99_ms']:>9.1f} {r['active_tokens']:>7.1f}"
        )
    return "\n".join(lines)


def budget_text(table3: pa.Table) -> str:
    """A fixed-width view of Table 3: best F1 per label (and dataset) under each budget."""
    rows = table3.to_pylist()
    width = max([len("method"), *(len(r["label"]) for r in rows)])
    datasets = len({r["dataset"] for r in rows}) > 1
    lines = [
        (f"{'dataset':<12} " if datasets else "")
        + f"{'method':<{width}} {'P99 budget':>10} {'best F1':>8} {'kc':>3} {'k':>3} {'P99':>8}"
    ]
    for r in rows:
        lead = (f"{r['dataset'][:12]:<12} " if datasets else "") + f"{r['label']:<{width}} "
        budget = budget_name(r["budget_ms"])
        if r["f1"] is None:
            lines.append(f"{lead}{budget:>10} {'-':>8}")
        else:
            lines.append(
                f"{lead}{budget:>10} {100 * r['f1']:>8.1f} {r['kc']:>3} {r['k']:>3} "
                f"{r['ttft_p99_ms']:>8.1f}"
            )
    return "\n".join(lines)


def table3_markdown(table3: pa.Table) -> str:
    """``table3.md``: one block per budget; a row per label; per dataset ``F1 / EM`` and the
    ``(kc, k)`` that achieved it; then avg F1 (when every dataset has one), TTFT mean / P99,
    active tokens (means over the datasets) and ``n`` (questions per sweep point: a method run
    on a subset says so). ``–``: no sweep point meets the budget."""
    rows = table3.to_pylist()
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    budgets = list(dict.fromkeys(r["budget_ms"] for r in rows))
    index = {(r["label"], r["dataset"], r["budget_ms"]): r for r in rows}
    cols = [f"{d} F1 / EM | {d} (kc, k)" for d in datasets]
    head = "| method | " + " | ".join(cols) + " | avg F1 | TTFT mean / P99 (ms) | active | n |"
    rule = "|---" * (2 * len(datasets) + 5) + "|"
    lines = [
        "# Table 3: best F1 under a P99 TTFT budget",
        "",
        "F1 / EM in percent (token-level, max over gold answers); TTFT = retrieval + KV load + "
        "assembly + prefill, ms; active = context tokens after the prompt prefix (mean); "
        "n = questions.",
        "",
    ]
    for budget in budgets:
        title = "none (unconstrained)" if math.isinf(budget) else f"{budget:g} ms"
        lines += [f"## P99 TTFT <= {title}", "", head, rule]
        for label in labels:
            cells, met = [], []
            for d in datasets:
                r = index.get((label, d, budget))
                if r is None or r["f1"] is None:
                    cells += ["–", "–"]
                    continue
                met.append(r)
                cells += [f"{_pct(r['f1'])} / {_pct(r['em'])}", f"({r['kc']}, {r['k']})"]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_summary(met, datasets)} |")
        lines.append("")
    return "\n".join(lines)


def _summary(met: list[dict[str, Any]], datasets: list[str]) -> str:
    """avg F1 | TTFT mean / P99 | active | n over the datasets where a point met the budget."""
    if not met:
        return "– | – | – | –"
    avg = f"{100 * np.mean([r['f1'] for r in met]):.1f}" if len(met) == len(datasets) else "–"
    mean = np.mean([r["ttft_mean_ms"] for r in met])
    tail = np.mean([r["ttft_p99_ms"] for r in met])
    active = np.mean([r["active_tokens"] for r in met])
    n = "/".join(str(r["n"]) for r in met)
    return f"{avg} | {mean:.0f} / {tail:.0f} | {active:.0f} | {n}"


# ---------------------------------------------------------------------------- figures


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labelled(results: pa.Table) -> list[dict[str, Any]]:
    label = row_labeller(results)
    return [{**r, "label": label(r)} for r in results.to_pylist()]


def _colors(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """One colour per label, the same in every panel (matplotlib's cycle, ``C0``..)."""
    labels = dict.fromkeys(r["label"] for r in rows)
    return {label: f"C{i % 10}" for i, label in enumerate(labels)}


def _legend(fig: Any, colors: dict[str, str]) -> None:
    """One legend for the whole figure, outside the panels (it must not cover points)."""
    from matplotlib.lines import Line2D

    fig.tight_layout()
    handles = [Line2D([], [], color=c, marker="o") for c in colors.values()]
    fig.legend(handles, list(colors), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))


def pareto_figure(results: pa.Table, x_col: str, x_label: str, log_x: bool) -> Any:
    """F1 against ``x_col``, one series per label (points annotated with ``kc, k``), one panel
    per dataset."""
    plt = _pyplot()
    rows = _labelled(results)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    colors = _colors(rows)
    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 4.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for label in colors:
            pts = sorted(
                (r[x_col], 100 * r["f1"], r["kc"], r["k"])
                for r in rows
                if r["label"] == label and r["dataset"] == dataset
            )
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[label])
            for x, y, kc, k in pts:
                ax.annotate(
                    f"{kc},{k}", (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3)
                )
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("token F1 (%)")
        ax.set_title(dataset)
        ax.grid(alpha=0.3, which="both")
    _legend(fig, colors)
    return fig


def plot_pareto(results: pa.Table, out_dir: str | Path) -> list[Path]:
    """``f1_vs_p99_ttft.png`` (log TTFT axis: the fast methods are not squeezed against zero)
    and ``f1_vs_active_tokens.png``."""
    plt = _pyplot()
    paths = []
    for x_col, x_label, log_x, name in (
        ("ttft_p99_ms", "P99 TTFT (ms, log scale)", True, "f1_vs_p99_ttft.png"),
        ("active_tokens", "active prefix tokens (mean)", False, "f1_vs_active_tokens.png"),
    ):
        fig = pareto_figure(results, x_col, x_label, log_x)
        paths.append(Path(out_dir) / name)
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def budget_curve_figure(results: pa.Table) -> Any:
    """Best F1 under a P99 budget, for every distinct P99 of the run as a budget: a step line
    per label, log budget axis, one panel per dataset (the paper's Figure 2)."""
    plt = _pyplot()
    budgets = sorted(set(results.column("ttft_p99_ms").to_pylist()))
    rows = best_under_budget(results, budgets).to_pylist()
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    colors = _colors(rows)
    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 4.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for label in colors:
            pts = [
                (r["budget_ms"], 100 * r["f1"])
                for r in rows
                if r["label"] == label and r["dataset"] == dataset and r["f1"] is not None
            ]
            if pts:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.step(xs, ys, where="post", color=colors[label])
        ax.set_xscale("log")
        ax.set_xlabel("P99 TTFT budget (ms, log scale)")
        ax.set_ylabel("best token F1 (%)")
        ax.set_title(dataset)
        ax.grid(alpha=0.3, which="both")
    _legend(fig, colors)
    return fig


def plot_budget_curve(results: pa.Table, out_dir: str | Path) -> Path:
    plt = _pyplot()
    fig = budget_curve_figure(results)
    path = Path(out_dir) / "f1_vs_budget.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def ablation_bars(table3: pa.Table) -> tuple[list[float], list[str], list[str]] | None:
    """What Figure 4 shows: ``(budgets, variants, datasets)``, or None when the run has no
    ablation to show (no ``coinrag``, or nothing next to it).

    The full method is ``coinrag`` on the model the ``coinrag-*`` ablations ran on (else the
    first model it ran on); variants: it, each ablation on that model, ``coinrag`` on every
    other model. Budgets: the tightest one full CoinRAG meets (in every dataset), and none.
    """
    rows = table3.to_pylist()
    full = [r for r in rows if r["method"] == FULL_METHOD]
    if not full:
        return None
    ablated = [r for r in rows if r["method"].startswith(ABLATION_PREFIX)]
    home = (ablated or full)[0]["model"]
    if not any(r["model"] == home for r in full):
        home = full[0]["model"]
    variants = [next(r["label"] for r in full if r["model"] == home)]
    variants += list(dict.fromkeys(r["label"] for r in ablated if r["model"] == home))
    variants += list(dict.fromkeys(r["label"] for r in full if r["model"] != home))
    if len(variants) < 2:
        return None
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    mine = [r for r in full if r["model"] == home]
    met = [
        b
        for b in sorted({r["budget_ms"] for r in mine})
        if all(r["f1"] is not None for r in mine if r["budget_ms"] == b)
    ]
    budgets = list(dict.fromkeys([*met[:1], max(r["budget_ms"] for r in mine)]))
    return budgets, variants, datasets


def ablation_figure(table3: pa.Table) -> Any | None:
    """Figure 4: grouped bars of F1 per dataset, one bar per variant (:func:`ablation_bars`),
    a panel per budget."""
    what = ablation_bars(table3)
    if what is None:
        return None
    budgets, variants, datasets = what
    plt = _pyplot()
    index = {(r["label"], r["dataset"], r["budget_ms"]): r for r in table3.to_pylist()}
    fig, axes = plt.subplots(
        1, len(budgets), figsize=(max(4.5, 1.2 * len(variants)) * len(budgets), 4.2),
        sharey=True, squeeze=False,
    )  # fmt: skip
    width = 0.8 / len(variants)
    x = np.arange(len(datasets))
    for ax, budget in zip(axes[0], budgets, strict=True):
        for i, variant in enumerate(variants):
            ys = []
            for d in datasets:
                r = index.get((variant, d, budget))
                ys.append(100 * r["f1"] if r and r["f1"] is not None else math.nan)
            bars = ax.bar(x + i * width, ys, width, label=variant)  # NaN: not run / not met
            texts = ["n/a" if math.isnan(y) else f"{y:.1f}" for y in ys]
            ax.bar_label(bars, labels=texts, fontsize=6)
        ax.set_xticks(x + 0.4 - width / 2, datasets)
        ax.set_title(
            "unconstrained (peak F1)" if math.isinf(budget) else f"P99 TTFT <= {budget:g} ms"
        )
        ax.set_ylabel("token F1 (%)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_ablation(table3: pa.Table, out_dir: str | Path) -> Path | None:
    """``ablation_f1.png`` (None, nothing written, when the run holds no ablation)."""
    fig = ablation_figure(table3)
    if fig is None:
        return None
    plt = _pyplot()
    path = Path(out_dir) / "ablation_f1.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
