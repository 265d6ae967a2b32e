"""Canonical form of span matching (``tasks/recover/match.py``): how a candidate and a chunk are
folded before they are compared, and the word-boundary tests on the folded text.

Per original character (:func:`fold_char`): whitespace becomes a space; quotes, guillemets and
dashes become ``'``, ``"`` and ``-``; format characters are dropped; NFKD decomposition and case
folding. Over the sequence: runs of spaces collapse to one and a digit-group separator between a
digit and exactly three digits is dropped. :func:`canonicalize` also keeps, per canonical
character, the index of the original character it came from (used to map a match back to the
source text). The full rules are in ``tasks/recover/match.py``'s docstring.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

import numpy as np

__all__ = [
    "HAS_ALNUM_RE",
    "canonical_form",
    "canonicalize",
    "edge_runs",
    "find_all_on_boundaries",
    "fold_char",
    "is_word_char",
    "trim_edge_punctuation",
    "window_word_range",
]

SINGLE_QUOTES = "'‘’‚‛′‵`´ʹʻʼʽ＇"
DOUBLE_QUOTES = '"“”„‟″‶«»＂'
DASHES = "-‐‑‒–—―−⁃﹘﹣－"
DIGIT_SEPARATORS = ",_\u2009\u202f"
_STROKES = {"ø": "o\u0338", "đ": "d\u0335", "ł": "l\u0337", "ħ": "h\u0335", "ŧ": "t\u0335"}

_PRE: dict[str, str] = {}
_PRE.update(dict.fromkeys(SINGLE_QUOTES, "'"))
_PRE.update(dict.fromkeys(DOUBLE_QUOTES, '"'))
_PRE.update(dict.fromkeys(DASHES, "-"))
_PRE.update(_STROKES)
_PRE["ı"] = "i"


@lru_cache(maxsize=65536)
def fold_char(ch: str) -> str:
    """Canonical form of one character (before spaces collapse and digit separators drop).

    >>> [fold_char(c) for c in "A’–\\u00ad\\t"], fold_char("é") == "e\\u0301"
    (['a', "'", '-', '', ' '], True)
    """
    if ch.isspace():
        return " "
    pre = _PRE.get(ch)
    if pre is not None:
        return pre
    if unicodedata.category(ch) == "Cf":
        return ""
    folded = unicodedata.normalize("NFKD", ch).casefold()
    if len(folded) == 1 and folded not in _PRE and not folded.isspace():
        return folded
    return "".join(_PRE.get(u, u) for u in folded if not u.isspace())


class _FoldTable(dict):
    """``str.translate`` table ``ord(ch) -> fold_char(ch)``, filled on first use."""

    def __missing__(self, key: int) -> str:
        value = fold_char(chr(key))
        self[key] = value
        return value


_FOLD = _FoldTable()
_ASCII_LUT = np.array([ord(fold_char(chr(i))) for i in range(128)], dtype=np.uint8)
# a digit, then a separator followed by exactly three digits (the separator is group 1's end)
_SEP_RE = re.compile(r"([0-9])[,_\u2009\u202f](?=[0-9]{3}(?![0-9]))")
HAS_ALNUM_RE = re.compile(r"[^\W_]")
_SPACE = ord(" ")


def _may_group_digits(text: str) -> bool:
    """Whether ``text`` holds a character that may separate digit groups (a quick test before
    the regular expression)."""
    return "," in text or "_" in text or "\u2009" in text or "\u202f" in text


def _fold_each(text: str) -> tuple[np.ndarray, np.ndarray | None, list[tuple[int, str]]]:
    """Per original character, its folded code point (``uint8`` for ASCII text, else
    ``uint32``); how many characters it folds to (``None`` when all fold to one); and the
    ``(index, folded)`` of those that fold to more than one."""
    if text.isascii():
        return _ASCII_LUT[np.frombuffer(text.encode("ascii"), dtype=np.uint8)], None, []
    counts = None
    expansions: list[tuple[int, str]] = []
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    out = cps.copy()
    small = cps < 128
    out[small] = _ASCII_LUT[cps[small]]
    for k in np.flatnonzero(~small).tolist():
        f = _FOLD[int(cps[k])]
        if len(f) == 1:
            out[k] = ord(f)
        else:
            if counts is None:
                counts = np.ones(len(text), dtype=np.int64)
            counts[k] = len(f)
            if f:
                expansions.append((k, f))
    return out, counts, expansions


def _fold_codes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Code points of the folded text (digit-group separators dropped, spaces not yet
    collapsed) and, per code point, the index of the original character it comes from."""
    n = len(text)
    out, counts, expansions = _fold_each(text)
    if _may_group_digits(text):
        for m in _SEP_RE.finditer(text):
            if counts is None:
                counts = np.ones(n, dtype=np.int64)
            counts[m.end(1)] = 0
    if counts is None:
        return out, np.arange(n)
    pos = np.cumsum(counts) - counts
    out = np.repeat(out, counts)
    for k, f in expansions:
        out[pos[k] : pos[k] + len(f)] = [ord(u) for u in f]
    return out, np.repeat(np.arange(n), counts)


def canonicalize(text: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Canonical text (not stripped); per canonical character, its original index; and the
    canonical start and end of every word (run of non-space characters)."""
    out, orig = _fold_codes(text)
    space = out == _SPACE
    dup = space[1:] & space[:-1]  # a space after a space: runs collapse to one
    if dup.any():
        keep = np.ones(len(out), dtype=bool)
        keep[1:] = ~dup
        out = out[keep]
        orig = orig[keep]
        space = space[keep]
    word = np.zeros(len(out) + 2, dtype=bool)
    np.logical_not(space, out=word[1:-1])
    edges = np.flatnonzero(word[1:] != word[:-1])
    if out.dtype == np.uint8:
        canon = out.tobytes().decode("ascii")
    else:
        canon = out.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
    return canon, orig, edges[0::2], edges[1::2]


def canonical_form(text: str) -> str:
    """The canonical form used for matching, stripped of leading and trailing spaces.

    >>> canonical_form("  Grace O’Malley  —  299,792,458 m/s ")
    "grace o'malley - 299792458 m/s"
    >>> canonical_form("Gráinne") == "gra\\u0301inne"
    True
    """
    if _may_group_digits(text):
        text = _SEP_RE.sub(r"\1", text)
    return " ".join(text.translate(_FOLD).split())


def window_word_range(n_words: int) -> tuple[int, int]:
    """Allowed window sizes ``(lo, hi)`` (inclusive) for a candidate of ``n_words`` words.

    ``d = max(1, round(n / 5))`` (n/5 never ends in .5), ``lo = max(1, n - d)``, ``hi = n + d``.

    >>> window_word_range(12), window_word_range(3), window_word_range(13)
    ((10, 14), (2, 4), (10, 16))
    """
    d = max(1, (n_words + 2) // 5)
    return max(1, n_words - d), n_words + d


def is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_" or (ch > "\x7f" and unicodedata.category(ch)[0] == "M")


def _on_boundaries(s: str, a: int, b: int) -> bool:
    """True when ``s[a:b]`` splits no run of word characters."""
    if 0 < a < len(s) and is_word_char(s[a - 1]) and is_word_char(s[a]):
        return False
    return not (0 < b < len(s) and is_word_char(s[b - 1]) and is_word_char(s[b]))


def find_all_on_boundaries(hay: str, needle: str) -> list[int]:
    """Starts of every (possibly overlapping) occurrence of ``needle`` on word boundaries."""
    m = len(needle)
    hits = []
    k = hay.find(needle)
    while k >= 0:
        if _on_boundaries(hay, k, k + m):
            hits.append(k)
        k = hay.find(needle, k + 1)
    return hits


def edge_runs(c: str) -> tuple[str, str]:
    """The leading and trailing runs of non-word characters of ``c``.

    >>> edge_runs('"rebel" legend,'), edge_runs("composer")
    (('"', ','), ('', ''))
    """
    x = 0
    while x < len(c) and not is_word_char(c[x]):
        x += 1
    y = len(c)
    while y > x and not is_word_char(c[y - 1]):
        y -= 1
    return c[:x], c[y:]


def trim_edge_punctuation(canon: str, a: int, b: int, c: str) -> tuple[int, int]:
    """The window ``canon[a:b]`` without the edge characters the candidate ``c`` lacks.

    Windows are whole words, so a window ending in ``"composer,"`` carries the comma although
    the candidate ``"... Hungarian composer"`` never had one. From each end, non-word characters
    (punctuation, spaces) are dropped while they do not occur in the candidate's own run of
    non-word characters at that end; the first word character, or one the candidate has there,
    stops it. A window that would lose everything is kept whole. Both texts are canonical.

    >>> w = "(ming rule)."
    >>> w[slice(*trim_edge_punctuation(w, 0, len(w), "ming rule"))]
    'ming rule'
    >>> w[slice(*trim_edge_punctuation(w, 0, len(w), "(ming rule."))]
    '(ming rule).'
    """
    lead, trail = edge_runs(c)
    x, y = a, b
    while x < y and canon[x] not in lead and not is_word_char(canon[x]):
        x += 1
    while y > x and canon[y - 1] not in trail and not is_word_char(canon[y - 1]):
        y -= 1
    return (x, y) if x < y else (a, b)
