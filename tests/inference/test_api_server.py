"""`coinrag api` end to end: a real uvicorn server on 127.0.0.1 (tests/api_harness.py) over a
copy of the session's sample store, asked with a real HTTP client (httpx): answers equal
`coinrag query --json`'s, streaming order, JSON errors, the bounded queue, a client that
disconnects, Prometheus metrics, and the hot swap across `coinrag build` and `coinrag delete`.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from api_harness import metric_values, serving, sse_events, stream_query
from store_fixtures import sample_docs, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.server.app import RUN_HEADER, ServerConfig
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store

pytestmark = pytest.mark.usefixtures("prefect_harness", "one_torch_thread")

QUESTION = "Who directed 2001: A Space Odyssey?"
SAME = ("answer", "method", "evidence", "active_tokens", "kc", "k", "model_fp", "retrieval")
NEW_DOC = {
    "id": "zorvath",
    "text": "Zorvath is a harbour town on the island of Keldia. Zorvath was founded by the "
    "shipwright Ilsa Moren in 1802, who built its first dry dock.",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory, sample_store: Path) -> Path:
    """A copy of the session's sample store (this module rebuilds and deletes in it)."""
    root = tmp_path_factory.mktemp("api") / "store"
    shutil.copytree(sample_store, root)
    return root


@pytest.fixture(scope="module")
def server(store: Path):
    config = ServerConfig(
        store=str(store),
        methods=("coinrag", "turborag", "standard"),
        max_new_tokens=8,
        # one address asks for everything here: no per-client share in the way of the queue
        # test's 503s or of the hot-swap loop, which asks as fast as answers come
        settings={
            "queue_limit": 2,
            "poll_interval": 0.2,
            "threads": 1,
            "client_queue_limit": 16,
            "client_rate": 0,
        },
    )
    with serving(config) as (base, srv):
        yield base, srv


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def _cli_query(store: Path, method: str, *more: str) -> dict:
    args = ["query", QUESTION, "--store", str(store), "--method", method, *more]
    args += ["--kc", "2", "--k", "4", "--max-new-tokens", "8", "--json", "--threads", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.heavy  # over 5 s: the second tier
def test_answers_equal_coinrag_query_json(server, client, store: Path) -> None:
    base, srv = server
    for method in ("coinrag", "turborag", "standard"):
        body = {"question": QUESTION, "method": method, "kc": 2, "k": 4}
        response = client.post(f"{base}/query", json=body)
        assert response.status_code == 200, response.text
        assert response.headers[RUN_HEADER] == srv.holder.current.run_id
        served = response.json()
        cli = _cli_query(store, method)
        assert {key: served[key] for key in SAME} == {key: cli[key] for key in SAME}
        assert set(served) == set(cli) and set(served["timings"]) == set(cli["timings"])
        assert served["evidence"] and "Kubrick" in " ".join(e["text"] for e in served["evidence"])
        assert served["retrieval"] == "hybrid"  # the store's default search mode
    # a request names its search mode; the answer records it, as `coinrag query` does
    body = {"question": QUESTION, "method": "coinrag", "kc": 2, "k": 4, "retrieval": "lexical"}
    served = client.post(f"{base}/query", json=body).json()
    cli = _cli_query(store, "coinrag", "--retrieval", "lexical")
    assert {key: served[key] for key in SAME} == {key: cli[key] for key in SAME}
    assert served["retrieval"] == "lexical"


def test_stream_sends_each_token_then_the_answer(server, client) -> None:
    base, srv = server
    body = {"question": QUESTION, "method": "coinrag", "kc": 2, "k": 4}
    events = stream_query(client, base, body)
    kinds = [e[0] for e in events]
    assert kinds[-1] == "answer" and set(kinds[:-1]) == {"token"} and len(kinds) > 2
    tokens = [e[1] for e in events[:-1]]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    final = events[-1][1]
    plain = client.post(f"{base}/query", json=body).json()
    assert {key: final[key] for key in SAME} == {key: plain[key] for key in SAME}
    tokenizer = srv.holder.current.engine.tokenizer
    ids = [t["token_id"] for t in tokens]
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == final["answer"]
    assert "".join(t["text"] for t in tokens).strip() == final["answer"]
    # "stream": true on /query is the same stream; the first token arrives before the answer
    with client.stream("POST", f"{base}/query", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        again = list(sse_events(response.iter_lines()))
    assert [e[0] for e in again] == kinds and again[-1][1]["answer"] == final["answer"]
    assert events[0][2] <= events[-1][2]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"question": "   "}, 422, "blank"),
        ({"question": "\u200b"}, 422, "blank"),
        ({"question": QUESTION, "method": "nope"}, 422, "not served"),
        ({"question": QUESTION, "method": "cartridge"}, 422, "not served"),
        ({"question": QUESTION, "kc": 0}, 422, "kc must be in 1.."),
        ({"question": QUESTION, "k": 10**6}, 422, "k must be in 1.."),
        ({"question": QUESTION, "max_new_tokens": 0}, 422, "max_new_tokens"),
        ({"question": QUESTION, "kc": "4"}, 422, "kc must be an integer"),
        ({"question": QUESTION, "stream": 1}, 422, "stream must be true or false"),
        ({"question": QUESTION, "retrieval": "fuzzy"}, 422, "retrieval 'fuzzy' is not one of"),
        ({"question": QUESTION, "temperature": 1}, 422, "unknown field"),
        ({}, 422, "question is required"),
        ([QUESTION], 400, "JSON object"),
        ({"question": "x" * 70_000}, 413, "over 65536 bytes"),
    ],
)
def test_bad_requests_get_a_json_4xx(server, client, body, status, says) -> None:
    base, _ = server
    response = client.post(f"{base}/query", json=body)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]


def test_not_json_and_unknown_paths_are_json_errors_and_the_server_lives(server, client) -> None:
    base, _ = server
    response = client.post(f"{base}/query", content=b"{not json")
    assert response.status_code == 400 and "not JSON" in response.json()["error"]
    assert client.get(f"{base}/nowhere").status_code == 404
    assert "error" in client.get(f"{base}/nowhere").json()
    assert client.get(f"{base}/query").status_code == 405
    assert client.get(f"{base}/health").json()["status"] == "ok"


def test_queue_is_bounded_503_with_retry_after(server) -> None:
    base, srv = server
    body = {"question": QUESTION, "method": "standard", "max_new_tokens": 16}
    n = 2 + srv.queue.limit + 3  # one running, `limit` waiting, the rest refused

    def ask(_: int) -> httpx.Response:
        with httpx.Client(timeout=300) as c:
            return c.post(f"{base}/query", json=body)

    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(ask, range(n)))
    codes = sorted(r.status_code for r in responses)
    busy = [r for r in responses if r.status_code == 503]
    assert set(codes) <= {200, 503} and codes.count(200) >= 1 + srv.queue.limit - 1, codes
    assert busy and all(r.headers["Retry-After"] == "1" for r in busy)
    assert "server busy" in busy[0].json()["error"]
    assert srv.queue.admitted == 0


def test_a_client_that_disconnects_stops_its_generation(server, client) -> None:
    base, srv = server
    before = metric_values(client.get(f"{base}/metrics").text)
    cancelled = before.get(("coinrag_cancelled_total", ()), 0.0)
    slow = {"question": QUESTION, "method": "standard", "max_new_tokens": 16}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: httpx.post(f"{base}/query", json=slow, timeout=300))
        while srv.queue.admitted == 0:  # the slow request holds the model thread
            time.sleep(0.01)
        body = {"question": QUESTION, "method": "coinrag", "max_new_tokens": 64}
        with client.stream("POST", f"{base}/query/stream", json=body) as response:
            assert response.status_code == 200
        # gone while waiting: its job starts, sees the cancel and stops before generating
        assert first.result().status_code == 200
    deadline = time.monotonic() + 60
    while srv.queue.admitted and time.monotonic() < deadline:
        time.sleep(0.05)
    after = metric_values(client.get(f"{base}/metrics").text)
    assert after[("coinrag_cancelled_total", ())] == cancelled + 1
    assert (
        after[
            (
                "coinrag_requests_total",
                (("endpoint", "stream"), ("method", "coinrag"), ("status", "499")),
            )
        ]
        >= 1
    )  # noqa: E501


def test_health_and_metrics(server, client, store: Path) -> None:
    base, srv = server
    health = client.get(f"{base}/health").json()
    published = Store.at(store).published()
    assert health["run_id"] == published["run_id"] and health["published"] == published
    fps = health["fingerprints"]
    assert fps["model_fp"].startswith("model-") and fps["kv_fp"].startswith("kv-")
    assert fps["embedder_fp"] == published["index"]["embedder_fp"]
    client.post(f"{base}/query", json={"question": QUESTION})
    client.post(f"{base}/query", json={"question": ""})
    values = metric_values(client.get(f"{base}/metrics").text)
    ok = (
        "coinrag_requests_total",
        (("endpoint", "query"), ("method", "coinrag"), ("status", "200")),
    )
    assert values[ok] >= 1
    bad = ("coinrag_requests_total", (("endpoint", "query"), ("method", "-"), ("status", "422")))
    assert values[bad] >= 1
    for name in ("ttft", "retrieval", "kv_load", "prefill", "request"):
        assert values[(f"coinrag_{name}_seconds_count", (("method", "coinrag"),))] >= 1
    assert values[("coinrag_served_run_info", (("run_id", health["run_id"]),))] == 1


def test_a_version_for_another_kv_dtype_is_refused_and_the_old_one_serves(
    server, client, store: Path, caplog
) -> None:
    """A publish whose KV is in another dtype than the served model computes in (as `coinrag
    build --kv-dtype ...` records it) is refused with one log line; the old version serves."""
    base, srv = server
    st = Store.at(store)
    toml = st.read_toml()
    served = client.get(f"{base}/health").json()
    other = "float32" if served["fingerprints"]["kv_dtype"] != "float32" else "bfloat16"
    refused = {**toml["published"], "run_id": "build-refused", "time": "2099-01-01T00:00:00"}
    before = metric_values(client.get(f"{base}/metrics").text)[
        ("coinrag_version_refusals_total", ())
    ]
    caplog.set_level("ERROR", logger="coinrag.api")
    try:
        st.write_settings({**toml["build"], "kv_dtype": other}, refused)
        deadline = time.monotonic() + 60
        while srv.watcher.checks < 3 or not caplog.records:
            assert time.monotonic() < deadline, "the watcher never saw the publish"
            time.sleep(0.1)
        response = client.post(f"{base}/query", json={"question": QUESTION})
        assert response.status_code == 200
        assert response.headers[RUN_HEADER] == served["run_id"]
    finally:
        st.write_settings(toml["build"], toml["published"])
    (line,) = [r.getMessage() for r in caplog.records if "build-refused" in r.getMessage()]
    assert f"KV in {other}" in line and f"still serving run {served['run_id']}" in line
    after = metric_values(client.get(f"{base}/metrics").text)
    assert after[("coinrag_version_refusals_total", ())] == before + 1
    assert client.get(f"{base}/health").json()["run_id"] == served["run_id"]


def _chunk_ids(store: Path, published: dict) -> set[str]:
    """The chunk ids of the index at a published version."""
    table = LanceIndex.open(Store.at(store), published).table("chunks")
    return set(table.to_arrow().column("chunk_id").to_pylist())


def _wait_served(base: str, client: httpx.Client, run_id: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while client.get(f"{base}/health").json()["run_id"] != run_id:
        assert time.monotonic() < deadline, f"the server never served {run_id}"
        time.sleep(0.1)


@pytest.mark.heavy  # over 5 s: the second tier
def test_hot_swap_across_build_and_delete(server, client, store: Path, sample_corpus) -> None:
    """A client loop while a build adds a document and edits another and a delete removes a
    third: no failed request, every answer's evidence from the index of the one version it
    names, the deleted document gone once its version is served, the new one found."""
    from coinrag.flows.build import build_flow

    base, srv = server
    st = Store.at(store)
    versions = {st.published()["run_id"]: st.published()}
    docs = sample_docs(sample_corpus, 5)
    deleted, edited = docs[1]["id"], docs[2]["id"]
    questions = [QUESTION, "Who founded Zorvath?", f"What is {deleted}?", f"What is {edited}?"]
    results: list[tuple[float, int, str, dict]] = []  # (sent, status, run id, answer)
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=300) as c:
            for i in range(400):  # bounded
                if stop.is_set():
                    return
                body = {"question": questions[i % 4], "kc": 4, "k": 10, "max_new_tokens": 2}
                sent = time.monotonic()
                r = c.post(f"{base}/query", json=body)
                data = r.json()
                results.append((sent, r.status_code, r.headers.get(RUN_HEADER), data))

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        docs[2] = {**docs[2], "text": docs[2]["text"] + " It was edited for the server test."}
        src = write_corpus(store.parent / "docs.jsonl", [*docs, NEW_DOC])
        built = build_flow(str(src), str(store), {"extractor": "rules", "threads": 1})
        assert built["rejected"] == [] and built["failures"] == []
        versions[st.published()["run_id"]] = st.published()
        _wait_served(base, client, st.published()["run_id"])
        result = CliRunner().invoke(app, ["delete", deleted, "--store", str(store)])
        assert result.exit_code == 0, result.output
        delete_run = st.published()["run_id"]
        versions[delete_run] = st.published()
        _wait_served(base, client, delete_run)
        served_delete = time.monotonic()
        n = len(results)
        deadline = time.monotonic() + 120
        while len(results) < n + 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join()
    assert results and all(status == 200 for _, status, _, _ in results), [
        (s, d) for _, s, _, d in results if s != 200
    ]
    chunks = {run: _chunk_ids(store, record) for run, record in versions.items()}
    seen = set()
    for _, _, run_id, answer in results:
        assert run_id in versions
        seen.add(run_id)
        assert {e["chunk_id"] for e in answer["evidence"]} <= chunks[run_id], run_id
        if run_id == delete_run:
            assert deleted not in {e["doc_id"] for e in answer["evidence"]}
    assert seen == set(versions), "every published version answered some request"
    after = [a for sent, _, _, a in results if sent > served_delete]  # sent after the swap
    assert after and all(deleted not in {e["doc_id"] for e in a["evidence"]} for a in after)
    new_run_docs = {
        e["doc_id"]
        for _, _, run, a in results
        if run != next(iter(versions))
        for e in a["evidence"]
    }
    assert NEW_DOC["id"] in new_run_docs
    health = client.get(f"{base}/health").json()
    assert health["versions_held"] == 1  # the old versions' views were closed
    values = metric_values(client.get(f"{base}/metrics").text)
    assert values[("coinrag_version_swaps_total", ())] >= 2
