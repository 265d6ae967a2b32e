"""`coinrag api` under load, on loopback: TTFT and end-to-end latency as a client sees them.

    python tests/benchmarks/bench_api.py [--docs 11] [--requests 20] [--clients 1 2 4]
        [--method coinrag] [--max-new-tokens 16] [--threads 1] [--no-rebuild] [--no-hog]
        [--json PATH]

Builds the first ``--docs`` documents of the bundled sample (``coinrag build --extractor
rules``) into a temporary store, then:

1. starts ``coinrag api`` (a subprocess, one worker) and measures the first 10 streamed
   queries one after another, the tenth asking the first one's question again (``first`` vs
   ``tenth``: warm-up must make them equal);
2. ``in-process``: the warm path of ``coinrag eval`` (a ``RagEngine`` in this process) and the
   server at 1 client, one question each in turn (both under the same machine load): the
   in-process TTFT (the answer's ``timings.ttft``) is the goal's reference (warm served TTFT
   p99 within 1.2x of it);
3. ``--requests`` streamed queries at 1, 2 and 4 concurrent clients: TTFT = request sent to
   the first ``token`` event, e2e = to the ``answer`` event; p50 and p99, failures; and the
   server's own TTFT (``timings.ttft``: without HTTP and queueing);
4. the same at 1 client with a competing CPU job (a busy-looping process; ``--no-hog`` skips);
5. the same at each client count while ``coinrag build`` rebuilds the store (one document
   edited, one added), and the time from the publish (``coinrag.toml``'s mtime) to the first
   answer on the new version (``--no-rebuild`` skips).

Bounded: every phase has a request count; the server and every process started are stopped.
Numbers on a shared machine are noisy: run it on a quiet one for the real figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402
from api_harness import free_port, sse_events  # noqa: E402

COINRAG = str(Path(sys.executable).with_name("coinrag"))
SAMPLE = REPO / "flows" / "sample" / "wiki_sample.jsonl"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank), in ms."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(
    name: str, ttft: list[float], e2e: list[float], failed: int, server: list[float]
) -> dict[str, Any]:
    """p50/p99 of the client's TTFT and e2e, and of the TTFT the server measured (the answer's
    ``timings.ttft``: retrieval + KV load + assembly + prefill, without HTTP or queueing)."""
    return {
        "phase": name,
        "n": len(ttft),
        "failed": failed,
        "ttft_p50_ms": round(pct(ttft, 0.5), 1),
        "ttft_p99_ms": round(pct(ttft, 0.99), 1),
        "e2e_p50_ms": round(pct(e2e, 0.5), 1),
        "e2e_p99_ms": round(pct(e2e, 0.99), 1),
        "server_ttft_p50_ms": round(pct(server, 0.5), 1),
        "server_ttft_p99_ms": round(pct(server, 0.99), 1),
    }


def ask(client: httpx.Client, base: str, body: dict[str, Any]) -> tuple[float, float, str, dict]:
    """(client TTFT ms, e2e ms, run id, answer) of one streamed query; raises on a failure."""
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{base}/query/stream", json=body) as r:
        r.raise_for_status()
        run_id = r.headers.get("x-coinrag-run-id", "")
        for event, data in sse_events(r.iter_lines()):
            if event == "token" and ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
            elif event == "answer":
                e2e = (time.perf_counter() - t0) * 1000
                return (ttft if ttft is not None else e2e), e2e, run_id, data
            elif event == "error":
                raise RuntimeError(data)
    raise RuntimeError("stream ended without an answer")


class Phase:
    """What a phase measured: client TTFTs, e2e, server TTFTs, failures, (end time, run id)."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.server: list[float] = []
        self.failed = 0
        self.runs: list[tuple[float, str]] = []

    def add(self, other: Phase) -> None:
        self.ttft += other.ttft
        self.e2e += other.e2e
        self.server += other.server
        self.failed += other.failed
        self.runs += other.runs

    def row(self, name: str) -> dict[str, Any]:
        return summary(name, self.ttft, self.e2e, self.failed, self.server)


def load(base: str, questions: list[str], args: argparse.Namespace, clients: int, n: int) -> Phase:
    """``n`` queries over ``clients`` threads."""
    phase = Phase()
    lock = threading.Lock()
    counter = iter(range(n))

    def worker() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = {
                    "question": questions[i % len(questions)],
                    "method": args.method,
                    "max_new_tokens": args.max_new_tokens,
                }
                try:
                    t, e, run_id, answer = ask(client, base, body)
                except Exception as exc:  # counted, shown once
                    with lock:
                        phase.failed += 1
                    print(f"  failed: {exc}", file=sys.stderr)
                    continue
                with lock:
                    phase.ttft.append(t)
                    phase.e2e.append(e)
                    phase.server.append(answer["timings"]["ttft"])
                    phase.runs.append((time.time(), run_id))

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return phase


def build(source: Path, store: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [COINRAG, "build", str(source), "--store", str(store), "--extractor", "rules"]
    cmd += ["--threads", "1"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def interleaved(
    base: str, store: Path, questions: list[str], args: argparse.Namespace
) -> tuple[list[float], Phase]:
    """The in-process warm path (a ``RagEngine`` here, as ``coinrag eval`` runs) and the
    server at 1 client, one question each in turn, so both see the same machine load: the
    in-process TTFTs and the served phase."""
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.model.threads import set_process_threads

    set_process_threads(args.threads)
    engine = RagEngine.open(str(store), max_new_tokens=args.max_new_tokens, methods=[args.method])
    engine.answer(questions[0], args.method)  # warm, as eval's first question is not
    local, served = [], Phase()
    for i in range(args.requests):
        question = questions[i % len(questions)]
        local.append(engine.answer(question, args.method).timings["ttft"])
        served.add(load(base, [question], args, 1, 1))
    engine.close()
    return local, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=11)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", default="coinrag")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-rebuild", action="store_true")
    parser.add_argument("--no-hog", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    docs = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines() if x.strip()]
    docs = docs[: args.docs]
    source, store = tmp / "docs.jsonl", tmp / "store"
    source.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    questions = [f"What is {d.get('title', d['id'])}?" for d in docs]
    questions.insert(0, "Who directed 2001: A Space Odyssey?")

    t = time.perf_counter()
    first = build(source, store, env)
    if first.wait() != 0:
        raise SystemExit(f"build failed: {first.stderr.read().decode()[-2000:]}")
    print(f"built {len(docs)} documents in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    port = free_port()
    cmd = [COINRAG, "api", "--store", str(store), "--port", str(port), "--methods", args.method]
    cmd += ["--threads", str(args.threads), "--queue-limit", "64"]
    cmd += ["--client-queue-limit", "64", "--client-rate", "0"]  # every client is 127.0.0.1
    cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    t = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    hog = None
    extra: dict[str, Any] = {}
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("coinrag api exited")
            time.sleep(0.2)
        extra["start_to_ready_s"] = round(time.perf_counter() - t, 1)
        # the tenth query repeats the first one's question: the same retrieval and context,
        # so any gap between them is the server's warm-up, not the question
        first = load(base, questions[:9] + questions[:1], args, 1, 10)
        extra["first_query_ttft_ms"] = round(first.ttft[0], 1)
        extra["tenth_query_ttft_ms"] = round(first.ttft[-1], 1)
        extra["first_query_server_ttft_ms"] = round(first.server[0], 1)
        extra["tenth_query_server_ttft_ms"] = round(first.server[-1], 1)
        local, served = interleaved(base, store, questions, args)
        rows.append(summary("in-process (eval's warm path)", local, local, 0, local))
        rows.append(served.row("served, 1 client, interleaved with in-process"))
        for clients in args.clients:
            rows.append(
                load(base, questions, args, clients, args.requests).row(f"{clients} client(s)")
            )
        if not args.no_hog:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            rows.append(
                load(base, questions, args, 1, args.requests).row("1 client + busy CPU job")
            )
            hog.kill()
            hog.wait()
            hog = None
        if not args.no_rebuild:
            settings = store / "coinrag.toml"
            for i, clients in enumerate(args.clients):
                docs[0] = {**docs[0], "text": docs[0]["text"] + f" Edited for round {i}."}
                added = {"id": f"bench-added-{i}", "text": f"Bench document {i} was added."}
                source.write_text(
                    "".join(json.dumps(d) + "\n" for d in [*docs, added]), encoding="utf-8"
                )
                before = json.loads(httpx.get(f"{base}/health").text)["run_id"]
                rebuild = build(source, store, env)
                phase = Phase()
                deadline = None
                while True:  # query until the build is done and the new version answered
                    step = load(base, questions, args, clients, clients * 2)
                    phase.add(step)
                    done = rebuild.poll() is not None
                    if done and any(run != before for _, run in step.runs):
                        break
                    if done and rebuild.returncode != 0:
                        raise SystemExit(f"rebuild failed: {rebuild.stderr.read().decode()}")
                    deadline = deadline or (time.monotonic() + 600 if done else None)
                    if deadline and time.monotonic() > deadline:
                        raise SystemExit("the server never answered on the rebuilt version")
                published = settings.stat().st_mtime
                first_new = min(t for t, run in phase.runs if run != before)
                rows.append(phase.row(f"{clients} client(s), rebuild running"))
                rows[-1]["publish_to_first_answer_ms"] = round((first_new - published) * 1000, 1)
    finally:
        if hog is not None:
            hog.kill()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for key, value in extra.items():
        print(f"{key}: {value}")
    ratio = rows[1]["ttft_p99_ms"] / rows[0]["ttft_p99_ms"]
    print(f"served TTFT p99 (client-side, interleaved) / in-process p99: {ratio:.2f} (goal <= 1.2)")
    ratio = rows[1]["server_ttft_p99_ms"] / rows[0]["ttft_p99_ms"]
    print(f"served TTFT p99 (server-side) / in-process p99: {ratio:.2f}")
    print(f"median of in-process TTFT: {statistics.median(local):.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **extra}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
