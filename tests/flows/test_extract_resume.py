"""Extraction that fails or is killed: nothing paid for is lost, nothing failed is hidden.

Where the user meets it: the real ``coinrag build`` (a subprocess that is SIGKILLed, and the CLI
through typer's runner) against a real Prefect API (the session harness), a real store in a
temporary folder and the official ``openai`` client talking to a real HTTP server on 127.0.0.1
(``fake_openai_server.py``), which counts every request.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.compute as pc
import pytest
from fake_openai_server import Action, FakeOpenAI
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.flows.progress import ProgressLog
from coinrag.schemas.tables import ChunkRow, ExtractionCallRow, ExtractionRow, NuggetRow, RunRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.extractors.factory import make_extractor

pytestmark = pytest.mark.usefixtures("prefect_harness")

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-resume-0123456789"
# No KV, no index: only what extraction needs, so each build takes seconds.
CONFIG = '[build]\nextractor = "openai"\nchunk_size = 64\nkv = false\nindex = {index}\n'


def _corpus(tmp_path: Path, sample_corpus: Path, n: int = 3) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:n]))
    return src


def _config(tmp_path: Path, index: bool = False, **extra: object) -> Path:
    path = tmp_path / f"build-{index}-{len(extra)}.toml"
    lines = [CONFIG.format(index=str(index).lower())]
    lines += [f"{k} = {json.dumps(v)}\n" for k, v in extra.items()]
    path.write_text("".join(lines))
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def _texts(store: Path) -> int:
    return len({c.text_hash for c in read_rows(Store.at(store), ChunkRow)})


def _last_run(store: Path) -> RunRow:
    rows = [r for r in read_rows(Store.at(store), RunRow) if r.status != "running"]
    return max(rows, key=lambda r: r.ended_at)


def _build(runner: CliRunner, src: Path, store: Path, config: Path):
    make_extractor.cache_clear()  # the client reads OPENAI_BASE_URL when it is made
    return runner.invoke(app, ["build", str(src), "--store", str(store), "--config", str(config)])


@pytest.mark.heavy  # over 5 s: the second tier
def test_failed_extractions_exit_4_and_the_next_build_asks_them_again(
    tmp_path, sample_corpus, monkeypatch
) -> None:
    """Items 1 and 2: a dead endpoint is a partial failure (exit 4, one line, the runs row says
    so), and the next build re-asks every failed chunk text through a real Prefect run."""
    src, store = _corpus(tmp_path, sample_corpus), tmp_path / "store"
    config = _config(tmp_path, max_attempts=1)
    runner = CliRunner()
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{_closed_port()}/v1")
    dead = _build(runner, src, store, config)
    n = _texts(store)
    assert n >= 4
    assert dead.exit_code == 4, dead.output
    line = f"error: {n} of {n} chunk texts could not be extracted ("
    assert line in dead.output and "run coinrag build again to retry them" in dead.output
    run = _last_run(store)
    assert run.status == "completed" and run.error.startswith(f"{n} of {n} chunk texts")
    assert json.loads(run.counts_json)["extract_failed"] == n
    failed = read_rows(Store.at(store), ExtractionRow)
    assert len(failed) == n and {r.status for r in failed} == {"failed"}

    with FakeOpenAI(api_key=API_KEY) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        healed = _build(runner, src, store, config)
        assert healed.exit_code == 0, healed.output
        assert len(fake.chat_requests()) == n  # every failed text asked again, once
        again = _build(runner, src, store, config)
        assert again.exit_code == 0 and len(fake.chat_requests()) == n  # answered: not asked
    make_extractor.cache_clear()
    assert _last_run(store).error is None
    assert read_rows(Store.at(store), NuggetRow)
    assert not list((store / "staging").rglob("*.parquet"))  # every staged answer moved in


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.heavy
def test_killed_build_keeps_every_answer_it_received(tmp_path, sample_corpus) -> None:
    """Item 13 (and 11): SIGKILL a real ``coinrag build`` after 5 answers; the resumed build
    asks only for the rest. Progress came per answered chunk text, with an ETA, before that."""
    from prefect.settings import PREFECT_API_URL

    src, store = _corpus(tmp_path, sample_corpus), tmp_path / "store"
    answered = 5
    with FakeOpenAI(api_key=API_KEY) as fake:
        fake.latency_s = 0.3  # a few progress ticks before the hold
        fake.hold_after = answered  # the 6th request waits: the build is killed meanwhile
        env = {
            **os.environ,
            "OPENAI_API_KEY": API_KEY,
            "OPENAI_BASE_URL": fake.base_url,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),  # the session's server
            "PREFECT_LOGGING_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-m", "coinrag.flows.cli", "build", str(src), "--store", str(store)]
        cmd += ["--config", str(_config(tmp_path, index=True)), "--concurrency", "1"]
        log = tmp_path / "killed.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        family: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + 240
            while len(fake.chat_requests()) <= answered:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            time.sleep(2.5)  # progress ticks while the 6th request hangs
            family = _family(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            for p in family or _family(proc.pid):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait(30)
            fake.release()
        killed = log.read_text()
        n = _texts(store)
        assert n > answered + 2
        # Progress inside the batch (the old code said nothing until all 32 were answered).
        moving = re.findall(
            rf"extract: (\d+)/{n} chunk texts \(\d+%\), .* about \d+ s left", killed
        )
        assert moving and 1 <= int(moving[0]) <= answered, killed
        assert not read_rows(Store.at(store), ExtractionRow)  # nothing moved in yet: staged

        before = len(fake.chat_requests())
        resumed = subprocess.run(
            [*cmd[:-2], "--concurrency", "4"], env=env, cwd=REPO, capture_output=True, text=True
        )
        output = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, output
        assert len(fake.chat_requests()) - before == n - answered  # only the unanswered ones
    assert f"kept {answered} answer(s) an interrupted build had received" in output
    run = _last_run(store)
    counts = json.loads(run.counts_json)
    assert counts["extract_cached"] == answered and counts["extract_ok"] == n - answered
    st = Store.at(store)
    assert len(read_rows(st, ExtractionRow, filter=pc.field("status") == "ok")) == n
    calls = read_rows(st, ExtractionCallRow)
    assert len(calls) == n and len({c.call_id for c in calls}) == n  # each paid call once
    assert sum(c.run_id != run.run_id for c in calls) == answered  # the killed run's, kept
    assert not list((store / "staging").rglob("*.parquet"))
    # Embedding progress: a percentage (and an ETA, or the time it took).
    assert re.search(r"embed: (\d+)/\1 texts \(100%\), .*done in \d+ s", output), output


def test_progress_lines_are_rate_limited_with_percent_and_eta() -> None:
    lines: list[str] = []

    class Logger:
        def info(self, text: str) -> None:
            lines.append(text)

    now = [0.0]
    progress = ProgressLog(Logger(), "extract", "chunk texts", 50, every_s=5, clock=lambda: now[0])  # type: ignore[arg-type]
    for done in range(1, 51):
        now[0] = done * 1.5
        progress.update(done)
    progress.update(50)
    assert lines[0] == "extract: 1/50 chunk texts (2%), 1.50 s each, about 74 s left"
    assert lines[1] == "extract: 5/50 chunk texts (10%), 1.50 s each, about 68 s left"
    assert lines[-1] == "extract: 50/50 chunk texts (100%), 1.50 s each, done in 75 s"
    assert len(lines) == 1 + 50 * 1.5 // 6 + 1  # one every 4 updates (6 s), the first, the last


@pytest.mark.slow
@pytest.mark.heavy
def test_dask_workers_stage_answers_the_flow_writes_once(
    tmp_path, sample_corpus, monkeypatch
) -> None:
    """Item 13 on a distributed runner: the answers are staged by the Dask workers as they
    arrive (seen on disk while the endpoint holds the next request), and the flow process alone
    writes them into the tables, each once."""
    import threading

    from coinrag.flows.build import build_flow

    src, store = _corpus(tmp_path, sample_corpus), tmp_path / "store"
    settings = {"extractor": "openai", "chunk_size": 64, "kv": False, "index": False}
    settings |= {"runner": "dask", "workers": 2, "extract_batch_size": 3, "concurrency": 1}
    staged_dir = store / "staging" / "extractions"
    with FakeOpenAI(api_key=API_KEY) as fake:
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        make_extractor.cache_clear()
        fake.hold_after = 2
        done: dict = {}
        build = threading.Thread(
            target=lambda: done.update(build_flow(str(src), str(store), settings))
        )
        build.start()
        try:
            deadline = time.monotonic() + 240
            while len(list(staged_dir.glob("*.parquet"))) < 2:  # staged by a worker, held
                assert build.is_alive() and time.monotonic() < deadline
                time.sleep(0.2)
            assert not read_rows(Store.at(store), ExtractionRow)  # not in the table yet
        finally:
            fake.release()
            build.join(300)
        make_extractor.cache_clear()
        n = _texts(store)
        assert done["extract_ok"] == n == len(fake.chat_requests())
    st = Store.at(store)
    answers = read_rows(st, ExtractionRow)
    assert len(answers) == len({a.text_hash for a in answers}) == n
    calls = read_rows(st, ExtractionCallRow)
    assert len(calls) == len({c.call_id for c in calls}) == n
    assert not list((store / "staging").rglob("*.parquet"))


# A reply no parser can read, and no item to salvage: what a small model at temperature 0 says
# about one passage, every time it is asked (repair requests included).
NOT_JSON = "Sure! Here are the nuggets: Kubrick, Clarke, the Sentinel."
TARGET = "2001: A Space Odyssey is a 1968 epic"  # the first chunk of the first document
LIGHT = "The speed of light is the speed of electromagnetic waves"  # the second document's
# A reply cut off after one complete item: the item is salvaged (no second request).
CUT_OFF = json.dumps({"nuggets": [LIGHT, "Light travels"]})[:-14]


def _explorer_marks_abandoned(store: Store, row: dict) -> None:
    """The store explorer's document page (``coinrag api``'s ``/ui``) marks the abandoned
    chunk with its reason, from what ``storage/explore.py`` reads."""
    from markupsafe import escape  # as Jinja escapes

    from coinrag.inference.server.ui.marks import cut_document
    from coinrag.inference.server.ui.pages import templates
    from coinrag.storage.explore import StoreExplorer

    doc = StoreExplorer.open(store).document(row["doc_id"])
    (chunk,) = [c for c in doc["chunks"] if c["chunk_id"] == row["chunk_id"]]
    assert chunk["extraction"]["status"] == "abandoned" and not chunk["nuggets"]
    assert [a["error"] for a in chunk["abandoned"]] == [row["error"]]
    html = (
        templates()
        .get_template("document.html")
        .render(
            signed_in=False,
            doc=doc,
            pieces=cut_document(doc["text"], doc["chunks"]),
            cited=None,
            kv_codec="none",
            kv_dtype="bfloat16",
        )
    )
    section = html.split(f'id="chunk-{row["chunk_id"]}"')[0].rsplit("<section", 1)[1]
    assert 'class="chunk failed' in section
    assert str(escape(row["error"])) in html


@pytest.mark.heavy  # over 10 s: the second tier
def test_malformed_replies_settle_after_three_builds_and_are_not_asked_again(
    tmp_path, sample_corpus, monkeypatch
) -> None:
    """Where the user meets issue 22: an endpoint on 127.0.0.1 answers one chunk malformed the
    same way every time. Builds 1 and 2 exit 4 (the next build asks again, with repair
    requests, never the same request twice); build 3 abandons it (exit 0, one warning line,
    runs.counts_json and the abandoned_extractions view show it); build 4 makes no call and the
    chunk is indexed without LLM nuggets; --retry-abandoned asks again."""
    src, store = _corpus(tmp_path, sample_corpus), tmp_path / "store"
    config = _config(tmp_path)
    runner = CliRunner()
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    with FakeOpenAI(api_key=API_KEY) as fake:
        fake.answer_always(TARGET, NOT_JSON)
        fake.script_chat(Action.raw_content(CUT_OFF), match=LIGHT)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        exits, asked = [], []
        for build in range(3):
            before = len(fake.chat_requests())
            result = _build(runner, src, store, config)
            exits.append(result.exit_code)
            mine = [r.body for r in fake.chat_requests()[before:] if TARGET in r.body.decode()]
            assert 1 < len(mine) <= 3 and len(set(mine)) == len(mine), result.output
            asked.append(len(mine))
            if build < 2:
                assert "1 of " in result.output and "got only malformed replies" in result.output
            if build == 0:  # the cut-off reply's complete item was kept: one request
                counts = json.loads(_last_run(store).counts_json)
                assert counts["extract_salvaged"] == 1, counts
                light = [r for r in fake.chat_requests() if LIGHT in r.body.decode()]
                assert len(light) == 1
                assert any(LIGHT in n.text for n in read_rows(Store.at(store), NuggetRow))
        n = _texts(store)
        assert exits == [4, 4, 0], result.output
        assert asked == [asked[0]] * 3 and len(fake.chat_requests()) == n - 1 + 3 * asked[0]
        assert "got only malformed replies" not in result.output
        warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
        assert warnings == [
            "warning: 1 chunk text(s) abandoned: their replies were malformed in 3 builds of "
            "this extractor; they keep no LLM nuggets (coinrag build --retry-abandoned asks "
            "again; the lineage view abandoned_extractions lists them)"
        ]
        third = _last_run(store)
        counts = json.loads(third.counts_json)
        assert counts["extract_malformed"] == counts["extract_abandoned"] == 1
        assert counts["extract_failed"] == 0 and third.error is None

        calls = len(fake.chat_requests())
        fourth = _build(runner, src, store, _config(tmp_path, index=True))
        assert fourth.exit_code == 0, fourth.output
        assert len(fake.chat_requests()) == calls  # no call at all
        assert "warning:" not in fourth.output
        counts = json.loads(_last_run(store).counts_json)
        assert counts["extract_abandoned_before"] == 1 and counts["llm_calls"] == 0

        sql = "SELECT * FROM abandoned_extractions"
        view = runner.invoke(app, ["lineage", "--store", str(store), sql, "--json"])
        assert view.exit_code == 0, view.output
        (row,) = json.loads(view.stdout)
        assert row["malformed_runs"] == 3 and row["run_id"] == third.run_id and row["live"]
        assert row["error"].startswith("malformed in 3 builds: malformed after 3 attempt(s)")
        chunk = row["chunk_id"]
        st = Store.at(store)
        assert not [r for r in read_rows(st, NuggetRow) if r.chunk_id == chunk]
        _explorer_marks_abandoned(st, row)
        indexed = runner.invoke(
            app,
            ["lineage", "--store", str(store), "--json"]
            + [f"SELECT index_run_id FROM lineage_chunks WHERE chunk_id = '{chunk}'"],
        )
        assert json.loads(indexed.stdout)[0]["index_run_id"]  # indexed like any chunk

        retried = runner.invoke(
            app,
            ["build", str(src), "--store", str(store), "--config", str(config)]
            + ["--retry-abandoned"],
        )
        make_extractor.cache_clear()
        assert retried.exit_code == 0, retried.output  # asked again, malformed: abandoned again
        assert len(fake.chat_requests()) == calls + asked[0]
        assert "warning: 1 chunk text(s) abandoned" in retried.output
        # another extractor fingerprint (model) asks every text, the abandoned one included
        calls = len(fake.chat_requests())
        other = runner.invoke(
            app,
            ["build", str(src), "--store", str(store), "--config", str(config)]
            + ["--llm-model", "gpt-4o"],
        )
        make_extractor.cache_clear()
        assert other.exit_code == 4 and "got only malformed replies" in other.output
        assert len(fake.chat_requests()) == calls + n - 1 + asked[0]
