"""Questions embedded in reduced precision (``query_dtype``), held to the float32 encoder: the
stored vectors never change, a question's vector stays within the stated cosine."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_index_retrieval import QUESTIONS  # noqa: E402

from coinrag.inference.model.kv_dtype import resolve_kv_dtype  # noqa: E402
from coinrag.inference.retrieval.embedders import load_embedder  # noqa: E402

# measured: smallest cosine 0.999947 over 63 natural questions (bench_query_embedding.py)
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def pair():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_embedder(None, query_dtype="float32"), load_embedder(None, query_dtype="bfloat16")
    torch.set_num_threads(before)


def test_bf16_questions_stay_within_the_stated_cosine(pair):
    fp32, bf16 = pair
    assert (fp32.query_dtype, bf16.query_dtype) == ("float32", "bfloat16")
    a, b = fp32.embed_queries(QUESTIONS), bf16.embed_queries(QUESTIONS)
    assert a.dtype == b.dtype == np.float32
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-6)
    assert (a * b).sum(axis=1).min() >= MIN_COSINE
    assert not np.array_equal(a, b)  # the bf16 encoder really ran


def test_stored_vectors_and_the_fingerprint_do_not_depend_on_the_query_dtype(pair):
    fp32, bf16 = pair
    assert fp32.fingerprint == bf16.fingerprint
    assert np.array_equal(fp32.embed_documents(QUESTIONS), bf16.embed_documents(QUESTIONS))
    # float32 questions are documents with the (empty) instruction: the same vectors
    assert np.array_equal(fp32.embed_queries(QUESTIONS), fp32.embed_documents(QUESTIONS))


def test_auto_follows_the_device_and_a_bad_dtype_is_refused():
    auto = load_embedder(None)
    assert auto.query_dtype == resolve_kv_dtype("auto", auto.device).dtype
    with pytest.raises(ValueError, match="query_dtype: kv_dtype 'int3' is not one of"):
        load_embedder(None, query_dtype="int3")
