"""An OpenAI-compatible chat endpoint as every LLM caller of coinrag uses it: the nugget
extractors (``tasks/extractors/openai_chat.py``, ``openai_batch.py``) and the self-study question
generator (``tasks/question_generators/openai_chat.py``).

- :class:`LlmEndpoint`: the official ``openai.OpenAI`` client with its own retries switched off
  (``max_retries=0``: every HTTP attempt is retried, timed and ledgered by the caller), the
  secrets to scrub from anything it reports, and a :class:`RetryPolicy`.
- :class:`RetryPolicy`: up to ``max_attempts`` attempts; exponential backoff with jitter
  (:func:`backoff_delay`), or the server's ``Retry-After`` / ``retry-after-ms`` capped at
  ``retry_after_max_s``.
- :func:`classify_error`: what an exception means: ledger status, retryable (429, 5xx, 408/409,
  timeouts, connection errors), fatal for the whole run (401/403/404, ``insufficient_quota``).
- :class:`CallRecord`: one request sent to an endpoint (or one local generation): a row of the
  call ledger; :meth:`LlmEndpoint.record` builds one for a chat-completions attempt (list
  prices, ``inference/llm/pricing.py``).
- :func:`content_of`: the message content of a completion; a refusal or an odd shape is a
  :class:`MalformedResponse`.

Secrets: an API key never reaches a ledger row, a log line or an error message produced from
here; every text coming from the client goes through :func:`scrub`.
"""

from __future__ import annotations

import email.utils
import random
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import openai

from coinrag.inference.llm.pricing import call_cost
from coinrag.schemas.secrets import env_secrets, scrub

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class CallRecord:
    """One request sent to an endpoint (or one local generation): a row of the ledger."""

    call_id: str
    key: str  # the request key it served (a text hash, a self-study call key)
    attempt: int  # 1-based
    status: str  # ok | malformed | rate_limited | server_error | timeout | error | expired
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_ms: float
    started_at: datetime
    error: str | None = None
    custom_id: str | None = None
    batch_id: str | None = None


class MalformedResponse(ValueError):
    """The model's answer is not what the prompt asks for."""


# --------------------------------------------------------------------------- secrets and errors


def known_secrets(client: Any) -> tuple[str, ...]:
    """The secrets this process could leak: the client's API key and the secret environment
    variables (``schemas.secrets.env_secrets``: ``OPENAI_API_KEY`` among them)."""
    key = getattr(client, "api_key", None)
    return ((key,) if isinstance(key, str) and key else ()) + env_secrets()


def describe_error(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """A short, scrubbed, one-line description of an exception."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    text = scrub(text, secrets)
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def classify_error(exc: BaseException) -> tuple[str, bool, bool]:
    """``(ledger status, retryable, fatal)`` for an exception raised by a client call.

    Fatal errors (bad key, no permission, unknown model, no quota) stop the whole run.
    """
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", True, False
    if isinstance(exc, openai.APIConnectionError):
        return "error", True, False
    if isinstance(exc, openai.RateLimitError):
        if getattr(exc, "code", None) == "insufficient_quota":
            return "rate_limited", False, True
        return "rate_limited", True, False
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        if code >= 500:
            return "server_error", True, False
        if code == 408:
            return "timeout", True, False
        if code == 409:
            return "error", True, False
        return "error", False, code in (401, 403, 404)
    return "error", False, False


# --------------------------------------------------------------------------- retries


def retry_after_seconds(exc: BaseException) -> float | None:
    """The server's ``retry-after-ms`` / ``Retry-After`` (seconds or HTTP date), if any."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return max(0.0, float(value) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_tz(value)
        if parsed is None:
            return None
        return max(0.0, email.utils.mktime_tz(parsed) - time.time())


def backoff_delay(failures: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: ``min(max_s, base_s * 2**(failures-1))``, scaled by a
    random factor in [0.5, 1]."""
    ceiling = min(max_s, base_s * (2 ** max(0, failures - 1)))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


@dataclass
class RetryPolicy:
    """How often and how long to wait: at most ``max_attempts`` attempts per request; between
    two, :func:`backoff_delay` of the failures so far (seconds), or the server's
    ``Retry-After`` capped at ``retry_after_max_s``. ``sleep`` waits (tests pass a recorder)."""

    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    retry_after_max_s: float = 300.0
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")

    def delay(self, failures: int, exc: BaseException) -> float:
        """Seconds to wait after the ``failures``-th failure, ``exc``."""
        delay = backoff_delay(failures, self.backoff_base_s, self.backoff_max_s, self.rng)
        server = retry_after_seconds(exc)
        if server is not None:
            delay = min(server, self.retry_after_max_s)
        return delay


# --------------------------------------------------------------------------- the endpoint


def make_client(
    client: openai.OpenAI | None,
    *,
    base_url: str | None,
    api_key: str | None,
    timeout_s: float,
) -> openai.OpenAI:
    """The client to use, with its own retries off and the request timeout set."""
    if client is not None:
        return client.with_options(max_retries=0, timeout=timeout_s)
    kwargs: dict[str, Any] = {"max_retries": 0, "timeout": timeout_s}
    if base_url is not None:
        kwargs["base_url"] = base_url
    if api_key is not None:
        kwargs["api_key"] = api_key
    return openai.OpenAI(**kwargs)


def new_call_id() -> str:
    """A unique id for one ledger row."""
    return "call-" + uuid.uuid4().hex


def usage_of(completion: Any) -> tuple[int, int]:
    """``(prompt tokens, completion tokens)`` a completion reports (0 where it reports none)."""
    usage = getattr(completion, "usage", None)
    tokens_in = int(getattr(usage, "prompt_tokens", 0) or 0)
    return tokens_in, int(getattr(usage, "completion_tokens", 0) or 0)


def content_of(completion: Any) -> str | None:
    """The message content of the first choice; a refusal or odd shape is malformed."""
    choices = getattr(completion, "choices", None)
    if not choices:
        raise MalformedResponse("no choices in the response")
    message = getattr(choices[0], "message", None)
    if message is None:
        raise MalformedResponse("no message in the first choice")
    refusal = getattr(message, "refusal", None)
    if refusal:
        raise MalformedResponse(f"refusal: {refusal}")
    content = getattr(message, "content", None)
    if content is not None and not isinstance(content, str):
        raise MalformedResponse("message content is not a string")
    return content


class LlmEndpoint:
    """One model on an OpenAI-compatible endpoint: the client (own retries off, ``timeout_s``
    per request), the secrets its reports must not contain, and the retry policy.

    ``client`` (tests, a custom endpoint) or a new ``openai.OpenAI`` that reads
    ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` itself (or ``base_url`` / ``api_key``).
    """

    def __init__(
        self,
        model: str,
        client: openai.OpenAI | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.model = model
        self.retry = retry if retry is not None else RetryPolicy()
        self.client = make_client(client, base_url=base_url, api_key=api_key, timeout_s=timeout_s)
        self.secrets = known_secrets(self.client) + ((api_key,) if api_key else ())

    def describe(self, exc: BaseException) -> str:
        """:func:`describe_error` with this endpoint's secrets scrubbed."""
        return describe_error(exc, self.secrets)

    def scrub(self, text: str) -> str:
        """:func:`scrub` with this endpoint's secrets."""
        return scrub(text, self.secrets)

    def record(
        self,
        key: str,
        attempt: int,
        status: str,
        started_at: datetime,
        t0: float,
        tokens_in: int = 0,
        tokens_out: int = 0,
        error: str | None = None,
    ) -> CallRecord:
        """The ledger record of one chat-completions attempt of this endpoint's model that began
        at ``perf_counter() == t0`` (list prices; latency measured up to now)."""
        return CallRecord(
            call_id=new_call_id(),
            key=key,
            attempt=attempt,
            status=status,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            cost_usd=call_cost(self.model, tokens_in, tokens_out, batch=False),
            latency_ms=(time.perf_counter() - t0) * 1000.0,
            started_at=started_at,
            error=error,
        )
