"""Shared test set-up: Prefect offline in a temporary home, and shared real components."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Prefect reads these at import time: set them before anything imports prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="coinrag-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("OPENAI_API_KEY", None)
os.environ.pop("OPENAI_BASE_URL", None)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items) -> None:
    """``@pytest.mark.cuda`` tests need a CUDA device: skipped where torch sees none
    (``tests/benchmarks/gpu_check.sh`` runs them on a GPU machine)."""
    cuda = [item for item in items if "cuda" in item.keywords]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (tests/benchmarks/gpu_check.sh)")
        for item in cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_harness():
    """A real Prefect API (temporary local server on SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread while a module runs (``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``): on a CPU shared with other jobs, two OpenMP
    threads spin-wait on each other and the tests of small models ran 5-20x slower (22 s instead
    of 3.4 s for the SmolLM2 extractor test, measured at load 5 on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The packaged SmolLM2 tokenizer (converted once into the coinrag cache)."""
    from coinrag.inference.model.loading import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def sample_corpus() -> Path:
    return REPO / "flows" / "sample" / "wiki_sample.jsonl"


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory, sample_corpus: Path, prefect_harness) -> Path:
    """A store built once per session from the first 5 sample documents (rules extractor, the
    packaged SmolLM2: its KV, the LanceDB indexes). Tests read it, or rebuild it unchanged;
    copy it to change it (``shutil.copytree``)."""
    from coinrag.flows.build import build_flow

    root = tmp_path_factory.mktemp("sample-store")
    src = root / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:5]))
    store = root / "store"
    summary = build_flow(str(src), str(store), {"extractor": "rules"})
    assert summary["kv_computed"] == summary["chunks"] and summary["embedded"] > 0
    return store
