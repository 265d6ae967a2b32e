"""Build the question generator the cartridge settings name (``generator``: openai | local)."""

from __future__ import annotations

from typing import Any

from coinrag.schemas.settings import CartridgeSettings
from coinrag.tasks.question_generators.base import QuestionGenerator
from coinrag.tasks.question_generators.local import LocalQuestionGenerator
from coinrag.tasks.question_generators.openai_chat import OpenAIQuestionGenerator

# backend name -> generator class (each has ``from_settings(settings, loaded)``)
GENERATORS: dict[str, Any] = {
    OpenAIQuestionGenerator.backend: OpenAIQuestionGenerator,
    LocalQuestionGenerator.backend: LocalQuestionGenerator,
}


def make_generator(settings: CartridgeSettings, loaded: Any) -> QuestionGenerator:
    """The question generator the settings name (default: openai when ``OPENAI_API_KEY`` is
    set, else local); ``loaded``: the target model, which the local generator uses."""
    return GENERATORS[settings.resolved_generator()].from_settings(settings, loaded)
