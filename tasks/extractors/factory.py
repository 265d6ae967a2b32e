"""Build the extractor a setting names (one instance per process and settings)."""

from __future__ import annotations

from functools import lru_cache

from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.extractors.base import Extractor


@lru_cache(maxsize=4)
def make_extractor(settings: BuildSettings, state_dir: str | None = None) -> Extractor:
    """The extractor for ``settings.resolved_extractor()``; models load lazily, once.

    ``state_dir`` (the store's) keeps the Batch API's submitted batch ids, so that a killed build
    polls its batches again instead of paying twice.
    """
    backend = settings.resolved_extractor()
    if backend == "openai":
        from coinrag.tasks.extractors.openai_chat import OpenAIChatExtractor

        return OpenAIChatExtractor(
            model=settings.llm_model,
            concurrency=settings.concurrency,
            max_attempts=settings.max_attempts,
            timeout_s=settings.request_timeout,
        )
    if backend == "openai-batch":
        from coinrag.tasks.extractors.openai_batch import OpenAIBatchExtractor

        return OpenAIBatchExtractor(
            model=settings.llm_model,
            poll_interval_s=settings.batch_poll_interval,
            max_rounds=settings.batch_max_rounds,
            max_attempts=settings.max_attempts,
            state_path=f"{state_dir}/openai-batch-state.json" if state_dir else None,
        )
    if backend == "local":
        from coinrag.tasks.extractors.local import LocalConstrainedExtractor

        return LocalConstrainedExtractor(
            model=settings.model, max_nuggets=settings.local_max_nuggets, device=settings.device
        )
    if backend == "rules":
        from coinrag.tasks.extractors.rules import RulesExtractor

        return RulesExtractor()
    if backend == "none":
        from coinrag.tasks.extractors.none import NoExtractor

        return NoExtractor()
    raise ValueError(f"unknown extractor {backend!r}")
