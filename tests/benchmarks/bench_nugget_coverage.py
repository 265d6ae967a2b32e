"""What the nuggets keep: token coverage, and whether a question's answer lies in the retrieved
nuggets, per extractor (``local``: SmolLM2 under the span-copy constraint; ``rules``).

Two corpora, each built by the real pipeline (``flows.build.build_flow``, no KV: extraction,
recovery, MiniLM index) once per extractor:

- the bundled sample (11 Wikipedia summaries) with the README's showcase question;
- Debian's ``python3.11-doc`` FAQ pages (``apt-get install -y python3.11-doc``) and their
  real question/answer pairs (``infra/python_faq.py``: the gold answer is the first sentence
  of the answer body, cleaned of reST markup).

Per extractor and corpus it reports nuggets per chunk, words per nugget, **token coverage**
(chunk tokens inside at least one nugget, over all chunk tokens; the paper's GPT-4o-mini nuggets
cover about 70%), and on the FAQ questions, with CoinRAG's two-stage retrieval (``--kc`` chunks,
then ``--k`` nuggets inside them): **answer-in-nuggets**, the share of the gold answer's content
words (lower-cased ``[a-z0-9_]+`` of 3+ characters, stopwords out) found in the retrieved
nuggets' words: its mean over questions, and the share of questions where it reaches 50% and
100%. For comparison: the same for the retrieved chunks' whole text (what TurboRAG loads, the
ceiling for any extractor), and ``in page nuggets``, the same for every nugget of the gold page
(what extraction kept of the answer, retrieval aside).

Run alone (minutes: the local extractor decodes every chunk with SmolLM2)::

    python tests/benchmarks/bench_nugget_coverage.py                   # every FAQ page
    python tests/benchmarks/bench_nugget_coverage.py --pages faq/gui faq/installed \\
        faq/windows faq/extending --threads 1                          # a small run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_TMP = tempfile.mkdtemp(prefix="bench-nugget-coverage-")
os.environ.setdefault("PREFECT_HOME", str(Path(_TMP) / "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

_WORDS = re.compile(r"[a-z0-9_]+")
_STOP = frozenset(
    "the and for are was were that this with from have has had not but can you your its his her "
    "their they them what which who whom when where why how does did all any one use used using "
    "into than then there these those also may might will would should could been being such "
    "more most other some only very just about over under out get gets".split()
)


def content_words(text: str) -> set[str]:
    """Lower-cased words of 3+ characters, stopwords out (markup such as ``x`` falls away)."""
    return {w for w in _WORDS.findall(text.lower()) if len(w) >= 3 and w not in _STOP}


def recall(answer: str, text_words: set[str]) -> float | None:
    words = content_words(answer)
    return len(words & text_words) / len(words) if words else None


def faq_data(out: Path, pages: list[str] | None) -> tuple[Path, list[dict]]:
    """The FAQ corpus (only ``pages`` if given) as JSONL, and its questions."""
    if not (out / "questions.jsonl").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "infra" / "python_faq.py"), str(out)], check=True
        )
    docs = [json.loads(x) for x in (out / "corpus.jsonl").read_text().splitlines()]
    docs = [d for d in docs if d["id"].startswith("faq/") and (not pages or d["id"] in pages)]
    ids = {d["id"] for d in docs}
    questions = [json.loads(x) for x in (out / "questions.jsonl").read_text().splitlines()]
    questions = [q for q in questions if q["doc_ids"][0] in ids]
    src = out / ("corpus-" + "-".join(sorted(p.split("/")[-1] for p in ids)) + ".jsonl")
    src.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return src, questions


def build(source: str, store: Path, extractor: str) -> float:
    from coinrag.flows.build import build_flow

    t0 = time.perf_counter()
    build_flow(source, str(store), {"extractor": extractor, "kv": False})
    return time.perf_counter() - t0


def coverage(store: Path) -> dict[str, float]:
    from coinrag.schemas.tables import ChunkRow, NuggetRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    st = Store.at(store)
    chunks = {c.chunk_id: c for c in read_rows(st, ChunkRow)}
    nuggets = read_rows(st, NuggetRow)
    covered: dict[str, set[int]] = {cid: set() for cid in chunks}
    for n in nuggets:
        covered[n.chunk_id].update(range(n.tok_start, n.tok_end))
    tokens = sum(c.n_tokens for c in chunks.values())
    return {
        "chunks": len(chunks),
        "nuggets/chunk": len(nuggets) / max(len(chunks), 1),
        "words/nugget": statistics.mean(len(n.text.split()) for n in nuggets) if nuggets else 0,
        "token coverage": sum(len(v) for v in covered.values()) / max(tokens, 1),
    }


def answers(store: Path, questions: list[dict], kc: int, k: int) -> dict[str, float]:
    """Answer-word recall in the retrieved nuggets, the retrieved chunks, the gold page's
    nuggets (see the module docstring)."""
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.schemas.tables import NuggetRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    st = Store.at(store)
    retriever = Retriever(st, load_embedder("minilm"))
    page_words: dict[str, set[str]] = {}
    for n in read_rows(st, NuggetRow):
        page_words.setdefault(n.doc_id, set()).update(content_words(n.text))
    got: dict[str, list[float]] = {"nuggets": [], "chunks": [], "page": []}
    for q in questions:
        gold = q["answers"][0]
        two = retriever.two_stage(q["question"], kc=kc, k=k)
        r_nug = recall(gold, set().union(*(content_words(e.text) for e in two.evidence)))
        if r_nug is None:
            continue
        got["nuggets"].append(r_nug)
        got["chunks"].append(
            recall(gold, set().union(*(content_words(h.text) for h in two.chunks)))
        )
        got["page"].append(recall(gold, page_words.get(q["doc_ids"][0], set())))
    out: dict[str, float] = {"questions": len(got["nuggets"])}
    for name, values in got.items():
        out[f"{name}: mean"] = statistics.mean(values) if values else 0.0
        out[f"{name}: >=50%"] = sum(v >= 0.5 for v in values) / max(len(values), 1)
        out[f"{name}: all"] = sum(v >= 1.0 for v in values) / max(len(values), 1)
    return out


def showcase(store: Path, kc: int, k: int) -> str:
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.storage.store import Store

    two = Retriever(Store.at(store), load_embedder("minilm")).two_stage(
        "Who directed 2001: A Space Odyssey?", kc=kc, k=k
    )
    return "yes" if any("Kubrick" in e.text for e in two.evidence) else "no"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extractors", nargs="+", default=["local", "rules"])
    ap.add_argument("--pages", nargs="*", default=None, help="FAQ pages (default: all faq/*)")
    ap.add_argument("--faq-dir", type=Path, default=Path(_TMP) / "faq")
    ap.add_argument("--kc", type=int, default=4)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--no-sample", action="store_true", help="skip the bundled sample")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.faq_dir.mkdir(parents=True, exist_ok=True)
    faq_src, questions = faq_data(args.faq_dir, args.pages)
    print(
        f"FAQ: {len(questions)} questions on {faq_src.name}; kc={args.kc} k={args.k}; torch "
        f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    sample = str(ROOT / "flows" / "sample" / "wiki_sample.jsonl")
    corpora = [] if args.no_sample else [("sample", sample)]
    corpora.append(("faq", str(faq_src)))
    rows = []
    for corpus, source in corpora:
        for extractor in args.extractors:
            store = Path(_TMP) / f"{corpus}-{extractor}"
            seconds = build(source, store, extractor)
            row = {"corpus": corpus, "extractor": extractor, "build s": seconds}
            row.update(coverage(store))
            if corpus == "sample":
                row["showcase answer in nuggets"] = showcase(store, args.kc, args.k)
            else:
                row.update(answers(store, questions, args.kc, args.k))
            rows.append(row)
            print(json.dumps(row, default=lambda v: round(v, 3)))
    print()
    for row in rows:
        print(f"{row['corpus']} / {row['extractor']}:")
        for key, value in row.items():
            if key not in ("corpus", "extractor"):
                shown = f"{value:.3f}" if isinstance(value, float) else value
                print(f"  {key:28} {shown}")


if __name__ == "__main__":
    main()
