"""Real question/answer pairs from Debian's ``python3.11-doc`` FAQ pages, and its docs as a corpus.

In the reST sources (``/usr/share/doc/python3.11/html/_sources``) each FAQ question is a section
title (underlined with ``=``, ``-``, ``~`` ...) containing ``?`` (all but one end with it;
overlined page titles are excluded) and its answer is the section body, up to the next title.

Outputs (JSONL, UTF-8):

- ``questions.jsonl``: ``{"question", "answers": [short answer], "doc_ids": ["faq/<page>"],
  "answer_body": full cleaned body}``. **The gold short answer is a choice made here**: the first
  sentence of the answer body's first prose paragraph (directives, labels, literal blocks and
  indented quotes skipped), cleaned of reST markup and cut to its first 30 words. The FAQ answers
  are long explanations, not short spans, so token F1 against this "gold" is only a rough measure
  of answer quality; recall of the right FAQ page (``doc_ids``) is the sharper measure.
- ``corpus.jsonl``: every ``_sources/**/*.rst.txt`` as ``{"id": <relative path without
  .rst.txt>, "text": <file text>}``; the FAQ pages stay in (finding them is the task).
- ``rst/``: the same pages as a folder of ``.rst`` files (``rst/faq/programming.rst``), a SOURCE
  for ``coinrag build`` whose reST reader parses the section titles; its ids are the corpus's.
- with ``--subset N``: ``corpus_subset.jsonl``, all ``faq/*`` pages plus ``N`` other pages
  drawn with a fixed seed (a corpus small enough to build on a CPU).

Usage: ``python infra/python_faq.py OUT_DIR [--sources DIR] [--subset 30] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
ADORNMENT = set("=-~^\"'`*+#:.<>_")
MAX_ANSWER_WORDS = 30


def _is_underline(line: str, title: str) -> bool:
    s = line.rstrip()
    return bool(s) and len(set(s)) == 1 and s[0] in ADORNMENT and len(s) >= len(title.rstrip())


def sections(text: str) -> list[tuple[str, list[str], bool]]:
    """``(title, body lines, overlined)`` for every section title of a reST page, in order
    (an overlined title is the page title)."""
    lines = text.splitlines()
    titles: list[int] = []
    for i in range(len(lines) - 1):
        title = lines[i]
        if (
            title.strip()
            and not title[0].isspace()
            and not _is_underline(title, title)
            and _is_underline(lines[i + 1], title)
        ):
            titles.append(i)
    out = []
    for n, i in enumerate(titles):
        end = titles[n + 1] if n + 1 < len(titles) else len(lines)
        if n + 1 < len(titles) and _is_underline(lines[end - 1], lines[end]):
            end -= 1  # the next title has an overline
        overlined = i > 0 and _is_underline(lines[i - 1], lines[i])
        out.append((lines[i].strip(), lines[i + 2 : end], overlined))
    return out


_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
_REF = re.compile(r"`([^`]+)`__?")
_LITERAL = re.compile(r"``(.+?)``")
_EMPH = re.compile(r"\*\*(.+?)\*\*|\*(.+?)\*")
_SUBST = re.compile(r"\|([^|\s][^|]*)\|")


def _role_text(match: re.Match[str]) -> str:
    inner = match.group(1).strip()
    explicit = re.match(r"(.*?)\s*<[^>]*>$", inner, re.S)
    if explicit and explicit.group(1):
        return explicit.group(1)
    if inner.startswith("~"):
        return inner[1:].rsplit(".", 1)[-1]
    return inner.lstrip("!")


def clean_rst(text: str) -> str:
    """Inline reST markup to plain text (roles, links, literals, emphasis), single spaces."""
    text = _ROLE.sub(_role_text, text)
    text = _LINK.sub(lambda m: m.group(1), text)
    text = _LITERAL.sub(lambda m: m.group(1), text)
    text = _REF.sub(lambda m: m.group(1), text)
    text = _EMPH.sub(lambda m: m.group(1) or m.group(2), text)
    text = _SUBST.sub(lambda m: m.group(1), text)
    text = re.sub(r"::(\s|$)", r":\1", text)
    text = text.replace("\\ ", "").replace("\\", "")
    return " ".join(text.split())


def paragraphs(body: list[str]) -> list[str]:
    """The body's top-level prose paragraphs (directives, their content, indented and literal
    blocks skipped); list items count as paragraphs."""
    out: list[str] = []
    current: list[str] = []
    skipping = False
    for line in body + [""]:
        if not line.strip():
            if current:
                out.append(" ".join(current))
                current = []
            continue
        if line[0].isspace():
            if current and not skipping:  # continuation of an indented list item, etc.
                current.append(line.strip())
            continue
        skipping = False
        if line.startswith(".."):
            skipping = True
            if current:
                out.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    return [p for p in (clean_rst(p) for p in out) if p]


_ABBREV = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Dr|approx)\.$", re.I)


def first_sentence(paragraph: str, max_words: int = MAX_ANSWER_WORDS) -> str:
    """The first sentence (abbreviations such as e.g. do not end it), at most ``max_words``."""
    words = paragraph.split()
    sentence: list[str] = []
    for w in words:
        sentence.append(w)
        if re.search(r"[.!?][)\"']?$", w) and not _ABBREV.search(w):
            break
        if len(sentence) >= max_words:
            break
    return " ".join(sentence)


def extract_pairs(sources: Path = SOURCES) -> list[dict]:
    """All question/answer pairs of ``sources/faq/*.rst.txt``, page by page, in page order."""
    pairs = []
    for path in sorted((sources / "faq").glob("*.rst.txt")):
        doc_id = path.relative_to(sources).as_posix().removesuffix(".rst.txt")
        for title, body, overlined in sections(path.read_text(encoding="utf-8")):
            # "How do I delete a file? (And other file questions...)" is a question too;
            # the overlined page title "Why is Python Installed on my Computer? FAQ" is not.
            if "?" not in title or overlined:
                continue
            paras = paragraphs(body)
            if not paras:
                continue
            pairs.append(
                {
                    "question": clean_rst(title),
                    "answers": [first_sentence(paras[0])],
                    "doc_ids": [doc_id],
                    "answer_body": "\n\n".join(paras),
                }
            )
    return pairs


def corpus(sources: Path = SOURCES) -> list[dict]:
    """Every ``*.rst.txt`` under ``sources``: id = relative path without ``.rst.txt``."""
    return [
        {
            "id": p.relative_to(sources).as_posix().removesuffix(".rst.txt"),
            "text": p.read_text(encoding="utf-8"),
        }
        for p in sorted(sources.rglob("*.rst.txt"))
    ]


def subset(docs: list[dict], n_other: int, seed: int = 0) -> list[dict]:
    """All ``faq/*`` pages plus ``n_other`` other pages drawn with ``seed``."""
    faq = [d for d in docs if d["id"].startswith("faq/")]
    other = [d for d in docs if not d["id"].startswith("faq/")]
    picked = random.Random(seed).sample(other, min(n_other, len(other)))
    return faq + sorted(picked, key=lambda d: d["id"])


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sources", type=Path, default=SOURCES)
    parser.add_argument("--subset", type=int, default=None, help="other pages beside faq/*")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.sources / "faq").is_dir():
        parser.error(f"{args.sources}/faq not found: install Debian's python3.11-doc")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    pairs = extract_pairs(args.sources)
    docs = corpus(args.sources)
    _write(args.out_dir / "questions.jsonl", pairs)
    _write(args.out_dir / "corpus.jsonl", docs)
    print(f"{len(pairs)} question/answer pairs -> {args.out_dir / 'questions.jsonl'}")
    print(f"{len(docs)} pages -> {args.out_dir / 'corpus.jsonl'}")
    for doc in docs:
        path = args.out_dir / "rst" / f"{doc['id']}.rst"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc["text"], encoding="utf-8")
    print(f"{len(docs)} pages -> {args.out_dir / 'rst'}")
    if args.subset is not None:
        sub = subset(docs, args.subset, args.seed)
        _write(args.out_dir / "corpus_subset.jsonl", sub)
        print(f"{len(sub)} pages -> {args.out_dir / 'corpus_subset.jsonl'}")


if __name__ == "__main__":
    main()
