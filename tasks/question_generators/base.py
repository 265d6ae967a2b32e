"""The interface every question generator implements, and the records it returns.

A generator turns :class:`QuestionRequest` (a text, a seed type, the call's cache key) into a
:class:`QuestionResult`: the raw items of its answer (``ok``), a malformed answer (dropped and
counted with its reason), or a failure, with one ``CallRecord`` per attempt for the ledger. It
never touches the store: ``tasks/questions.py`` asks which calls are already answered and hands
only the rest to :meth:`QuestionGenerator.generate`. Backends: ``openai``
(``openai_chat.py``), ``local`` (``local.py``); ``factory.py`` builds the one the settings name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from coinrag.inference.llm.client import CallRecord
from coinrag.schemas.keys import fingerprint
from coinrag.schemas.registry import Backend, Registry
from coinrag.schemas.settings import QUESTION_GENERATORS, CartridgeSettings
from coinrag.tasks.question_generators.prompt import PROMPT_VERSION


@dataclass(frozen=True)
class QuestionRequest:
    """One call to make: ``key`` is its call key."""

    key: str
    text: str
    seed_type: str
    call_index: int


@dataclass
class QuestionResult:
    """The outcome of one call: raw items (``ok``), a malformed answer, or a failure."""

    key: str
    status: str  # ok | malformed | failed
    items: list[Any] = field(default_factory=list)
    error: str | None = None
    calls: list[CallRecord] = field(default_factory=list)
    malformed_reason: str | None = None  # why a malformed answer was dropped (questions.py)


# Progress of a generator: called with the number of questions just written (an OpenAI call
# counts its n_questions when it returns, the local generator each question as it closes).
QuestionsDone = Callable[[int], None]


def generator_fingerprint(backend: str, fields: dict[str, Any]) -> str:
    """Fingerprint of a question generator (no key, no URL)."""
    return fingerprint("qgen", {"backend": backend, "prompt_version": PROMPT_VERSION, **fields})


class QuestionGenerator(Backend):
    """What the self-study stage needs from a backend; a backend is a subclass registered by
    name (``class LocalQuestionGenerator(QuestionGenerator, name="local")``), its module
    imported on first look-up of ``QuestionGenerator.registry[name]``."""

    registry: ClassVar[Registry[QuestionGenerator]] = Registry(
        "question generator",
        QUESTION_GENERATORS,
        modules={
            "openai": f"{__package__}.openai_chat",
            "local": f"{__package__}.local",
        },
    )
    backend: ClassVar[str]  # openai | local
    n_questions: int

    @classmethod
    def from_settings(cls, settings: CartridgeSettings, loaded: Any = None) -> Any:
        """The generator ``settings`` describe (``loaded``: the target model, which a local
        generator uses)."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """:func:`generator_fingerprint` of this backend and its :meth:`fingerprint_fields`."""
        return generator_fingerprint(self.backend, self.fingerprint_fields())

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything the questions depend on but the backend and the prompt version (no key,
        no URL)."""
        raise NotImplementedError

    def generate(
        self, requests: Sequence[QuestionRequest], progress: QuestionsDone | None = None
    ) -> list[QuestionResult]:
        """One result per request, in order; never raises for one bad call."""
        raise NotImplementedError
