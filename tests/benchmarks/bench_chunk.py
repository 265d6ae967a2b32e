"""Chunking throughput (tokens/s) on the Python docs with the SmolLM2 tokenizer.

Run alone: ``python tests/benchmarks/bench_chunk.py [--files N]``. Needs Debian's python3.11-doc
(``/usr/share/doc/python3.11/html/_sources``). Reports tokens/s for each chunker (tokenization
included; ``section`` gets the pages' reST section titles as heading offsets, found outside the
timing), and chunks per document.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from coinrag.inference.model.loading import load_tokenizer, tokenizer_fingerprint
from coinrag.tasks.chunk import chunk_document

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (store_fixtures)
from store_fixtures import rst_heading_starts  # noqa: E402

DOCS = Path("/usr/share/doc/python3.11/html/_sources")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=120)
    args = parser.parse_args()
    files = sorted(DOCS.rglob("*.rst.txt"))[: args.files]
    texts = [f.read_text(encoding="utf-8") for f in files]
    headings = [rst_heading_starts(text) for text in texts]
    tok = load_tokenizer(None)
    fp = tokenizer_fingerprint(tok)
    print(f"{len(texts)} files, {sum(map(len, texts)):,} chars")
    for method in ("fixed", "sentence", "content", "section"):
        t0 = time.process_time()
        tokens = chunks = 0
        for i, text in enumerate(texts):
            rows = chunk_document(
                tok,
                str(i),
                f"dv{i}",
                text,
                tokenizer_fp=fp,
                method=method,
                heading_starts=headings[i],
                run_id="bench",
            )
            tokens += sum(r.n_tokens for r in rows)
            chunks += len(rows)
        cpu = time.process_time() - t0
        print(
            f"{method:9s}: {tokens:,} tokens, {chunks} chunks, {tokens / cpu:,.0f} tokens/s CPU "
            f"({cpu:.1f} s CPU)"
        )


if __name__ == "__main__":
    main()
