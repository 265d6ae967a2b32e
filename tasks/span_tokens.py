"""Token snapping of span matching (``tasks/span_match.py``): a matched char span becomes the
range of whole tokens that covers it, without edge tokens of punctuation the candidate lacks.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from operator import itemgetter

from coinrag.tasks.span_canon import edge_runs, fold_char, is_word_char

__all__ = ["char_span_to_token_span", "shed_edge_tokens", "snap_to_tokens"]


def _lacks(chars: str, run: str) -> bool:
    """Whether ``chars`` (source text) hold punctuation not in ``run`` (a candidate's edge run,
    canonical): spaces do not count."""
    return any(u != " " and u not in run for ch in chars for u in fold_char(ch))


def _punctuation_only(text: str) -> bool:
    return not any(is_word_char(ch) for ch in text)


def shed_edge_tokens(
    text: str, token_spans: Sequence[tuple[int, int]], ts: int, te: int, cs: int, ce: int, c: str
) -> tuple[int, int]:
    """The token range ``[ts, te)`` covering the char span ``[cs, ce)`` of ``text`` without its
    edge tokens that reach beyond the span with punctuation the candidate ``c`` (canonical)
    lacks at that end and hold no word character: such a token (``").")`` glued by the
    tokenizer) would bring that punctuation into the nugget. At least one token stays.

    >>> text = "(1368–1644). It"
    >>> spans = [(0, 1), (1, 5), (5, 6), (6, 10), (10, 12), (12, 15)]
    >>> shed_edge_tokens(text, spans, 0, 5, 0, 11, "(1368-1644)")
    (0, 4)
    >>> shed_edge_tokens(text, spans, 0, 5, 0, 12, "(1368-1644).")
    (0, 5)
    """
    lead, trail = edge_runs(c)
    while te - ts > 1:
        s, e = token_spans[te - 1]
        if e > ce and _lacks(text[ce:e], trail) and _punctuation_only(text[s:e]):
            te -= 1
        else:
            break
    while te - ts > 1:
        s, e = token_spans[ts]
        if s < cs and _lacks(text[s:cs], lead) and _punctuation_only(text[s:e]):
            ts += 1
        else:
            break
    return ts, te


_START = itemgetter(0)
_END = itemgetter(1)


def char_span_to_token_span(
    token_spans: Sequence[tuple[int, int]], cs: int, ce: int
) -> tuple[int, int]:
    """Smallest token range ``[ts, te)`` covering the char span ``[cs, ce)``.

    It holds every token whose span intersects ``[cs, ce)`` (so the tokens of a multi-byte
    character that share one span are kept together). Spans must be sorted (starts and ends
    non-decreasing), as a fast tokenizer's offset mapping is. Raises ``ValueError`` when
    ``cs >= ce`` or no token intersects the span.

    >>> spans = [(0, 5), (5, 11), (11, 12), (11, 12), (12, 18)]  # "Grace O’Malley" style
    >>> char_span_to_token_span(spans, 6, 11), char_span_to_token_span(spans, 7, 12)
    ((1, 2), (1, 4))
    """
    ts = bisect_right(token_spans, cs, key=_END)
    te = bisect_left(token_spans, ce, key=_START)
    if cs >= ce or ts >= te:
        raise ValueError(f"char span [{cs}, {ce}) is empty or covered by no token")
    return ts, te


def snap_to_tokens(
    text: str, token_spans: Sequence[tuple[int, int]], cs: int, ce: int, edges: Callable[[], str]
) -> tuple[int, int]:
    """Token range ``[ts, te)`` of a matched char span ``[cs, ce)`` of ``text``.

    Every token intersecting the span is in; when the edge tokens reach beyond the span with
    more than spaces, those of punctuation only that the candidate lacks at that end are shed
    (:func:`shed_edge_tokens`); ``edges()`` gives the canonical candidate, asked for only then.
    Raises ``ValueError`` when no token intersects the span.
    """
    ts = bisect_right(token_spans, cs, key=_END)
    te = bisect_left(token_spans, ce, key=_START)
    if ts >= te:
        raise ValueError(f"char span [{cs}, {ce}) is covered by no token")
    left = text[token_spans[ts][0] : cs]
    right = text[ce : token_spans[te - 1][1]]
    if (left and not left.isspace()) or (right and not right.isspace()):  # reach out
        ts, te = shed_edge_tokens(text, token_spans, ts, te, cs, ce, edges())
    return ts, te
