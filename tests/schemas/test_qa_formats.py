"""schemas/qa.py: one file loop, two formats, each reader taking the other's format."""

from __future__ import annotations

import json

import pytest

from coinrag.schemas.qa import (
    DataError,
    QAFileError,
    QuestionsError,
    load_examples,
    load_questions,
    read_qa_jsonl,
)

TRAIN = {
    "question": "Who founded Zorvath?",
    "answer": "Ilsa Moren",
    "documents": [
        {"id": "zorvath", "text": "Zorvath was founded by Ilsa Moren.", "gold": True},
        {"id": "amber", "text": "The Amber Sea is shallow."},
    ],
}
EVAL = {"question": "Who founded Zorvath?", "answers": ["Ilsa Moren", "Moren"], "doc_ids": ["z"]}


def _write(path, *records) -> object:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_eval_reader_takes_the_train_format(tmp_path) -> None:
    (q,) = load_questions(_write(tmp_path / "t.jsonl", TRAIN))
    assert (q.question, q.answers, q.doc_ids, q.line) == (
        "Who founded Zorvath?",
        ["Ilsa Moren"],
        ["zorvath"],  # the gold-flagged document only
        1,
    )


def test_train_reader_takes_the_eval_format(tmp_path) -> None:
    (ex,) = load_examples(_write(tmp_path / "e.jsonl", EVAL))
    assert (ex.answer, ex.doc_ids, ex.gold_doc_ids, ex.documents) == (
        "Ilsa Moren",
        ("z",),
        ("z",),
        (),
    )


def test_one_loop_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "ok?", "answers": ["yes"], "doc_ids": ["d"]}\n\n[1]\n')
    for load, error in ((load_questions, QuestionsError), (load_examples, DataError)):
        with pytest.raises(error, match=r"q\.jsonl:3: expected a JSON object, got list"):
            load(path)
    assert issubclass(QuestionsError, QAFileError) and issubclass(DataError, QAFileError)
    with pytest.raises(QAFileError, match="no such file"):
        read_qa_jsonl(tmp_path / "missing.jsonl", lambda obj, where, line: obj)
    with pytest.raises(DataError, match="no such file"):
        load_examples(tmp_path / "missing.jsonl")
    path.write_text("\n")
    with pytest.raises(DataError, match="no examples"):
        load_examples(path)


def test_blank_question_refused_by_both(tmp_path) -> None:
    path = _write(tmp_path / "b.jsonl", {**EVAL, "question": "\u200b "})
    with pytest.raises(QuestionsError, match="'question' must be a non-empty string"):
        load_questions(path)
    with pytest.raises(DataError, match="'question' must be a non-empty string"):
        load_examples(path)
