"""The width a chunk is embedded in (``embed_window``): 0 keeps each embedder's own (MiniLM:
256 word pieces; the fingerprints of the indexes already built), another width cuts every
window to it and names the vectors (a change re-embeds), and a width outside the range is
refused."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from coinrag.inference.retrieval.embedders import load_embedder, store_embedder_of  # noqa: E402
from coinrag.schemas.settings import BuildSettings, SettingsError  # noqa: E402

LONG = (
    "The with statement wraps the execution of a block with methods defined by a context "
    "manager. It allows common try, except and finally usage patterns to be encapsulated for "
    "convenient reuse. "
) * 12  # about 450 word pieces


def test_zero_is_the_embedders_own_width():
    own = load_embedder(None)
    default = store_embedder_of(BuildSettings().validate())
    assert own.max_length == default.max_length == 256
    assert default.fingerprint == own.fingerprint


def test_a_width_cuts_every_window_and_names_the_vectors():
    narrow = store_embedder_of(BuildSettings(embed_window=64).validate())
    assert narrow.max_length == 64
    assert narrow.fingerprint != load_embedder(None).fingerprint  # a change re-embeds
    windows = narrow.windows(LONG, prefix="Compound statements > The with statement")
    assert len(windows) > 6
    for window in windows:
        pieces = narrow.tokenizer(window.text)["input_ids"]  # with [CLS] and [SEP]
        assert len(pieces) <= 64
    wide = store_embedder_of(BuildSettings(embed_window=128).validate())
    assert len(wide.windows(LONG)) < len(windows)


def test_a_width_outside_the_range_is_refused():
    for bad in (16, -1, 9000):
        with pytest.raises(SettingsError, match=f"embed_window {bad} is outside 32..8192"):
            BuildSettings(embed_window=bad).validate()
    assert BuildSettings(embed_window=32).validate().embed_window == 32
