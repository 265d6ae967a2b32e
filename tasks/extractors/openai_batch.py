"""Nugget extraction through the OpenAI Batch API (backend ``openai-batch``): half the price,
answers within 24 h.

One run of :meth:`OpenAIBatchExtractor.extract` goes in *rounds*. In each round the requests
still pending are written as Batch API JSONL (one line per request, ``custom_id`` =
:func:`custom_id_for` of the request key and the round), split into several batches when they
exceed ``max_requests_per_batch`` lines or ``max_bytes_per_batch`` bytes, uploaded
(``files.create(purpose="batch")``) and submitted (``batches.create``). The batches are polled
every ``poll_interval_s`` seconds through all their statuses (``validating``, ``in_progress``,
``finalizing``, ``cancelling`` and the terminal ``completed``, ``failed``, ``expired``,
``cancelled``), with a log line per change. Then the output and error files are downloaded and
matched to the requests **by custom_id** (their order is irrelevant). Whatever failed or is
missing is submitted again in the next round, up to ``max_rounds``; an expired or cancelled
batch keeps the answers it did produce. After the last round the leftovers are
``status="failed"`` with the last reason: no chunk is ever lost.

A malformed answer is content (the same request gets the same answer): its complete string
items are kept when there are any (``salvage_nuggets``; ledger status ``salvaged``), else the
next round sends a *repair* request (the reply and its parse error quoted back,
``prompt.repair_messages``), and a malformed answer to that settles the request as
``status="malformed"`` (``tasks/extract.py`` settles those across builds).

Ledger: one :class:`~inference.llm.client.CallRecord` per request per round (``attempt`` = the
round), with ``custom_id``, ``batch_id``, tokens from the answer's ``usage`` and the cost at batch
prices; status ``ok``, ``salvaged``, ``malformed``, ``expired`` or ``error``.

Resuming (``state_path``, ``batch_state.py``): the uploaded files and submitted batches are
recorded in a JSON file as soon as they exist (written atomically). A build that is killed and
restarted with the same ``state_path`` and the same extractor fingerprint polls those batches
again instead of uploading and paying a second time: a recorded batch of round *r* serves, in
round *r*, every still-pending request it contains; only the requests no recorded batch covers
are submitted. A state written by an extractor with another fingerprint is ignored (and
replaced).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from coinrag.inference.llm.client import (
    CallRecord,
    LlmEndpoint,
    MalformedResponse,
    RetryPolicy,
    classify_error,
    new_call_id,
)
from coinrag.inference.llm.pricing import call_cost
from coinrag.schemas.keys import sha256_hex
from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    ResultFn,
    ResultReporter,
)
from coinrag.tasks.extractors.batch_state import BatchJob as _Job
from coinrag.tasks.extractors.batch_state import load_jobs, save_jobs
from coinrag.tasks.extractors.openai_chat import (
    MODE_JSON_SCHEMA,
    MODE_PROMPT,
    OpenAIExtractor,
    group_requests,
    spread_results,
)
from coinrag.tasks.extractors.prompt import (
    build_messages,
    parse_nuggets,
    repair_messages,
    salvage_nuggets,
)

log = logging.getLogger(__name__)

ENDPOINT = "/v1/chat/completions"
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})

_NEXT_MODE = {MODE_JSON_SCHEMA: "json_object", "json_object": MODE_PROMPT}
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,48}$")

T = TypeVar("T")


def custom_id_for(key: str, round_: int) -> str:
    """Deterministic ``custom_id`` of a request key in a round: ``<key>-r<round>`` (a hash of the
    key stands in for a long or unusual key)."""
    base = key if _SAFE_ID.match(key) else "k-" + sha256_hex("custom-id", key)[:24]
    return f"{base}-r{round_}"


_ANSWERED = frozenset({"ok", "salvaged"})  # outcomes whose candidates are the answer


@dataclass
class _Outcome:
    status: str  # ok | salvaged | malformed | error | expired
    tokens_in: int = 0
    tokens_out: int = 0
    candidates: list[str] | None = None
    error: str | None = None
    reply: str | None = None  # a malformed answer's content (quoted back by its repair)
    parse_error: str | None = None  # why it did not parse


class OpenAIBatchExtractor(OpenAIExtractor, name="openai-batch"):
    """Extract nuggets with the Batch API; resubmits what fails; resumable via ``state_path``."""

    takes_all_at_once = True

    def __init__(
        self,
        endpoint: LlmEndpoint | None = None,
        *,
        temperature: float = 0.0,
        structured: bool | None = None,
        poll_interval_s: float = 30.0,
        max_rounds: int = 3,
        max_requests_per_batch: int = 50_000,
        max_bytes_per_batch: int = 190_000_000,
        state_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """``endpoint``: the model, its client (``timeout_s`` per request) and the retry policy
        of each API call (upload, create, poll, download); default: gpt-4o-mini through a new
        ``openai.OpenAI`` reading the environment's key and URL, 120 s. ``state_path`` keeps
        the submitted batch ids (a killed build polls them again)."""
        if max_rounds < 1 or max_requests_per_batch < 1 or max_bytes_per_batch < 1:
            raise ValueError("max_rounds, max_requests_per_batch, max_bytes_per_batch must be >= 1")
        self.endpoint = endpoint or LlmEndpoint("gpt-4o-mini", timeout_s=120.0)
        self.llm_model = self.endpoint.model
        self.temperature = temperature
        self.structured = structured
        self.poll_interval_s = poll_interval_s
        self.max_rounds = max_rounds
        self.max_requests_per_batch = max_requests_per_batch
        self.max_bytes_per_batch = max_bytes_per_batch
        self.state_path = Path(state_path) if state_path is not None else None
        self._lock = threading.Lock()
        self._mode = MODE_PROMPT if structured is False else MODE_JSON_SCHEMA
        self._state_jobs: list[_Job] = []
        self._repairs: dict[str, tuple[str | None, str]] = {}
        self._last_malformed: dict[str, bool] = {}

    @classmethod
    def from_settings(
        cls, settings: BuildSettings, state_dir: str | None = None
    ) -> OpenAIBatchExtractor:
        """``llm_model``, ``batch_poll_interval`` (seconds), ``batch_max_rounds``,
        ``max_attempts``; the submitted batch ids kept in ``state_dir`` (a killed build polls
        its batches again instead of paying twice)."""
        retry = RetryPolicy(max_attempts=settings.max_attempts)
        return cls(
            LlmEndpoint(settings.llm_model, timeout_s=120.0, retry=retry),
            poll_interval_s=settings.batch_poll_interval,
            max_rounds=settings.batch_max_rounds,
            state_path=f"{state_dir}/openai-batch-state.json" if state_dir else None,
        )

    @property
    def response_mode(self) -> str:
        """The response format the next batch will ask for: json_schema|json_object|prompt."""
        return self._mode

    # ----------------------------------------------------------------------- the run

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in order; ``on_result(result)`` for each key as soon as it
        is settled: the ok answers of a batch when its output is collected, the leftovers after
        the last round."""
        if not requests:
            return []
        unique, where = group_requests(requests)
        pending: dict[str, ExtractionRequest] = dict(unique)
        calls: dict[str, list[CallRecord]] = {key: [] for key in unique}
        last_error: dict[str, str] = {}
        done: dict[str, ExtractionResult] = {}
        self._repairs: dict[str, tuple[str | None, str]] = {}  # key -> (reply, parse error)
        self._last_malformed: dict[str, bool] = {}  # key -> its last outcome was malformed
        report = ResultReporter(on_result)

        def finished(keys: list[str]) -> None:
            for key in keys:  # a settled key gets no more calls: its ledger is complete
                done[key].calls = list(calls[key])
                report(done[key])

        recorded = [
            job for job in self._load_state() if any(k in unique for k in job.custom_ids.values())
        ]
        self._state_jobs = list(recorded)

        for round_ in range(1, self.max_rounds + 1):
            if not pending:
                break
            jobs: list[_Job] = []
            covered: set[str] = set()
            for job in recorded:
                if job.round != round_:
                    continue
                job.serves = {}
                for cid, key in job.custom_ids.items():
                    if key in pending and key not in covered:
                        job.serves[cid] = key
                        covered.add(key)
                if job.serves:
                    jobs.append(job)
            if jobs:
                log.info(
                    "round %d: resuming %d recorded batch(es) for %d request(s)",
                    round_,
                    len(jobs),
                    len(covered),
                )
                for job in jobs:
                    if job.batch_id is None and job.input_file_id is not None:
                        self._create_batch(job)
            to_send = [req for key, req in pending.items() if key not in covered]
            if to_send:
                jobs.extend(self._submit(to_send, round_))
            self._wait(jobs)
            for job in jobs:
                settled = self._collect(job, pending, done, calls, last_error)
                finished(settled)

        leftovers = list(pending)
        for key in leftovers:
            reason = last_error.get(key, "no answer")
            done[key] = ExtractionResult(
                key=key,
                # the last round's answer was content, not an accident: a content failure
                status="malformed" if self._last_malformed.get(key) else "failed",
                error=f"no valid answer after {self.max_rounds} round(s): {reason}",
            )
            log.warning("%s failed: %s", key, done[key].error)
        finished(leftovers)
        return spread_results(len(requests), where, done)

    # ----------------------------------------------------------------------- submitting

    def _request_line(self, custom_id: str, req: ExtractionRequest, mode: str) -> bytes:
        repair = self._repairs.get(req.key)
        if repair is None:
            messages = build_messages(req.text)
        else:
            messages = repair_messages(req.text, *repair)
        body = self.request_body(messages, mode)
        line = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": body}
        return (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")

    def _split(self, lines: list[tuple[str, str, bytes]]) -> Iterator[list[tuple[str, str, bytes]]]:
        group: list[tuple[str, str, bytes]] = []
        size = 0
        for item in lines:
            n = len(item[2])
            if group and (
                len(group) >= self.max_requests_per_batch or size + n > self.max_bytes_per_batch
            ):
                yield group
                group, size = [], 0
            group.append(item)
            size += n
        if group:
            yield group

    def _submit(self, requests: list[ExtractionRequest], round_: int) -> list[_Job]:
        """Write, upload and submit the requests of a round; one job per batch."""
        mode = self._mode
        lines: list[tuple[str, str, bytes]] = []
        too_big: list[_Job] = []
        for req in requests:
            cid = custom_id_for(req.key, round_)
            data = self._request_line(cid, req, mode)
            if len(data) > self.max_bytes_per_batch:
                job = _Job(round=round_, custom_ids={cid: req.key}, mode=mode)
                job.serves = dict(job.custom_ids)
                job.status = "failed"
                job.error = f"request line of {len(data)} bytes exceeds max_bytes_per_batch"
                too_big.append(job)
                continue
            lines.append((cid, req.key, data))
        jobs: list[_Job] = []
        for i, group in enumerate(self._split(lines)):
            job = _Job(round=round_, custom_ids={cid: key for cid, key, _ in group}, mode=mode)
            job.serves = dict(job.custom_ids)
            payload = b"".join(data for _, _, data in group)
            name = f"coinrag-{self.fingerprint}-r{round_}-{i}.jsonl"
            try:
                uploaded = self._api(
                    "upload",
                    lambda payload=payload, name=name: self.endpoint.client.files.create(
                        file=(name, payload, "application/jsonl"), purpose="batch"
                    ),
                )
            except Exception as exc:
                job.status = "failed"
                job.error = f"upload failed: {self.endpoint.describe(exc)}"
                log.error("round %d batch %d: %s", round_, i, job.error)
                jobs.append(job)
                continue
            job.input_file_id = uploaded.id
            self._state_jobs.append(job)
            self._save_state()  # a kill from here on reuses the uploaded file
            log.info(
                "round %d: uploaded %s (%d requests, %d bytes)",
                round_,
                uploaded.id,
                len(group),
                len(payload),
            )
            self._create_batch(job)
            jobs.append(job)
        return too_big + jobs

    def _create_batch(self, job: _Job) -> None:
        file_id = job.input_file_id
        assert file_id is not None
        try:
            batch = self._api(
                "create batch",
                lambda: self.endpoint.client.batches.create(
                    input_file_id=file_id,
                    endpoint=ENDPOINT,
                    completion_window="24h",
                    metadata={"coinrag_extractor": self.fingerprint, "round": str(job.round)},
                ),
            )
        except Exception as exc:
            job.status = "failed"
            job.error = f"batch creation failed: {self.endpoint.describe(exc)}"
            log.error("round %d: %s", job.round, job.error)
            return
        job.batch_id = batch.id
        job.batch = batch
        job.status = batch.status
        job.submitted_at = time.time()
        self._save_state()
        log.info("round %d: batch %s submitted (%s)", job.round, batch.id, batch.status)

    # ----------------------------------------------------------------------- polling

    def _wait(self, jobs: list[_Job]) -> None:
        """Poll every job with a batch until all are terminal."""
        while True:
            active = [j for j in jobs if j.batch_id and j.status not in TERMINAL_STATUSES]
            if not active:
                return
            for job in active:
                self._poll(job)
            if all(j.status in TERMINAL_STATUSES for j in active):
                return
            self.endpoint.retry.sleep(self.poll_interval_s)

    def _poll(self, job: _Job) -> None:
        batch_id = job.batch_id
        assert batch_id is not None
        try:
            batch = self._api("poll", lambda: self.endpoint.client.batches.retrieve(batch_id))
        except Exception as exc:
            msg = self.endpoint.describe(exc)
            job.poll_failures += 1
            status, retryable, _ = classify_error(exc)
            if not retryable or job.poll_failures >= self.endpoint.retry.max_attempts:
                job.status = "failed"
                job.error = f"could not poll batch {batch_id}: {msg}"
                log.error("round %d: %s", job.round, job.error)
            else:
                log.warning(
                    "round %d: polling %s failed (%s); will retry", job.round, batch_id, msg
                )
            return
        job.poll_failures = 0
        job.batch = batch
        if batch.status != job.status:
            counts = batch.request_counts
            done = (
                f"{counts.completed}/{counts.total} done, {counts.failed} failed" if counts else ""
            )
            log.info(
                "round %d: batch %s %s -> %s %s",
                job.round,
                batch_id,
                job.status,
                batch.status,
                done,
            )
            job.status = batch.status

    # ----------------------------------------------------------------------- results

    def _download(self, file_id: str) -> str:
        return self._api("download", lambda: self.endpoint.client.files.content(file_id)).text

    def _collect(
        self,
        job: _Job,
        pending: dict[str, ExtractionRequest],
        done: dict[str, ExtractionResult],
        calls: dict[str, list[CallRecord]],
        last_error: dict[str, str],
    ) -> list[str]:
        """Ledger a job's requests, settle the good ones and those whose repair request was
        malformed too; the keys settled."""
        outcomes: dict[str, _Outcome] = {}
        problems: list[str] = []
        batch = job.batch
        if batch is not None and job.error is None:
            for file_id in (batch.output_file_id, batch.error_file_id):
                if not file_id:
                    continue
                try:
                    text = self._download(file_id)
                except Exception as exc:
                    problems.append(f"download of {file_id} failed: {self.endpoint.describe(exc)}")
                    continue
                for line in text.splitlines():
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        log.warning("batch %s: unreadable result line skipped", job.batch_id)
                        continue
                    cid = row.get("custom_id") if isinstance(row, dict) else None
                    if cid not in job.serves:
                        continue
                    previous = outcomes.get(cid)
                    if previous is not None and previous.status == "ok":
                        continue
                    outcomes[cid] = self._parse_line(row, job)
        default = self._default_outcome(job, problems)
        started_at, latency_ms = self._timing(job)
        ok_keys: list[str] = []
        given_up: list[str] = []
        for cid, key in job.serves.items():
            outcome = outcomes.get(cid, default)
            error = self.endpoint.scrub(outcome.error) if outcome.error else None
            calls[key].append(
                CallRecord(
                    call_id=new_call_id(),
                    key=key,
                    attempt=job.round,
                    status=outcome.status,
                    tokens_in=outcome.tokens_in,
                    tokens_out=outcome.tokens_out,
                    cost_usd=call_cost(
                        self.llm_model, outcome.tokens_in, outcome.tokens_out, batch=True
                    ),
                    latency_ms=latency_ms,
                    started_at=started_at,
                    error=error,
                    custom_id=cid,
                    batch_id=job.batch_id,
                )
            )
            if key not in pending:
                continue
            if outcome.status in _ANSWERED:
                del pending[key]
                done[key] = ExtractionResult(
                    key=key, status="ok", candidates=outcome.candidates or []
                )
                ok_keys.append(key)
            elif outcome.status == "malformed" and key in self._repairs:  # the repair too
                del pending[key]
                done[key] = ExtractionResult(
                    key=key,
                    status="malformed",
                    error=f"malformed after a repair request (round {job.round}): {error}",
                )
                log.warning("%s: %s", key, done[key].error)
                given_up.append(key)
            else:
                last_error[key] = f"round {job.round}: {outcome.status}: {error}"
                self._last_malformed[key] = outcome.status == "malformed"
                if outcome.status == "malformed":
                    self._repairs[key] = (outcome.reply, outcome.parse_error or "malformed")
        n_ok = len(ok_keys)
        log.info(
            "round %d: batch %s (%s): %d ok, %d malformed after a repair, %d to retry",
            job.round,
            job.batch_id,
            job.status,
            n_ok,
            len(given_up),
            len(job.serves) - n_ok - len(given_up),
        )
        return ok_keys + given_up

    def _default_outcome(self, job: _Job, problems: list[str]) -> _Outcome:
        """The outcome of a request with no line in the output or error file."""
        if job.error is not None:
            return _Outcome("error", error=job.error)
        batch = job.batch
        extra = ("; " + "; ".join(problems)) if problems else ""
        if job.status == "failed":
            reasons = []
            errors = getattr(batch, "errors", None)
            for err in getattr(errors, "data", None) or []:
                reasons.append(f"{err.code}: {err.message}")
            why = "; ".join(reasons) or "no reason given"
            return _Outcome("error", error=f"batch {job.batch_id} failed: {why}{extra}")
        if job.status == "expired":
            return _Outcome("expired", error=f"batch {job.batch_id} expired{extra}")
        if job.status == "cancelled":
            return _Outcome("error", error=f"batch {job.batch_id} cancelled{extra}")
        return _Outcome(
            "error", error=f"missing from the output of batch {job.batch_id} ({job.status}){extra}"
        )

    def _parse_line(self, row: dict[str, Any], job: _Job) -> _Outcome:
        """One line of an output or error file."""
        tokens_in = tokens_out = 0
        try:
            response = row.get("response") or {}
            body = response.get("body") if isinstance(response, dict) else None
            usage = body.get("usage") if isinstance(body, dict) else None
            tokens_in = int((usage or {}).get("prompt_tokens") or 0)
            tokens_out = int((usage or {}).get("completion_tokens") or 0)
            err = row.get("error")
            if err:
                code = err.get("code") if isinstance(err, dict) else None
                message = err.get("message") if isinstance(err, dict) else str(err)
                status = "expired" if code == "batch_expired" else "error"
                return _Outcome(status, tokens_in, tokens_out, error=f"{code}: {message}")
            status_code = response.get("status_code")
            if status_code != 200:
                body_error = (body or {}).get("error") if isinstance(body, dict) else None
                message = (
                    body_error.get("message") if isinstance(body_error, dict) else str(body_error)
                )
                if status_code in (400, 422):
                    self._maybe_downgrade(job.mode, f"{message} {body_error}")
                return _Outcome(
                    "error", tokens_in, tokens_out, error=f"HTTP {status_code}: {message}"
                )
            message = body["choices"][0]["message"]
            if message.get("refusal"):
                raise MalformedResponse(f"refusal: {message['refusal']}")
            content = message.get("content")
            try:
                candidates = parse_nuggets(content)
            except MalformedResponse as exc:
                salvaged = salvage_nuggets(content)
                if salvaged:
                    error = f"malformed answer ({len(salvaged)} items salvaged): {exc}"
                    return _Outcome("salvaged", tokens_in, tokens_out, salvaged, error)
                return _Outcome(
                    "malformed",
                    tokens_in,
                    tokens_out,
                    error=f"malformed answer: {exc}",
                    reply=content,
                    parse_error=str(exc),
                )
        except MalformedResponse as exc:
            return _Outcome("malformed", tokens_in, tokens_out, error=f"malformed answer: {exc}")
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            return _Outcome(
                "malformed", error=f"unexpected result line: {self.endpoint.describe(exc)}"
            )
        return _Outcome("ok", tokens_in, tokens_out, candidates=candidates)

    def _maybe_downgrade(self, mode: str, text: str) -> None:
        """With ``structured=None``, a 400 about the response format moves the next rounds to
        the next mode (json_schema -> json_object -> prompt)."""
        if self.structured is not None or mode not in _NEXT_MODE:
            return
        lowered = text.lower()
        if not any(w in lowered for w in ("response_format", "json_schema", "json_object")):
            return
        with self._lock:
            if self._mode == mode:
                self._mode = _NEXT_MODE[mode]
                log.warning(
                    "endpoint rejects response_format %s; next batches use %s", mode, self._mode
                )

    @staticmethod
    def _timing(job: _Job) -> tuple[datetime, float]:
        """When a job's requests started (batch creation) and how long the batch took."""
        batch = job.batch
        created = getattr(batch, "created_at", None) or job.submitted_at
        ended = None
        for name in ("completed_at", "failed_at", "expired_at", "cancelled_at"):
            ended = getattr(batch, name, None) or ended
        end = float(ended) if ended else time.time()
        return datetime.fromtimestamp(float(created), UTC), max(0.0, (end - created) * 1000.0)

    # ----------------------------------------------------------------------- plumbing

    def _api(self, what: str, fn: Callable[[], T]) -> T:
        """Call the API with retries (429 with Retry-After, 5xx, timeouts, connection errors)."""
        failures = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                failures += 1
                _, retryable, _ = classify_error(exc)
                if not retryable or failures >= self.endpoint.retry.max_attempts:
                    raise
                delay = self.endpoint.retry.delay(failures, exc)
                log.warning(
                    "%s failed (%s); retrying in %.2fs",
                    what,
                    self.endpoint.describe(exc),
                    delay,
                )
                self.endpoint.retry.sleep(delay)

    def _load_state(self) -> list[_Job]:
        return load_jobs(self.state_path, self.fingerprint)

    def _save_state(self) -> None:
        save_jobs(self.state_path, self.fingerprint, self.llm_model, self._state_jobs)
