"""Chromium's running lines left after the PDF reader, document by document (issue 32's proof,
the reader alone: no store needed). Run alone:

    python tests/benchmarks/check_pdf_running.py DIR

DIR: PDFs printed by headless Chromium with its default header (the print date and the title)
and footer (the page's ``file://`` URL and ``n/N``), e.g. by ``infra/print_pdfs.sh``. Every PDF
under DIR is read by ``PdfReader``; printed: the PDFs, their pages, the reader's CPU seconds and
pages per second, the rejects, and each document whose text still holds a footer (a
``file://...html`` URL followed by ``n/N``), a print date (``12/5/26, 1:23 AM``) or any other
``file://`` (listed with what matched, for a look: a page's own text may hold one). A chunk is
a piece of its document's text, so a document without them has no chunk with them.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from check_pdf_store import RUNNING as STORE_RUNNING

from coinrag.tasks.readers.base import ReadError
from coinrag.tasks.readers.pdf import PdfReader

# Chromium's footer and its header's print date (check_pdf_store.py's), and any other file:// URL
RUNNING = [*STORE_RUNNING, re.compile(r"file://")]


def main(folder: Path) -> int:
    files = sorted(folder.rglob("*.pdf"))
    left, rejects, pages, cpu = [], [], 0, 0.0
    for path in files:
        started = time.process_time()
        try:
            doc = PdfReader().read(path.read_bytes(), str(path))
        except ReadError as exc:
            rejects.append((str(path), exc.reason))
            continue
        cpu += time.process_time() - started
        pages += len(doc.pages)
        hits = [m.group() for pattern in RUNNING for m in pattern.finditer(doc.text)]
        if hits:
            left.append((str(path), hits[:3]))
    rate = pages / cpu if cpu else 0.0
    print(f"{len(files)} PDFs, {pages} pages, {cpu:.1f} CPU s ({rate:.0f} pages/s)")
    print(f"rejects: {rejects}")
    print(f"documents with a running line or a file:// URL left: {len(left)}")
    for path, hits in left:
        print(f"  {path}: {hits}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(Path(sys.argv[1])))
