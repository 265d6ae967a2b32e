"""Stored vectors embedded in bfloat16 (``embed_dtype``), held to the float32 encoder: within
the stated cosine, their own fingerprint (so an index never mixes the two), the float32
fingerprint unchanged, questions unaffected."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_index_retrieval import QUESTIONS  # noqa: E402

from coinrag.inference.retrieval.embedders import load_embedder, store_embedder_of  # noqa: E402
from coinrag.schemas.settings import BuildSettings, SettingsError  # noqa: E402

# measured: smallest cosine 0.999917 over 2,000 nuggets and 200 windows of the Python docs
# (tests/benchmarks/bench_document_embedding.py); the same bound as bfloat16 questions'
MIN_COSINE = 0.9999

PASSAGES = [
    "The sort() method sorts the list in place, using only < comparisons between items. "
    "Exceptions are not suppressed: if any comparison operations fail, the entire sort "
    "operation will fail (and the list will likely be left in a partially modified state).",
    "time.sleep(secs) suspends execution of the calling thread for the given number of "
    "seconds. The argument may be a floating point number to indicate a more precise sleep "
    "time.",
    "2001: A Space Odyssey is a 1968 epic science fiction film produced and directed by "
    "Stanley Kubrick. The screenplay was written by Kubrick and science fiction author Arthur "
    "C. Clarke, and was inspired by Clarke's 1951 short story The Sentinel. " * 6,
    *QUESTIONS,
]


@pytest.fixture(scope="module")
def pair():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_embedder(None), load_embedder(None, document_dtype="bfloat16")
    torch.set_num_threads(before)


def test_bf16_documents_stay_within_the_stated_cosine(pair):
    fp32, bf16 = pair
    assert (fp32.document_dtype, bf16.document_dtype) == ("float32", "bfloat16")
    a, b = fp32.embed_documents(PASSAGES), bf16.embed_documents(PASSAGES)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-6)
    assert (a * b).sum(axis=1).min() >= MIN_COSINE
    assert not np.array_equal(a, b)  # the bf16 encoder really ran
    # the nearest passage of every question is the same either way
    q = fp32.embed_queries(PASSAGES[:3])
    assert np.array_equal((q @ a.T).argmax(1), (q @ b.T).argmax(1))


def test_the_document_dtype_names_the_vectors_and_leaves_questions_alone(pair):
    fp32, bf16 = pair
    assert fp32.fingerprint != bf16.fingerprint  # an index never mixes the two
    assert load_embedder(None, document_dtype="float32").fingerprint == fp32.fingerprint
    assert np.array_equal(fp32.embed_queries(QUESTIONS), bf16.embed_queries(QUESTIONS))


def test_the_store_setting_chooses_it_and_a_bad_dtype_is_refused():
    settings = BuildSettings(embed_dtype="bfloat16").validate()
    assert store_embedder_of(settings).document_dtype == "bfloat16"
    assert store_embedder_of(BuildSettings()).document_dtype == "float32"
    with pytest.raises(SettingsError, match="embed_dtype 'float16' is not one of"):
        BuildSettings(embed_dtype="float16").validate()
    with pytest.raises(ValueError, match="embed_dtype 'int8' is not one of"):
        load_embedder(None, document_dtype="int8")
