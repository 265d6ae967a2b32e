"""Generate ``storage/ascii_folding.json``: tantivy's ASCII folding table, which LanceDB's
full-text index applies to every non-ASCII token (lance-tokenizer 13.0.0 vendors it from tantivy
0.24.2), for the reader's in-memory BM25 copy (``storage/index_bm25.py``).

Usage: ``python infra/gen_ascii_folding.py ascii_folding_filter.rs`` with the file taken from
tantivy's repository at tag 0.24.2 (``git show 0.24.2:src/tokenizer/ascii_folding_filter.rs``).
It reads ``fold_non_ascii_char``: runs of ``'\\u{XXXX}' |`` match arms closed by
``=> Some("...")``; every character of a run folds to that string.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "storage" / "ascii_folding.json"
_ARM = re.compile(r"'\\u\{([0-9A-Fa-f]+)\}'")
_RESULT = re.compile(r'=>\s*Some\("((?:[^"\\]|\\.)*)"\)')
_ESCAPES = {'\\"': '"', "\\\\": "\\", "\\'": "'"}


def _unescape(literal: str) -> str:
    return re.sub(r"\\.", lambda m: _ESCAPES[m.group(0)], literal)


def parse(source: str) -> dict[str, str]:
    """Character -> its folded string, from the match in ``fold_non_ascii_char``."""
    body = source[source.index("fn fold_non_ascii_char") : source.index("fn to_ascii")]
    table: dict[str, str] = {}
    pending: list[str] = []
    for line in body.splitlines():
        code = line.split("//", 1)[0] if "=>" not in line else line
        pending += [chr(int(h, 16)) for h in _ARM.findall(code)]
        result = _RESULT.search(line)
        if result:
            folded = _unescape(result.group(1))
            for char in pending:
                if char in table:
                    raise ValueError(f"{char!r} folds twice in the source")
                table[char] = folded
            pending = []
    if pending:
        raise ValueError(f"match arms without a result: {pending!r}")
    return table


def main(path: str) -> None:
    source = Path(path).read_text(encoding="utf-8")
    table = parse(source)
    data = {
        "source": "quickwit-oss/tantivy tag 0.24.2, src/tokenizer/ascii_folding_filter.rs",
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "fold": dict(sorted(table.items())),
    }
    OUT.write_text(json.dumps(data, ensure_ascii=True, indent=0) + "\n", encoding="utf-8")
    print(f"{len(table)} characters -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
