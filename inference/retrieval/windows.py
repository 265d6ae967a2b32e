"""Windows: a text cut into pieces an embedder sees whole, so that every token of it counts.

An encoder truncates its input to ``max_length`` word pieces (all-MiniLM-L6-v2: 256, about a
third of a 512-token chunk of the generation model), so one vector of a long text says nothing
about its end. :func:`window_spans` cuts a tokenized text into consecutive token ranges of at
most ``width`` tokens that cover every token, each overlapping the one before by about
``overlap`` tokens, starting (and, where it can, ending) at a word boundary so that a window
tokenizes alone as it did inside the text. The last window is moved back to hold a whole
``width`` where the text allows (a short tail would be a vector of a few words).

Worked example, one token per word, ``width`` 4, ``overlap`` 1, 10 tokens: ``[(0, 4), (3, 7),
(6, 10)]``: each window starts one token before the previous one ends, the last ends at the end.

:func:`text_windows` turns the token ranges into :class:`Window`s: character spans of the text
and the string embedded for each, after the heading path in effect where the window starts (a
chunk's own path, or that of a heading inside it), cut to a quarter of the room.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import NamedTuple

OVERLAP_FRACTION = 0.25  # of a window's width: the tokens consecutive windows share
PREFIX_FRACTION = 0.25  # of a window's room: the most the heading prefix may take
# A tokenizer for windows: text -> (each token's [start, end) characters, each token's word
# index: tokens of one word share it; None for a token of no word).
Tokenize = Callable[[str], tuple[Sequence[tuple[int, int]], Sequence[int | None]]]


class Window(NamedTuple):
    """A piece of a text: characters ``[char_start, char_end)`` and the string embedded for it
    (the heading prefix, a newline, then those characters; the characters alone without a
    prefix)."""

    char_start: int
    char_end: int
    text: str


def _word_starts(word_ids: Sequence[int | None]) -> list[bool]:
    """Whether each token starts a word (a token of no word starts its own)."""
    return [i == 0 or w is None or w != word_ids[i - 1] for i, w in enumerate(word_ids)]


def window_spans(word_ids: Sequence[int | None], width: int, overlap: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of at most ``width`` tokens covering ``0..n`` (``n =
    len(word_ids)``), each starting at most ``overlap`` tokens before the previous one ends
    (less where that would split a word), at word starts and ending at word ends wherever a
    word is shorter than a window; one range ``(0, n)`` if the text fits.

    >>> window_spans(list(range(10)), 4, 1)
    [(0, 4), (3, 7), (6, 10)]
    >>> window_spans([0, 0, 1, 1, 1, 2, 3, 3], 4, 1)  # words: [0 1] [2 3 4] [5] [6 7]
    [(0, 2), (2, 6), (5, 8)]
    """
    n = len(word_ids)
    width = max(1, int(width))
    overlap = max(0, min(int(overlap), width - 1))
    if n <= width:
        return [(0, n)]
    starts = _word_starts(word_ids)
    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        end = min(start + width, n)
        if end < n:
            cut = end
            while cut > start and not starts[cut]:
                cut -= 1
            end = cut if cut > start else end  # a word longer than a window is cut inside
        spans.append((start, end))
        if end >= n:
            break
        nxt = max(end - overlap, start + 1)
        back = next((i for i in range(nxt, start, -1) if starts[i]), None)
        ahead = next((i for i in range(nxt + 1, end + 1) if starts[i]), nxt)
        start = ahead if back is None else back  # a word start: before nxt, else after it
    last_start, _ = spans[-1]
    if len(spans) > 1 and n - last_start < width:  # move a short tail back: a whole window
        at = n - width
        while at < last_start and not starts[at]:
            at += 1
        spans[-1] = (at, n)
    return spans


def _cut_prefix(prefix: str, tokenize: Tokenize, room: int) -> tuple[str, int]:
    """``prefix``'s first words within ``PREFIX_FRACTION * room`` tokens, and the tokens it
    takes with the join (0 for an empty prefix)."""
    if not prefix.strip():
        return "", 0
    offsets, words = tokenize(prefix)
    cut = max(1, int(room * PREFIX_FRACTION))
    if len(offsets) > cut:  # keep its first words that fit
        while cut > 1 and words[cut] is not None and words[cut] == words[cut - 1]:
            cut -= 1
    cut = min(cut, len(offsets))
    head = prefix if cut == len(offsets) else prefix[: offsets[cut - 1][1]]
    return head, cut + 1


def _prefix_at(starts: Sequence[int], heads: Sequence[str], text: str, a: int, b: int) -> str:
    """The prefix in effect at the first visible character of ``text[a:b]``: the last of
    ``heads`` whose start (``starts``, ascending, the first 0) is at or before it."""
    visible = a + len(text[a:b]) - len(text[a:b].lstrip())
    return heads[bisect.bisect_right(starts, visible) - 1]


def text_windows(
    text: str,
    prefix: str,
    tokenize: Tokenize,
    room: int,
    overlap_fraction: float | None = None,
    sections: Sequence[tuple[int, str]] = (),
) -> list[Window]:
    """The windows of ``text`` for an encoder with ``room`` tokens per input (its
    ``max_length`` less its special tokens), cut by ``tokenize`` (the encoder's tokenizer).

    Each window is embedded after the heading path in effect where its first visible
    character is: ``prefix`` (the path at the text's start; "" for none), or the last of
    ``sections`` (``(character of text, path)``, ascending: headings inside the text) at or
    before it; so a window that starts in a later section of a chunk is embedded under that
    section's path, not the chunk's first one. Each prefix keeps its first words within
    ``PREFIX_FRACTION * room`` tokens; the windows get the rest less the longest prefix and
    one token for the join. A text that fits is one window, the whole text after ``prefix``
    (so its string is the one embedded for the whole text: one vector). Windows overlap by
    ``OVERLAP_FRACTION`` of their width.
    """
    cuts = [_cut_prefix(p, tokenize, room) for p in (prefix, *(path for _, path in sections))]
    heads = [f"{head}\n" if head else "" for head, _ in cuts]
    starts = [0, *(at for at, _ in sections)]
    width = max(1, room - max(used for _, used in cuts))
    offsets, word_ids = tokenize(text)
    fraction = OVERLAP_FRACTION if overlap_fraction is None else overlap_fraction
    spans = window_spans(word_ids, width, int(width * fraction))
    if len(spans) == 1:
        return [Window(0, len(text), heads[0] + text)]
    out = []
    for start, end in spans:
        a = 0 if start == 0 else offsets[start][0]
        b = len(text) if end == len(offsets) else offsets[end - 1][1]
        out.append(Window(a, b, _prefix_at(starts, heads, text, a, b) + text[a:b]))
    return out
