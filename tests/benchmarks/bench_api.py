"""`coinrag api` under load, on loopback: TTFT and end-to-end latency as a client sees them.

    python tests/benchmarks/bench_api.py [--docs 11] [--requests 20] [--clients 1 2 4]
        [--method coinrag] [--max-new-tokens 16] [--threads 1] [--no-rebuild] [--no-hog]
        [--json PATH]

Builds the first ``--docs`` documents of the bundled sample (``coinrag build --extractor
rules``) into a temporary store, then:

1. ``in-process``: the warm path of ``coinrag eval`` (a ``RagEngine`` in this process), the
   same questions: its TTFT (the answer's ``timings.ttft``) is the goal's reference (warm
   served TTFT p99 within 1.2x of it);
2. starts ``coinrag api`` (a subprocess, one worker) and measures the first 10 streamed
   queries one after another (``first`` vs ``tenth``: warm-up must make them equal);
3. ``--requests`` streamed queries at 1, 2 and 4 concurrent clients: TTFT = request sent to
   the first ``token`` event, e2e = to the ``answer`` event; p50 and p99, failures;
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


def summary(name: str, ttft: list[float], e2e: list[float], failed: int) -> dict[str, Any]:
    return {
        "phase": name,
        "n": len(ttft),
        "failed": failed,
        "ttft_p50_ms": round(pct(ttft, 0.5), 1),
        "ttft_p99_ms": round(pct(ttft, 0.99), 1),
        "e2e_p50_ms": round(pct(e2e, 0.5), 1),
        "e2e_p99_ms": round(pct(e2e, 0.99), 1),
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


def load(
    base: str, questions: list[str], args: argparse.Namespace, clients: int, n: int
) -> tuple[list[float], list[float], int, list[tuple[float, str]]]:
    """``n`` queries over ``clients`` threads: TTFTs, e2e, failures, (end time, run id)."""
    ttft: list[float] = []
    e2e: list[float] = []
    runs: list[tuple[float, str]] = []
    failed = [0]
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
                    t, e, run_id, _ = ask(client, base, body)
                except Exception as exc:  # counted, shown once
                    with lock:
                        failed[0] += 1
                    print(f"  failed: {exc}", file=sys.stderr)
                    continue
                with lock:
                    ttft.append(t)
                    e2e.append(e)
                    runs.append((time.time(), run_id))

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttft, e2e, failed[0], runs


def build(source: Path, store: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [COINRAG, "build", str(source), "--store", str(store), "--extractor", "rules"]
    cmd += ["--threads", "1"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def in_process(store: Path, questions: list[str], args: argparse.Namespace) -> list[float]:
    from inference.methods import RagEngine
    from inference.threads import set_process_threads

    set_process_threads(args.threads)
    engine = RagEngine.open(str(store), max_new_tokens=args.max_new_tokens, methods=[args.method])
    engine.answer(questions[0], args.method)  # warm, as eval's first question is not
    out = []
    for i in range(args.requests):
        out.append(engine.answer(questions[i % len(questions)], args.method).timings["ttft"])
    engine.close()
    return out


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
    base_ttft = in_process(store, questions, args)
    rows.append(summary("in-process (eval's warm path)", base_ttft, base_ttft, 0))

    port = free_port()
    cmd = [COINRAG, "api", "--store", str(store), "--port", str(port), "--methods", args.method]
    cmd += ["--threads", str(args.threads), "--queue-limit", "64"]
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
        ttft, e2e, failed, _ = load(base, questions, args, 1, 10)
        extra["first_query_ttft_ms"] = round(ttft[0], 1)
        extra["tenth_query_ttft_ms"] = round(ttft[-1], 1)
        for clients in args.clients:
            ttft, e2e, failed, _ = load(base, questions, args, clients, args.requests)
            rows.append(summary(f"{clients} client(s)", ttft, e2e, failed))
        if not args.no_hog:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            ttft, e2e, failed, _ = load(base, questions, args, 1, args.requests)
            rows.append(summary("1 client + a busy CPU job", ttft, e2e, failed))
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
                ttft, e2e, failed, runs = [], [], 0, []
                deadline = None
                while True:  # query until the build is done and the new version answered
                    a, b, f, r = load(base, questions, args, clients, clients * 2)
                    ttft += a
                    e2e += b
                    failed += f
                    runs += r
                    done = rebuild.poll() is not None
                    if done and any(run != before for _, run in r):
                        break
                    if done and rebuild.returncode != 0:
                        raise SystemExit(f"rebuild failed: {rebuild.stderr.read().decode()}")
                    deadline = deadline or (time.monotonic() + 600 if done else None)
                    if deadline and time.monotonic() > deadline:
                        raise SystemExit("the server never answered on the rebuilt version")
                published = settings.stat().st_mtime
                first_new = min(t for t, run in runs if run != before)
                rows.append(summary(f"{clients} client(s), rebuild running", ttft, e2e, failed))
                rows[-1]["publish_to_first_answer_ms"] = round((first_new - published) * 1000, 1)
    finally:
        if hog is not None:
            hog.kill()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    keys = list(rows[0])
    keys += [k for r in rows for k in r if k not in keys]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for key, value in extra.items():
        print(f"{key}: {value}")
    served_p99 = next(r["ttft_p99_ms"] for r in rows if r["phase"] == "1 client(s)")
    ratio = served_p99 / rows[0]["ttft_p99_ms"]
    print(f"served TTFT p99 (1 client) / in-process p99: {ratio:.2f} (goal <= 1.2)")
    print(f"median of in-process TTFT: {statistics.median(base_ttft):.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **extra}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
