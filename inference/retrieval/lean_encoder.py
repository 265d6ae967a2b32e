"""A lean forward of BERT encoders for questions: the same layers as transformers' ``BertModel``
(embeddings, then per layer self-attention, residual and LayerNorm, GELU feed-forward, residual
and LayerNorm), called as a few functional operations instead of ~110 modules.

A question is a short sequence (7-36 word pieces for the Python FAQ and natural questions), so
transformers' module calls, output capturing and mask building are a large part of the forward
on a CPU: all-MiniLM-L6-v2 in bf16 on one core embeds a question in 9.1 ms median against 10.9
(``tests/benchmarks/bench_query_embedding.py``, 63 questions x 3 passes; 6.7-7.5 against 9.4-9.7
for the forward alone in another run). Besides dropping that overhead it computes Q, K
and V of a layer with one matrix product (their weights concatenated once, an extra 5 MB in bf16
for MiniLM) and skips the pooler (a dense layer on the first token that mean pooling and CLS
pooling of the last hidden state never read).

Used only for the reduced-precision question copy of
:class:`inference.retrieval.embedders.FlagEmbedder`
(``query_dtype`` other than float32), where the vector is already held to a cosine tolerance
against the float32 encoder, not to its bits; stored vectors always come from transformers'
forward. Held to transformers: ``tests/inference/test_lean_encoder.py`` (the last hidden state
within 1e-5 of max |h| in float32, padded batches included; the bf16 question vectors within
the query dtype's cosine). Only plain BERT (``model_type`` "bert", absolute positions, exact
GELU, an encoder) is taken; :meth:`LeanBertEncoder.of` gives None for anything else, and the
embedder keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


class LeanBertEncoder:
    """``BertModel``'s last hidden state from its own weights (shared, not copied, but for the
    fused Q/K/V weights); see the module docstring."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.hidden = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.head_dim = self.hidden // self.heads
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.token_type = emb.token_type_embeddings.weight
        self.norm0 = (emb.LayerNorm.weight, emb.LayerNorm.bias, float(emb.LayerNorm.eps))
        self.layers = [self._layer(layer) for layer in model.encoder.layer]

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        att, out = layer.attention.self, layer.attention.output
        with torch.no_grad():
            qkv_w = torch.cat([att.query.weight, att.key.weight, att.value.weight]).contiguous()
            qkv_b = torch.cat([att.query.bias, att.key.bias, att.value.bias]).contiguous()
        return _Layer(
            qkv_w,
            qkv_b,
            out.dense.weight,
            out.dense.bias,
            (out.LayerNorm.weight, out.LayerNorm.bias, float(out.LayerNorm.eps)),
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

    @classmethod
    def of(cls, model: Any) -> LeanBertEncoder | None:
        """The lean forward of ``model`` if it is a plain BERT encoder, else None."""
        config = getattr(model, "config", None)
        plain = (
            config is not None
            and getattr(config, "model_type", "") == "bert"
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and getattr(config, "hidden_act", "") == "gelu"
            and not getattr(config, "is_decoder", False)
            and not getattr(config, "add_cross_attention", False)
            and hasattr(model, "embeddings")
            and hasattr(model, "encoder")
        )
        return cls(model) if plain else None

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
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word[input_ids] + self.position[:n] + self.token_type[types]
        x = F.layer_norm(x, (self.hidden,), *self.norm0)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask[:, None, None, :].bool()  # keys to attend to
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
