"""Build the extractor a setting names (one instance per process and settings)."""

from __future__ import annotations

from functools import lru_cache

from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.extractors.base import Extractor


@lru_cache(maxsize=4)
def make_extractor(settings: BuildSettings, state_dir: str | None = None) -> Extractor:
    """The extractor registered as ``settings.resolved_extractor()``, from the settings
    (:meth:`Extractor.from_settings`); models load lazily, once. An unknown name raises
    ``UnknownPlugin`` (a ValueError) listing the registered ones.

    ``state_dir`` (the store's) keeps the Batch API's submitted batch ids, so that a killed build
    polls its batches again instead of paying twice.
    """
    cls = Extractor.registry[settings.resolved_extractor()]
    return cls.from_settings(settings, state_dir)
