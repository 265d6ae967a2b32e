"""`coinrag train cartridges` as the user runs it: what self-study accepts from the question
generator (a JSON array of questions, nothing else, drops counted with their reasons), and the
progress lines with an ETA of its three long stages (questions, teacher answers, training).

The generator is the local fake OpenAI server (the network edge); the store is built by the CLI,
the teacher and the cartridges use the packaged SmolLM2."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import sample_docs, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.schemas.tables import SelfStudyCallRow, SelfStudyQuestionRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = pytest.mark.usefixtures("prefect_harness")

API_KEY = "sk-test-selfstudy-cli-0123456789"
# One answer is an object holding statements (not what was asked for); the other an array of
# two questions and two statements. Every item shares content words with both documents.
OBJECT_ANSWER = json.dumps(
    {"facts": ["The film is about the speed of light.", "Light in the film travels fast."]}
)
ARRAY_ANSWER = json.dumps(
    [
        "Who directed the film about the speed of light?",
        "List what the film directed by Kubrick shows about the speed of light.",
        "The film was directed by Stanley Kubrick, who studied light.",
        "Light travels fast in the film.",
    ]
)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def task_logs():
    """Lines Prefect's task-run loggers write (the progress the user sees on the console):
    ``task_logs()`` starts capturing and returns the list. (Call it after the first command of
    a test: importing the build's libraries reconfigures logging once, dropping handlers.)"""
    handler = _Lines()
    logger = logging.getLogger("prefect.task_runs")
    level = logger.level

    def start() -> list[str]:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        return handler.lines

    yield start
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.heavy  # over 5 s: the second tier
def test_statements_are_dropped_with_reasons_and_stages_show_an_eta(
    tmp_path: Path, sample_corpus: Path, monkeypatch, task_logs
) -> None:
    src = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 2))
    config = tmp_path / "build.toml"
    config.write_text("[build]\nkv = false\nindex = false\n", encoding="utf-8")
    store = tmp_path / "store"
    runner = CliRunner()
    built = runner.invoke(
        app,
        ["build", str(src), "--store", str(store), "--extractor", "rules", "--config", str(config)],
    )
    assert built.exit_code == 0, built.output
    lines = task_logs()
    with FakeOpenAI(api_key=API_KEY) as fake:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        fake.script_chat(Action.raw_content(OBJECT_ANSWER), Action.raw_content(ARRAY_ANSWER))
        trained = runner.invoke(
            app, ["train", "cartridges", "--store", str(store), "--max-steps", "2"]
        )
        assert len(fake.chat_requests()) == 2
    assert trained.exit_code == 0, trained.output
    summary = json.loads(trained.stdout[trained.stdout.index("{") :])
    ss = summary["selfstudy"]
    assert (ss["planned"], ss["ok"], ss["malformed"]) == (2, 1, 1)
    assert ss["malformed_reasons"] == {"not_an_array": 1}
    assert ss["drop_reasons"] == {"not_a_question": 2}
    assert summary["questions"] == 2 and ss["raw_items"] == 4
    st = Store.at(store)
    kept = sorted(r.question for r in read_rows(st, SelfStudyQuestionRow))
    assert kept == sorted(json.loads(ARRAY_ANSWER)[:2])
    calls = {r.status: r for r in read_rows(st, SelfStudyCallRow)}
    assert "a JSON object, not the JSON array of questions asked for" in calls["malformed"].error
    # progress with an ETA for each stage
    for stage in ("selfstudy", "teacher", "train"):
        mine = [x for x in lines if x.startswith(f"{stage}: ")]
        assert mine, (stage, lines)
        eta = r"\(\d+%\), ([\d.]+ s each|\d+ per s), (about \d+ s left|done in \d+ s)$"
        assert all(re.search(eta, x) for x in mine), mine
    assert any(x.startswith("selfstudy: 40/40 questions written (100%)") for x in lines)
    assert any(x.startswith("teacher: 2/2 answers (100%)") for x in lines)
    assert any(x.startswith("train: step 2/2, loss ") for x in lines)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"questions": ["Who directed it?"]}', "not_an_array"),
        ('"Who directed it?"', "not_an_array"),
        ("Who directed it?", "not_json"),
        ("  ", "empty"),
    ],
)
def test_only_a_json_array_parses(content: str, reason: str) -> None:
    from coinrag.tasks.question_generators.accept import MalformedQuestions, parse_questions

    with pytest.raises(MalformedQuestions) as exc:
        parse_questions(content)
    assert exc.value.reason == reason
    assert parse_questions('```json\n["Who directed it?"]\n```') == ["Who directed it?"]


def test_questions_and_requests_pass_statements_do_not() -> None:
    from coinrag.tasks.question_generators.accept import is_question, usable_questions

    doc = (
        "2001: A Space Odyssey is a 1968 film directed by Stanley Kubrick. The film's plot, "
        "actors, credits, critics and release are described."
    )
    asked = [
        "Who directed 2001: A Space Odyssey?",
        "In which year was the film released?",
        "Summarise the film's plot in two sentences.",
        "Organize the film's credits as a JSON object",
        "Based on the document, list the film's actors",
        "Please describe the film's release",
        "Imagine you are Stanley Kubrick: explain the film",
        'What did the critics call the "film"?"',
    ]
    statements = [
        "Stanley Kubrick directed the film.",
        "The film was released in 1968, which was a good year.",
        "2001: A Space Odyssey is a film.",
        "May 1968 saw the film in cinemas.",
        "In 1968, Kubrick released the film.",
    ]
    assert [is_question(q) for q in asked] == [True] * len(asked)
    assert [is_question(s) for s in statements] == [False] * len(statements)
    kept, drops = usable_questions(asked + statements, doc)
    assert kept == asked and drops == {"not_a_question": len(statements)}
