"""The OpenAI extractors (chat and Batch API) with the real ``openai`` client against a real,
local HTTP server (``fake_openai_server``): retries, fallbacks, batches, resume, ledger, secrets."""

from __future__ import annotations

import json
import logging
import threading

import openai
import pytest

from coinrag.inference.llm.client import LlmEndpoint, RetryPolicy, scrub
from coinrag.inference.llm.pricing import call_cost, is_priced
from coinrag.schemas.keys import text_hash
from coinrag.tasks.extractors.base import ExtractionRequest, ExtractionResult
from coinrag.tasks.extractors.openai_batch import OpenAIBatchExtractor, custom_id_for
from coinrag.tasks.extractors.openai_chat import OpenAIChatExtractor
from coinrag.tasks.extractors.prompt import PROMPT_VERSION

try:  # `python -m pytest` from the repo root, with or without tests/ as a package
    from tests.fake_openai_server import Action, BatchPlan, FakeOpenAI, nuggets_for
except ImportError:  # pragma: no cover
    from fake_openai_server import Action, BatchPlan, FakeOpenAI, nuggets_for

API_KEY = "sk-test-secret-0123456789abcdefDONOTLEAK"

TEXTS = [
    "The Rhine flows through six countries. It is 1,230 km long; barges carry coal on it.",
    "Marie Curie won two Nobel Prizes. She was born in Warsaw in 1867.",
    "Photosynthesis turns light into chemical energy; it happens in chloroplasts.",
    "The Eiffel Tower was finished in 1889. It is 330 metres tall.",
    "Honey never spoils. Archaeologists found edible honey in Egyptian tombs.",
    "Mount Everest is 8,849 metres high. It lies on the border of Nepal and China.",
]


def _requests(texts: list[str] = TEXTS) -> list[ExtractionRequest]:
    return [ExtractionRequest(key=text_hash(t), text=t) for t in texts]


def _expected(text: str) -> list[str]:
    return nuggets_for(text)


@pytest.fixture
def fake():
    """The fake OpenAI server on 127.0.0.1:<ephemeral>, started and stopped per test."""
    with FakeOpenAI(api_key=API_KEY) as server:
        yield server


@pytest.fixture
def client(fake: FakeOpenAI) -> openai.OpenAI:
    """The official client pointed at the fake server."""
    return openai.OpenAI(base_url=fake.base_url, api_key=API_KEY)


RETRY_OPTIONS = ("max_attempts", "backoff_base_s", "backoff_max_s", "retry_after_max_s", "sleep")


def _endpoint(client: openai.OpenAI, opts: dict) -> LlmEndpoint:
    """The endpoint of ``client`` from the test's options (``model``, ``timeout_s``, the
    retry policy's), which it pops."""
    retry = RetryPolicy(**{k: opts.pop(k) for k in RETRY_OPTIONS if k in opts})
    model = opts.pop("model", "gpt-4o-mini")
    return LlmEndpoint(model, client, timeout_s=opts.pop("timeout_s", 60.0), retry=retry)


def _chat(client: openai.OpenAI, **kwargs) -> OpenAIChatExtractor:
    opts = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
    opts.update(kwargs)
    return OpenAIChatExtractor(_endpoint(client, opts), **opts)


def _batch(client: openai.OpenAI, **kwargs) -> OpenAIBatchExtractor:
    opts = {"poll_interval_s": 0.01, "backoff_base_s": 0.01, "backoff_max_s": 0.05}
    opts.update(kwargs)
    return OpenAIBatchExtractor(_endpoint(client, opts), **opts)


def _statuses(result: ExtractionResult) -> list[str]:
    return [c.status for c in result.calls]


# --------------------------------------------------------------------------- chat


def test_chat_happy_path(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    reqs = _requests()
    reqs.append(reqs[1])  # the same text twice: asked once, answered twice
    seen: list[ExtractionResult] = []
    lock = threading.Lock()

    def on_result(result: ExtractionResult) -> None:
        with lock:
            seen.append(result)

    ex = _chat(client, concurrency=4)
    results = ex.extract(reqs, on_result)

    assert [r.key for r in results] == [r.key for r in reqs]
    assert all(r.status == "ok" and r.error is None for r in results)
    for req, res in zip(reqs, results, strict=True):
        assert res.candidates == _expected(req.text)
    # Once per distinct text, as it finished, with its ledger.
    assert sorted(r.key for r in seen) == sorted(r.key for r in reqs[: len(TEXTS)])
    assert all(len(r.calls) == 1 and r.status == "ok" for r in seen)
    assert len(fake.chat_requests()) == len(TEXTS)  # the duplicate was not asked again
    assert results[-1].calls == [] and len(results[1].calls) == 1
    for res in results[: len(TEXTS)]:
        (call,) = res.calls
        assert call.status == "ok" and call.attempt == 1 and call.key == res.key
        assert call.tokens_in > 0 and call.tokens_out > 0 and call.latency_ms > 0
    for rec in fake.chat_requests():
        assert rec.headers["authorization"] == f"Bearer {API_KEY}"
        assert rec.json["temperature"] == 0
        assert rec.json["response_format"]["type"] == "json_schema"
        assert rec.json["model"] == "gpt-4o-mini"
    assert ex.backend == "openai" and ex.llm_model == "gpt-4o-mini"


def test_chat_fingerprint_has_no_secret_and_tracks_output_inputs(client: openai.OpenAI) -> None:
    a = _chat(client)
    assert a.fingerprint.startswith("extractor-")
    assert a.fingerprint == _chat(client, concurrency=1, max_attempts=2).fingerprint
    assert a.fingerprint != _chat(client, model="gpt-4o").fingerprint
    assert a.fingerprint != _chat(client, structured=False).fingerprint
    assert a.fingerprint != _chat(client, temperature=0.7).fingerprint
    assert API_KEY not in a.fingerprint and PROMPT_VERSION.startswith("p-")
    other_url = openai.OpenAI(base_url="http://user:pw@example.invalid/v1", api_key="sk-other-xyz")
    assert _chat(other_url).fingerprint == a.fingerprint


def test_chat_429_then_success_honours_retry_after(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.script_chat(Action.error(429, "slow down", headers={"Retry-After": "1"}))
    (res,) = _chat(client).extract(_requests(TEXTS[:1]))
    assert res.status == "ok"
    assert _statuses(res) == ["rate_limited", "ok"]
    assert [c.attempt for c in res.calls] == [1, 2]
    first, second = fake.chat_requests()
    assert second.started - first.finished >= 0.9  # waited Retry-After, not the 10 ms backoff


def test_chat_500s_then_success_every_attempt_ledgered(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    fake.script_chat(Action.error(500), Action.error(503))
    (res,) = _chat(client).extract(_requests(TEXTS[:1]))
    assert res.status == "ok"
    assert _statuses(res) == ["server_error", "server_error", "ok"]
    # the client's own retries are off: one ledger row per HTTP request
    assert len(fake.chat_requests()) == len(res.calls) == 3


def test_chat_server_errors_exhaust_attempts(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.script_chat(*[Action.error(500)] * 5)
    (res,) = _chat(client, max_attempts=3).extract(_requests(TEXTS[:1]))
    assert res.status == "failed" and res.candidates == []
    assert "server_error after 3 attempt" in (res.error or "")
    assert len(fake.chat_requests()) == 3


def test_chat_timeout_then_success(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.script_chat(Action.delay(2.0))
    (res,) = _chat(client, timeout_s=0.4).extract(_requests(TEXTS[:1]))
    assert res.status == "ok"
    assert _statuses(res) == ["timeout", "ok"]
    assert res.candidates == _expected(TEXTS[0])


def test_chat_malformed_then_repaired(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    """A malformed reply is asked again with another request: the conversation, the reply and
    a message quoting the parse error; then that repair in the next response format."""
    cut = '{"nuggets": ["The Rhine flows'  # cut off inside the first item: nothing to salvage
    fake.script_chat(
        Action.raw_content(cut),
        Action.raw_content('{"nuggets": [{"text": "an object"}]}'),
    )
    (res,) = _chat(client).extract(_requests(TEXTS[:1]))
    assert res.status == "ok" and res.candidates == _expected(TEXTS[0])
    assert _statuses(res) == ["malformed", "malformed", "ok"]
    assert all(c.tokens_in > 0 for c in res.calls)  # malformed answers were paid for
    first, second, third = (r.json for r in fake.chat_requests())
    assert len(first["messages"]) == 2 and first["response_format"]["type"] == "json_schema"
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": cut}
    assert "could not be read: not JSON" in second["messages"][3]["content"]
    assert second["response_format"]["type"] == "json_schema"
    assert third["response_format"]["type"] == "json_object"  # the next format
    assert '"an object"' not in json.dumps(second) and "an object" in json.dumps(third)


def test_chat_malformed_forever_is_a_content_failure_never_the_same_request_twice(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    """A model at temperature 0 that answers one passage malformed whatever it is asked: each
    request about it differs from the others, and the result is ``malformed`` (a content
    failure, not a transient one) after the repairs, not after max_attempts copies."""
    target = "Marie Curie"
    fake.answer_always(target, "not json at all")
    results = _chat(client, max_attempts=5).extract(_requests(TEXTS[:3]))
    bad = results[1]
    assert bad.status == "malformed" and bad.candidates == []
    assert bad.error and "malformed" in bad.error
    assert _statuses(bad) == ["malformed"] * 3
    asked = [r.body for r in fake.chat_requests() if target in json.dumps(r.json)]
    assert len(asked) == 3 and len(set(asked)) == 3  # three different requests
    assert [r.status for r in results] == ["ok", "malformed", "ok"]
    # plain prompting has no next format: the repair request is the only other one
    fake.requests.clear()
    (bad,) = _chat(client, structured=False).extract(_requests(TEXTS[1:2]))
    assert bad.status == "malformed" and _statuses(bad) == ["malformed"] * 2
    # a transport failure is still transient: failed, not malformed
    fake.script_chat(*[Action.error(503)] * 3, match="Eiffel")
    (res,) = _chat(client, max_attempts=3).extract(_requests(TEXTS[3:4]))
    assert res.status == "failed" and _statuses(res) == ["server_error"] * 3


@pytest.mark.parametrize(
    ("content", "items"),
    [
        ('{"nuggets": ["The Rhine flows through six countries", "It is 1,23', 1),  # truncated
        ('{"nuggets": ["The Rhine flows through six countries" "It is 1,230 km long"]}', 2),
    ],
)
def test_chat_salvages_the_complete_items_of_a_malformed_reply(
    fake: FakeOpenAI, client: openai.OpenAI, content: str, items: int
) -> None:
    """A truncated array or one missing comma: the complete string items are the candidates
    (no second request), and the call is ledgered ``salvaged``."""
    fake.script_chat(Action.raw_content(content))
    (res,) = _chat(client).extract(_requests(TEXTS[:1]))
    assert res.status == "ok" and res.candidates == _expected(TEXTS[0])[:items]
    assert _statuses(res) == ["salvaged"] and len(fake.chat_requests()) == 1
    assert f"{items} items salvaged" in (res.calls[0].error or "")


def test_chat_json_schema_unsupported_falls_back_and_remembers(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    fake.reject_formats = {"json_schema"}
    ex = _chat(client, concurrency=1)
    fp = ex.fingerprint
    results = ex.extract(_requests(TEXTS[:3]))
    assert [r.status for r in results] == ["ok"] * 3
    kinds = [r.json.get("response_format", {}).get("type") for r in fake.chat_requests()]
    assert kinds == ["json_schema", "json_object", "json_object", "json_object"]
    assert ex.response_mode == "json_object"
    assert ex.fingerprint == fp  # the requested mode ("auto") is what is fingerprinted
    assert _statuses(results[0]) == ["error", "ok"]
    assert "falling back" in (results[0].calls[0].error or "")


def test_chat_falls_back_to_plain_prompting(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.reject_formats = {"json_schema", "json_object"}
    ex = _chat(client, concurrency=1, max_attempts=1)  # fallbacks do not use up attempts
    results = ex.extract(_requests(TEXTS[:2]))
    assert [r.status for r in results] == ["ok", "ok"]
    assert ex.response_mode == "prompt"
    assert "response_format" not in fake.chat_requests()[-1].json


def test_chat_structured_true_does_not_fall_back(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.reject_formats = {"json_schema"}
    (res,) = _chat(client, structured=True).extract(_requests(TEXTS[:1]))
    assert res.status == "failed" and "response_format" in (res.error or "")
    assert len(fake.chat_requests()) == 1  # a 400 is not retried


def test_chat_concurrency_is_bounded(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.latency_s = 0.15
    texts = [f"Fact number {i} is true. It was checked." for i in range(12)]
    results = _chat(client, concurrency=3).extract(_requests(texts))
    assert all(r.status == "ok" for r in results)
    assert 2 <= fake.max_in_flight <= 3


def test_chat_fatal_auth_error_stops_the_run_and_key_is_scrubbed(
    fake: FakeOpenAI, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # api.openai.com echoes the (masked) key in its 401 message; this one echoes it in full
    fake.script_chat(Action.error(401, f"Incorrect API key provided: {API_KEY}."))
    results = _chat(client, concurrency=1).extract(_requests(TEXTS[:4]))
    assert all(r.status == "failed" for r in results)
    assert len(fake.chat_requests()) == 1  # the other requests were not sent
    assert "aborted" in (results[1].error or "")
    assert API_KEY not in repr(results)
    assert API_KEY not in caplog.text


def test_api_key_never_in_records_or_logs(
    fake: FakeOpenAI, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.script_chat(
        Action.error(429, f"rate limited for key {API_KEY}", headers={"retry-after-ms": "10"}),
        Action.error(500, f"boom Bearer {API_KEY}"),
        Action.raw_content(f'{{"nuggets": "{API_KEY}"'),
    )
    chat = _chat(client, concurrency=1).extract(_requests(TEXTS[:2]))
    fake.plan_batch(BatchPlan(final="failed", failure_message=f"bad key {API_KEY}"))
    batch = _batch(client).extract(_requests(TEXTS[:2]))
    assert all(r.status == "ok" for r in chat + batch)
    rows = [c for r in chat + batch for c in r.calls]
    assert any(c.error for c in rows)
    assert API_KEY not in repr(rows)
    assert API_KEY not in caplog.text
    assert any(r.headers.get("authorization") == f"Bearer {API_KEY}" for r in fake.requests)
    assert scrub(f"x {API_KEY} y") == "x sk-*** y"
    assert scrub("see http://bob:hunter2@host/v1") == "see http://***@host/v1"


def test_chat_costs_match_pricing(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.fixed_usage = (1000, 200)
    (res,) = _chat(client).extract(_requests(TEXTS[:1]))
    (call,) = res.calls
    assert (call.tokens_in, call.tokens_out) == (1000, 200)
    assert call.cost_usd == pytest.approx(1000 * 0.15e-6 + 200 * 0.60e-6)
    (res,) = _chat(client, model="gpt-4o").extract(_requests(TEXTS[:1]))
    assert res.calls[0].cost_usd == pytest.approx(1000 * 2.5e-6 + 200 * 10e-6)
    (res,) = _chat(client, model="local-llama").extract(_requests(TEXTS[:1]))
    assert res.calls[0].cost_usd == 0.0 and not is_priced("local-llama")


def test_pricing_table() -> None:
    assert call_cost("gpt-4o-mini", 1_000_000, 0, batch=False) == pytest.approx(0.15)
    assert call_cost("gpt-4o-mini", 0, 1_000_000, batch=False) == pytest.approx(0.60)
    assert call_cost("gpt-4o-mini", 1_000_000, 1_000_000, batch=True) == pytest.approx(0.375)
    assert call_cost("gpt-4o", 1_000_000, 1_000_000, batch=False) == pytest.approx(12.5)
    assert call_cost("gpt-4o", 1_000_000, 1_000_000, batch=True) == pytest.approx(6.25)
    assert call_cost("unknown-model", 10**9, 10**9, batch=False) == 0.0


# --------------------------------------------------------------------------- batch


def test_batch_happy_path_over_several_polls(
    fake: FakeOpenAI, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coinrag.tasks.extractors.openai_batch")
    fake.fixed_usage = (1000, 200)
    reqs = _requests()
    seen: list[ExtractionResult] = []
    ex = _batch(client)
    results = ex.extract(reqs, seen.append)

    assert ex.backend == "openai-batch"
    assert [r.key for r in results] == [r.key for r in reqs]
    for req, res in zip(reqs, results, strict=True):
        assert res.status == "ok" and res.candidates == _expected(req.text)
        (call,) = res.calls
        assert call.status == "ok" and call.attempt == 1
        assert call.custom_id == custom_id_for(req.key, 1) and call.batch_id
        assert call.cost_usd == pytest.approx(1000 * 0.075e-6 + 200 * 0.30e-6)
    # Once per distinct text, as it finished, with its ledger.
    assert sorted(r.key for r in seen) == sorted(r.key for r in reqs[: len(TEXTS)])
    assert all(len(r.calls) == 1 and r.status == "ok" for r in seen)
    assert len(fake.received("POST", "/v1/files")) == 1
    assert len(fake.received("POST", "/v1/batches")) == 1
    assert len(fake.received("GET", "/v1/batches/")) >= 3
    for change in ("validating -> in_progress", "in_progress -> finalizing", "-> completed"):
        assert change in caplog.text
    (lines,) = fake.uploaded_lines()
    assert [line["custom_id"] for line in lines] == [custom_id_for(r.key, 1) for r in reqs]
    line = lines[0]
    assert line["method"] == "POST" and line["url"] == "/v1/chat/completions"
    assert line["body"]["model"] == "gpt-4o-mini" and line["body"]["temperature"] == 0
    assert line["body"]["response_format"]["type"] == "json_schema"
    assert line["body"]["messages"][1]["content"].count(TEXTS[0]) == 1
    # the fingerprint differs from the chat backend's (backend is part of it)
    assert ex.fingerprint != _chat(client).fingerprint


def test_batch_output_order_shuffled_matched_by_custom_id(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    fake.plan_batch(BatchPlan(shuffle=True))
    reqs = _requests()
    results = _batch(client).extract(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.status == "ok" and res.candidates == _expected(req.text)


def test_batch_split_by_request_count_and_bytes(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    results = _batch(client, max_requests_per_batch=4).extract(_requests())
    assert all(r.status == "ok" for r in results)
    assert [len(f) for f in fake.uploaded_lines()] == [4, 2]
    fake.requests.clear()
    fake.files.clear()
    results = _batch(client, max_bytes_per_batch=1500).extract(_requests())
    assert all(r.status == "ok" for r in results)
    assert len(fake.uploaded_lines()) == len(TEXTS)  # each line is over half the cap
    assert len({c.batch_id for r in results for c in r.calls}) == len(TEXTS)


def test_batch_failed_is_resubmitted(fake: FakeOpenAI, client: openai.OpenAI) -> None:
    fake.plan_batch(BatchPlan(final="failed", failure_message="input file rejected"))
    reqs = _requests(TEXTS[:3])
    results = _batch(client).extract(reqs)
    assert all(r.status == "ok" for r in results)
    for req, res in zip(reqs, results, strict=True):
        assert _statuses(res) == ["error", "ok"]
        assert "input file rejected" in (res.calls[0].error or "")
        assert [c.custom_id for c in res.calls] == [
            custom_id_for(req.key, 1),
            custom_id_for(req.key, 2),
        ]
        assert res.calls[0].batch_id != res.calls[1].batch_id
    assert len(fake.received("POST", "/v1/batches")) == 2


def test_batch_expired_keeps_partial_output_and_resubmits_the_rest(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    fake.plan_batch(BatchPlan(final="expired", processed_fraction=0.5))
    reqs = _requests(TEXTS[:4])
    reported: list[tuple[str, int, list[str]]] = []  # (key, uploads so far, its ledger)

    def on_result(result: ExtractionResult) -> None:
        reported.append((result.key, len(fake.uploaded_lines()), _statuses(result)))

    results = _batch(client).extract(reqs, on_result)
    assert len(results) == 4 and all(r.status == "ok" for r in results)
    # The answers of the expired batch are handed over (to be persisted) before round 2 starts.
    assert reported == [
        (reqs[0].key, 1, ["ok"]),
        (reqs[1].key, 1, ["ok"]),
        (reqs[2].key, 2, ["expired", "ok"]),
        (reqs[3].key, 2, ["expired", "ok"]),
    ]
    assert [_statuses(r) for r in results] == [["ok"], ["ok"], ["expired", "ok"], ["expired", "ok"]]
    for req, res in zip(reqs, results, strict=True):
        assert res.candidates == _expected(req.text)
    first, second = fake.uploaded_lines()
    assert len(first) == 4
    assert [line["custom_id"] for line in second] == [custom_id_for(r.key, 2) for r in reqs[2:]]


def test_batch_malformed_and_line_errors_retried_then_failed_not_lost(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    plan = BatchPlan(progression=["validating"], malformed_match="Marie", error_match="Eiffel")
    fake.plan_batch(plan, BatchPlan(progression=[], malformed_match="Marie"))
    reqs = _requests(TEXTS[:4])
    results = _batch(client, max_rounds=3).extract(reqs)
    assert [r.key for r in results] == [r.key for r in reqs]
    assert [r.status for r in results] == ["ok", "malformed", "ok", "ok"]
    # malformed, then malformed again to the repair request: settled, no third round for it
    assert _statuses(results[1]) == ["malformed", "malformed"]
    assert "malformed" in (results[1].error or "") and results[1].candidates == []
    first, second = fake.uploaded_lines()
    (repair,) = [line for line in second if "Marie" in json.dumps(line)]
    assert repair["body"]["messages"][2]["role"] == "assistant"
    assert "could not be read" in repair["body"]["messages"][3]["content"]
    assert _statuses(results[3]) == ["error", "ok"]  # the 500 line, then a good answer
    assert "HTTP 500" in (results[3].calls[0].error or "")


def test_batch_salvages_the_complete_items_of_a_cut_off_line(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    first = _expected(TEXTS[1])[0]
    cut = json.dumps({"nuggets": [first, "She was born"]})[:-10]
    fake.plan_batch(BatchPlan(progression=[], malformed_match="Marie", malformed_content=cut))
    results = _batch(client).extract(_requests(TEXTS[:2]))
    assert [r.status for r in results] == ["ok", "ok"] and results[1].candidates == [first]
    assert _statuses(results[1]) == ["salvaged"] and len(fake.uploaded_lines()) == 1


def test_batch_json_schema_rejected_lines_fall_back(
    fake: FakeOpenAI, client: openai.OpenAI
) -> None:
    fake.reject_formats = {"json_schema"}
    ex = _batch(client)
    results = ex.extract(_requests(TEXTS[:2]))
    assert all(r.status == "ok" for r in results)
    assert ex.response_mode == "json_object"
    first, second = fake.uploaded_lines()
    assert first[0]["body"]["response_format"]["type"] == "json_schema"
    assert second[0]["body"]["response_format"]["type"] == "json_object"


class _Killed(BaseException):
    """Stands for the build being killed (not an Exception: nothing may swallow it)."""


def test_batch_state_path_resume_does_not_pay_twice(
    fake: FakeOpenAI, client: openai.OpenAI, tmp_path
) -> None:
    state = tmp_path / "batches.json"
    reqs = _requests(TEXTS[:3])

    def killed(_seconds: float) -> None:
        raise _Killed

    first = _batch(client, state_path=state, sleep=killed)
    with pytest.raises(_Killed):
        first.extract(reqs)  # uploaded, submitted, polled once, then killed
    recorded = json.loads(state.read_text())
    assert recorded["extractor"] == first.fingerprint
    (entry,) = recorded["batches"]
    assert entry["batch_id"] and entry["round"] == 1
    assert API_KEY not in state.read_text()

    second = _batch(client, state_path=state)
    results = second.extract(reqs)
    assert all(r.status == "ok" for r in results)
    assert {c.batch_id for r in results for c in r.calls} == {entry["batch_id"]}
    assert len(fake.received("POST", "/v1/files")) == 1  # no second upload
    assert len(fake.received("POST", "/v1/batches")) == 1  # no second batch

    # a state written by another extractor (another model) is ignored, not reused
    other = _batch(client, state_path=state, model="gpt-4o")
    assert all(r.status == "ok" for r in other.extract(reqs))
    assert len(fake.received("POST", "/v1/batches")) == 2


def test_batch_resume_after_upload_before_create(
    fake: FakeOpenAI, client: openai.OpenAI, tmp_path
) -> None:
    state = tmp_path / "batches.json"
    reqs = _requests(TEXTS[:2])
    ex = _batch(client, state_path=state)
    original = ex._create_batch

    def crash(job) -> None:
        raise _Killed

    ex._create_batch = crash  # killed between the upload and batches.create
    with pytest.raises(_Killed):
        ex.extract(reqs)
    ex._create_batch = original
    results = _batch(client, state_path=state).extract(reqs)
    assert all(r.status == "ok" for r in results)
    assert len(fake.received("POST", "/v1/files")) == 1
    assert len(fake.received("POST", "/v1/batches")) == 1


def test_batch_unreachable_endpoint_fails_every_request(client: openai.OpenAI) -> None:
    assert _batch(client).extract([]) == []
    bad = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=API_KEY)
    res = _batch(bad, max_attempts=2, max_rounds=2, timeout_s=1.0).extract(_requests(TEXTS[:2]))
    assert [r.status for r in res] == ["failed", "failed"]
    assert [c.status for c in res[0].calls] == ["error", "error"]
    assert "upload failed" in (res[0].error or "")
