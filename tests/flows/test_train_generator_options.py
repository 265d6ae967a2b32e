"""``train fusion`` and ``train retriever``'s ``--generator``: refused before any work when it
is unknown, given without ``--generated``, or ``openai`` without ``OPENAI_API_KEY``; and the
retriever's loss never counts a pair's own passage as its negative."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.training.retriever import own_passage_elsewhere

COMMANDS = {
    "fusion": ["train", "fusion", "--store", "STORE"],
    "retriever": ["train", "retriever", "--store", "STORE", "--out", "OUT"],
}


def _args(command: str, tmp_path, *extra: str) -> list[str]:
    paths = {"STORE": str(tmp_path / "store"), "OUT": str(tmp_path / "out")}
    return [paths.get(a, a) for a in COMMANDS[command]] + list(extra)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_generator_is_checked_before_any_work(command, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    runner = CliRunner()
    unknown = runner.invoke(app, _args(command, tmp_path, "--generated", "3", "--generator", "gpt"))
    assert unknown.exit_code == 2 and "--generator must be one of" in unknown.output
    alone = runner.invoke(app, _args(command, tmp_path, "--generator", "local"))
    assert alone.exit_code == 2 and "give --generated N" in alone.output
    keyless = runner.invoke(
        app, _args(command, tmp_path, "--generated", "3", "--generator", "openai")
    )
    assert keyless.exit_code != 0 and "needs OPENAI_API_KEY" in keyless.output
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()


def test_a_pairs_own_passage_is_never_its_negative() -> None:
    """Two questions asked about one chunk share their positive: each one's column of the
    other's positive (and a negative with the same text) is masked, its target is not."""
    pairs = [SimpleNamespace(positive="chunk a"), SimpleNamespace(positive="chunk a"),
             SimpleNamespace(positive="chunk b")]  # fmt: skip
    passages = ["chunk a", "chunk a", "chunk b", "chunk b", "other", "chunk a"]
    mask = own_passage_elsewhere(pairs, passages).tolist()
    assert mask == [
        [False, True, False, False, False, True],
        [True, False, False, False, False, True],
        [False, False, False, True, False, False],
    ]
