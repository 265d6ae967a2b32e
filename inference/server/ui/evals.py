"""The Evaluations page's data: one ``coinrag eval --out`` folder (the ``eval_dir`` setting of
``coinrag api``), as ``inference/evaluation/evaluate.py`` writes it: ``table3.parquet``
(columns: ``schemas.evaluation.TABLE3_SCHEMA``), ``per_question.parquet``
(``PER_QUESTION_SCHEMA``: each question's answer with its evidence's documents and citations)
and the plots (``*.png``). Read when the page is asked for, so a rerun of ``eval`` shows without
a restart; a missing file is an empty section, never an error page.

Example::

    folder = EvalFolder(Path("runs/eval-sample"))
    folder.page()["table3"][0]["label"]   # "coinrag"
    folder.plot("f1_vs_p99_ttft.png")     # Path(...) or None
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

MAX_QUESTIONS = 500  # per-question rows shown at most
TABLE3 = "table3.parquet"
PER_QUESTION = "per_question.parquet"


class EvalFolder:
    """An ``eval --out`` folder, read on each page."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _rows(self, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        path = self.folder / name
        if not path.is_file():
            return []
        table = pq.read_table(path)
        return (table.slice(0, limit) if limit else table).to_pylist()

    def plots(self) -> list[str]:
        """The PNG files of the folder, by name."""
        if not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.glob("*.png") if p.is_file())

    def plot(self, name: str) -> Path | None:
        """The plot called ``name`` (a bare ``*.png`` name of the folder), else None."""
        return self.folder / name if name in self.plots() else None

    def page(self) -> dict[str, Any]:
        questions = self._rows(PER_QUESTION, MAX_QUESTIONS)
        for row in questions:
            row["timings"] = dict(row.get("timings") or [])
        return {
            "folder": str(self.folder),
            "exists": self.folder.is_dir(),
            "table3": self._rows(TABLE3),
            "questions": questions,
            "max_questions": MAX_QUESTIONS,
            "plots": self.plots(),
        }
