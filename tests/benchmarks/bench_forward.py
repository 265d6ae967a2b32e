"""The model forward, eager vs compiled, side by side in one run on one thread (issue 23).

    python tests/benchmarks/bench_forward.py [--docs 11] [--questions 8] [--store PATH]
        [--questions-file JSONL]
        [--methods coinrag turborag standard] [--forwards plain eager compiled] [--kc 4] [--k 10]
        [--max-new-tokens 32] [--threads 1] [--json PATH]

Builds the first ``--docs`` documents of the bundled sample (``coinrag build --extractor rules
--kv-dtype bfloat16 --kv-codec int4``: the served default's bf16 model and int4 KV) into a
temporary store (or reads ``--store``; ``--questions-file``: its questions, else questions
about the sample), opens one engine (one model), then:

1. per forward kind, the warm-up: one untimed answer per method (``coinrag eval``'s warm-up;
   compiled: the graphs of its shapes compile here) and its wall time. The kinds:
   ``plain`` = what every method ran before (the transformers model call on a
   ``DynamicCache``, logits of every query position), ``eager`` = ``inference/model/forward.py``'s
   static KV buffer, uncompiled, ``compiled`` = the same step under torch.compile;
2. ``--questions`` questions, each answered by every method with every kind in turn
   (interleaved, so all see the same machine load): per method and kind TTFT mean and
   P99 with its parts (retrieval, kv_load, assembly, prefill), decode ms per token, answer
   tokens per second end to end (all answer tokens / the answers' wall time), and how many
   answers equal the eager forward's; decode as a multiple of ``plain``'s (the goal:
   <= 0.25x plain eager transformers);
3. plain transformers decoding 32 tokens alone after about 200 and 2,000 context tokens;
4. peak RSS after each phase, and the load average at start and end.

Numbers on a shared machine are noisy: the ratios in one run are what count (the load average
is printed beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

COINRAG = str(Path(sys.executable).with_name("coinrag"))
SAMPLE = REPO / "flows" / "sample" / "wiki_sample.jsonl"
PARTS = ("retrieval", "kv_load", "assembly", "prefill")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build_store(docs: int, tmp: Path) -> Path:
    rows = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines() if x.strip()]
    source, store = tmp / "docs.jsonl", tmp / "store"
    source.write_text("".join(json.dumps(d) + "\n" for d in rows[:docs]), encoding="utf-8")
    cmd = [COINRAG, "build", str(source), "--store", str(store), "--extractor", "rules"]
    cmd += ["--threads", "1", "--kv-dtype", "bfloat16", "--kv-codec", "int4"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"built {docs} documents in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return store


def plain_transformers_ms_per_token(model: Any, context: int, steps: int = 32) -> float:
    """Decode ms/token of the model's own call on a DynamicCache after ``context`` tokens."""
    import torch

    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        t = time.perf_counter()
        for i in range(steps):
            out = model(
                input_ids=torch.tensor([[nxt]]),
                position_ids=torch.tensor([[context + i]]),
                past_key_values=cache,
                use_cache=True,
            )
            cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    return (time.perf_counter() - t) * 1000 / steps


def plain_forward(model: Any) -> Any:
    """What every method ran before: the transformers model call on a ``DynamicCache``,
    logits of every query position (a forward kind of its own, ``plain``)."""
    import torch

    from coinrag.inference.model.forward import ForwardRun, TransformersForward

    class PlainRun(ForwardRun):
        def __init__(self, cache: Any, position: int) -> None:
            self.cache, self.position = cache, position

        def prefill(self, input_ids: Any) -> Any:
            n = len(input_ids)
            out = model(
                input_ids=torch.tensor([list(input_ids)]),
                position_ids=torch.arange(self.position, self.position + n)[None],
                past_key_values=self.cache,
                use_cache=True,
            )
            self.cache, self.position = out.past_key_values, self.position + n
            return out.logits[0, -1].float()

    class Plain(TransformersForward):
        kind = "plain"

        def begin(self, context: Any, context_len: int, query_len: int, new: int) -> Any:
            run = super().begin(context, context_len, query_len, new)
            return PlainRun(run.cache, context_len)

    return Plain(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=11)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--store", type=Path)
    parser.add_argument("--questions-file", type=Path, help="JSONL with a 'question' field")
    parser.add_argument("--methods", nargs="+", default=["coinrag", "turborag", "standard"])
    parser.add_argument("--forwards", nargs="+", default=["plain", "eager", "compiled"])
    parser.add_argument("--kc", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    start_load = load()

    from coinrag.inference.model.threads import set_process_threads

    threads = set_process_threads(args.threads)
    store = args.store or build_store(args.docs, Path(tempfile.mkdtemp(prefix="bench-fwd-")))

    from coinrag.inference.methods import RagEngine
    from coinrag.inference.model.forward import install_forward, use_forward

    if args.questions_file:
        lines = args.questions_file.read_text(encoding="utf-8").splitlines()
        questions = [json.loads(x)["question"] for x in lines if x.strip()]
    else:
        rows = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines() if x]
        questions = ["Who directed 2001: A Space Odyssey?"]
        questions += [f"What is {d.get('title', d['id'])}?" for d in rows[: args.docs]]
    questions = (questions * (1 + args.questions // len(questions)))[: args.questions]

    t = time.perf_counter()
    engine = RagEngine.open(str(store), max_new_tokens=args.max_new_tokens, methods=args.methods)
    model = engine.model
    print(f"engine opened in {time.perf_counter() - t:.1f} s; rss {peak_rss_mb():.0f} MB")

    warm: dict[str, float] = {}
    rss: dict[str, float] = {"opened": peak_rss_mb()}
    plain = plain_forward(model)

    def use(kind: str) -> Any:
        return install_forward(model, plain) if kind == "plain" else use_forward(model, kind)

    for kind in args.forwards:
        forward = use(kind)
        t = time.perf_counter()
        for method in args.methods:
            engine.answer(questions[0], method, kc=args.kc, k=args.k)
        warm[kind] = time.perf_counter() - t
        rss[f"after {kind} warm-up"] = peak_rss_mb()
        print(f"{kind} ({type(forward).__name__}) warm-up {warm[kind]:.1f} s", flush=True)

    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for qi, question in enumerate(questions):
        for method in args.methods:
            rag = engine.method(method)
            retrieval = rag.retrieve(question, args.kc, args.k)
            for kind in args.forwards:
                use(kind)
                t = time.perf_counter()
                ans = rag.run(question, retrieval, args.kc, args.k)
                e2e = (time.perf_counter() - t) * 1000 + ans.timings["retrieval"]
                results.setdefault((method, kind), []).append(
                    {**ans.timings, "e2e": e2e, "tokens": len(ans.token_ids), "ids": ans.token_ids}
                )
        print(f"question {qi + 1}/{len(questions)} (load {load()})", file=sys.stderr, flush=True)
    rss["after the questions"] = peak_rss_mb()

    use_forward(model, "eager")
    plain_ms = {n: plain_transformers_ms_per_token(model, n) for n in (200, 2000)}

    table = []
    for (method, kind), got in results.items():
        ttft = [r["ttft"] for r in got]
        # decode steps: one per token after the first, and one more that gave an EOS
        steps = sum(r["tokens"] - (r["tokens"] == args.max_new_tokens) for r in got)
        eager = results.get((method, "eager"))
        same = (
            None
            if eager is None
            else sum(a["ids"] == b["ids"] for a, b in zip(got, eager, strict=True))
        )
        row = {
            "method": method,
            "forward": kind,
            "n": len(got),
            "ttft_mean": statistics.mean(ttft),
            "ttft_p99": pct(ttft, 0.99),
            **{f"{p}_mean": statistics.mean(r[p] for r in got) for p in PARTS},
            "prefill_p99": pct([r["prefill"] for r in got], 0.99),
            "decode_ms_per_token": sum(r["decode"] for r in got) / max(1, steps),
            "tokens_per_s_e2e": sum(r["tokens"] for r in got) / sum(r["e2e"] for r in got) * 1000,
            "warm_up_s": warm[kind],
            "answers_equal_eager": f"{same}/{len(got)}" if same is not None else "-",
        }
        table.append(row)

    print(f"\nthreads {threads}; load average at start {start_load}, at end {load()}")
    print("(a shared machine: compare the columns of one run, not runs)\n")
    head = "method    forward   n  TTFT mean   P99 | retr  kvload  assem  prefill (P99)"
    head += " | decode ms/tok  tok/s e2e  warm-up s  equal"
    print(head)
    for r in table:
        print(
            f"{r['method']:<9} {r['forward']:<8} {r['n']:>2} {r['ttft_mean']:>9.1f} "
            f"{r['ttft_p99']:>5.0f} | {r['retrieval_mean']:>4.1f} {r['kv_load_mean']:>7.1f} "
            f"{r['assembly_mean']:>6.1f} {r['prefill_mean']:>8.1f} ({r['prefill_p99']:.0f})"
            f" | {r['decode_ms_per_token']:>13.1f} {r['tokens_per_s_e2e']:>10.1f} "
            f"{r['warm_up_s']:>10.1f}  {r['answers_equal_eager']}"
        )
    print(
        "\nplain transformers decode alone (model call + DynamicCache, after the questions): "
        + ", ".join(f"{ms:.1f} ms/token at {n} context tokens" for n, ms in plain_ms.items())
    )
    ref = {r["method"]: r["decode_ms_per_token"] for r in table if r["forward"] == "plain"}
    for r in table:
        if r["method"] in ref and r["forward"] != "plain":
            print(
                f"  {r['method']} {r['forward']}: decode "
                f"{r['decode_ms_per_token'] / ref[r['method']]:.2f}x plain transformers "
                "(interleaved, same questions; goal <= 0.25x)"
            )
    print("peak RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    if args.json:
        out = {"rows": table, "plain_ms_per_token": plain_ms, "rss_mb": rss, "load": load()}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
