"""Reader throughput: pages per second of each file format on one thread, through the readers'
registry (``Reader.registry[name](**options).read(data, name)``), as ingest calls them.

    python tests/benchmarks/bench_readers.py [--html DIR] [--pdf DIR] [--docx 30]
        [--sources DIR] [--json PATH]

Formats and what a page is:

- ``html`` (``main`` and ``whole`` modes): every ``*.html`` under ``--html`` (default Debian's
  ``python3.11-doc``, ``/usr/share/doc/python3.11/html``, 530 Sphinx pages); a file is a page;
- ``pdf``: every ``*.pdf`` under ``--pdf`` (skipped without it); a file counts its pages
  (pypdfium2, counted before the clock starts);
- ``docx``: ``--docx N`` Word files written here with python-docx into a temporary folder,
  ``PAGES_PER_DOCX`` pages each (pages separated by page breaks; a page: a heading, four
  paragraphs of the docs' reST text, a five-item list and a 4x3 table); 0 skips them;
- ``rst``, ``markdown``, ``text``: the reST sources (``--sources``, default the docs'
  ``_sources``, read as ``.rst``, ``.md`` and ``.txt``), which have no pages: a page is
  ``CHARS_PER_PAGE`` characters.

Every file is read once from memory (the bytes are loaded before the clock starts; one read of
each format first, untimed, imports the reader and its libraries). Seconds are CPU seconds of
this process (the machine is shared: its wall clock also measures the other load, printed
alongside, as is the load average). A file a reader rejects (``ReadError``) is counted apart.
Goals (issue 32): >= 20 PDF pages/s, >= 50 HTML pages/s.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # one thread, set before any numeric library loads

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from coinrag.tasks.readers.base import Reader, ReadError  # noqa: E402

DOCS = Path("/usr/share/doc/python3.11/html")
CHARS_PER_PAGE = 3000  # a printed page of prose, for formats without pages
PAGES_PER_DOCX = 4
GOALS = {"pdf": 20.0, "html": 50.0}  # pages/s


@dataclass
class Row:
    format: str
    files: int
    pages: int
    rejected: int
    cpu_s: float
    wall_s: float

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.cpu_s if self.cpu_s else 0.0


def measure(label: str, reader: Reader, files: list[tuple[str, bytes, int]]) -> Row:
    """Read every ``(name, data, pages)`` once with ``reader``; rejected files count no page."""
    try:
        reader.read(files[0][1], files[0][0])  # imports, caches: not timed
    except ReadError:
        pass
    pages = rejected = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for name, data, n in files:
        try:
            reader.read(data, name)
        except ReadError:
            rejected += 1
            continue
        pages += n
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return Row(label, len(files), pages, rejected, cpu, wall)


def html_files(folder: Path) -> list[tuple[str, bytes, int]]:
    return [(str(p.relative_to(folder)), p.read_bytes(), 1) for p in sorted(folder.rglob("*.html"))]


def pdf_files(folder: Path) -> list[tuple[str, bytes, int]]:
    import pypdfium2

    out = []
    for path in sorted(folder.rglob("*.pdf")):
        data = path.read_bytes()
        try:
            pdf = pypdfium2.PdfDocument(data)
        except pypdfium2.PdfiumError:
            pages = 0  # the reader will reject it too
        else:
            pages = len(pdf)
            pdf.close()
        out.append((str(path.relative_to(folder)), data, pages))
    return out


def source_files(folder: Path, suffix: str) -> list[tuple[str, bytes, int]]:
    out = []
    for path in sorted(folder.rglob("*.rst.txt")):
        data = path.read_bytes()
        name = str(path.relative_to(folder)).removesuffix(".rst.txt") + suffix
        out.append((name, data, max(1, round(len(data.decode("utf-8")) / CHARS_PER_PAGE))))
    return out


def docx_files(n: int, sources: Path, folder: Path) -> list[tuple[str, bytes, int]]:
    """``n`` Word files of ``PAGES_PER_DOCX`` pages, written into ``folder`` from the
    paragraphs of the reST sources (a fixed order: the same files on every run)."""
    import docx

    paragraphs = [
        " ".join(block.split())
        for path in sorted(sources.rglob("*.rst.txt"))[:60]
        for block in path.read_text(encoding="utf-8").split("\n\n")
        if 300 < len(block) < 1500 and not block.lstrip().startswith((".", ":", "*", "-", "="))
    ]
    out, k = [], 0
    for i in range(n):
        d = docx.Document()
        d.core_properties.title = f"Benchmark document {i}"
        for page in range(PAGES_PER_DOCX):
            if page:
                d.add_page_break()
            d.add_heading(f"Part {page + 1}", level=1)
            for _ in range(4):
                d.add_paragraph(paragraphs[k % len(paragraphs)])
                k += 1
            for item in range(5):
                d.add_paragraph(
                    f"Step {item + 1}: {paragraphs[k % len(paragraphs)][:80]}", style="List Bullet"
                )
            table = d.add_table(rows=4, cols=3)
            for r in range(4):
                for c in range(3):
                    table.cell(r, c).text = f"cell {r}.{c}"
        path = folder / f"doc{i:03d}.docx"
        d.save(path)
        out.append((path.name, path.read_bytes(), PAGES_PER_DOCX))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--html", type=Path, default=DOCS)
    parser.add_argument("--pdf", type=Path, default=None)
    parser.add_argument("--docx", type=int, default=30, help="Word files to write and read")
    parser.add_argument("--sources", type=Path, default=DOCS / "_sources")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

    registry = Reader.registry
    rows = []
    for mode in ("main", "whole"):
        reader = registry["html"](html_mode=mode)
        rows.append(measure(f"html ({mode})", reader, html_files(args.html)))
    if args.pdf is not None:
        rows.append(measure("pdf", registry["pdf"](), pdf_files(args.pdf)))
    if args.docx:
        with tempfile.TemporaryDirectory(prefix="bench-docx-") as tmp:
            files = docx_files(args.docx, args.sources, Path(tmp))
        rows.append(measure("docx", registry["docx"](), files))
    rows.append(measure("rst", registry["rst"](), source_files(args.sources, ".rst")))
    rows.append(measure("markdown", registry["markdown"](), source_files(args.sources, ".md")))
    rows.append(measure("text", registry["text"](), source_files(args.sources, ".txt")))

    print(f"load average {os.getloadavg()[0]:.2f}, one thread; seconds: CPU of this process")
    head = f"{'format':14} {'files':>6} {'pages':>7} {'rejected':>8} {'seconds':>8}"
    print(f"{head} {'wall s':>8} {'pages/s':>9}  goal")
    for r in rows:
        goal = GOALS.get(r.format.split(" ")[0])
        verdict = (
            "" if goal is None else f">= {goal:g} " + ("met" if r.pages_per_s >= goal else "MISSED")
        )
        print(
            f"{r.format:14} {r.files:6d} {r.pages:7d} {r.rejected:8d} {r.cpu_s:8.3f} "
            f"{r.wall_s:8.2f} {r.pages_per_s:9.1f}  {verdict}"
        )
    if args.json is not None:
        report = [asdict(r) | {"pages_per_s": r.pages_per_s} for r in rows]
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
