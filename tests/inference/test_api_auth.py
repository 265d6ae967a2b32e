"""`coinrag api` with API keys and per-client limits: one real uvicorn server on 127.0.0.1
(tests/api_harness.py) with an ``--api-key`` and a keys file, asked with a real HTTP client
(httpx): 401 without a valid key, 200 with each key, a rotated keys file picked up, a flooding
client refused (429) while another is served, the rate limit, and no key in the logs, the
store or the metrics afterwards. The module's tests run in order on one server."""

from __future__ import annotations

import dataclasses
import io
import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from api_harness import metric_values, serving

from coinrag.inference.server.app import LOG_FORMAT, ServerConfig
from coinrag.inference.server.auth import client_of_key
from coinrag.inference.server.limits import ClientLimits, Limited

pytestmark = pytest.mark.usefixtures("prefect_harness", "one_torch_thread")

QUESTION = "Who directed 2001: A Space Odyssey?"
BODY = {"question": QUESTION, "kc": 1, "k": 2}
KEY_MAIN = "coinrag-test-main-key-0f9c2d"  # --api-key
KEY_A, KEY_B, KEY_C, KEY_D, KEY_E = (f"coinrag-test-file-key-{c}-7e41b8" for c in "ABCDE")
WRONG = "coinrag-test-wrong-key-5a3e90"
EVERY_KEY = (KEY_MAIN, KEY_A, KEY_B, KEY_C, KEY_D, KEY_E, WRONG)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _write_keys(path: Path, keys: list[str]) -> None:
    path.write_text("# coinrag api keys\n\n" + "".join(f"{k}\n" for k in keys), encoding="utf-8")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, sample_store: Path):
    """The server (``--api-key KEY_MAIN``, a keys file of A, B, C, E; a client's share: 2
    requests admitted, bursts of 8 at 0.5 per second) and everything it logged."""
    root = tmp_path_factory.mktemp("api-auth")
    store = root / "store"
    shutil.copytree(sample_store, store)
    keys_file = root / "keys.txt"
    _write_keys(keys_file, [KEY_A, KEY_B, KEY_C, KEY_E])
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    api_log = logging.getLogger("coinrag.api")
    level = api_log.level
    api_log.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    settings = {"threads": 1, "api_key_file": str(keys_file), "client_queue_limit": 2}
    settings |= {"client_rate": 0.5, "client_burst": 8}
    config = ServerConfig(
        store=str(store),
        methods=("coinrag",),
        max_new_tokens=2,
        settings=settings,
        api_key=KEY_MAIN,
    )
    uvicorn_logs = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access")]
    try:
        with serving(config, log_level="info") as (base, srv):
            for logger in uvicorn_logs:  # uvicorn's own handlers were set when it started
                logger.addHandler(handler)
            yield SimpleNamespace(base=base, srv=srv, store=store, keys_file=keys_file, logs=logs)
    finally:
        for logger in [logging.getLogger(), *uvicorn_logs]:
            logger.removeHandler(handler)
        api_log.setLevel(level)


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=300) as c:
        yield c


def test_no_key_or_a_wrong_key_gets_401_and_health_says_only_ok(keyed, client) -> None:
    base = keyed.base
    refused = [{}, _auth(WRONG), {"Authorization": KEY_MAIN}, {"Authorization": f"Basic {KEY_A}"}]
    for headers in refused:
        for path in ("/query", "/query/stream"):
            response = client.post(f"{base}{path}", json=BODY, headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert "API key" in response.json()["error"]
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert client.get(f"{base}/metrics", headers=headers).status_code == 401
        assert client.get(f"{base}/health", headers=headers).json() == {"status": "ok"}
    health = client.get(f"{base}/health", headers=_auth(KEY_MAIN)).json()
    assert health["run_id"] and health["fingerprints"] and health["store"] == str(keyed.store)
    values = metric_values(client.get(f"{base}/metrics", headers=_auth(KEY_MAIN)).text)
    for endpoint in ("query", "stream", "metrics"):
        assert values[("coinrag_unauthorized_total", (("endpoint", endpoint),))] == len(refused)
    status_401 = (("endpoint", "query"), ("method", "-"), ("status", "401"))
    assert values[("coinrag_requests_total", status_401)] == len(refused)


def test_metrics_open_serves_metrics_without_a_key(keyed, client) -> None:
    srv = keyed.srv
    saved = srv.settings
    srv.settings = dataclasses.replace(saved, metrics_open=True)  # as --metrics-open starts it
    try:
        response = client.get(f"{keyed.base}/metrics")
        assert response.status_code == 200 and "coinrag_requests_total" in response.text
        assert client.post(f"{keyed.base}/query", json=BODY).status_code == 401  # only metrics
    finally:
        srv.settings = saved
    assert client.get(f"{keyed.base}/metrics").status_code == 401


def test_each_key_answers(keyed, client) -> None:
    for key in (KEY_MAIN, KEY_A, KEY_B, KEY_C, KEY_E):
        response = client.post(f"{keyed.base}/query", json=BODY, headers=_auth(key))
        assert response.status_code == 200, response.text
        assert response.json()["evidence"]


def test_a_rotated_keys_file_is_picked_up(keyed, client) -> None:
    base = keyed.base

    def metrics_status(key: str) -> int:
        return client.get(f"{base}/metrics", headers=_auth(key)).status_code

    assert metrics_status(KEY_A) == 200 and metrics_status(KEY_D) == 401
    _write_keys(keyed.keys_file, [KEY_B, KEY_C, KEY_E, KEY_D])  # rewritten in place: A out, D in
    assert metrics_status(KEY_A) == 401 and metrics_status(KEY_D) == 200
    response = client.post(f"{base}/query", json=BODY, headers=_auth(KEY_D))
    assert response.status_code == 200, response.text
    saved = keyed.keys_file.read_text(encoding="utf-8")
    keyed.keys_file.unlink()  # gone: only --api-key is valid (fails closed) until it is back
    try:
        assert metrics_status(KEY_B) == 401 and metrics_status(KEY_MAIN) == 200
    finally:
        staged = keyed.keys_file.with_suffix(".new")
        staged.write_text(saved, encoding="utf-8")
        staged.replace(keyed.keys_file)  # back, atomically (a new inode)
    assert metrics_status(KEY_B) == 200 and metrics_status(KEY_A) == 401


def _wait(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_flooding_client_gets_429_while_another_is_served(keyed, client) -> None:
    """Client B floods (6 requests at once, its share is 2 admitted) while the model thread is
    held: 2 are admitted, 4 get 429 at once; client C's requests are all admitted and answered."""
    base, srv = keyed.base, keyed.srv
    gate = threading.Event()
    srv.queue.submit(lambda: gate.wait(300), force=True)  # holds the model thread

    def ask(key: str) -> httpx.Response:
        with httpx.Client(timeout=300) as c:
            return c.post(f"{base}/query", json=BODY, headers=_auth(key))

    def done(futures: list[Future]) -> int:
        return sum(f.done() for f in futures)

    try:
        with ThreadPoolExecutor(8) as pool:
            flood = [pool.submit(ask, KEY_B) for _ in range(6)]
            _wait(lambda: done(flood) == 4, "4 of the flood were not refused")
            assert srv.limits.admitted(client_of_key(KEY_B)) == 2
            other = [pool.submit(ask, KEY_C) for _ in range(2)]
            _wait(lambda: srv.limits.admitted(client_of_key(KEY_C)) == 2, "C was not admitted")
            assert srv.queue.admitted == 1 + 2 + 2  # the gate, B's share, C's two
            gate.set()
            flooded = [f.result() for f in flood]
            served = [f.result() for f in other]
    finally:
        gate.set()
    served.append(client.post(f"{base}/query", json=BODY, headers=_auth(KEY_C)))
    assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
    assert sorted(r.status_code for r in flooded) == [200, 200, 429, 429, 429, 429]
    for r in (r for r in flooded if r.status_code == 429):
        assert r.headers["Retry-After"] == "1"
        assert "too many requests in progress" in r.json()["error"]
    assert srv.limits.admitted(client_of_key(KEY_B)) == 0
    values = metric_values(client.get(f"{base}/metrics", headers=_auth(KEY_MAIN)).text)
    assert values[("coinrag_client_limited_total", (("reason", "queue"),))] == 4
    status_429 = (("endpoint", "query"), ("method", "coinrag"), ("status", "429"))
    assert values[("coinrag_requests_total", status_429)] == 4


def test_a_client_over_its_rate_gets_429_and_others_do_not(keyed, client) -> None:
    """Bursts of 8 at 0.5 per second: E sends 12 invalid requests in a row; its tokens run
    out (422 until then: a token is taken before the body is read), then 429."""
    base = keyed.base
    codes, limited = [], None
    for _ in range(12):
        response = client.post(f"{base}/query", json={}, headers=_auth(KEY_E))
        codes.append(response.status_code)
        if response.status_code == 429 and limited is None:
            limited = response
    assert 429 in codes and set(codes[: codes.index(429)]) == {422}, codes
    assert codes.index(429) >= 7, codes  # 8 tokens, 1 spent earlier, plus what refilled
    assert int(limited.headers["Retry-After"]) >= 1
    assert "per second" in limited.json()["error"]
    other = client.post(f"{base}/query", json={}, headers=_auth(KEY_C))
    assert other.status_code == 422  # C's bucket is its own
    values = metric_values(client.get(f"{base}/metrics", headers=_auth(KEY_MAIN)).text)
    assert values[("coinrag_client_limited_total", (("reason", "rate"),))] == codes.count(429)


def test_no_key_is_in_the_logs_the_store_or_the_metrics(keyed, client) -> None:
    """Last: after every test above, and a key sent in a URL too (uvicorn logs URLs)."""
    base = keyed.base
    client.post(f"{base}/query?api_key={KEY_MAIN}", json={}, headers=_auth(KEY_MAIN))
    client.post(f"{base}/query?api_key={WRONG}", json={}, headers=_auth(WRONG))
    metrics = client.get(f"{base}/metrics", headers=_auth(KEY_MAIN)).text
    logs = keyed.logs.getvalue()
    assert "POST /query?api_key=*** HTTP/1.1" in logs  # the access log saw that URL, scrubbed
    assert "API keys file" in logs  # the rotations were logged (without a key)
    leases = list((keyed.store / "readers").glob("*.json"))
    assert leases  # the reader lease of the running server is among the files read below
    files = [p for p in keyed.store.rglob("*") if p.is_file()]
    for key in EVERY_KEY:
        assert key not in logs and key not in metrics, key
        assert not [p for p in files if key.encode() in p.read_bytes()], key


def test_client_limits_token_bucket_and_share() -> None:
    """The worked example of ``inference/server/limits.py``, on a clock the test moves."""
    now = [0.0]
    limits = ClientLimits(queue_limit=1, rate=0.5, burst=2, clock=lambda: now[0])
    limits.take("a")
    limits.take("a")
    with pytest.raises(Limited) as refused:
        limits.take("a")
    assert refused.value.reason == "rate" and refused.value.retry_after == 2
    limits.take("b")  # b has its own bucket
    now[0] = 2.0
    limits.take("a")  # one token back
    release = limits.enter("a")
    with pytest.raises(Limited) as full:
        limits.enter("a")
    assert full.value.reason == "queue" and full.value.retry_after == 1
    limits.enter("b")()
    release()
    release()  # once only
    assert limits.admitted("a") == 0
    limits.enter("a")
    assert ClientLimits(1, 0.0, 1).take("x") is None  # rate 0: no rate limit
