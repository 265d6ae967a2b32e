"""``inference/evaluation/report.py``: aggregation by dataset and model, Table 3 and the figures."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from coinrag.inference.evaluation.report import (
    ablation_bars,
    aggregate,
    best_under_budget,
    budget_curve_figure,
    pareto_figure,
    plot_ablation,
    plot_budget_curve,
    plot_pareto,
    table3_markdown,
)


def _row(method, kc, k, f1, ttft, *, model="trained", dataset="faq", em=0.0, active=10):
    return dict(dataset=dataset, model=model, method=method, kc=kc, k=k, f1=f1, em=em,
                recall=None, ttft_ms=ttft, active_tokens=active)  # fmt: skip


ROWS = [
    # coinrag on the trained model: (1, 5) fast, (4, 10) better and slower
    _row("coinrag", 1, 5, 0.4, 50.0, em=0.2),
    _row("coinrag", 1, 5, 0.6, 70.0),
    _row("coinrag", 4, 10, 0.9, 300.0, active=80),
    _row("coinrag-isolated", 1, 5, 0.3, 90.0),
    _row("coinrag-noalign", 1, 5, 0.2, 60.0),
    _row("turborag", 1, 0, 0.5, 150.0, active=512),
    _row("coinrag", 1, 5, 0.1, 40.0, model="base"),
    _row("coinrag", 1, 5, 0.7, 80.0, dataset="wiki"),
]
BUDGETS = (100.0, 200.0, math.inf)


def test_aggregate_groups_by_dataset_model_method_and_sweep_point() -> None:
    results = aggregate(ROWS).to_pylist()
    assert [(r["dataset"], r["model"], r["method"], r["kc"], r["k"], r["n"]) for r in results] == [
        ("faq", "trained", "coinrag", 1, 5, 2),
        ("faq", "trained", "coinrag", 4, 10, 1),
        ("faq", "trained", "coinrag-isolated", 1, 5, 1),
        ("faq", "trained", "coinrag-noalign", 1, 5, 1),
        ("faq", "trained", "turborag", 1, 0, 1),
        ("faq", "base", "coinrag", 1, 5, 1),
        ("wiki", "trained", "coinrag", 1, 5, 1),
    ]
    first = results[0]
    assert first["f1"] == pytest.approx(0.5) and first["em"] == pytest.approx(0.1)
    assert first["ttft_p99_ms"] == pytest.approx(50 + 0.99 * 20)


def test_table3_best_f1_under_each_budget_with_labels() -> None:
    t3 = best_under_budget(aggregate(ROWS), BUDGETS).to_pylist()
    by = {(r["dataset"], r["label"], r["budget_ms"]): r for r in t3}
    assert by[("faq", "coinrag", 100.0)]["f1"] == pytest.approx(0.5)  # (1, 5): P99 69.8
    assert (by[("faq", "coinrag", 100.0)]["kc"], by[("faq", "coinrag", 100.0)]["k"]) == (1, 5)
    assert by[("faq", "coinrag", math.inf)]["f1"] == pytest.approx(0.9)
    assert by[("faq", "coinrag", math.inf)]["active_tokens"] == 80
    assert by[("faq", "turborag", 100.0)]["f1"] is None  # P99 150 > 100
    assert by[("faq", "turborag", 100.0)]["kc"] is None
    assert by[("faq", "coinrag [base]", 100.0)]["f1"] == pytest.approx(0.1)
    assert by[("wiki", "coinrag", 100.0)]["n"] == 1


def test_table3_markdown() -> None:
    md = table3_markdown(best_under_budget(aggregate(ROWS), BUDGETS))
    assert "## P99 TTFT <= 100 ms" in md and "## P99 TTFT <= none (unconstrained)" in md
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| method"))
    assert "faq F1 / EM" in head and "wiki (kc, k)" in head and head.endswith("| n |")
    block = lines[lines.index("## P99 TTFT <= 100 ms") :]
    coinrag = next(line for line in block if line.startswith("| coinrag |"))
    assert coinrag.startswith("| coinrag | 50.0 / 10.0 | (1, 5) | 70.0 / 0.0 | (1, 5) | 60.0 |")
    assert coinrag.endswith("| 2/1 |")
    turbo = next(line for line in block if line.startswith("| turborag |"))
    assert turbo == "| turborag |" + " – |" * 8


def test_figures_log_ttft_axes_and_files(tmp_path) -> None:
    results = aggregate(ROWS)
    fig = pareto_figure(results, "ttft_p99_ms", "P99", log_x=True)
    assert [ax.get_xscale() for ax in fig.axes[:2]] == ["log", "log"]  # a panel per dataset
    assert budget_curve_figure(results).axes[0].get_xscale() == "log"
    names = [p.name for p in plot_pareto(results, tmp_path)]
    assert names == ["f1_vs_p99_ttft.png", "f1_vs_active_tokens.png"]
    assert plot_budget_curve(results, tmp_path).stat().st_size > 0


def test_ablation_chart_variants_and_budgets(tmp_path) -> None:
    t3 = best_under_budget(aggregate(ROWS), BUDGETS)
    budgets, variants, datasets = ablation_bars(t3)
    assert variants == ["coinrag", "coinrag-isolated", "coinrag-noalign", "coinrag [base]"]
    assert budgets == [100.0, math.inf] and datasets == ["faq", "wiki"]
    assert plot_ablation(t3, tmp_path).name == "ablation_f1.png"
    pq.write_table(t3, tmp_path / "t3.parquet")  # the schema writes as parquet
    only_turbo = best_under_budget(
        aggregate([r for r in ROWS if r["method"] == "turborag"]), BUDGETS
    )
    assert ablation_bars(only_turbo) is None and plot_ablation(only_turbo, tmp_path / "x") is None
