"""The interface every nugget extractor implements, and the records it returns.

An extractor turns chunk texts into candidate nugget strings. It never touches the store: the
build flow asks ``storage/`` which ``(text_hash, extractor_fp)`` pairs are already answered and
hands only the rest to :meth:`Extractor.extract`. Backends: ``openai`` (chat completions),
``openai-batch`` (Batch API), ``local`` (constrained decoding with a local model), ``rules``
(model-free clause segmentation), ``none`` (no nuggets).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from coinrag.inference.llm.client import CallRecord
from coinrag.schemas.registry import Backend, Registry
from coinrag.schemas.settings import EXTRACTORS, BuildSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractionRequest:
    """One chunk text to extract from. ``key`` is its text hash (``keys.text_hash``)."""

    key: str
    text: str


@dataclass
class ExtractionResult:
    """The outcome for one request: candidates (``status == "ok"``) or a failure, never lost.

    ``failed``: the endpoint did not answer (transport errors, timeouts, 429, 5xx: worth asking
    again later); ``malformed``: it answered, and every reply (and every repair request) was
    unreadable: a content failure, which the build settles after ``abandon_after`` builds."""

    key: str
    status: str  # ok | failed | malformed
    candidates: list[str] = field(default_factory=list)
    error: str | None = None
    calls: list[CallRecord] = field(default_factory=list)


ResultFn = Callable[[ExtractionResult], None]
"""Called with each finished result (candidates or failure, with its ledger), as it finishes."""


class ResultReporter:
    """Hands each key's final result to a :data:`ResultFn` once, from any thread.

    A failing callback is logged, never raised: the result still comes back from
    :meth:`Extractor.extract`, so a callback (e.g. one persisting answers early) cannot lose it.
    """

    def __init__(self, on_result: ResultFn | None) -> None:
        self._on_result = on_result
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, result: ExtractionResult) -> None:
        if self._on_result is None:
            return
        with self._lock:
            if result.key in self._seen:
                return
            self._seen.add(result.key)
            try:
                self._on_result(result)
            except Exception as exc:  # noqa: BLE001 - the result is returned anyway
                log.warning(
                    "result callback failed for %s: %s: %s", result.key, type(exc).__name__, exc
                )


class Extractor(Backend):
    """What the build flow needs from a backend; a backend is a subclass registered by name
    (``class RulesExtractor(Extractor, name="rules")``), its module imported on first look-up
    of ``Extractor.registry[name]`` (``tasks/extractors/factory.py``); its ``fingerprint`` is a
    ``keys.fingerprint("extractor", ...)``."""

    registry: ClassVar[Registry[Extractor]] = Registry(
        "extractor",
        EXTRACTORS,
        modules={
            "openai": f"{__package__}.openai_chat",
            "openai-batch": f"{__package__}.openai_batch",
            "local": f"{__package__}.local",
            "rules": f"{__package__}.rules",
            "none": f"{__package__}.none",
        },
    )
    backend: ClassVar[str]  # openai | openai-batch | local | rules | none
    prompt_version: str  # version of the prompt (or rules) in the fingerprint; "" for none
    # An answer costs money or model time: the build stages each one as it arrives, so that a
    # kill loses none (False: answers are recomputed in milliseconds, staging would cost more).
    stage_answers: bool
    # The backend takes every pending text in one call (the Batch API: one submission, half the
    # price), instead of the build's ``extract_batch_size`` at a time.
    takes_all_at_once: ClassVar[bool] = False

    @classmethod
    def from_settings(cls, settings: BuildSettings, state_dir: str | None = None) -> Any:
        """The backend as the build ``settings`` configure it (``state_dir``: the store's
        folder for state a killed build resumes from, e.g. the Batch API's batch ids)."""
        return cls()

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in the same order. Must not raise for one bad chunk.

        ``on_result(result)``: once per distinct key, as soon as its result is final (its
        ledger complete), from any thread (wrap it in :class:`ResultReporter`)."""
        raise NotImplementedError
