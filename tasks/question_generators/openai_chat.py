"""Questions from chat completions (backend ``openai``): GPT-4o-mini or any OpenAI-compatible
endpoint, through ``inference/llm/client.py`` as the extractors use it (client without its own
retries, retries with backoff and ``Retry-After``, fatal errors stop the run, secrets scrubbed);
every HTTP attempt is a ledger row (``extraction_calls``, backend ``selfstudy-openai``). An
answer that is not a JSON array is ``malformed`` (cached, not retried; ``accept.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from coinrag.inference.llm.calls import ConcurrentCalls
from coinrag.inference.llm.client import (
    CallRecord,
    LlmEndpoint,
    MalformedResponse,
    classify_error,
    content_of,
    usage_of,
)
from coinrag.schemas.settings import CartridgeSettings
from coinrag.tasks.question_generators.accept import (
    ACCEPTS_VERSION,
    MalformedQuestions,
    parse_questions,
)
from coinrag.tasks.question_generators.base import (
    QuestionGenerator,
    QuestionRequest,
    QuestionResult,
    QuestionsDone,
)
from coinrag.tasks.question_generators.prompt import build_question_messages


class OpenAIQuestionGenerator(QuestionGenerator, ConcurrentCalls, name="openai"):
    """Questions from chat completions (GPT-4o-mini or any OpenAI-compatible endpoint)."""

    def __init__(
        self,
        endpoint: LlmEndpoint | None = None,
        *,
        n_questions: int = 20,
        temperature: float = 1.0,
        concurrency: int = 8,
    ) -> None:
        """``endpoint``: the model, its client (``timeout_s`` per request) and retry policy
        (default: gpt-4o-mini through a new ``openai.OpenAI`` reading the environment's key and
        URL, 120 s); ``concurrency`` requests at a time."""
        ConcurrentCalls.__init__(self, endpoint, concurrency, timeout_s=120.0)
        self.n_questions = n_questions
        self.temperature = temperature

    @classmethod
    def from_settings(
        cls, settings: CartridgeSettings, loaded: Any = None
    ) -> OpenAIQuestionGenerator:
        """The generator ``settings`` describe (the key and URL default to the environment)."""
        endpoint = LlmEndpoint(settings.llm_model, base_url=settings.base_url, timeout_s=120.0)
        return cls(endpoint, n_questions=settings.n_questions)

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "model": self.llm_model,
            "n": self.n_questions,
            "temperature": self.temperature,
            # what is accepted from a free answer (the local skeleton's output is always an
            # array of questions, so its fingerprint does not carry this)
            "accepts": ACCEPTS_VERSION,
        }

    def generate(
        self, requests: Sequence[QuestionRequest], progress: QuestionsDone | None = None
    ) -> list[QuestionResult]:
        """One result per request, in order; never raises for one bad call.
        ``progress(n_questions)`` after each call (from the worker threads, one at a time)."""

        def run(req: QuestionRequest) -> QuestionResult:
            try:
                result = self._one(req)
            except Exception as exc:  # noqa: BLE001 - one call must not sink the run
                result = QuestionResult(req.key, "failed", error=self.endpoint.describe(exc))
            if progress is not None:
                with self._lock:
                    progress(self.n_questions)
            return result

        return self.each(run, requests, "selfstudy")

    def _one(self, req: QuestionRequest) -> QuestionResult:
        calls: list[CallRecord] = []
        messages = build_question_messages(req.text, req.seed_type, self.n_questions)
        attempt = 0
        while True:
            if (aborted := self.aborted) is not None:
                return QuestionResult(req.key, "failed", error=aborted, calls=calls)
            attempt += 1
            started, t0 = datetime.now(UTC), time.perf_counter()
            try:
                completion = self.endpoint.client.chat.completions.create(
                    model=self.llm_model, messages=messages, temperature=self.temperature
                )
            except Exception as exc:  # noqa: BLE001 - classified below
                msg = self.endpoint.describe(exc)
                status, retryable, fatal = classify_error(exc)
                calls.append(self.endpoint.record(req.key, attempt, status, started, t0, error=msg))
                if fatal:
                    self.stop_run(msg)
                if fatal or not retryable or attempt >= self.endpoint.retry.max_attempts:
                    error = f"{status} after {attempt} attempt(s): {msg}"
                    return QuestionResult(req.key, "failed", error=error, calls=calls)
                self.endpoint.retry.sleep(self.endpoint.retry.delay(attempt, exc))
                continue
            t_in, t_out = usage_of(completion)
            try:
                items = parse_questions(content_of(completion))
            except (MalformedQuestions, MalformedResponse) as exc:
                msg = self.endpoint.scrub(f"malformed answer: {exc}")
                calls.append(
                    self.endpoint.record(
                        req.key, attempt, "malformed", started, t0, t_in, t_out, msg
                    )
                )
                reason = getattr(exc, "reason", "no_content")
                return QuestionResult(
                    req.key, "malformed", error=msg, calls=calls, malformed_reason=reason
                )
            calls.append(self.endpoint.record(req.key, attempt, "ok", started, t0, t_in, t_out))
            return QuestionResult(req.key, "ok", items=items, calls=calls)
