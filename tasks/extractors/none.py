"""The null extractor (backend ``"none"``): every request succeeds with no candidates.

For stores built without nuggets (chunk-only, TurboRAG-style KV reuse). It makes no call, so it
adds no CallRecord to the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence

from coinrag.schemas.keys import fingerprint
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    Extractor,
    ResultFn,
    ResultReporter,
)


class NoExtractor(Extractor, name="none"):
    """Returns ``ok`` with an empty candidate list for every request."""

    stage_answers = False
    llm_model = "none"
    prompt_version = ""

    @property
    def fingerprint(self) -> str:
        return fingerprint("extractor", {"backend": self.backend})

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One empty ``ok`` result per request, in order."""
        results = [ExtractionResult(req.key, "ok") for req in requests]
        report = ResultReporter(on_result)
        for result in results:
            report(result)
        return results
