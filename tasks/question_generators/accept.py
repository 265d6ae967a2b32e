"""What a self-study question generator answered: parsing, and which items are usable questions.

The generator is asked for one thing (``prompt.py``): a JSON array of strings, each a
question or a request about the document (``question``: questions; ``structuring``,
``summarization``, ``use_case``, ``creative``: requests such as "Organise ... as a table").
Anything else is dropped and counted with its reason, never trained on:

- the answer as a whole (:func:`parse_questions`, :class:`MalformedQuestions` with a ``reason``):
  ``empty``; ``not_json``; ``not_an_array`` (a JSON object, even one holding a list, a string, a
  number: ``{"facts": ["The film was released in 1968.", ...]}`` is not what was asked for);
- each item (:func:`usable_questions`): ``not_string``; ``not_a_question`` (a statement:
  :func:`is_question`); ``too_short`` / ``too_long`` (words); ``duplicate``; ``off_document``
  (no content word of the document).

:func:`is_question` is a surface test, no model: an item is a question when it ends with ``?``,
or starts with a question word (``what``, ``how``, ...) or an imperative verb of a request
(``list``, ``summarise``, ``organise``, ``imagine``, ...), also after ``please`` or after one
leading phrase closed by a comma (``"Based on the document, list ..."``). "The Eiffel Tower is
330 m tall." is a statement.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ACCEPTS_VERSION",
    "MalformedQuestions",
    "content_words",
    "is_question",
    "parse_questions",
    "usable_questions",
]

ACCEPTS_VERSION = "questions-v2"  # bump when what is accepted changes (a generator fingerprint)

_STOPWORDS = frozenset(
    "about above after again also among been before being below between both could does doing "
    "during each from further have having here into itself more most other over same should some "
    "such than that their them then there these they this those through under until very what "
    "when where which while whom will with would your yours list write give describe explain "
    "document text information".split()
)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*")

# Words that open a question without a "?" (not auxiliaries: "May 1968 saw ..." is a statement).
_QUESTION_WORDS = frozenset("what who whom whose which when where why how whether".split())
# Imperative verbs that open a request (the seed types ask for requests as well as questions).
_REQUEST_VERBS = frozenset(
    "analyse analyze arrange assess break build calculate categorise categorize choose classify "
    "compare compile compose condense construct contrast convert create debate define describe "
    "design detail determine develop discuss draft elaborate enumerate estimate evaluate examine "
    "explain explore express extract find format formulate frame generate give highlight identify "
    "illustrate imagine interpret itemise itemize justify list map match name note organise "
    "organize outline paraphrase plan predict prepare present pretend produce propose provide put "
    "rank recommend reflect reformat rephrase restate retell rewrite select show sketch sort "
    "specify state structure suggest summarise summarize tabulate tell trace transform translate "
    "use write".split()
)
_EDGE = "\"'“”‘’«»()[]{}*_`.,:;!-–— "
_CLOSERS = " \"'”’»)]*"


class MalformedQuestions(ValueError):
    """The generator's answer is not a JSON array; ``reason`` names why (module docstring)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_questions(content: str | None) -> list[Any]:
    """The items of the JSON array the generator was asked for (a ```json fence around it is
    tolerated); anything else raises :class:`MalformedQuestions`.

    >>> parse_questions('["Who?", "When?"]')
    ['Who?', 'When?']
    >>> try:
    ...     parse_questions('{"facts": ["It is tall."]}')
    ... except MalformedQuestions as exc:
    ...     print(exc.reason, "-", exc)
    not_an_array - a JSON object, not the JSON array of questions asked for
    """
    if content is None or not content.strip():
        raise MalformedQuestions("empty", "empty answer")
    text = content.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    if fence:
        text = fence.group(1)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedQuestions("not_json", f"not JSON: {exc}") from None
    if not isinstance(value, list):
        kind = "object" if isinstance(value, dict) else type(value).__name__
        raise MalformedQuestions(
            "not_an_array", f"a JSON {kind}, not the JSON array of questions asked for"
        )
    return value


def is_question(text: str) -> bool:
    """A question or a request (what the generator was asked for), not a statement.

    >>> [is_question(t) for t in ["Who directed it?", "List the films", "It was released."]]
    [True, True, False]
    >>> is_question("Based on the document, summarise the plot"), is_question("How it ends")
    (True, True)
    """
    if text.rstrip(_CLOSERS).endswith("?"):
        return True
    words = [w.strip(_EDGE).lower() for w in text.split()]
    if not words:
        return False
    first = 1 if words[0] == "please" and len(words) > 1 else 0
    if words[first] in _QUESTION_WORDS or words[first] in _REQUEST_VERBS:
        return True
    raw = text.split()
    comma = next((k for k, w in enumerate(raw[:8]) if w.rstrip("\"'”’)").endswith(",")), None)
    if comma is not None and comma + 1 < len(words):
        after = comma + 2 if words[comma + 1] == "please" and comma + 2 < len(words) else comma + 1
        return words[after] in _REQUEST_VERBS
    return False


def content_words(text: str) -> set[str]:
    """Lower-cased words of 4+ characters that are not stopwords."""
    return {w.lower() for w in _WORD.findall(text) if len(w) >= 4} - _STOPWORDS


def usable_questions(
    items: Sequence[Any], doc_text: str, min_words: int = 3, max_words: int = 80
) -> tuple[list[str], dict[str, int]]:
    """The usable questions among ``items`` and the count of drops per reason.

    Usable: a string that is a question or a request (:func:`is_question`), of
    ``min_words..max_words`` words (whitespace collapsed), not a case-insensitive duplicate of
    an earlier one, sharing a content word with the document.

    >>> usable_questions(["Who wrote Dune?", "Dune is a novel.", 3], "Dune, a novel")
    (['Who wrote Dune?'], {'not_a_question': 1, 'not_string': 1})
    """
    kept: list[str] = []
    seen: set[str] = set()
    drops: dict[str, int] = {}
    vocab = content_words(doc_text)

    def drop(reason: str) -> None:
        drops[reason] = drops.get(reason, 0) + 1

    for item in items:
        if not isinstance(item, str):
            drop("not_string")
            continue
        q = " ".join(item.split())
        n = len(q.split())
        if n < min_words:
            drop("too_short")
        elif n > max_words:
            drop("too_long")
        elif not is_question(q):
            drop("not_a_question")
        elif q.lower() in seen:
            drop("duplicate")
        elif not content_words(q) & vocab:
            drop("off_document")
        else:
            seen.add(q.lower())
            kept.append(q)
    return kept, drops
