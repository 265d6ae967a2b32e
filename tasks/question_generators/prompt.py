"""The question-generation prompt (versioned): the seed types and the chat messages of a call.

A generator gets a document (or a slice of a long one) and a seed type and is asked for ``n``
questions as a JSON array of strings. Seed types: ``structuring`` (organise facts as JSON / YAML /
a table), ``summarization``, ``question`` (factual recall and reasoning), ``use_case``
(downstream tasks), ``creative`` (open discussion). The templates' hash is
:data:`PROMPT_VERSION`, part of every generator's fingerprint: a change of wording is a new
version and invalidates exactly the questions made with the old one.
"""

from __future__ import annotations

import json

from coinrag.schemas.keys import sha256_hex

SEED_TYPES = ("structuring", "summarization", "question", "use_case", "creative")

SEED_TASKS = {
    "structuring": (
        "requests that ask to organise specific information from the document into a structured "
        "format such as JSON, YAML, a table or a list; name the facts, entities or sections"
    ),
    "summarization": (
        "requests that ask to summarise a specific part, aspect or section of the document; "
        "say precisely which part"
    ),
    "question": (
        "questions that test knowledge of the information in the document; each covers a "
        "different fact, detail or aspect; mix factual recall, comparison, reasoning and "
        "detail-oriented questions; include specific details (numbers, names, titles, dates, "
        "values) so that it is clear what is asked"
    ),
    "use_case": (
        "practical tasks a user could ask an assistant to do with the information in the "
        "document, each grounded in specific details of it"
    ),
    "creative": (
        "open-ended, creative prompts for discussion that are grounded in specific details of "
        "the document"
    ),
}
SYSTEM_TEMPLATE = "You write diverse questions about a document.\n\nDocument:\n{text}"
USER_TEMPLATE = (
    "Generate {n} diverse {task}. Output only one JSON array of strings, for example "
    '["Question 1", "Question 2", ...]. No other text, no markdown fences, no explanations.'
)
LOCAL_SYSTEM = "You write questions about a document."
LOCAL_USER_TEMPLATE = "Document:\n{text}\n\nWrite {n} different {task}, as a JSON list."
PROMPT_VERSION = (
    "qp-"
    + sha256_hex(
        "qgen",
        SYSTEM_TEMPLATE,
        USER_TEMPLATE,
        LOCAL_SYSTEM,
        LOCAL_USER_TEMPLATE,
        json.dumps(SEED_TASKS),
    )[:12]
)


def build_question_messages(text: str, seed_type: str, n: int) -> list[dict[str, str]]:
    """Chat messages of one question-generation call (OpenAI backend)."""
    return [
        {"role": "system", "content": SYSTEM_TEMPLATE.format(text=text)},
        {"role": "user", "content": USER_TEMPLATE.format(n=n, task=SEED_TASKS[seed_type])},
    ]


def build_local_messages(text: str, seed_type: str, n: int) -> list[dict[str, str]]:
    """Chat messages of one call of the local generator (shorter: a 135M model)."""
    return [
        {"role": "system", "content": LOCAL_SYSTEM},
        {
            "role": "user",
            "content": LOCAL_USER_TEMPLATE.format(
                text=text, n=n, task=SEED_TASKS[seed_type].split(";")[0]
            ),
        },
    ]
