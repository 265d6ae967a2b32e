"""Chat calls to one endpoint, ``concurrency`` at a time, stopped for the rest of a run by a
fatal error: what the OpenAI extractor (``tasks/extractors/openai_chat.py``) and the OpenAI
question generator (``tasks/question_generators/openai_chat.py``) share.

A backend derives :class:`ConcurrentCalls` and runs a batch with :meth:`ConcurrentCalls.each`;
a call that meets a fatal error (a bad key, no quota: ``client.classify_error``) calls
:meth:`ConcurrentCalls.stop_run`, and every call of the run that has not asked yet finds
:attr:`ConcurrentCalls.aborted` set and fails without asking. E.g.::

    class Asker(ConcurrentCalls):
        def ask_all(self, texts: list[str]) -> list[str]:
            return self.each(self._ask, texts, "asker")  # _ask(text) checks self.aborted first
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from coinrag.inference.llm.client import LlmEndpoint

log = logging.getLogger(__name__)

_Request = TypeVar("_Request")
_Result = TypeVar("_Result")


class ConcurrentCalls:
    """Calls to ``endpoint``'s model (``llm_model``), ``concurrency`` at a time."""

    def __init__(self, endpoint: LlmEndpoint | None, concurrency: int, timeout_s: float) -> None:
        """``endpoint``, default: gpt-4o-mini through a new ``openai.OpenAI`` reading the
        environment's key and URL, ``timeout_s`` per request; ValueError for ``concurrency``
        below 1."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.endpoint = endpoint or LlmEndpoint("gpt-4o-mini", timeout_s=timeout_s)
        self.llm_model = self.endpoint.model
        self.concurrency = concurrency
        self._lock = threading.Lock()
        self._fatal: str | None = None

    def each(
        self, call: Callable[[_Request], _Result], requests: Sequence[_Request], threads: str
    ) -> list[_Result]:
        """``call`` of every request, ``concurrency`` at a time on threads named ``threads``;
        the results in request order. A new run: no fatal error yet."""
        self._fatal = None
        if not requests:
            return []
        workers = min(self.concurrency, len(requests))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=threads) as pool:
            return list(pool.map(call, requests))

    def stop_run(self, error: str) -> None:
        """The fatal ``error`` (already scrubbed): the calls of this run that have not asked yet
        fail with :attr:`aborted`."""
        self._fatal = error
        log.error("fatal endpoint error, failing the rest of the run: %s", error)

    @property
    def aborted(self) -> str | None:
        """``"aborted: <the fatal error>"`` once :meth:`stop_run` was called in this run."""
        return None if self._fatal is None else f"aborted: {self._fatal}"
