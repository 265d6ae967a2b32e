"""Chunks invalidated by one edit in the middle of a long document, per chunker.

Run alone: ``python tests/benchmarks/bench_chunk_edit.py [--docs 100] [--seed 0]``. Reads the
Python docs (``--corpus corpus.jsonl`` as written by ``python infra/python_faq.py OUT``, else
Debian's ``python3.11-doc`` sources directly), keeps the ``--docs`` longest pages (at least
``--min-chars`` characters) and makes one edit of each kind in a prose paragraph of the middle
third of each page (seeded):

- ``replace-sentence``, ``insert-sentence``, ``delete-sentence``: a sentence of a prose paragraph
  replaced by / preceded by a sentence of another page, or removed;
- ``replace-paragraph``, ``insert-paragraph``, ``delete-paragraph``: the same for a paragraph.

For each chunker (``fixed``, ``sentence``, ``content``, plus ``--content MIN:TARGET`` variants,
and ``section``, given the page's reST section titles as its heading offsets, found again in the
edited page as a reader would) it chunks the page before and after the edit with the SmolLM2
tokenizer and counts the chunks of the edited page whose text is not a chunk text of the
original page: these are the chunks whose nuggets, KV and embeddings a rebuild recomputes (the
caches are keyed by chunk text and tokens).
Prints per chunker: mean / median / p90 chunks invalidated per edit, mean tokens invalidated per
edit, chunks per page and mean chunk tokens; ``--json PATH`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from coinrag.inference.model.loading import load_tokenizer, tokenizer_fingerprint
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.chunk_content import ContentParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (store_fixtures)
from store_fixtures import REPO, load_script, rst_heading_starts  # noqa: E402

python_docs_corpus = load_script(REPO / "infra" / "python_faq.py").corpus

EDIT_KINDS = (
    "replace-sentence",
    "insert-sentence",
    "delete-sentence",
    "replace-paragraph",
    "insert-paragraph",
    "delete-paragraph",
)
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_SENTENCE = re.compile(r"[^.!?]*[.!?](?=\s)")


@dataclass(frozen=True)
class Chunker:
    """One chunker under test: a method and, for ``content``, its sizes."""

    name: str
    method: str
    content: ContentParams | None = None


def load_pages(corpus_path: Path | None) -> list[dict]:
    """``[{"id", "text"}]``: the JSONL corpus if given, else the installed Python docs."""
    if corpus_path is not None:
        with corpus_path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    return python_docs_corpus()


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """Char spans ``[start, end)`` of the paragraphs (text between blank lines)."""
    spans, start = [], 0
    for m in _PARAGRAPH_BREAK.finditer(text):
        if m.start() > start:
            spans.append((start, m.start()))
        start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def is_prose(paragraph: str) -> bool:
    """A paragraph of sentences: not indented (code, directive bodies), not markup, >= 2 ends."""
    return (
        not paragraph[:1].isspace()
        and not paragraph.startswith(("..", "*", "-", "|", "=", "+"))
        and len(_SENTENCE.findall(paragraph + " ")) >= 2
    )


def make_edit(text: str, kind: str, donor: str, rng: random.Random) -> str | None:
    """``text`` with one edit of ``kind`` in a prose paragraph of its middle third, or None.

    New sentences and paragraphs come from ``donor`` (another page), so they are real text.
    """
    paragraphs = paragraph_spans(text)
    middle = [
        (s, e)
        for s, e in paragraphs
        if len(text) / 3 <= s <= 2 * len(text) / 3 and is_prose(text[s:e])
    ]
    donor_paragraphs = [donor[s:e] for s, e in paragraph_spans(donor) if is_prose(donor[s:e])]
    if not middle or not donor_paragraphs:
        return None
    s, e = rng.choice(middle)
    new_paragraph = rng.choice(donor_paragraphs)
    if kind.endswith("-paragraph"):
        if kind == "replace-paragraph":
            return text[:s] + new_paragraph + text[e:]
        if kind == "insert-paragraph":
            return text[:s] + new_paragraph + "\n\n" + text[s:]
        return text[:s] + text[e:].lstrip("\n")
    sentences = [(s + m.start(), s + m.end()) for m in _SENTENCE.finditer(text[s:e] + " ")]
    a, b = rng.choice(sentences)
    new_sentence = _SENTENCE.findall(new_paragraph + " ")[0].strip()
    if kind == "replace-sentence":
        a += len(text[a:b]) - len(text[a:b].lstrip())  # keep the space before the sentence
        return text[:a] + new_sentence + text[b:]
    if kind == "insert-sentence":
        return text[:b] + " " + new_sentence + text[b:]
    return text[:a] + text[b:]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", type=Path, default=None, help="JSONL {id, text}")
    parser.add_argument("--docs", type=int, default=100, help="longest pages to edit")
    parser.add_argument("--min-chars", type=int, default=20000, help="shortest page kept")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument(
        "--content", action="append", default=[], help="extra content variant MIN:TARGET tokens"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    pages = [p for p in load_pages(args.corpus) if len(p["text"]) >= args.min_chars]
    pages = sorted(pages, key=lambda p: (-len(p["text"]), p["id"]))[: args.docs]
    if not pages:
        raise SystemExit(f"no page of at least {args.min_chars} characters")
    chunkers = [Chunker("fixed", "fixed"), Chunker("sentence", "sentence")]
    chunkers.append(Chunker("content", "content", ContentParams.for_chunk_size(args.chunk_size)))
    for spec in args.content:
        lo, target = (int(x) for x in spec.split(":"))
        params = ContentParams(args.chunk_size, lo, target).validate()
        chunkers.append(Chunker(f"content-{lo}:{target}", "content", params))
    chunkers.append(Chunker("section", "section"))

    rng = random.Random(args.seed)
    edits: list[tuple[int, str, str]] = []  # (page index, kind, edited text)
    for i, page in enumerate(pages):
        for kind in EDIT_KINDS:
            donor = pages[rng.randrange(len(pages))]["text"]
            edited = make_edit(page["text"], kind, donor, rng)
            if edited is not None and edited != page["text"]:
                edits.append((i, kind, edited))
    print(
        f"{len(pages)} pages ({sum(len(p['text']) for p in pages):,} chars), "
        f"{len(edits)} edits, chunk_size {args.chunk_size}, seed {args.seed}"
    )

    tok = load_tokenizer(None)
    fp = tokenizer_fingerprint(tok)

    def chunk(text: str, c: Chunker) -> list:
        return chunk_document(
            tok,
            "d",
            "dv",
            text,
            tokenizer_fp=fp,
            chunk_size=args.chunk_size,
            method=c.method,
            content=c.content,
            heading_starts=rst_heading_starts(text) if c.method == "section" else (),
            run_id="bench",
        )

    results = []
    header = (
        f"{'chunker':16s} {'inval mean':>10s} {'median':>6s} {'p90':>5s} {'max':>5s} "
        f"{'tok inval':>9s} {'chunks/doc':>10s} {'tok/chunk':>9s} {'s CPU':>6s}"
    )
    print(header)
    for c in chunkers:
        t0 = time.process_time()
        originals = [chunk(p["text"], c) for p in pages]
        invalid: list[float] = []
        invalid_tokens: list[float] = []
        by_kind: dict[str, list[int]] = {k: [] for k in EDIT_KINDS}
        for i, kind, edited in edits:
            before = {r.text for r in originals[i]}
            new = [r for r in chunk(edited, c) if r.text not in before]
            invalid.append(len(new))
            invalid_tokens.append(sum(r.n_tokens for r in new))
            by_kind[kind].append(len(new))
        cpu = time.process_time() - t0
        sizes = [r.n_tokens for rows in originals for r in rows]
        row = {
            "chunker": c.name,
            "content_params": c.content.fingerprint_fields() if c.content else None,
            "invalidated_mean": statistics.mean(invalid),
            "invalidated_median": statistics.median(invalid),
            "invalidated_p90": percentile(invalid, 90),
            "invalidated_max": max(invalid),
            "invalidated_tokens_mean": statistics.mean(invalid_tokens),
            "invalidated_by_kind": {k: statistics.mean(v) for k, v in by_kind.items() if v},
            "chunks_per_doc": len(sizes) / len(pages),
            "mean_chunk_tokens": statistics.mean(sizes),
            "cpu_seconds": cpu,
        }
        results.append(row)
        print(
            f"{c.name:16s} {row['invalidated_mean']:10.2f} {row['invalidated_median']:6.1f} "
            f"{row['invalidated_p90']:5.0f} {row['invalidated_max']:5.0f} "
            f"{row['invalidated_tokens_mean']:9.0f} {row['chunks_per_doc']:10.1f} "
            f"{row['mean_chunk_tokens']:9.0f} {cpu:6.1f}"
        )
    print("mean chunks invalidated per edit kind:")
    for row in results:
        kinds = "  ".join(f"{k} {v:.2f}" for k, v in row["invalidated_by_kind"].items())
        print(f"  {row['chunker']:16s} {kinds}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "pages": len(pages),
                    "edits": len(edits),
                    "chunk_size": args.chunk_size,
                    "seed": args.seed,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
