"""The content chunker: resynchronisation after an edit, on the real SmolLM2 tokenizer.

The invariants shared with the other chunkers (exact offsets, decode, size bound, emoji and
accents) are checked by ``tests/tasks/test_chunk.py``, which runs every chunker.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coinrag.tasks.chunk import chunk_document, chunker_fingerprint, tokenize
from coinrag.tasks.chunk_content import CONTEXT_AFTER, CONTEXT_BEFORE, ContentParams, content_plan

WORDS = ["the", "café", "naïve", "😀", "東京", "m/s", "(Irish:", "O’Malley)", "299,792", "—"]
WORDS += ["a", "of", "river", "Gráinne", "head", "x", "is", "and", "were", "dynasty"]
ENDS = [".", "!", "?", ".”", ")."]
SEPARATORS = [" ", " ", " ", "\n\n"]
# A pre-token (a word) is at most this many characters long here, so text this far from an edit
# tokenizes the same before and after it.
WORD_MARGIN = 16


def _chunks(tokenizer, text: str, size: int, method: str = "content") -> list:
    return chunk_document(
        tokenizer, "d", "dv", text, tokenizer_fp="tok", chunk_size=size, method=method, run_id="r"
    )


def _sentence(words: list[str], end: str) -> str:
    return " ".join(words).capitalize() + end


sentences = st.builds(
    _sentence, st.lists(st.sampled_from(WORDS), min_size=2, max_size=12), st.sampled_from(ENDS)
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.lists(st.tuples(sentences, st.sampled_from(SEPARATORS)), min_size=30, max_size=120),
    new_sentence=sentences,
    where=st.floats(min_value=0.3, max_value=0.7),
    kind=st.sampled_from(["replace", "insert", "delete"]),
    size=st.integers(min_value=16, max_value=64),
)
def test_chunks_far_from_an_edit_are_unchanged(
    smollm2_tokenizer, body, new_sentence, where, kind, size
) -> None:
    """The guarantee of ``tasks/chunk_content.py``, before and after the edited sentence."""
    parts = [s + sep for s, sep in body]
    i = int(where * len(parts))
    x = sum(map(len, parts[:i]))  # the edit replaces old[x:y] by new[x:x + len(inserted)]
    if kind == "replace":
        edited, inserted = [*parts[:i], new_sentence + " ", *parts[i + 1 :]], new_sentence + " "
    elif kind == "insert":
        edited, inserted = [*parts[:i], new_sentence + " ", *parts[i:]], new_sentence + " "
    else:
        edited, inserted = [*parts[:i], *parts[i + 1 :]], ""
    old, new = "".join(parts), "".join(edited)
    y = x + (len(parts[i]) if kind != "insert" else 0)
    delta = len(inserted) - (y - x)
    assert new == old[:x] + inserted + old[y:]

    params = ContentParams.for_chunk_size(size)
    doc = tokenize(smollm2_tokenizer, old)
    n_new = len(tokenize(smollm2_tokenizer, new).ids)
    if len(doc.ids) <= size or n_new <= size:
        event("document fits in one chunk")
        return
    plan = content_plan(doc.text, doc.ends, params)
    pos = [0, *doc.ends]  # char offset of each token cut
    old_rows, new_rows = (
        _chunks(smollm2_tokenizer, old, size),
        _chunks(smollm2_tokenizer, new, size),
    )
    new_chunks = {(r.char_start, r.text, tuple(r.token_ids)) for r in new_rows}

    # Before: chunks up to the last segment cut whose hash context ends before the edit.
    before = [s for s in plan.segment_starts if pos[s] + CONTEXT_AFTER + WORD_MARGIN <= x]
    if before and n_new - before[-1] >= params.min_tokens:
        kept = [r for r in old_rows if r.char_end <= pos[before[-1]]]
        assert kept
        for r in kept:
            assert (r.char_start, r.text, tuple(r.token_ids)) in new_chunks
        event("before: checked")

    # After: chunks from the first segment cut after the first anchor whose previous candidate
    # (hence gap and hash context) lies after the edit.
    previous = dict(zip(plan.candidates[1:], plan.candidates, strict=False))
    anchor = next(
        (
            a
            for a in plan.anchors
            if a in previous and pos[previous[a]] - CONTEXT_BEFORE - WORD_MARGIN >= y
        ),
        None,
    )
    resync = next((s for s in plan.segment_starts if anchor is not None and s > anchor), None)
    if resync is not None:
        kept = [r for r in old_rows if r.char_start >= pos[resync]]
        assert kept
        for r in kept:
            assert (r.char_start + delta, r.text, tuple(r.token_ids)) in new_chunks
        event("after: checked")


def _prose(n_sentences: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = WORDS + ["sentence", "about", "topic", "number", "long", "document", "edit"]
    return [
        _sentence(rng.choices(words, k=rng.randint(4, 16)), rng.choice(ENDS))
        + rng.choice(SEPARATORS)
        for _ in range(n_sentences)
    ]


@pytest.mark.parametrize("kind", ["replace", "insert", "delete"])
def test_an_edit_in_the_middle_re_chunks_only_its_neighbourhood(smollm2_tokenizer, kind) -> None:
    parts = _prose(600, seed=1)
    i = len(parts) // 2
    # Longer than any generated sentence, so that a replacement shifts the later tokens.
    new_sentence = "An edit put this sentence here, " * 4 + "longer than the sentences around. "
    edited = {
        "replace": [*parts[:i], new_sentence, *parts[i + 1 :]],
        "insert": [*parts[:i], new_sentence, *parts[i:]],
        "delete": [*parts[:i], *parts[i + 1 :]],
    }[kind]
    invalidated = {}
    for method in ("fixed", "content"):
        old_keys = {r.content_key for r in _chunks(smollm2_tokenizer, "".join(parts), 64, method)}
        new = _chunks(smollm2_tokenizer, "".join(edited), 64, method)
        invalidated[method] = sum(r.content_key not in old_keys for r in new)
        assert len(new) > 100
    assert invalidated["fixed"] > 50  # every later boundary moved
    assert 1 <= invalidated["content"] <= 3


def test_content_chunks_respect_the_size_window(smollm2_tokenizer) -> None:
    text = "".join(_prose(400, seed=2))
    params = ContentParams.for_chunk_size(64)
    rows = _chunks(smollm2_tokenizer, text, 64)
    assert all(r.n_tokens <= 64 for r in rows)
    # Segments are >= min tokens; only the split of a long segment can leave a shorter piece.
    assert sum(r.n_tokens < params.min_tokens for r in rows) <= len(rows) // 10
    # Chunks end at sentence ends or blank lines on prose like this.
    assert all(r.text.rstrip()[-1:] in ".!?”)" for r in rows)


def test_a_document_that_fits_is_one_chunk(smollm2_tokenizer) -> None:
    text = "".join(_prose(8, seed=3))
    assert len(_chunks(smollm2_tokenizer, text, 512)) == 1


def test_the_fingerprint_follows_the_parameters() -> None:
    base = chunker_fingerprint("content", 512)
    assert base == chunker_fingerprint("content", 512, ContentParams.for_chunk_size(512))
    assert base != chunker_fingerprint("content", 256)
    assert base != chunker_fingerprint("content", 512, ContentParams(512, 64, 128))
    assert base != chunker_fingerprint("content", 512, ContentParams(512, 128, 64))
    assert base != chunker_fingerprint("sentence", 512)
    # The other chunkers' fingerprints (hence their stored chunk ids) did not change.
    assert chunker_fingerprint("fixed", 512) == chunker_fingerprint(
        "fixed", 512, ContentParams(512, 64, 128)
    )


def test_bad_content_parameters_are_refused(smollm2_tokenizer) -> None:
    with pytest.raises(ValueError, match="min_tokens 40"):
        ContentParams(64, 40, 16).validate()
    with pytest.raises(ValueError, match="target_tokens 0"):
        ContentParams(64, 16, 0).validate()
    with pytest.raises(ValueError, match="differs from chunk_size 64"):
        chunk_document(
            smollm2_tokenizer,
            "d",
            "dv",
            "x y",
            tokenizer_fp="t",
            chunk_size=64,
            method="content",
            content=ContentParams(128, 32, 32),
            run_id="r",
        )
