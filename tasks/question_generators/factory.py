"""Build the question generator the cartridge settings name (``generator``: openai | local)."""

from __future__ import annotations

from typing import Any

from coinrag.schemas.settings import CartridgeSettings
from coinrag.tasks.question_generators.base import QuestionGenerator

# backend name -> generator class (each has ``from_settings(settings, loaded)``)
GENERATORS = QuestionGenerator.registry


def make_generator(settings: CartridgeSettings, loaded: Any) -> QuestionGenerator:
    """The question generator the settings name (default: openai when ``OPENAI_API_KEY`` is
    set, else local); ``loaded``: the target model, which the local generator uses. An unknown
    name raises ``UnknownPlugin`` (a ValueError) listing the registered ones."""
    return GENERATORS[settings.resolved_generator()].from_settings(settings, loaded)
