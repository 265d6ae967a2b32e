"""Nugget texts as the user meets them (`coinrag build` then `coinrag lineage`): an LLM candidate
that lacks the punctuation after its last word is recovered without it, although the fuzzy
stage scored whole-word windows ("composer," with its comma). The LLM is the local fake OpenAI
server (the network edge); chunking, recovery and the tables are the real ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.tasks.extractors.factory import make_extractor

pytestmark = pytest.mark.usefixtures("prefect_harness")

API_KEY = "sk-test-edges-0123456789"
TEXT = (
    "Franz Liszt was a Hungarian composer, pianist and teacher. China flourished under Ming "
    "rule. Trade grew after Riyadh, the capital, opened its port. Grace O’Malley (Irish: Gráinne "
    "Ní Mháille) was a queen."
)
# (what the LLM answered, the nugget text the user must see): misspelt, so recovered by the
# fuzzy stage, and without the punctuation that follows (or precedes) them in the passage.
ANSWERS = {
    "Franz Lizst was a Hungarian composer": "Franz Liszt was a Hungarian composer",
    "China flourishd under Ming rule": "China flourished under Ming rule",
    "Trade grew after Riyahd": "Trade grew after Riyadh",
    "Irish: Grainne Ni Mhaille": "Irish: Gráinne Ní Mháille",
}


@pytest.fixture()
def fake(monkeypatch):
    with FakeOpenAI(api_key=API_KEY) as server:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        make_extractor.cache_clear()
        yield server
        make_extractor.cache_clear()


def test_fuzzy_nuggets_keep_no_punctuation_the_candidate_lacks(tmp_path: Path, fake) -> None:
    src = write_corpus(tmp_path / "docs.jsonl", [{"id": "edges", "text": TEXT}])
    config = tmp_path / "build.toml"
    config.write_text("[build]\nkv = false\nindex = false\n", encoding="utf-8")
    fake.script_chat(Action.raw_content(json.dumps({"nuggets": list(ANSWERS)})))
    store = str(tmp_path / "store")
    runner = CliRunner()
    built = runner.invoke(
        app, ["build", str(src), "--store", store, "--extractor", "openai", "--config", str(config)]
    )
    assert built.exit_code == 0, built.output
    shown = runner.invoke(
        app,
        ["lineage", "--store", store, "--json", "SELECT candidate, match_kind, text FROM nuggets"],
    )
    assert shown.exit_code == 0, shown.output
    rows = {r["candidate"]: r for r in json.loads(shown.stdout)}
    assert set(rows) == set(ANSWERS)
    for candidate, want in ANSWERS.items():
        assert rows[candidate]["match_kind"] == "fuzzy"
        assert rows[candidate]["text"].lstrip(" ") == want, rows[candidate]
