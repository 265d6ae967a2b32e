"""The lean forwards of question embedding (``inference/retrieval/lean_encoder.py``) held to
transformers' own ``BertModel`` and ``MPNetModel``: the same last hidden state (float32: within
1e-5 of max |h|, padded batches and token types included) on a tiny random BERT and MPNet and on
the packaged MiniLM and mpnet; the bf16 question copies use them and stay within the query
dtype's cosine (``test_query_dtype.py``, ``test_packaged_mpnet.py``); MPNet's stored vectors keep
transformers' forward; anything else keeps transformers' forward."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_index_retrieval import QUESTIONS  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    MPNetConfig,
    MPNetModel,
    RobertaConfig,
    RobertaModel,
)

from coinrag.inference.retrieval.lean_encoder import (  # noqa: E402
    LeanBertEncoder,
    LeanMPNetEncoder,
    lean_encoder_of,
)

FP32_RTOL = 1e-5  # of max |h|: float32 with other operation orders (fused Q/K/V)
TINY = {  # a random encoder small enough to build in milliseconds (BERT and MPNet alike)
    "vocab_size": 97,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 40,
}


def _tiny_bert(**overrides) -> BertModel:
    config = BertConfig(**TINY, type_vocab_size=2, **overrides)
    torch.manual_seed(0)
    return BertModel(config).eval()


def _close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())


def test_a_padded_batch_equals_bert_at_every_token():
    model = _tiny_bert()
    lean = lean_encoder_of(model)
    assert isinstance(lean, LeanBertEncoder)
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
    lean = lean_encoder_of(model)
    assert isinstance(lean, LeanBertEncoder)
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
def test_anything_else_keeps_transformers_forward(model):
    assert not LeanBertEncoder.takes(model())
    assert lean_encoder_of(model()) is None


def _tiny_mpnet() -> MPNetModel:
    config = MPNetConfig(**TINY)
    torch.manual_seed(0)
    model = MPNetModel(config).eval()
    with torch.no_grad():  # initialised at zero: a bias that would not show a wrong distance
        model.encoder.relative_attention_bias.weight.normal_()
    return model


def test_a_padded_batch_equals_mpnet_at_every_token():
    """Right padding (MPNet's padding id 1 where the mask is 0): its positions count from the
    padding id and the relative position bias is cut to the batch's length."""
    model = _tiny_mpnet()
    lean = lean_encoder_of(model)
    assert isinstance(lean, LeanMPNetEncoder)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 1:] = 0
    ids = torch.randint(3, 97, (3, 11), generator=g).masked_fill(mask == 0, 1)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = lean(ids, mask)
        assert got.shape == want.shape
        assert _close(got, want, mask) <= FP32_RTOL
        unpadded = model(input_ids=ids[:1, :6]).last_hidden_state
        assert _close(lean(ids[:1, :6]), unpadded, torch.ones(1, 6)) <= FP32_RTOL


def test_the_packaged_mpnet_equals_transformers_on_questions():
    from coinrag.inference.retrieval.embedders import load_embedder

    embedder = load_embedder("mpnet", query_dtype="float32")
    model = embedder._flag.model
    lean = lean_encoder_of(model)
    assert isinstance(lean, LeanMPNetEncoder)
    batch = embedder.tokenizer(list(QUESTIONS), padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = model(**batch).last_hidden_state
        got = lean(batch["input_ids"], batch["attention_mask"])
    assert _close(got, want, batch["attention_mask"]) <= FP32_RTOL


def test_stored_mpnet_vectors_keep_transformers_forward():
    """bf16 texts and questions share one copy; MiniLM's run both through the lean forward (its
    bf16 indexes were built so), mpnet's only the questions (its indexes were built without)."""
    from coinrag.inference.retrieval.embedders import load_embedder

    minilm = load_embedder(None, query_dtype="bfloat16", document_dtype="bfloat16")
    mpnet = load_embedder("mpnet", query_dtype="bfloat16", document_dtype="bfloat16")
    assert minilm._lean_documents is minilm._lean_query is not None
    assert isinstance(mpnet._lean_query, LeanMPNetEncoder) and mpnet._lean_documents is None
