"""Mistakes are refused at once, as one ``error:`` line naming the thing and the fix (issue 12,
items 5, 7 and 12): the real ``coinrag`` command in a subprocess, so what is checked is what a
user sees (no traceback, no Prefect server started, no store folder left behind)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coinrag.storage.store import Store

COINRAG = str(Path(sys.executable).parent / "coinrag")
SERVER_STARTED = "Starting temporary server"


def coinrag(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``coinrag`` (this session's PREFECT_HOME, no API URL, no key)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",)}
    environ.update(env or {})
    return subprocess.run(
        [COINRAG, *args], capture_output=True, text=True, env=environ, timeout=600
    )


def assert_error_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """Exit ``code``, and stderr is exactly one ``error:`` line holding ``words``."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "Alpha is a letter."}) + "\n")
    return src


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
def test_build_refuses_bad_inputs_before_any_work(tmp_path: Path, corpus: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    (tmp_path / "docs.csv").write_text("id,text\na,Alpha\n")
    store = str(tmp_path / "store")
    cases = [
        (["build", str(corpus), "--store", str(a_file)], ["--store", "is a file"]),
        (["build", str(corpus), "--store", str(a_file / "sub")], ["a-file", "is a file"]),
        (["build", str(corpus), "--store", store, "--model", str(tmp_path / "no-model")],
         ["--model", "no-model", "no such file or folder", "smollm2"]),
        (["build", str(corpus), "--store", store, "--model", str(tmp_path)],
         ["--model", "config.json"]),
        (["build", str(corpus), "--store", store, "--embedder", str(tmp_path / "none")],
         ["--embedder", "never downloaded"]),
        (["build", str(corpus), "--store", store, "--extractor", "openai"],
         ["--extractor openai", "OPENAI_API_KEY"]),
        (["build", str(corpus), "--store", store, "--extractor", "openai-batch"],
         ["OPENAI_API_KEY"]),
        (["build", str(tmp_path / "docs.csv"), "--store", store],
         ["unknown format .csv", ".jsonl"]),
        (["build", str(tmp_path / "nothing"), "--store", store], ["does not exist"]),
        (["build", str(tmp_path), "--store", store], ["holds no files coinrag reads"]),
    ]  # fmt: skip
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, words in cases:
        result = coinrag(*args)
        assert_error_line(result, 1, *words)
        assert SERVER_STARTED not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no store skeleton either


def test_bad_values_name_their_option(tmp_path: Path, corpus: Path) -> None:
    store = str(tmp_path / "store")
    for args, option in [
        (["query", "q", "--store", store, "--kc", "0"], "--kc"),
        (["query", "q", "--store", store, "--k", "0"], "--k"),
        (["query", "q", "--store", store, "--max-new-tokens", "0"], "--max-new-tokens"),
        (["eval", str(corpus), "--store", store, "--out", store, "--kc", "1", "0"], "--kc"),
        (["train", "cartridges", "--store", store, "--max-steps", "0"], "--max-steps"),
    ]:
        result = coinrag(*args)
        assert result.returncode == 2 and option in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    result = coinrag("build", str(corpus), "--store", store, "--chunk-size", "0")
    assert_error_line(result, 2, "chunk_size 0")
    result = coinrag("eval", str(corpus), "--store", store, "--out", store, "--methods", "magic")
    assert_error_line(result, 2, "--methods magic", "coinrag")
    assert not Path(store).exists()


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
def test_every_command_checks_its_store_first(tmp_path: Path, corpus: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    missing = tmp_path / "missing"
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Q?", "answers": ["A"], "doc_ids": ["a"]}) + "\n")
    out = str(tmp_path / "out")
    commands = [
        ["query", "q"],
        ["eval", str(qa), "--out", out],
        ["eval", str(qa), "--out", out, "--retrieval-only"],
        ["gc"],
        ["gc", "--dry-run"],
        ["delete", "a"],
        ["lineage"],
        ["train", "cartridges"],
        ["train", "nuggets", "--data", str(qa), "--out", out],
    ]
    for command in commands:
        assert_error_line(coinrag(*command, "--store", str(a_file)), 1, "is a file")
        assert_error_line(
            coinrag(*command, "--store", str(missing)),
            1,
            "not a coinrag store",
            f"coinrag build SOURCE --store {missing}",
        )
    assert not missing.exists() and not Path(out).exists()


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
def test_a_locked_store_is_refused_before_any_work(tmp_path: Path, corpus: Path) -> None:
    store = tmp_path / "store"
    st = Store.at(store).init()
    with st.write_lock("build-holder-42"):
        for args in (
            ["build", str(corpus), "--store", str(store)],
            ["gc", "--store", str(store)],
            ["delete", "a", "--store", str(store)],
            ["train", "cartridges", "--store", str(store)],
        ):
            result = coinrag(*args)
            assert_error_line(result, 1, "being written by another build", "build-holder-42")
            assert SERVER_STARTED not in result.stderr


def test_serve_and_watch_need_a_prefect_server(tmp_path: Path, corpus: Path) -> None:
    for command in ("serve", "watch"):
        result = coinrag(command, str(corpus), "--store", str(tmp_path / "s"))
        assert_error_line(result, 1, f"coinrag {command} needs a running Prefect server")


def test_blank_questions_are_refused(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    for blank in ("", "   ", "\t\u200b "):
        assert_error_line(coinrag("query", blank, "--store", store), 2, "blank")
        assert_error_line(
            coinrag("query", blank, "--store", store, "--method", "cartridge"), 2, "blank"
        )
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question": "Who?", "answers": ["x"]})
        + "\n"
        + json.dumps({"question": "  ", "answers": ["y"]})
        + "\n"
    )
    for extra in ([], ["--retrieval-only"]):
        result = coinrag("eval", str(questions), "--store", store, "--out", store, *extra)
        assert_error_line(result, 2, f"{questions}:2", "'question'")


@pytest.mark.heavy  # over 5 s: the second tier
def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    store = Store.at(tmp_path / "store").init()
    broken = Path(store.root) / "tables" / "runs"
    broken.mkdir(parents=True)
    (broken / "part-0.parquet").write_bytes(b"this is not parquet")
    result = coinrag("gc", "--dry-run", "--store", str(store.root))
    line = assert_error_line(result, 1, "coinrag --debug")
    assert "part-0.parquet" in line or "Parquet" in line or "parquet" in line
    debug = coinrag("--debug", "gc", "--dry-run", "--store", str(store.root))
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
@pytest.mark.slow
def test_a_failure_inside_the_flow_shows_no_traceback(tmp_path: Path, corpus: Path) -> None:
    """What no check can foresee (here: a model folder whose tokenizer cannot load) fails inside
    the flow: Prefect's log lines keep their messages, not their tracebacks, and the last word
    is one ``error:`` line."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')  # passes the preflight
    result = coinrag("build", str(corpus), "--store", str(tmp_path / "s"), "--model", str(model))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "its traceback: coinrag --debug" in result.stderr  # Prefect's failed task and flow
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "tokenizer" in errors[0], result.stderr
