"""The store's synthetic questions (headings) for the fusion choice and the retriever's pairs:
what counts as a heading, which pages each split holds, and that evaluation questions never
become training or tuning questions."""

from __future__ import annotations

import json
from pathlib import Path

from coinrag.tasks.retrieval.fusion import (
    SyntheticQuestion,
    clean_heading,
    excluding,
    page_split,
    store_headings,
    text_headings,
)
from coinrag.tasks.retrieval.retriever_pairs import heading_candidates, without_headings

REPO = Path(__file__).resolve().parents[2]
RST = """.. _sorting:

**************
Sorting HOW TO
**************

Python lists have a built-in sort method.

Sorting Basics
==============

A simple ascending sort is easy.

Key Functions
-------------

Odd underline
---

:mod:`functools` --- Higher order functions
===========================================

## Markdown works too

====
"""


def test_text_headings_finds_rest_and_markdown_titles():
    assert text_headings(RST) == [
        "Sorting HOW TO",
        "Sorting Basics",
        "Key Functions",  # ("Odd underline": its underline is shorter)
        "functools --- Higher order functions",
        "Markdown works too",
    ]
    assert clean_heading("The ``with`` *statement*") == "The with statement"


def test_store_headings_keep_long_headings_of_one_page():
    rows = [
        {"doc_id": "howto/sorting", "section": None, "text": RST},
        {"doc_id": "a", "section": ["Guide", "See also the notes"], "text": "x"},
        {"doc_id": "b", "section": ["Other", "See also the notes"], "text": "y"},
        {"doc_id": "c", "section": ["Guide", "Reading CSV files"], "text": "z"},
    ]
    got = {(q.text, q.doc_id) for q in store_headings(rows)}
    assert ("Sorting HOW TO", "howto/sorting") in got
    assert ("Reading CSV files", "c") in got  # a section's last part
    assert not any(text == "Key Functions" for text, _ in got)  # 2 words
    assert not any(text == "See also the notes" for text, _ in got)  # heads two pages


def test_evaluation_questions_are_excluded():
    faq = json.loads((REPO / "infra" / "python_natural_questions.jsonl").open().readline())
    questions = [
        SyntheticQuestion(faq["question"].upper() + "  ", "library/argparse"),
        SyntheticQuestion("Sorting HOW TO", "howto/sorting"),
    ]
    kept, dropped = excluding(questions, [faq["question"]])
    assert dropped == 1 and [q.text for q in kept] == ["Sorting HOW TO"]


def test_page_split_is_stable_and_near_its_shares():
    ids = [f"page/{i}" for i in range(4000)]
    splits = [page_split(i) for i in ids]
    assert splits == [page_split(i) for i in ids]
    share = {name: splits.count(name) / len(ids) for name in ("fusion", "report", "retriever")}
    assert abs(share["fusion"] - 0.15) < 0.03 and abs(share["report"] - 0.15) < 0.03
    assert abs(share["retriever"] - 0.70) < 0.03


def test_heading_pairs_drop_the_heading_from_the_passage():
    page = next(f"p{i}" for i in range(100) if page_split(f"p{i}") == "retriever")
    other = next(f"p{i}" for i in range(100) if page_split(f"p{i}") != "retriever")
    body = "Sorting the Basics\n==================\n" + "A simple ascending sort is easy. " * 4
    rows = [
        {"doc_id": page, "section": None, "text": body},
        {"doc_id": other, "section": None, "text": body},
    ]
    (pair,) = heading_candidates(rows)  # the other page is the fusion's: never trained on
    assert pair[0] == "Sorting the Basics" and pair[2] == page
    assert "Sorting the Basics" not in pair[1] and "====" not in pair[1]
    assert without_headings("Key Functions\n-------------\ntext", ["Key Functions"]) == "text"


def test_generated_questions_become_pairs_first_and_never_an_evaluation_question(sample_store):
    """``training_pairs(generated=...)``: each generated question of a ``retriever`` page is a
    pair with the chunk it was asked about as its positive and another page's BM25 chunk as its
    negative, ahead of every heading pair; one equal to an evaluation question, one of another
    split's page and one without its passage are not pairs."""
    from coinrag.storage.index.lance import LanceIndex
    from coinrag.storage.store import Store
    from coinrag.tasks.retrieval.fusion import GENERATED_KIND
    from coinrag.tasks.retrieval.retriever_pairs import training_pairs

    index = LanceIndex.open(Store.at(sample_store))
    rows = index.columns("chunks", ["doc_id", "text"]).to_pylist()
    asked = [r for r in rows if page_split(r["doc_id"]) == "retriever"][:2]
    other = next(r for r in rows if page_split(r["doc_id"]) != "retriever")
    assert len(asked) == 2, "the sample store holds chunks of retriever pages"
    # words of another page too, so that BM25 finds a negative in this 5-page store
    words = [" ".join(r["text"].split()[:6] + other["text"].split()[:6]) for r in asked]
    generated = [
        SyntheticQuestion(f"What does it say about {words[0]}?", asked[0]["doc_id"],
                          GENERATED_KIND, asked[0]["text"]),
        SyntheticQuestion(f"Which is {words[1]}?", asked[1]["doc_id"], GENERATED_KIND,
                          asked[1]["text"]),
        SyntheticQuestion("Is this from a fusion page?", other["doc_id"], GENERATED_KIND,
                          other["text"]),
        SyntheticQuestion("A question without its passage?", asked[0]["doc_id"], GENERATED_KIND),
    ]  # fmt: skip
    evaluation = [f"which is {words[1]} ?"]  # the second, as an evaluation file words it
    pairs, counts = training_pairs(index, evaluation, max_pairs=50, generated=generated)
    first = pairs[0]
    assert first.kind == GENERATED_KIND and first.query == generated[0].text
    assert first.positive == asked[0]["text"][:2000] and first.doc_id == asked[0]["doc_id"]
    own_page = {r["text"][:2000] for r in rows if r["doc_id"] == asked[0]["doc_id"]}
    assert first.negative and first.negative not in own_page
    assert counts["generated_pairs"] == 1 and counts["excluded_as_evaluation"] == 1
    assert all(p.kind != GENERATED_KIND for p in pairs[1:])
    assert all(page_split(p.doc_id) == "retriever" for p in pairs)
    # Without generated questions the pairs are what they were: the same sample, in order.
    before, _ = training_pairs(index, evaluation, max_pairs=50)
    assert pairs[1:] == before[: len(pairs) - 1]
