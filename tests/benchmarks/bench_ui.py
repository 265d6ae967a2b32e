"""The store explorer's cost on the server: a document page of 50 chunks, and what the Ask page's
stream adds to the API's TTFT.

    python tests/benchmarks/bench_ui.py [--chunks 50] [--requests 30] [--json PATH]

Builds one document of about ``--chunks`` chunks (the bundled sample's texts repeated, cut at
``chunk_size`` 128 tokens, rules extractor) and three sample documents into a temporary store
(``coinrag build``), serves it in this process (tests/api_harness.py: the app on uvicorn,
127.0.0.1, an API key), then measures:

1. ``document page``: ``GET /ui/documents/{doc_id}`` ``--requests`` times after one warm-up;
   the server's time is its ``Server-Timing: app;dur=`` header (the whole page: the explorer's
   queries, the cutting, the template); the client's time includes HTTP on loopback. Goal:
   p50 <= 100 ms of server time.
2. ``ask vs api``: the same question streamed through ``POST /query/stream`` (the API, Bearer
   key) and ``POST /ui/ask/stream`` (the Ask page's path, the sign-in cookie), alternating,
   ``--requests`` each: TTFT = request sent to the first ``token`` event. Goal: the Ask page's
   p50 TTFT <= the API's + 5 ms.

Numbers on a shared machine are noisy: run it on a quiet one for the real figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402
from api_harness import serving, sse_events  # noqa: E402

COINRAG = str(Path(sys.executable).with_name("coinrag"))
SAMPLE = REPO / "flows" / "sample" / "wiki_sample.jsonl"
KEY = "coinrag-ui-bench-key-7c2d41e9"
LONG_DOC = "long-document"
QUESTION = "Who directed 2001: A Space Odyssey?"
CHUNK_SIZE = 128
TOKENS_PER_CHAR = 0.22  # SmolLM2 on the sample's English prose, about


def write_source(path: Path, chunks: int) -> None:
    """A document of about ``chunks`` chunks of :data:`CHUNK_SIZE` tokens, and 3 sample ones."""
    docs = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    text, i = "", 0
    while len(text) * TOKENS_PER_CHAR < chunks * CHUNK_SIZE:
        text += docs[i % len(docs)]["text"] + "\n\n"
        i += 1
    rows = [{"id": LONG_DOC, "text": text.strip()}, *docs[:3]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def pcts(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": round(statistics.median(ordered), 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        "max_ms": round(ordered[-1], 2),
    }


def bench_document(client: httpx.Client, base: str, n: int) -> dict:
    url = f"{base}/ui/documents/{quote(LONG_DOC, safe='')}"
    first = client.get(url)
    first.raise_for_status()
    server, wall = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        response = client.get(url)
        wall.append((time.perf_counter() - t0) * 1000)
        response.raise_for_status()
        server.append(float(response.headers["server-timing"].split("dur=")[1]))
    return {
        "chunks": first.text.count('class="chunk'),
        "marks": first.text.count("<mark data-nugget="),
        "html_bytes": len(first.content),
        "server": pcts(server),
        "client": pcts(wall),
    }


def ttft(client: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for event, _ in sse_events(response.iter_lines()):
            if event == "token":
                return (time.perf_counter() - t0) * 1000
    raise RuntimeError(f"{url}: no token event")


def bench_ask(base: str, n: int) -> dict:
    body = {"question": QUESTION, "method": "coinrag", "kc": 2, "k": 4}
    api = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    page = httpx.Client(timeout=120)
    login = page.post(f"{base}/ui/login", data={"key": KEY, "next": "/ui/ask"})
    assert login.status_code in (200, 303) and page.cookies, login.text
    out: dict[str, list[float]] = {"api": [], "ask": []}
    ttft(api, f"{base}/query/stream", body)  # warm both paths once
    ttft(page, f"{base}/ui/ask/stream", body)
    for _ in range(n):
        out["api"].append(ttft(api, f"{base}/query/stream", body))
        out["ask"].append(ttft(page, f"{base}/ui/ask/stream", body))
    result = {name: pcts(values) for name, values in out.items()}
    result["ask_minus_api_p50_ms"] = round(result["ask"]["p50_ms"] - result["api"]["p50_ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from coinrag.inference.server.app import ServerConfig

    with tempfile.TemporaryDirectory(prefix="coinrag-bench-ui-") as tmp:
        source, store = Path(tmp) / "docs.jsonl", Path(tmp) / "store"
        write_source(source, args.chunks)
        env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        cmd = [COINRAG, "build", str(source), "--store", str(store), "--extractor", "rules"]
        cmd += ["--chunk-size", str(CHUNK_SIZE), "--threads", "1"]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        config = ServerConfig(
            store=str(store),
            methods=("coinrag",),
            max_new_tokens=8,
            settings={"threads": 1, "client_rate": 0},
            api_key=KEY,
        )
        with serving(config) as (base, _):
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
                results = {"document_page": bench_document(client, base, args.requests)}
            results["ask_vs_api_ttft"] = bench_ask(base, args.requests)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
