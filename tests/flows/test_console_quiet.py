"""What a user sees on the console of `coinrag query` and `coinrag eval` (real subprocesses on
the session's sample store): the answer and coinrag's own progress lines, never the model
libraries' "Loading weights" progress bars or warnings about their internals; ``--debug``
shows them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

COINRAG = str(Path(sys.executable).with_name("coinrag"))
QUESTION = "Who directed 2001: A Space Odyssey?"
# A tqdm bar ("Loading weights: 100%|####| 272/272 [00:00<00:00, 1.2it/s]") or a warning.
NOISE = re.compile(r"Loading weights|\d+%\|.*\|\s*\d+/\d+|it/s\]|Warning|warn\(", re.IGNORECASE)


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)  # as a user's shell has them: unset
    return env


def _query(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``coinrag [--debug] query QUESTION --store STORE ...`` (``extra`` before ``query`` when
    it is ``--debug``, else after it)."""
    first = [x for x in extra if x == "--debug"]
    cmd = [COINRAG, *first, "query", QUESTION, "--store", str(store), "--threads", "1"]
    cmd += ["--kc", "2", "--k", "4", "--max-new-tokens", "4"]
    cmd += [x for x in extra if x != "--debug"]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.heavy  # over 5 s: the second tier
def test_query_prints_the_answer_and_no_library_progress_bars(sample_store: Path) -> None:
    done = _query(sample_store)
    assert done.returncode == 0, done.stderr
    assert "method coinrag" in done.stdout
    assert not NOISE.search(done.stderr), done.stderr
    assert done.stderr.strip() == "", done.stderr


@pytest.mark.heavy
def test_debug_shows_the_library_progress_bars(sample_store: Path) -> None:
    done = _query(sample_store, "--debug")
    assert done.returncode == 0, done.stderr
    assert "Loading weights" in done.stderr


@pytest.mark.heavy
def test_eval_keeps_its_own_progress_lines_only(sample_store: Path, tmp_path: Path) -> None:
    questions = tmp_path / "questions.jsonl"
    line = {"question": QUESTION, "answers": ["Stanley Kubrick"]}
    questions.write_text(json.dumps(line) + "\n")
    cmd = [COINRAG, "eval", str(questions), "--store", str(sample_store), "--out"]
    cmd += [str(tmp_path / "out"), "--methods", "coinrag", "--kc", "1", "--k", "2"]
    cmd += ["--max-new-tokens", "2", "--threads", "1"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip(), "eval's own progress lines are on stderr"
    assert not NOISE.search(done.stderr), done.stderr


@pytest.mark.heavy
def test_an_error_after_the_models_load_is_the_only_line(sample_store: Path) -> None:
    """No cartridge is trained: the error comes once the model is loaded, alone on stderr."""
    done = _query(sample_store, "--method", "cartridge")
    assert done.returncode == 1, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        line for line in done.stderr.splitlines() if line.startswith("error: no cartridges")
    ], done.stderr
    assert not NOISE.search(done.stderr), done.stderr
