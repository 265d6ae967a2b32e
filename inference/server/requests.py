"""A query request as the server reads it: the fields of ``schemas.settings.QueryOptions`` (the
options of ``coinrag query``, the same defaults) plus ``question`` and ``stream``, checked with
one error message each. Nothing here names a query option: a new one is declared once, in
``QueryOptions``, and is a request field and a CLI option by construction."""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from coinrag.schemas.qa import require_question
from coinrag.schemas.settings import ApiSettings, QueryOptions, SettingsError, check_choices


class BadRequest(ValueError):
    """A request the server refuses: ``http_status`` (400, 413, 422) and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status


@dataclass(frozen=True, kw_only=True)
class QueryRequest(QueryOptions):
    """A request: the question, its :class:`QueryOptions`, and whether to stream tokens."""

    question: str
    stream: bool = False


def _field_types() -> dict[str, tuple[type, bool]]:
    """Each request field: its JSON type and whether it may be null (``str | None``)."""
    hints = typing.get_type_hints(QueryRequest)
    out = {}
    names = [f.name for f in dataclasses.fields(QueryRequest)]
    for name in sorted(names, key=lambda n: n != "question"):  # question first, then in order
        hint = hints[name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = (args[0], True) if args else (hint, False)
    return out


FIELDS = _field_types()
_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def parse_query(
    body: bytes, settings: ApiSettings, methods: Sequence[str], max_new_tokens: int
) -> QueryRequest:
    """The request in ``body`` (a JSON object), or :class:`BadRequest`: 413 over
    ``max_body_bytes``, 400 not a JSON object, 422 a bad field (unknown, wrong type, blank or
    over-long question, method not served, a value outside its choices or range).
    ``max_new_tokens``: the default of a request that gives none (``coinrag api``'s)."""
    if len(body) > settings.max_body_bytes:
        raise BadRequest(413, f"request body over {settings.max_body_bytes} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(400, "request body must be a JSON object")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise BadRequest(422, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    if "question" not in data:
        raise BadRequest(422, "question is required")
    for name, value in data.items():
        kind, nullable = FIELDS[name]
        if value is None and nullable:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadRequest(422, f"{name} must be {_KIND_NAMES[kind]}, got {value!r}")
    req = QueryRequest(**{"max_new_tokens": max_new_tokens, **data})
    _check(req, settings, methods)
    return req


def _check(req: QueryRequest, settings: ApiSettings, methods: Sequence[str]) -> None:
    require_question(req.question)  # BlankQuestion declares 422
    if len(req.question) > settings.max_question_chars:
        raise BadRequest(422, f"question over {settings.max_question_chars} characters")
    if req.method not in methods:
        raise BadRequest(422, f"method {req.method!r} is not served; served: {', '.join(methods)}")
    try:
        check_choices(req)
    except SettingsError as exc:
        raise BadRequest(422, str(exc)) from exc
    for field in dataclasses.fields(QueryOptions):
        cap = field.metadata.get("cap")
        if cap is None:
            continue
        value, low, top = getattr(req, field.name), field.metadata["min"], getattr(settings, cap)
        if not low <= value <= top:
            raise BadRequest(422, f"{field.name} must be in {low}..{top}, got {value}")
