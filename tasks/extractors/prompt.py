"""The extraction prompt (versioned) and the parser of its answers.

The prompt asks for short, self-contained, verbatim spans, answered as the JSON object
``{"nuggets": ["span", ...]}``. Its hash is recorded with every extraction, so a change of wording
is a new ``prompt_version`` and invalidates exactly the nuggets made with the old one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from coinrag.inference.llm_client import MalformedResponse
from coinrag.schemas.keys import sha256_hex

SYSTEM_PROMPT = (
    "You extract information nuggets from a passage for a retrieval system. A nugget is a short, "
    "self-contained span copied VERBATIM from the passage: a phrase or clause (typically 5 to 25 "
    "words) that states one fact, never rewritten, never paraphrased, never summarised. Copy the "
    "exact characters, including capitalisation, punctuation and accents. Together the nuggets "
    "should cover the passage's facts. Answer only with the JSON object "
    '{"nuggets": ["span", "span", ...]} and nothing else.'
)

USER_TEMPLATE = "Passage:\n<<<\n{text}\n>>>\nReturn the nuggets as JSON."

PROMPT_VERSION = "p-" + sha256_hex("extraction-prompt", SYSTEM_PROMPT, USER_TEMPLATE)[:12]

# JSON schema for endpoints that support structured outputs (response_format=json_schema).
RESPONSE_SCHEMA: dict[str, Any] = {
    "name": "nuggets",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"nuggets": {"type": "array", "items": {"type": "string"}}},
        "required": ["nuggets"],
        "additionalProperties": False,
    },
}


def build_messages(text: str) -> list[dict[str, str]]:
    """Chat messages for one chunk text."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_TEMPLATE.format(text=text)},
    ]


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


def parse_nuggets(content: str | None) -> list[str]:
    """Parse ``{"nuggets": [...]}`` (tolerating a code fence around it) into a list of strings.

    >>> parse_nuggets('{"nuggets": ["a b", "c"]}')
    ['a b', 'c']
    >>> parse_nuggets('```json\\n{"nuggets": []}\\n```')
    []

    Raises :class:`MalformedResponse` for anything else: cut-off JSON, a bare list, objects in
    place of strings, a missing key.
    """
    if content is None:
        raise MalformedResponse("empty response")
    body = _FENCE.sub("", content.strip())
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise MalformedResponse(f"not JSON ({exc.msg} at char {exc.pos})") from exc
    if not isinstance(value, dict) or "nuggets" not in value:
        raise MalformedResponse('expected an object with key "nuggets"')
    items = value["nuggets"]
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise MalformedResponse('"nuggets" must be a list of strings')
    return [s for s in items if s.strip()]
