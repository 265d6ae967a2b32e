"""Windows (``inference/retrieval/windows.py``): every token of a text in some window, each window
within the embedder's length; the pure cutting on generated word layouts, then the real MiniLM
tokenizer on the sample corpus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from coinrag.inference.retrieval.embedders import FlagEmbedder, load_embedder
from coinrag.inference.retrieval.windows import PREFIX_FRACTION, text_windows, window_spans


def _word_ids(rng: random.Random, n: int, longest: int) -> list[int | None]:
    """``n`` token word ids: words of 1..longest tokens, some tokens of no word (None)."""
    ids: list[int | None] = []
    word = 0
    while len(ids) < n:
        if rng.random() < 0.05:
            ids.append(None)
            continue
        ids.extend([word] * rng.randint(1, longest))
        word += 1
    return ids[:n]


@pytest.mark.parametrize("seed", range(40))
def test_window_spans_cover_every_token_within_width(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 900)
    width = rng.randint(1, 300)
    overlap = rng.randint(0, width)
    word_ids = _word_ids(rng, n, longest=rng.choice([1, 3, 8, 400]))
    spans = window_spans(word_ids, width, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(0 <= s < e <= n or (s, e) == (0, 0) for s, e in spans)
    assert all(e - s <= max(width, 1) for s, e in spans)
    covered = set()
    for s, e in spans:
        covered.update(range(s, e))
    assert covered == set(range(n))  # every token in some window
    starts = [s for s, _ in spans]
    assert starts == sorted(set(starts))  # each window starts after the one before
    for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
        assert s1 <= e0  # no gap between consecutive windows
    if n > width:
        first = {i for i, w in enumerate(word_ids) if i == 0 or w is None or w != word_ids[i - 1]}
        # a window starts inside a word only where the word is longer than a window
        for s, _ in spans:
            if s not in first:
                j = max(i for i in first if i <= s)
                k = min([i for i in first if i > s] + [n])
                assert k - j > width or (s, n) == spans[-1]


def test_window_spans_examples():
    assert window_spans(list(range(10)), 4, 1) == [(0, 4), (3, 7), (6, 10)]
    assert window_spans(list(range(3)), 4, 1) == [(0, 3)]
    assert window_spans([], 4, 1) == [(0, 0)]
    # no overlap asked: windows follow each other; the short tail moves back to a full window
    assert window_spans(list(range(9)), 4, 0) == [(0, 4), (4, 8), (5, 9)]


@pytest.fixture(scope="module")
def minilm() -> FlagEmbedder:
    return load_embedder(None, device="cpu")


def test_minilm_windows_cover_a_long_text_within_max_length(minilm, sample_corpus: Path):
    text = sample_corpus.read_text(encoding="utf-8")  # ~1,000 words of eleven articles
    tok = minilm.tokenizer
    total = len(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
    for prefix in ("", "Sample corpus > Articles > Science"):
        windows = minilm.windows(text, prefix)
        assert total > 2 * minilm.max_length and len(windows) >= 3
        lead = f"{prefix}\n" if prefix else ""
        for w in windows:
            assert w.text == lead + text[w.char_start : w.char_end]
            ids = tok(w.text, verbose=False)["input_ids"]  # with [CLS] and [SEP]
            assert len(ids) <= minilm.max_length  # the embedder sees the whole window
        # every character of a token (every non-space character) is in some window
        covered = [False] * len(text)
        for w in windows:
            covered[w.char_start : w.char_end] = [True] * (w.char_end - w.char_start)
        missed = [i for i, c in enumerate(text) if not c.isspace() and not covered[i]]
        assert missed == []
        assert windows[0].char_start == 0 and windows[-1].char_end == len(text)
        # consecutive windows overlap (by about a quarter of a window)
        for a, b in zip(windows, windows[1:], strict=False):
            assert b.char_start < a.char_end


def test_minilm_short_text_is_one_window_and_a_long_prefix_is_cut(minilm):
    text = "  A short chunk of text.\n"
    assert minilm.windows(text) == [(0, len(text), text)]  # the whole text, spaces and all
    long_heading = " > ".join(f"Heading number {i}" for i in range(60))
    (window,) = minilm.windows(text, long_heading)
    room = minilm.max_length - 2
    head = window.text[: -len(text) - 1]
    assert long_heading.startswith(head) and len(head) < len(long_heading)
    assert len(minilm.tokenizer(head, add_special_tokens=False)["input_ids"]) <= int(
        room * PREFIX_FRACTION
    )


def test_text_windows_with_a_word_tokenizer():
    """The pure function with whitespace words: the worked example of the module."""
    import re

    def words(text: str):
        offsets = [m.span() for m in re.finditer(r"\S+", text)]
        return offsets, list(range(len(offsets)))

    text = "a b c d e f g h i j"
    got = text_windows(text, "", words, room=4, overlap_fraction=0.25)
    assert [w.text for w in got] == ["a b c d", "d e f g", "g h i j"]
    got = text_windows(text, "T", words, room=5, overlap_fraction=0.25)  # T + join: 2 tokens
    assert [w.text for w in got] == ["T\na b c", "T\nd e f", "T\ng h i", "T\nh i j"]


def test_text_windows_take_the_path_of_a_heading_inside_the_text():
    """A window is embedded after the path where its first word is: the text's own, or that of
    a heading inside the text; the width leaves room for the longest path."""
    import re

    def words(text: str):
        offsets = [m.span() for m in re.finditer(r"\S+", text)]
        return offsets, list(range(len(offsets)))

    text = "a b c d e f g h i j"
    got = text_windows(text, "T", words, room=5, overlap_fraction=0.25, sections=[(12, "S")])
    assert [w.text for w in got] == ["T\na b c", "T\nd e f", "S\ng h i", "S\nh i j"]
    got = text_windows(text, "T", words, room=5, overlap_fraction=0.25, sections=[(11, "S")])
    assert [w.text for w in got][2] == "S\ng h i"  # a heading starting on the blank before
    # room 8: a path keeps 2 words, "S U" and its join take 3 tokens: windows of 5
    got = text_windows(text, "T", words, room=8, overlap_fraction=0.25, sections=[(6, "S U")])
    assert [w.text for w in got] == ["T\na b c d e", "S U\ne f g h i", "S U\nf g h i j"]
