"""Token snapping of span matching (``tasks/recover/match.py``): a matched char span becomes the
range of whole tokens that covers it.

The rule at the edges: a token that holds any character of the candidate's matched text stays,
whatever else it holds. A tokenizer that glues marks into one token (SmolLM2 reads
``"(1368–1644)."`` as ``... "4", ")."``) therefore brings the marks it glues to the candidate's
own: the candidate ``"built by the Ming dynasty (1368-1644)"`` recovers ``" built by the Ming
dynasty (1368–1644)."``, never a span without the candidate's ``")"``. Tokens that hold nothing
but marks the candidate lacks never reach the span: the matching stages place the candidate on
its own characters (the fuzzy stage first trims the edge punctuation of its whole-word window,
:func:`tasks.recover.canon.trim_edge_punctuation`), and only tokens that intersect that char span
are taken.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from operator import itemgetter

__all__ = ["char_span_to_token_span"]

_START = itemgetter(0)
_END = itemgetter(1)


def char_span_to_token_span(
    token_spans: Sequence[tuple[int, int]], cs: int, ce: int
) -> tuple[int, int]:
    """Smallest token range ``[ts, te)`` covering the char span ``[cs, ce)``.

    It holds every token whose span intersects ``[cs, ce)`` (so the tokens of a multi-byte
    character that share one span are kept together, and a boundary token keeps the marks it
    glues to a matched character). Spans must be sorted (starts and ends non-decreasing), as a
    fast tokenizer's offset mapping is. Raises ``ValueError`` when ``cs >= ce`` or no token
    intersects the span.

    >>> spans = [(0, 5), (5, 11), (11, 12), (11, 12), (12, 18)]  # "Grace O’Malley" style
    >>> char_span_to_token_span(spans, 6, 11), char_span_to_token_span(spans, 7, 12)
    ((1, 2), (1, 4))
    >>> text = "(1368–1644). It"  # SmolLM2-like tokens: "(", "1368", "–", "1644", ").", " It"
    >>> spans = [(0, 1), (1, 5), (5, 6), (6, 10), (10, 12), (12, 15)]
    >>> ts, te = char_span_to_token_span(spans, 0, 11)  # the candidate "(1368-1644)"
    >>> text[spans[ts][0] : spans[te - 1][1]]
    '(1368–1644).'
    """
    ts = bisect_right(token_spans, cs, key=_END)
    te = bisect_left(token_spans, ce, key=_START)
    if cs >= ce or ts >= te:
        raise ValueError(f"char span [{cs}, {ce}) is empty or covered by no token")
    return ts, te
