"""A query request as the server reads it: the options of ``coinrag query`` (question, method,
kc, k, max_new_tokens, oracle_doc, retrieval) plus ``stream``, checked with one error message
each."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coinrag.schemas.qa import BlankQuestion, require_question
from coinrag.schemas.settings import RETRIEVAL_MODES, ApiSettings


class BadRequest(ValueError):
    """A request the server refuses: ``status`` (400, 413, 422) and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class QueryRequest:
    question: str
    method: str = "coinrag"
    kc: int = 4
    k: int = 10
    max_new_tokens: int = 32
    oracle_doc: str | None = None
    retrieval: str | None = None  # search mode (RETRIEVAL_MODES); None: the store's setting
    stream: bool = False

    @property
    def doc_ids(self) -> list[str] | None:
        return [self.oracle_doc] if self.oracle_doc else None


_TYPES: dict[str, type] = {
    "question": str,
    "method": str,
    "kc": int,
    "k": int,
    "max_new_tokens": int,
    "oracle_doc": str,
    "retrieval": str,
    "stream": bool,
}

_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def parse_query(
    body: bytes, settings: ApiSettings, methods: Sequence[str], max_new_tokens: int
) -> QueryRequest:
    """The request in ``body`` (a JSON object), or :class:`BadRequest`: 413 over
    ``max_body_bytes``, 400 not a JSON object, 422 a bad field (unknown, wrong type, blank or
    over-long question, method not served, kc/k/max_new_tokens out of range)."""
    if len(body) > settings.max_body_bytes:
        raise BadRequest(413, f"request body over {settings.max_body_bytes} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(400, "request body must be a JSON object")
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise BadRequest(422, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(_TYPES)}")
    if "question" not in data:
        raise BadRequest(422, "question is required")
    for name, value in data.items():
        if name in ("oracle_doc", "retrieval") and value is None:
            continue
        kind = _TYPES[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadRequest(422, f"{name} must be {_KIND_NAMES[kind]}, got {value!r}")
    values: dict[str, Any] = {"max_new_tokens": max_new_tokens, **data}
    req = QueryRequest(**values)
    _check(req, settings, methods)
    return req


def _check(req: QueryRequest, settings: ApiSettings, methods: Sequence[str]) -> None:
    try:
        require_question(req.question)
    except BlankQuestion as exc:
        raise BadRequest(422, str(exc)) from exc
    if len(req.question) > settings.max_question_chars:
        raise BadRequest(422, f"question over {settings.max_question_chars} characters")
    if req.retrieval is not None and req.retrieval not in RETRIEVAL_MODES:
        raise BadRequest(
            422, f"retrieval {req.retrieval!r} is not one of {', '.join(RETRIEVAL_MODES)}"
        )
    if req.method not in methods:
        raise BadRequest(422, f"method {req.method!r} is not served; served: {', '.join(methods)}")
    for name, top in (
        ("kc", settings.max_kc),
        ("k", settings.max_k),
        ("max_new_tokens", settings.max_new_tokens),
    ):
        value = getattr(req, name)
        if not 1 <= value <= top:
            raise BadRequest(422, f"{name} must be in 1..{top}, got {value}")
