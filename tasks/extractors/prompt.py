"""The extraction prompt (versioned) and the parser of its answers.

The prompt asks for short, self-contained, verbatim spans, answered as the JSON object
``{"nuggets": ["span", ...]}``. Its hash is recorded with every extraction, so a change of wording
is a new ``prompt_version`` and invalidates exactly the nuggets made with the old one.

A reply that does not parse is content, not a transport accident: a model at temperature 0
answers the same request the same way. So it is asked again only with another request,
:func:`repair_messages` (the conversation so far, the reply, and a message quoting the parse
error), and what can still be read of it is kept: :func:`salvage_nuggets` reads the complete
string items of a cut-off or comma-less array (recovery's verbatim check guards what is kept).
The repair message is not part of ``prompt_version``: it changes no answer that parsed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from coinrag.inference.llm.client import MalformedResponse
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


REPAIR_TEMPLATE = (
    "Your answer could not be read: {error}. Answer again with only the JSON object "
    '{{"nuggets": ["span", "span", ...]}}: every span a string in double quotes, separated by '
    "commas, the array closed, nothing before or after it."
)
_REPLY_CHARS = 4000  # of a malformed reply quoted back in a repair request


def repair_messages(text: str, reply: str | None, error: str) -> list[dict[str, str]]:
    """The messages of a repair request for one chunk text: the original request, the
    malformed ``reply`` (its first 4,000 characters) and a user message quoting ``error``."""
    return [
        *build_messages(text),
        {"role": "assistant", "content": (reply or "")[:_REPLY_CHARS]},
        {"role": "user", "content": REPAIR_TEMPLATE.format(error=error)},
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


_OPEN_FENCE = re.compile(r"^```(?:json)?\s*", re.IGNORECASE)
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')
_NUGGETS_ARRAY = re.compile(r'"nuggets"\s*:\s*\[')
_SEPARATORS = " \t\r\n,"


def salvage_nuggets(content: str | None) -> list[str]:
    """The complete string items of a malformed answer's array, in order: those before the cut
    of a truncated reply, all of them when only a comma is missing. ``[]`` when none can be read.

    The array is the one after ``"nuggets":`` (else the first ``[``); items are read while they
    are JSON strings separated by commas and/or whitespace, up to ``]``, an unterminated string
    or anything else.

    >>> salvage_nuggets('{"nuggets": ["a b", "c d", "e')
    ['a b', 'c d']
    >>> salvage_nuggets('{"nuggets": ["a" "b", "c"]}')
    ['a', 'b', 'c']
    >>> salvage_nuggets("I cannot help with that.")
    []
    """
    if not content:
        return []
    body = _OPEN_FENCE.sub("", content.strip())
    found = _NUGGETS_ARRAY.search(body)
    pos = found.end() if found else body.find("[") + 1
    if pos <= 0:
        return []
    items: list[str] = []
    n = len(body)
    while pos < n:
        while pos < n and body[pos] in _SEPARATORS:
            pos += 1
        if pos >= n or body[pos] != '"':
            break
        match = _JSON_STRING.match(body, pos)
        if match is None:  # cut off inside the string
            break
        try:
            item = json.loads(match.group(0))
        except json.JSONDecodeError:  # a bad escape: nothing after it can be trusted
            break
        items.append(item)
        pos = match.end()
    return [s for s in items if s.strip()]
