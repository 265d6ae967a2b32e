"""A deliberately naive reference for :mod:`tasks.recover.match`, plus candidate generators.

``reference_recover`` has the same semantics as ``tasks.recover.match.recover_candidates`` but does
everything the obvious way: per-character canonicalisation in a loop, substring search by trying
every position, and the fuzzy stage by scoring *every* whole-word window of every allowed length.
Only the per-character folding rule (``fold_char``) is shared with the package: it is the spec.

Similarity: the Indel similarity ``1 - (len(a) + len(b) - 2 * LCS(a, b)) / (len(a) + len(b))``,
which is what ``rapidfuzz.fuzz.ratio / 100`` computes. ``difflib.SequenceMatcher.ratio()`` is not
the same quantity (Ratcliff/Obershelp matches the longest block first, even with
``autojunk=False``), so the LCS is computed here directly: :func:`lcs_dp` is the textbook O(n*m)
table and :func:`lcs_bits` the equivalent bit-vector recurrence (Allison-Dix/Hyyro) on Python
integers, which the reference uses because it is ~50x faster; the tests check both agree.

Run as a script to print a few candidates of :func:`make_candidates`.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Sequence

from coinrag.tasks.recover.match import AbandonedCandidate, RecoveredSpan, fold_char

DIGITS = "0123456789"
SEPARATORS = ",_\u2009\u202f"


# ---------------------------------------------------------------------------- similarity


def lcs_dp(a: str, b: str) -> int:
    """Length of the longest common subsequence, by the O(len(a) * len(b)) table."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_bits(a: str, b: str) -> int:
    """Length of the longest common subsequence, bit-parallel over ``a`` (same result)."""
    masks: dict[str, int] = {}
    for i, ca in enumerate(a):
        masks[ca] = masks.get(ca, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for cb in b:
        u = v & masks.get(cb, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def indel_similarity(a: str, b: str) -> float:
    """``1 - indel_distance / (len(a) + len(b))`` (1.0 for two empty strings)."""
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    return 1.0 - (total - 2 * lcs_bits(a, b)) / total


# ---------------------------------------------------------------------------- canonical form


def reference_canonical(text: str) -> tuple[str, list[int]]:
    """Canonical text and the original index of each of its characters (naive loop)."""
    chars: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        if (
            ch in SEPARATORS
            and i > 0
            and text[i - 1] in DIGITS
            and len(text[i + 1 : i + 4]) == 3
            and all(x in DIGITS for x in text[i + 1 : i + 4])
            and (i + 4 >= len(text) or text[i + 4] not in DIGITS)
        ):
            continue
        for u in fold_char(ch):
            chars.append(u)
            where.append(i)
    out: list[str] = []
    out_where: list[int] = []
    for u, i in zip(chars, where, strict=True):
        if u == " " and out and out[-1] == " ":
            continue
        out.append(u)
        out_where.append(i)
    return "".join(out), out_where


def is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_" or unicodedata.category(ch).startswith("M")


def boundary_ok(s: str, pos: int) -> bool:
    if pos == 0 or pos == len(s):
        return True
    return not (is_word_char(s[pos - 1]) and is_word_char(s[pos]))


def all_hits(hay: str, needle: str) -> list[int]:
    m = len(needle)
    return [
        k
        for k in range(len(hay) - m + 1)
        if hay[k : k + m] == needle and boundary_ok(hay, k) and boundary_ok(hay, k + m)
    ]


def words_of(canon: str) -> list[tuple[int, int]]:
    """(start, end) of every run of non-space characters."""
    out = []
    start = None
    for k, ch in enumerate(canon + " "):
        if ch != " " and start is None:
            start = k
        elif ch == " " and start is not None:
            out.append((start, k))
            start = None
    return out


def trim_window(canon: str, a: int, b: int, cand: str) -> tuple[int, int]:
    """``canon[a:b]`` without the edge punctuation ``cand`` lacks, one character at a time:
    a non-word character at an edge goes unless the candidate has it in its own run of non-word
    characters at that edge; nothing left means the window stays whole."""
    first = [k for k, ch in enumerate(cand) if is_word_char(ch)]
    lead = cand[: first[0]] if first else cand
    trail = cand[first[-1] + 1 :] if first else cand
    x, y = a, b
    while x < y and not is_word_char(canon[x]) and canon[x] not in lead:
        x += 1
    while y > x and not is_word_char(canon[y - 1]) and canon[y - 1] not in trail:
        y -= 1
    return (x, y) if x < y else (a, b)


def snap(token_spans: Sequence[tuple[int, int]], cs: int, ce: int) -> tuple[int, int]:
    """Every token whose span intersects [cs, ce) (a boundary token that holds a matched
    character stays, with whatever marks it glues to it)."""
    idx = [i for i, (s, e) in enumerate(token_spans) if s < ce and e > cs]
    return idx[0], idx[-1] + 1


# ---------------------------------------------------------------------------- reference


def reference_recover(
    chunk_text: str,
    token_spans: Sequence[tuple[int, int]],
    candidates: Sequence[str],
    tau: float = 0.7,
) -> tuple[list[RecoveredSpan], list[AbandonedCandidate]]:
    """Same contract as ``tasks.recover.match.recover_candidates``, computed by brute force."""
    canon, where = reference_canonical(chunk_text)
    words = words_of(canon)
    recovered: list[RecoveredSpan] = []
    abandoned: list[AbandonedCandidate] = []
    cursor = 0
    for cand in candidates:
        stripped = cand.strip()
        if stripped == "":
            abandoned.append(AbandonedCandidate(cand, 0.0, "empty"))
            continue
        if not any(ch.isalnum() for ch in stripped):
            abandoned.append(AbandonedCandidate(cand, 0.0, "no_word"))
            continue
        if len(stripped) > len(chunk_text):
            abandoned.append(AbandonedCandidate(cand, 0.0, "too_long"))
            continue
        hits = all_hits(chunk_text, stripped)
        if hits:
            kind, sim, occ = "exact", 1.0, len(hits)
            after = [h for h in hits if h >= cursor]
            k = after[0] if after else hits[0]
            cs, ce = k, k + len(stripped)
        else:
            kind = "fuzzy"
            c = reference_canonical(cand)[0].strip(" ")
            n = len(c.split(" "))
            d = max(1, round(n / 5))
            lo, hi = max(1, n - d), n + d
            if lo > len(words):
                abandoned.append(AbandonedCandidate(cand, 0.0, "too_long"))
                continue
            hits = all_hits(canon, c)
            if hits:
                sim, occ = 1.0, len(hits)
                after = [h for h in hits if where[h] >= cursor]
                k = after[0] if after else hits[0]
                cs, ce = where[k], where[k + len(c) - 1] + 1
            else:
                scored = []  # (sim, i, size)
                for size in range(lo, hi + 1):
                    for i in range(len(words) - size + 1):
                        window = canon[words[i][0] : words[i + size - 1][1]]
                        scored.append((indel_similarity(c, window), i, size))
                sim = max(s for s, _, _ in scored)
                if sim < tau:
                    abandoned.append(AbandonedCandidate(cand, sim, "below_threshold"))
                    continue
                best = [(i, size) for s, i, size in scored if s == sim]
                occ = len({i for i, _ in best})
                after = [t for t in best if where[words[t[0]][0]] >= cursor]
                pool = after if after else best
                first = min(i for i, _ in pool)
                i, size = min(
                    ((i, size) for i, size in pool if i == first),
                    key=lambda t: (abs(t[1] - n), t[1]),
                )
                a, b = trim_window(canon, words[i][0], words[i + size - 1][1], c)
                cs = where[a]
                ce = where[b - 1] + 1
        ts, te = snap(token_spans, cs, ce)
        s0, e0 = token_spans[ts][0], token_spans[te - 1][1]
        recovered.append(RecoveredSpan(cand, chunk_text[s0:e0], kind, sim, s0, e0, ts, te, occ))
        cursor = s0
    return recovered, abandoned


# ---------------------------------------------------------------------------- generators

MUTATIONS = (
    "case",
    "quotes",
    "accents",
    "dashes",
    "whitespace",
    "drop_word",
    "add_word",
    "numbers",
)
_FILLERS = ("the", "also", "very", "new", "of", "and", "its", "early", "main")
_QUOTE_SWAP = {"'": "’", "’": "'", "‘": "'", '"': "“", "“": '"', "”": '"'}
_DASH_SWAP = {"-": "–", "–": "-", "—": "-", "‐": "-"}


def _strip_accents(s: str) -> str:
    decomposed = unicodedata.normalize("NFKD", s)
    return unicodedata.normalize(
        "NFC", "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    )


def mutate(span: str, kind: str, rng: random.Random) -> str:
    """A plausible LLM mis-copy of ``span`` (may equal it when the kind does not apply)."""
    words = span.split(" ")
    if kind == "case":
        return rng.choice([span.lower(), span.upper(), span.title(), span.swapcase()])
    if kind == "quotes":
        if any(q in span for q in _QUOTE_SWAP):
            return "".join(_QUOTE_SWAP.get(ch, ch) for ch in span)
        return f"“{span}”"
    if kind == "accents":
        plain = _strip_accents(span)
        if plain != span:
            return plain
        vowels = [k for k, ch in enumerate(span) if ch in "aeiou"]
        if not vowels:
            return span
        k = rng.choice(vowels)
        return span[:k] + unicodedata.normalize("NFC", span[k] + "\u0301") + span[k + 1 :]
    if kind == "dashes":
        if any(d in span for d in _DASH_SWAP):
            return "".join(_DASH_SWAP.get(ch, ch) for ch in span)
        return span.replace(", ", " — ", 1) if ", " in span else span
    if kind == "whitespace":
        if len(words) > 2 and rng.random() < 0.5:
            k = rng.randrange(1, len(words))
            return " ".join(words[:k]) + "".join(words[k : k + 1]) + " " + " ".join(words[k + 1 :])
        return "  " + "   ".join(words) + "\n"
    if kind == "drop_word":
        if len(words) < 4:
            return span
        k = rng.randrange(1, len(words) - 1)
        return " ".join(words[:k] + words[k + 1 :])
    if kind == "add_word":
        k = rng.randrange(1, len(words)) if len(words) > 1 else 1
        return " ".join(words[:k] + [rng.choice(_FILLERS)] + words[k:])
    if kind == "numbers":
        if re.search(r"\d,\d{3}", span):
            return re.sub(r"(?<=\d),(?=\d{3})", "", span)
        m = re.search(r"\d{4,}", span)
        if m:
            digits = m.group()
            grouped = f"{int(digits):,}"
            return span[: m.start()] + grouped + span[m.end() :]
        return span
    raise ValueError(kind)


def clause_spans(text: str, rng: random.Random, count: int) -> list[str]:
    """Verbatim runs of whole words inside sentences, as an extractor proposes them: raw slices
    of ``text`` (original spacing and line breaks kept), about 12 +- 4 words (the paper's mean
    nugget has 11-13 words)."""
    sentences = []
    for m in re.finditer(r"(?:[^.;:!?\n]|\n(?![ \t]*\n))+[.;:!?]*", text):
        words = [w.span() for w in re.finditer(r"\S+", m.group())]
        if len(words) >= 3:
            sentences.append((m.start(), words))
    out = []
    for _ in range(count):
        if not sentences:
            break
        base, words = rng.choice(sentences)
        size = min(len(words), max(3, round(rng.gauss(12, 4))))
        start = rng.randint(0, len(words) - size)
        out.append(text[base + words[start][0] : base + words[start + size - 1][1]])
    return out


def make_candidates(
    text: str,
    rng: random.Random,
    count: int = 25,
    p_mutated: float = 0.15,
    p_junk: float = 0.05,
    other_text: str = "",
) -> list[tuple[str, str]]:
    """``(candidate, label)`` pairs: label is "verbatim", a mutation name, or "junk:<kind>"."""
    spans = clause_spans(text, rng, count)
    others = clause_spans(other_text, rng, count) if other_text else []
    out = []
    for span in spans:
        r = rng.random()
        if r < p_junk:
            kind = rng.choice(["other_chunk", "other_chunk", "punct", "empty", "too_long"])
            if kind == "other_chunk" and others:
                out.append((rng.choice(others), "junk:other_chunk"))
            elif kind == "punct":
                out.append((rng.choice(["...", " — ", "(“”)", "*"]), "junk:punct"))
            elif kind == "empty":
                out.append((rng.choice(["", "  ", "\n"]), "junk:empty"))
            else:
                out.append((text + " " + span, "junk:too_long"))
        elif r < p_junk + p_mutated:
            kind = rng.choice(MUTATIONS)
            out.append((mutate(span, kind, rng), kind))
        else:
            out.append((span, "verbatim"))
    return out


if __name__ == "__main__":
    demo = "Grace O’Malley (Irish: Gráinne Ní Mháille) was the head of the Ó Máille dynasty."
    for cand, label in make_candidates(demo, random.Random(0), 10, 0.5, 0.2):
        print(f"{label:18} {cand!r}")
