"""Nugget extraction through the chat completions endpoint (backend ``openai``).

Works with api.openai.com and with any OpenAI-compatible server (``base_url=``). The official
``openai.OpenAI`` client reads ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` itself; its own retries
are switched off (``max_retries=0``) so that every HTTP attempt is retried, timed and ledgered
here, as one :class:`~inference.llm.client.CallRecord` each (the client, retries, error
classes and scrubbing are ``inference/llm/client.py``'s, shared with self-study).

Retries: 429 (honouring ``Retry-After`` / ``retry-after-ms``), 5xx, 408/409, timeouts and
connection errors, with exponential backoff and jitter, up to ``max_attempts`` per request; after
the last attempt the result is ``status="failed"`` with the reason (transient: the next build
asks again), never an empty success. 401/403/404 and ``insufficient_quota`` are fatal: the
remaining requests of the run fail at once instead of hammering the endpoint.

A malformed answer (``parse_nuggets`` raises) is content, not an accident: the same request
would get the same answer. Its complete string items are kept when there are any
(``salvage_nuggets``: the call is ledgered ``salvaged``, the result is ``ok``); otherwise it is
asked again only with *other* requests (:func:`content_variants`): a repair request quoting the
parse error, then that repair in the next response format where there is one. When those are
malformed too the result is ``status="malformed"`` (``tasks/extract.py`` settles it across
builds). Every reply and transport failure counts against ``max_attempts``.

Response format (``structured``): ``True`` asks for ``json_schema`` structured outputs, ``False``
for plain prompting; ``None`` (default) tries ``json_schema``, and on a 400 saying the endpoint
does not support it falls back to ``json_object``, then to plain prompting, and keeps that
decision for the rest of the extractor's life. The fingerprint holds the *requested* mode.

The API key never appears in a ledger row, a log line or an error message produced here: every
text coming from the client is passed through ``inference.llm.client.scrub``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import openai

from coinrag.inference.llm.calls import ConcurrentCalls
from coinrag.inference.llm.client import (
    CallRecord,
    LlmEndpoint,
    MalformedResponse,
    RetryPolicy,
    classify_error,
    content_of,
    usage_of,
)
from coinrag.schemas.keys import fingerprint as _fingerprint
from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    Extractor,
    ResultFn,
    ResultReporter,
)
from coinrag.tasks.extractors.prompt import (
    PROMPT_VERSION,
    RESPONSE_SCHEMA,
    build_messages,
    parse_nuggets,
    repair_messages,
    salvage_nuggets,
)

log = logging.getLogger(__name__)

MODE_JSON_SCHEMA = "json_schema"
MODE_JSON_OBJECT = "json_object"
MODE_PROMPT = "prompt"
_NEXT_MODE = {MODE_JSON_SCHEMA: MODE_JSON_OBJECT, MODE_JSON_OBJECT: MODE_PROMPT}

# --------------------------------------------------------------------------- shared helpers
# (also used by openai_batch)


def requested_format(structured: bool | None) -> str:
    """The response-format mode asked for: ``auto`` (None), ``json_schema`` or ``prompt``."""
    if structured is None:
        return "auto"
    return MODE_JSON_SCHEMA if structured else MODE_PROMPT


def response_format_param(mode: str) -> dict[str, Any] | None:
    """The ``response_format`` request field for a mode (``None`` for plain prompting)."""
    if mode == MODE_JSON_SCHEMA:
        return {"type": "json_schema", "json_schema": RESPONSE_SCHEMA}
    if mode == MODE_JSON_OBJECT:
        return {"type": "json_object"}
    return None


def content_variants(mode: str) -> list[str]:
    """The response formats of the repair requests after a malformed reply in ``mode``: the
    same mode, then the next one (json_schema -> json_object -> prompt) where there is one. A
    reply to the last one that is malformed too ends the chunk text's attempts in this build."""
    nxt = _NEXT_MODE.get(mode)
    return [mode, nxt] if nxt is not None else [mode]


def extractor_fingerprint(backend: str, model: str, temperature: float, fmt: str) -> str:
    """Fingerprint of an OpenAI extractor: no key, no base URL."""
    return _fingerprint(
        "extractor",
        {
            "backend": backend,
            "model": model,
            "prompt_version": PROMPT_VERSION,
            "temperature": float(temperature),
            "response_format": fmt,
        },
    )


def group_requests(
    requests: Sequence[ExtractionRequest],
) -> tuple[dict[str, ExtractionRequest], dict[str, list[int]]]:
    """Unique requests by key (the same text is asked once) and the indices each key serves."""
    unique: dict[str, ExtractionRequest] = {}
    where: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        unique.setdefault(req.key, req)
        where.setdefault(req.key, []).append(i)
    return unique, where


def spread_results(
    n: int, where: dict[str, list[int]], by_key: dict[str, ExtractionResult]
) -> list[ExtractionResult]:
    """One result per request, in request order. A key asked several times carries its ledger
    rows on its first occurrence only (so summing the calls of all results counts each once)."""
    out: list[ExtractionResult | None] = [None] * n
    for key, indices in where.items():
        result = by_key[key]
        out[indices[0]] = result
        for i in indices[1:]:
            out[i] = replace(result, candidates=list(result.candidates), calls=[])
    return [r for r in out if r is not None]


# --------------------------------------------------------------------------- the extractor


class OpenAIExtractor(Extractor):
    """What the two OpenAI backends share: the prompt, answers staged as they arrive, and the
    fingerprint (no key, no URL)."""

    stage_answers = True
    prompt_version = PROMPT_VERSION
    endpoint: LlmEndpoint
    temperature: float
    structured: bool | None  # None: json_schema, falling back as the endpoint requires

    @property
    def fingerprint(self) -> str:
        """keys.fingerprint("extractor", backend, model, prompt version, temperature, format)."""
        return extractor_fingerprint(
            self.backend, self.llm_model, self.temperature, requested_format(self.structured)
        )

    def request_body(self, messages: list[dict[str, str]], mode: str) -> dict[str, Any]:
        """The ``chat.completions.create`` arguments of one request (a Batch API line's
        ``body``): model, ``messages``, temperature, and the ``response_format`` of ``mode``
        (none for ``prompt``)."""
        body: dict[str, Any] = {
            "model": self.llm_model,
            "messages": messages,
            "temperature": self.temperature,
        }
        fmt = response_format_param(mode)
        if fmt is not None:
            body["response_format"] = fmt
        return body


class OpenAIChatExtractor(OpenAIExtractor, ConcurrentCalls, name="openai"):
    """Extract nuggets with ``chat.completions.create``, ``concurrency`` requests at a time."""

    def __init__(
        self,
        endpoint: LlmEndpoint | None = None,
        *,
        concurrency: int = 8,
        temperature: float = 0.0,
        structured: bool | None = None,
    ) -> None:
        """``endpoint``: the model, its client (``timeout_s`` per request) and retry policy
        (default: gpt-4o-mini through a new ``openai.OpenAI`` reading the environment's key and
        URL, 60 s, :class:`RetryPolicy` defaults); ``concurrency`` requests at a time."""
        ConcurrentCalls.__init__(self, endpoint, concurrency, timeout_s=60.0)
        self.temperature = temperature
        self.structured = structured
        self._mode = MODE_PROMPT if structured is False else MODE_JSON_SCHEMA

    @classmethod
    def from_settings(
        cls, settings: BuildSettings, state_dir: str | None = None
    ) -> OpenAIChatExtractor:
        """``llm_model``, ``concurrency``, ``max_attempts``, ``request_timeout`` (seconds)."""
        retry = RetryPolicy(max_attempts=settings.max_attempts)
        endpoint = LlmEndpoint(settings.llm_model, timeout_s=settings.request_timeout, retry=retry)
        return cls(endpoint, concurrency=settings.concurrency)

    @property
    def response_mode(self) -> str:
        """The response format in use now (after any fallback): json_schema|json_object|prompt."""
        with self._lock:
            return self._mode

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in order; ``on_result(result)`` as each key finishes."""
        unique, where = group_requests(requests)
        report = ResultReporter(on_result)

        def run(req: ExtractionRequest) -> ExtractionResult:
            try:
                result = self._extract_one(req)
            except Exception as exc:  # never let one chunk sink the run
                msg = self.endpoint.describe(exc)
                log.error("extraction of %s crashed: %s", req.key, msg)
                result = ExtractionResult(key=req.key, status="failed", error=msg)
            report(result)
            return result

        results = self.each(run, list(unique.values()), "openai-extract")
        return spread_results(len(requests), where, dict(zip(unique, results, strict=True)))

    # ----------------------------------------------------------------------- internals

    def _downgrade(self, failed_mode: str) -> str:
        """Move past ``failed_mode`` (once, whichever thread sees it first); the mode to use."""
        with self._lock:
            if self._mode == failed_mode and failed_mode in _NEXT_MODE:
                self._mode = _NEXT_MODE[failed_mode]
                log.warning(
                    "endpoint rejects response_format %s; using %s from now on",
                    failed_mode,
                    self._mode,
                )
            return self._mode

    def _format_unsupported(self, exc: BaseException, mode: str) -> bool:
        if self.structured is not None or mode == MODE_PROMPT:
            return False
        if not isinstance(exc, openai.APIStatusError) or exc.status_code not in (400, 422):
            return False
        text = f"{exc} {getattr(exc, 'param', '') or ''}".lower()
        return any(word in text for word in ("response_format", "json_schema", "json_object"))

    def _extract_one(self, req: ExtractionRequest) -> ExtractionResult:
        calls: list[CallRecord] = []
        messages = build_messages(req.text)
        attempt = 0  # every HTTP attempt, for the ledger
        spent = 0  # attempts that count against max_attempts (format fallbacks do not)
        failures = 0  # consecutive transport failures, for the backoff
        repairs: list[str] | None = None  # formats of the repair requests still to send
        repair_mode: str | None = None  # the format of the repair request being sent
        while True:
            if (aborted := self.aborted) is not None:
                return ExtractionResult(req.key, "failed", error=aborted, calls=calls)
            with self._lock:
                mode = self._mode if repair_mode is None else repair_mode
            attempt += 1
            kwargs = self.request_body(messages, mode)
            started_at = datetime.now(UTC)
            t0 = time.perf_counter()
            try:
                completion = self.endpoint.client.chat.completions.create(**kwargs)
            except Exception as exc:
                msg = self.endpoint.describe(exc)
                if self._format_unsupported(exc, mode):
                    new_mode = self._downgrade(mode)
                    if repair_mode is not None:  # this repair's own format: the next one
                        repair_mode = new_mode = _NEXT_MODE[mode]
                    note = f"response_format {mode} unsupported, falling back to {new_mode}: {msg}"
                    rec = self.endpoint.record(
                        req.key, attempt, "error", started_at, t0, error=note
                    )
                    calls.append(rec)
                    continue
                status, retryable, fatal = classify_error(exc)
                rec = self.endpoint.record(req.key, attempt, status, started_at, t0, error=msg)
                calls.append(rec)
                spent += 1
                failures += 1
                if fatal:
                    self.stop_run(msg)
                    return ExtractionResult(req.key, "failed", error=msg, calls=calls)
                if not retryable or spent >= self.endpoint.retry.max_attempts:
                    error = f"{status} after {spent} attempt(s): {msg}"
                    log.warning("%s failed: %s", req.key, error)
                    return ExtractionResult(req.key, "failed", error=error, calls=calls)
                delay = self.endpoint.retry.delay(failures, exc)
                log.warning("%s attempt %d: %s; retrying in %.2fs", req.key, attempt, msg, delay)
                self.endpoint.retry.sleep(delay)
                continue

            failures = 0
            tokens_in, tokens_out = usage_of(completion)
            content = content_of(completion)
            try:
                nuggets = parse_nuggets(content)
            except MalformedResponse as exc:
                spent += 1
                salvaged = salvage_nuggets(content)
                status = "salvaged" if salvaged else "malformed"
                note = f" ({len(salvaged)} items salvaged)" if salvaged else ""
                msg = self.endpoint.scrub(f"malformed answer{note}: {exc}")
                rec = self.endpoint.record(
                    req.key, attempt, status, started_at, t0, tokens_in, tokens_out, msg
                )
                calls.append(rec)
                if salvaged:
                    log.info("%s attempt %d: %s", req.key, attempt, msg)
                    return ExtractionResult(req.key, "ok", candidates=salvaged, calls=calls)
                if repairs is None:  # structured=True/False: the format asked for, only
                    repairs = content_variants(mode) if self.structured is None else [mode]
                if not repairs or spent >= self.endpoint.retry.max_attempts:
                    error = self.endpoint.scrub(f"malformed after {spent} attempt(s): {exc}")
                    log.warning("%s: %s", req.key, error)
                    return ExtractionResult(req.key, "malformed", error=error, calls=calls)
                repair_mode = repairs.pop(0)
                messages = repair_messages(req.text, content, str(exc))
                log.info("%s attempt %d: %s; asking with a repair request", req.key, attempt, msg)
                continue
            rec = self.endpoint.record(
                req.key, attempt, "ok", started_at, t0, tokens_in, tokens_out
            )
            calls.append(rec)
            return ExtractionResult(req.key, "ok", candidates=nuggets, calls=calls)
