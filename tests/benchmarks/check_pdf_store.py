"""Check a store built from Chromium-printed PDFs against the PDFs themselves (issue 32's proof).

Run alone: ``python tests/benchmarks/check_pdf_store.py --store S --pdf-dir DIR
[--questions questions.jsonl]``, where DIR is the folder the store was built from (the Python
docs printed by ``chromium --headless --print-to-pdf``, with Chromium's default running header
and footer: date and title above, the page's ``file://`` URL and ``n/N`` below).

It reads the store's live chunks and documents (``storage``) and each PDF's own page texts
(pypdfium2's text page, the oracle) and prints:

1. **Running lines left**: chunks holding Chromium's footer (a page's ``file://`` URL and its
   ``n/N`` counter) or header (the print date ``12/5/26, 1:23 AM``). Goal: 0.
2. **Page map**: for every chunk and every page it claims (``page_first..page_last``), every
   word (3 letters or more; not the part's first and last, which a chunk boundary may cut) of
   the part of the chunk that the document's page map puts on that page is in that page's
   pypdfium2 text (without white space and hyphens; words, not a substring: the reader
   reorders lines into reading order). Goal: all.
3. **FAQ answers** (with ``--questions``, ``infra/python_faq.py``'s questions.jsonl): for each
   question, the page of the gold PDF whose pypdfium2 text holds the gold answer's first 60
   characters, and the store's chunk of that document that holds them: the chunk's pages must
   include that page. Goal: every answer found is on a page its chunk claims.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from coinrag.schemas.tables import ChunkRow
from coinrag.storage.corpus import live_documents
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

WORD = re.compile(r"[^\W\d_]{3,}")  # words of three letters or more (hyphenation rejoins parts)
RUNNING = [  # Chromium's footer (the page's URL, then "n/N") and header (the print date)
    re.compile(r"file://\S+\.html\s+\d+/\d+"),
    re.compile(r"\d{1,2}/\d{1,2}/\d{2}, \d{1,2}:\d{2}\s?[AP]M"),
]


def squash(text: str) -> str:
    """Text without white space, hyphens and soft hyphens (what line breaking may change)."""
    return re.sub(r"[\s\-\u00ad\u2010\u2011]+", "", text)


def pdf_pages(path: Path) -> list[str]:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(str(path))
    try:
        return [pdf[i].get_textpage().get_text_range() for i in range(len(pdf))]
    finally:
        pdf.close()


def check_running(chunks: list[ChunkRow]) -> list[str]:
    return [c.chunk_id for c in chunks if any(p.search(c.text) for p in RUNNING)]


def check_page_map(chunks, docs, pages_of) -> tuple[int, int, list[str]]:
    checked = ok = 0
    bad: list[str] = []
    for c in chunks:
        doc = docs[c.doc_id]
        if c.page_first is None or not doc.page_starts:
            continue
        starts = [*doc.page_starts, len(doc.text)]
        for p in range(c.page_first, c.page_last + 1):
            a, b = max(c.char_start, starts[p - 1]), min(c.char_end, starts[p])
            words = set(WORD.findall(doc.text[a:b])[1:-1])  # edge words may be cut in two
            if not words:
                continue
            checked += 1
            page = squash(pages_of(doc)[p - 1])  # a word broken at a line end is found too
            missing = {w for w in words if w not in page}
            if not missing:
                ok += 1
            else:
                bad.append(f"{c.doc_id} p.{p}: not on the page: {sorted(missing)[:5]}")
    return checked, ok, bad


def check_answers(questions: Path, chunks, docs, pages_of) -> tuple[int, int, int, list[str]]:
    by_doc: dict[str, list[ChunkRow]] = {}
    for c in chunks:
        by_doc.setdefault(c.doc_id, []).append(c)
    found = placed = 0
    bad: list[str] = []
    lines = questions.read_text(encoding="utf-8").splitlines()
    for line in lines:
        q = json.loads(line)
        doc = docs.get(q["doc_ids"][0])
        if doc is None:
            continue
        key = squash(q["answers"][0])[:60]
        page = next((i + 1 for i, t in enumerate(pages_of(doc)) if key in squash(t)), None)
        holder = next((c for c in by_doc[doc.doc_id] if key in squash(c.text)), None)
        if page is None or holder is None:
            continue  # the answer's start crosses a page or a chunk boundary
        found += 1
        if holder.page_first <= page <= holder.page_last:
            placed += 1
        else:
            bad.append(
                f"{q['question']!r}: page {page}, chunk pages "
                f"{holder.page_first}-{holder.page_last}"
            )
    return len(lines), found, placed, bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--pdf-dir", required=True, type=Path)
    ap.add_argument("--questions", type=Path)
    args = ap.parse_args(argv)
    store = Store.at(args.store)
    docs = {d: r for d, r in live_documents(store).items() if r.format == "pdf"}
    live = {r.doc_version for r in docs.values()}
    chunks = [c for c in read_rows(store, ChunkRow) if c.doc_version in live]
    cache: dict[str, list[str]] = {}

    def pages_of(doc) -> list[str]:
        if doc.doc_id not in cache:
            cache[doc.doc_id] = pdf_pages(args.pdf_dir / doc.path)
        return cache[doc.doc_id]

    left = check_running(chunks)
    print(f"PDF documents {len(docs)}, chunks {len(chunks)}")
    print(f"1. chunks holding a running header/footer line: {len(left)} (goal 0)")
    checked, ok, bad = check_page_map(chunks, docs, pages_of)
    print(f"2. chunk page claims found on their PDF page: {ok}/{checked} (goal all)")
    for line in bad[:10]:
        print("   ", line)
    failed = bool(left) or ok != checked
    if args.questions:
        n, found, placed, wrong = check_answers(args.questions, chunks, docs, pages_of)
        print(
            f"3. FAQ answers: {n} questions, {found} answers found on one page and in one chunk, "
            f"{placed} on a page their chunk claims (goal all)"
        )
        for line in wrong[:10]:
            print("   ", line)
        failed = failed or placed != found
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
