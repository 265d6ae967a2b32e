"""The lean BERT forward of question embedding (``inference/retrieval/lean_encoder.py``) held to
transformers' own ``BertModel``: the same last hidden state (float32: within 1e-5 of max |h|,
padded batches and token types included) on a tiny random BERT and on the packaged MiniLM; the
bf16 question copy of the default embedder uses it and stays within the query dtype's cosine
(``test_query_dtype.py``); anything but a plain BERT encoder keeps transformers' forward."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_index_retrieval import QUESTIONS  # noqa: E402
from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel  # noqa: E402

from coinrag.inference.retrieval.lean_encoder import LeanBertEncoder  # noqa: E402

FP32_RTOL = 1e-5  # of max |h|: float32 with other operation orders (fused Q/K/V)


def _tiny_bert(**overrides) -> BertModel:
    config = BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
        **overrides,
    )
    torch.manual_seed(0)
    return BertModel(config).eval()


def _close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())


def test_a_padded_batch_equals_bert_at_every_token():
    model = _tiny_bert()
    lean = LeanBertEncoder.of(model)
    assert lean is not None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, 1:] = 0  # one token
    types = torch.zeros_like(ids)
    types[0, 5:] = 1  # a second segment
    with torch.inference_mode():
        for token_types in (types, None):
            want = model(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
            got = lean(ids, mask, token_types)
            assert got.shape == want.last_hidden_state.shape
            assert _close(got, want.last_hidden_state, mask) <= FP32_RTOL
        unpadded = model(input_ids=ids[:1, :6]).last_hidden_state
        assert _close(lean(ids[:1, :6]), unpadded, torch.ones(1, 6)) <= FP32_RTOL


def test_the_packaged_minilm_equals_transformers_on_questions():
    from coinrag.inference.retrieval.embedders import load_embedder

    embedder = load_embedder(None, query_dtype="float32")
    model = embedder._flag.model
    lean = LeanBertEncoder.of(model)
    assert lean is not None
    batch = embedder.tokenizer(list(QUESTIONS), padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = model(**batch).last_hidden_state
        got = lean(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    assert _close(got, want, batch["attention_mask"]) <= FP32_RTOL


def test_the_bf16_question_copy_runs_the_lean_forward():
    from coinrag.inference.retrieval.embedders import load_embedder

    bf16, fp32 = (
        load_embedder(None, query_dtype="bfloat16"),
        load_embedder(None, query_dtype="float32"),
    )
    assert isinstance(bf16._lean_query, LeanBertEncoder)
    assert fp32._lean_query is None  # float32 questions are embedded as documents, bit for bit


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: _tiny_bert(position_embedding_type="relative_key"), id="relative"),
        pytest.param(lambda: _tiny_bert(hidden_act="gelu_new"), id="gelu_new"),
        pytest.param(lambda: _tiny_bert(is_decoder=True), id="decoder"),
        pytest.param(
            lambda: RobertaModel(
                RobertaConfig(
                    vocab_size=97,
                    hidden_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    intermediate_size=64,
                )
            ),
            id="roberta",
        ),
    ],
)
def test_anything_but_a_plain_bert_keeps_transformers_forward(model):
    assert LeanBertEncoder.of(model()) is None
