"""The two QA JSONL formats, read by one loop, and what a question is.

One JSON object per line; blank lines are skipped; any other bad line raises a
:class:`QAFileError` whose message names ``path:line`` and what is wrong.

- **eval** (``coinrag eval``, :func:`load_questions` -> :class:`EvalQuestion`)::

      {"question": "Who?", "answers": ["A", "B"], "doc_ids": ["d1"]}      # doc_ids optional

- **train** (``coinrag train nuggets``, :func:`load_examples` -> :class:`QAExample`)::

      {"question": "Who?", "answer": "A",
       "documents": [{"id": "d1", "text": "...", "gold": true}, ...]}     # or "doc_ids": [...]
                                                                          # + "gold_doc_ids"?

Each reader takes the other format too (a file written for one command serves the other): the
eval reader takes ``answer`` for ``answers`` and the gold documents of ``gold_doc_ids`` or
``documents``; the train reader takes the first of ``answers`` and retrieves inside ``doc_ids``
(all gold). A question is blank when it holds no visible character (:func:`require_question`):
every entry point that answers or trains on questions refuses those.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class QAFileError(ValueError):
    """A malformed QA file: the message names the file and the line."""

    exit_code = 2  # a usage error: the file can never work as it is


class QuestionsError(QAFileError):
    """A malformed questions file (``coinrag eval``)."""


class DataError(QAFileError):
    """A malformed training file (``coinrag train nuggets``)."""


class BlankQuestion(ValueError):
    """A question with nothing to ask: empty, or only spaces and invisible characters."""

    exit_code = 2
    http_status = 422


def require_question(question: str) -> str:
    """``question`` itself, or :class:`BlankQuestion` when it holds no visible character
    (``""``, ``"  "``, ``"\\u200b"``): every entry point that answers questions refuses those,
    rather than answering a question nobody asked.

    >>> require_question(" Who? ")
    ' Who? '
    """
    if not isinstance(question, str) or not any(
        unicodedata.category(ch)[0] not in "CZ" for ch in question
    ):
        raise BlankQuestion(f"the question {question!r} is blank: ask something")
    return question


# ---------------------------------------------------------------------------- the file loop


def read_qa_jsonl(
    path: str | os.PathLike[str],
    parse: Callable[[dict[str, Any], str, int], T],
    *,
    error: type[QAFileError] = QAFileError,
    missing: str = "no such file",
    empty: str = "no records",
) -> list[T]:
    """``parse(obj, where, line)`` of every JSON object line of ``path`` (``where`` is
    ``"path:line"``, ``line`` 1-based). Blank lines are skipped. ``error`` is raised with
    ``"path: <missing>"`` for a missing file, ``"path: <empty>"`` for a file without records,
    and ``"path:line: ..."`` for a line that is not a JSON object (``parse`` raises its own).
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {missing}")
    out: list[T] = []
    with path.open(encoding="utf-8") as fh:
        for line, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
            out.append(parse(obj, where, line))
    if not out:
        raise error(f"{path}: {empty}")
    return out


# ---------------------------------------------------------------------------- shared fields


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _question(obj: dict[str, Any], where: str, error: type[QAFileError]) -> str:
    """The record's question, stripped (never blank)."""
    q = obj.get("question")
    try:
        require_question(q)  # type: ignore[arg-type]
    except BlankQuestion:
        raise error(f"{where}: 'question' must be a non-empty string, got {q!r}") from None
    return q.strip()


def _answers(obj: dict[str, Any], where: str, error: type[QAFileError]) -> list[str]:
    """``answers`` (eval format), else ``[answer]`` (train format): a non-empty string list."""
    answers = obj.get("answers")
    if answers is None and isinstance(obj.get("answer"), str):
        answers = [obj["answer"]]
    if not _is_str_list(answers) or not answers:
        raise error(
            f"{where}: 'answers' must be a non-empty list of strings (or 'answer' a string)"
        )
    return list(answers)


# ---------------------------------------------------------------------------- eval format


@dataclass(frozen=True)
class EvalQuestion:
    """One question of ``coinrag eval`` (``line``: 1-based line in the JSONL)."""

    question: str
    answers: list[str]
    doc_ids: list[str] | None  # gold documents; None: recall is not measured
    line: int


def _gold_doc_ids(obj: dict[str, Any], where: str) -> list[str] | None:
    """Gold document ids: ``doc_ids`` (the eval format); in the train format,
    ``gold_doc_ids``, else the ``gold`` documents of ``documents`` (all of them if none is
    flagged), else ``doc_ids``."""
    for name in ("gold_doc_ids", "doc_ids"):
        if obj.get(name) is not None:
            if not _is_str_list(obj[name]):
                raise QuestionsError(f"{where}: {name!r} must be a list of strings if given")
            return list(obj[name]) or None
    docs = obj.get("documents")
    if docs is None:
        return None
    if not isinstance(docs, list) or not all(
        isinstance(d, dict) and isinstance(d.get("id"), str | int) for d in docs
    ):
        raise QuestionsError(f"{where}: 'documents' must be a list of objects with an id")
    gold = [str(d["id"]) for d in docs if d.get("gold")]
    return gold or [str(d["id"]) for d in docs] or None


def parse_eval_question(obj: dict[str, Any], where: str, line: int) -> EvalQuestion:
    """One line of a questions file (either format, see the module doc)."""
    question = _question(obj, where, QuestionsError)
    answers = _answers(obj, where, QuestionsError)
    return EvalQuestion(question, answers, _gold_doc_ids(obj, where), line)


def load_questions(path: str | os.PathLike[str]) -> list[EvalQuestion]:
    """Read ``{"question": str, "answers": [str, ...], "doc_ids": [str, ...]?}`` lines.

    The ``coinrag train nuggets`` format is read too: ``"answer": str`` for ``answers``, and
    gold documents from ``gold_doc_ids`` or ``documents`` (see :func:`_gold_doc_ids`).
    Blank lines are skipped; any other malformed line (a blank question too) raises
    :class:`QuestionsError` naming ``path:line`` and what is wrong.
    """
    return read_qa_jsonl(
        path,
        parse_eval_question,
        error=QuestionsError,
        missing="no such questions file",
        empty="no questions",
    )


# ---------------------------------------------------------------------------- train format


@dataclass(frozen=True)
class QAExample:
    """One training example (``line``: 1-based line in the JSONL)."""

    line: int
    question: str
    answer: str
    doc_ids: tuple[str, ...]
    gold_doc_ids: tuple[str, ...]
    documents: tuple[tuple[str, str], ...] = ()  # (id, text) when given inline


def _id_list(value: Any, where: str, name: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise DataError(f"{where}: {name!r} must be a non-empty list of non-empty strings")
    if len(set(value)) != len(value):
        raise DataError(f"{where}: {name!r} repeats an id")
    return value


def _documents(docs: Any, where: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``documents`` as ``[(id, text)]`` and the ids flagged ``gold``."""
    if not isinstance(docs, list) or not docs:
        raise DataError(f"{where}: 'documents' must be a non-empty list")
    documents: list[tuple[str, str]] = []
    flagged: list[str] = []
    for j, d in enumerate(docs):
        if not isinstance(d, dict):
            raise DataError(f"{where}: documents[{j}] must be an object with id and text")
        if not isinstance(d.get("id"), str | int) or str(d["id"]) == "":
            raise DataError(f"{where}: documents[{j}].id must be a non-empty string")
        if not isinstance(d.get("text"), str) or not d["text"].strip():
            raise DataError(f"{where}: documents[{j}].text must be a non-empty string")
        if "gold" in d and not isinstance(d["gold"], bool):
            raise DataError(f"{where}: documents[{j}].gold must be true or false")
        documents.append((str(d["id"]), d["text"]))
        if d.get("gold"):
            flagged.append(str(d["id"]))
    ids = [i for i, _ in documents]
    if len(set(ids)) != len(ids):
        raise DataError(f"{where}: 'documents' repeats an id")
    return documents, flagged


def parse_example(obj: dict[str, Any], where: str, line: int) -> QAExample:
    """One line of a training file (either format, see :func:`load_examples`)."""
    question = _question(obj, where, DataError)
    answer = obj.get("answer")
    if answer is None and "answers" in obj:  # the eval format: the first gold answer
        answer = _answers(obj, where, DataError)[0]
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(
            f"{where}: 'answer' must be a non-empty string (or 'answers' a list of them)"
        )
    has_docs, has_ids = "documents" in obj, "doc_ids" in obj
    if has_docs == has_ids:
        raise DataError(f"{where}: give exactly one of 'documents' or 'doc_ids'")
    documents: list[tuple[str, str]] = []
    flagged: list[str] = []
    if has_docs:
        documents, flagged = _documents(obj["documents"], where)
        doc_ids = [i for i, _ in documents]
    else:
        doc_ids = _id_list(obj["doc_ids"], where, "doc_ids")
    if "gold_doc_ids" in obj:
        gold = _id_list(obj["gold_doc_ids"], where, "gold_doc_ids")
        if flagged and set(flagged) != set(gold):
            raise DataError(f"{where}: 'gold_doc_ids' disagrees with the documents' gold flags")
    else:
        gold = flagged or list(doc_ids)  # no gold marked: every document is gold
    unknown = set(gold) - set(doc_ids)
    if unknown:
        raise DataError(f"{where}: gold ids {sorted(unknown)} are not among the documents")
    return QAExample(
        line=line,
        question=question,
        answer=answer.strip(),
        doc_ids=tuple(doc_ids),
        gold_doc_ids=tuple(gold),
        documents=tuple(documents),
    )


def load_examples(path: str | os.PathLike[str]) -> list[QAExample]:
    """Read a QA JSONL: one object per line with ``question``, ``answer`` and either
    ``documents`` (``[{"id", "text", "gold"?}]``: gold and distractor passages) or ``doc_ids``
    (documents already in the store). Gold documents: ``gold_doc_ids`` or the ``gold`` flags;
    if neither is given, every document of the example is gold. Blank lines are skipped.

    The ``coinrag eval`` format is read too: ``{"question", "answers": [...], "doc_ids":
    [...]}`` trains on the first answer, retrieving inside (all gold) ``doc_ids``. A document
    id given with two different texts is an error. Raises :class:`DataError` naming the line.
    """
    texts: dict[str, str] = {}

    def parse(obj: dict[str, Any], where: str, line: int) -> QAExample:
        ex = parse_example(obj, where, line)
        for doc_id, text in ex.documents:
            if texts.setdefault(doc_id, text) != text:
                raise DataError(f"{where}: document {doc_id!r} has another text on an earlier line")
        return ex

    return read_qa_jsonl(path, parse, error=DataError, empty="no examples")
