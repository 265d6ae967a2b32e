"""A lean forward of BERT-like encoders for questions: the same layers as transformers'
``BertModel`` (embeddings, then per layer self-attention, residual and LayerNorm, GELU
feed-forward, residual and LayerNorm), called as a few functional operations instead of ~110
modules.

A question is a short sequence (7-36 word pieces for the Python FAQ and natural questions), so
transformers' module calls, output capturing and mask building are a large part of the forward
on a CPU: all-MiniLM-L6-v2 in bf16 on one core embeds a question in 9.1 ms median against 10.9
(``tests/benchmarks/bench_query_embedding.py``, 63 questions x 3 passes; 6.7-7.5 against 9.4-9.7
for the forward alone in another run). Besides dropping that overhead it computes Q, K
and V of a layer with one matrix product (their weights concatenated once, an extra 5 MB in bf16
for MiniLM) and skips the pooler (a dense layer on the first token that mean pooling and CLS
pooling of the last hidden state never read).

Two encoders are taken (:func:`lean_encoder_of`; anything else keeps transformers' forward):
plain BERT (:class:`LeanBertEncoder`: ``model_type`` "bert", absolute positions, exact GELU, an
encoder; the default MiniLM) and MPNet (:class:`LeanMPNetEncoder`: all-mpnet-base-v2, whose
attention adds a relative position bias). Used for the reduced-precision question copy of
:class:`inference.retrieval.embedders.FlagEmbedder` (``query_dtype`` other than float32), where
the vector is held to a cosine tolerance against the float32 encoder, not to its bits; a BERT
store embedded in bfloat16 has its stored vectors from it too (``LeanEncoder.stores``). Held to
transformers: ``tests/inference/test_lean_encoder.py`` (the last hidden state within 1e-5 of
max |h| in float32, padded batches included, on tiny random BERT and MPNet and on the packaged
MiniLM and mpnet; the bf16 question vectors within the query dtype's cosine).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Layer:
    """One encoder layer's weights: fused ``qkv`` ``(3 * hidden, hidden)``, attention output,
    the two LayerNorms (weight, bias, eps) and the feed-forward."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    norm1: tuple[torch.Tensor, torch.Tensor, float]
    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor
    norm2: tuple[torch.Tensor, torch.Tensor, float]


class LeanEncoder(ABC):
    """The last hidden state of a post-LayerNorm encoder (BERT's layer: self-attention, residual
    and LayerNorm, GELU feed-forward, residual and LayerNorm) from its own weights (shared, not
    copied, but for the fused Q/K/V weights; word and position embeddings and their LayerNorm
    held here); a subclass names the model it takes (:meth:`takes`), where its layers' weights
    sit (:meth:`_layer`), how its embeddings add up and what its attention adds to the scores.
    See the module docstring."""

    stores: ClassVar[bool]  # whether stored vectors run through it too (else questions only)

    def __init__(self, model: Any) -> None:
        config = model.config
        self.hidden = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.head_dim = self.hidden // self.heads
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.norm0 = (emb.LayerNorm.weight, emb.LayerNorm.bias, float(emb.LayerNorm.eps))
        self.layers = [self._layer(layer) for layer in model.encoder.layer]

    @classmethod
    @abstractmethod
    def takes(cls, model: Any) -> bool:
        """Whether ``model`` is one this forward reproduces."""

    @staticmethod
    @abstractmethod
    def _layer(layer: Any) -> _Layer:
        """One of ``model.encoder.layer``'s weights (:func:`fused_layer`)."""

    @abstractmethod
    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``(batch, tokens, hidden)``: the embeddings, after their LayerNorm."""

    def _scores_mask(
        self, batch: int, n: int, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """What ``scaled_dot_product_attention`` takes as ``attn_mask`` for ``n`` tokens: the
        keys to attend to (bool ``(batch, 1, 1, n)``), None where every token is attended."""
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask[:, None, None, :].bool()

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, tokens)`` ids (a right-padded batch: ``attention_mask`` 1 for tokens, 0 for
        padding) -> the last hidden state ``(batch, tokens, hidden)`` in the weights' dtype
        (padding positions hold values no pooling reads)."""
        batch, n = input_ids.shape
        x = self._embed(input_ids, token_type_ids)
        mask = self._scores_mask(batch, n, attention_mask)
        shape = (batch, n, 3, self.heads, self.head_dim)
        for layer in self.layers:
            q, k, v = (
                F.linear(x, layer.qkv_weight, layer.qkv_bias).view(shape).permute(2, 0, 3, 1, 4)
            )
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            att = att.transpose(1, 2).reshape(batch, n, self.hidden)
            x = F.layer_norm(
                F.linear(att, layer.out_weight, layer.out_bias) + x, (self.hidden,), *layer.norm1
            )
            up = F.gelu(F.linear(x, layer.up_weight, layer.up_bias))
            x = F.layer_norm(
                F.linear(up, layer.down_weight, layer.down_bias) + x, (self.hidden,), *layer.norm2
            )
        return x


def fused_layer(attention: Any, out: Any, norm1: Any, layer: Any) -> _Layer:
    """A layer's weights from its modules: ``attention``'s ``(query, key, value)`` linears (one
    product after concatenation), the attention ``out`` linear and the LayerNorm after it
    (``norm1``), ``layer.intermediate.dense`` and ``layer.output`` (dense, LayerNorm)."""
    with torch.no_grad():
        qkv_w = torch.cat([m.weight for m in attention]).contiguous()
        qkv_b = torch.cat([m.bias for m in attention]).contiguous()
    return _Layer(
        qkv_w,
        qkv_b,
        out.weight,
        out.bias,
        (norm1.weight, norm1.bias, float(norm1.eps)),
        layer.intermediate.dense.weight,
        layer.intermediate.dense.bias,
        layer.output.dense.weight,
        layer.output.dense.bias,
        (
            layer.output.LayerNorm.weight,
            layer.output.LayerNorm.bias,
            float(layer.output.LayerNorm.eps),
        ),
    )


class LeanBertEncoder(LeanEncoder):
    """``BertModel``: absolute position and token type embeddings, exact GELU. A store whose
    texts and questions are both embedded in bfloat16 has its vectors from this forward (their
    fingerprints were made so)."""

    stores = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.token_type = model.embeddings.token_type_embeddings.weight

    @classmethod
    def takes(cls, model: Any) -> bool:
        config = getattr(model, "config", None)
        return (
            config is not None
            and getattr(config, "model_type", "") == "bert"
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and getattr(config, "hidden_act", "") == "gelu"
            and not getattr(config, "is_decoder", False)
            and not getattr(config, "add_cross_attention", False)
            and hasattr(model, "embeddings")
            and hasattr(model, "encoder")
        )

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        att, out = layer.attention.self, layer.attention.output
        return fused_layer((att.query, att.key, att.value), out.dense, out.LayerNorm, layer)

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        n = input_ids.shape[1]
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word[input_ids] + self.position[:n] + self.token_type[types]
        return F.layer_norm(x, (self.hidden,), *self.norm0)


class LeanMPNetEncoder(LeanEncoder):
    """``MPNetModel`` (all-mpnet-base-v2): position embeddings counted from the padding id
    (as RoBERTa), no token types, and a relative position bias added to every layer's attention
    scores, per head. The bias is transformers' own ``compute_position_bias`` for the longest
    sequence, computed once (``(1, heads, positions, positions)`` in the weights' dtype, 6.3 MB
    in bf16 for all-mpnet-base-v2) and cut to ``n`` tokens: it depends on the distance only.
    Questions only: stored vectors keep transformers' forward, as the indexes built before it
    were (their fingerprint does not name the forward)."""

    stores = False

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.padding_idx = int(model.embeddings.padding_idx)
        longest = self.position.shape[0]
        with torch.no_grad():
            probe = torch.zeros(1, longest, 1, device=self.word.device)
            self.bias = model.encoder.compute_position_bias(probe).to(self.word.dtype)

    @classmethod
    def takes(cls, model: Any) -> bool:
        config = getattr(model, "config", None)
        return (
            config is not None
            and getattr(config, "model_type", "") == "mpnet"
            and getattr(config, "hidden_act", "") == "gelu"
            and hasattr(model, "embeddings")
            and hasattr(getattr(model, "encoder", None), "compute_position_bias")
        )

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        att = layer.attention.attn
        return fused_layer((att.q, att.k, att.v), att.o, layer.attention.LayerNorm, layer)

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        tokens = input_ids.ne(self.padding_idx).int()
        positions = torch.cumsum(tokens, dim=1).type_as(tokens) * tokens + self.padding_idx
        x = self.word[input_ids] + self.position[positions.long()]
        return F.layer_norm(x, (self.hidden,), *self.norm0)

    def _scores_mask(
        self, batch: int, n: int, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The position bias ``(1, heads, n, n)``, with ``-inf`` at padding keys where there are
        any (``(batch, heads, n, n)``)."""
        bias = self.bias[:, :, :n, :n]
        if attention_mask is None or bool(attention_mask.all()):
            return bias
        padding = ~attention_mask[:, None, None, :].bool()
        return bias.expand(batch, -1, -1, -1).masked_fill(padding, float("-inf"))


LEAN_ENCODERS: tuple[type[LeanEncoder], ...] = (LeanBertEncoder, LeanMPNetEncoder)


def lean_encoder_of(model: Any) -> LeanEncoder | None:
    """The lean forward of ``model`` (the first of :data:`LEAN_ENCODERS` that takes it), else
    None: the embedder keeps transformers' forward."""
    for kind in LEAN_ENCODERS:
        if kind.takes(model):
            return kind(model)
    return None
