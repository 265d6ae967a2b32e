"""CacheBlend: reuse the retrieved chunks' stored KV, recompute the tokens that deviate most.

CacheBlend (Yao et al., EuroSys'25; LMCache's ``LMCBlender``) starts from TurboRAG's context:
``C_p`` and each chunk's stored KV re-rotated to contiguous positions, which misses the chunks'
cross-attention to each other. It then runs the model once over the context and query tokens,
layer by layer (``P = |p|``, ``n`` context tokens, ``m`` query tokens):

1. layers ``< check_layer``: every context and query token is recomputed; its fresh K/V
   overwrite the cache (``C_p`` is never recomputed: it is exact);
2. at ``check_layer`` the fresh K/V of every token are computed and *measured* only: a
   context token's deviation is ``Σ_heads,dims (fresh - cached)²`` in float32, of the keys
   (:class:`KeyDeviation`, LMCache: after RoPE) or of the values (:class:`ValueDeviation`, the
   paper); the ``int(n * ratio)`` context tokens with the largest deviation are kept, plus
   every query token;
3. from ``check_layer`` on only the kept tokens are computed (hidden states, residuals and
   positions sliced); their K/V overwrite the cache at their positions and they attend over the
   whole mixed cache, causally by position. The other tokens keep their cached K/V.

So ``ratio = 1`` is standard RAG (every token recomputed; the next-token logits equal one
forward over ``prefix ⊕ chunks ⊕ query``) and ``ratio = 0`` with ``check_layer = 1`` is
TurboRAG (layer-0 K/V depend only on token and position, so fresh ones equal the re-rotated
stored ones): ``tests/inference/test_cacheblend_oracle.py`` checks both against transformers.

How it runs in plain transformers: the decoder layers are called as black boxes, and a
``DynamicCache`` subclass (:class:`BlendCache`) decides what the layer's
``past_key_values.update(k, v, layer_idx)`` does. The keys handed to ``update`` are exactly the
ones the model caches (q/k norms and RoPE applied), so no architecture needs its own code:
:class:`_Scatter` writes the active tokens' K/V into the full-length cache and returns it,
:class:`_Probe` records them and stops the layer (the check layer's measurement costs norm and
projections only), :class:`_Append` is plain decoding afterwards.

Shapes: the cache holds ``P + n + m`` slots per layer in position order (cache index =
position), ``(1, kv_heads, P + n + m, head_dim)``; the query's slots are filled by the blend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import DynamicCache

from coinrag.inference.model.encode import causal_lm, decoder
from coinrag.inference.model.masks import check_attention, check_no_sliding, key_position_mask
from coinrag.inference.rope import LayerRopes, model_rope, reset_rotary

DEFAULT_RATIO = 0.15  # LMCache's default recompute ratio
DEFAULT_CHECK_LAYER = 1  # LMCache's check layer


# Verified architectures (inference.rope) whose modules CacheBlend's layer loop cannot call.
_OTHER_DECODER_LAYOUT = {"gpt_neox": "its decoder is embed_in, layers, final_layer_norm, embed_out"}


class UnsupportedBlend(ValueError):
    """The model or the settings cannot be blended (the message says why)."""


# ---------------------------------------------------------------------------- deviation


class Deviation:
    """Per-token deviation of fresh from cached K/V at the check layer (``name``: the method's
    suffix in reports)."""

    name: ClassVar[str]

    def of(
        self, fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """``(tokens,)`` float32: ``Σ over heads and dims (fresh - cached)²``; ``fresh`` and
        ``cached`` are ``(keys, values)``, each ``(1, kv_heads, tokens, head_dim)``."""
        new, old = self.pick(*fresh), self.pick(*cached)
        return ((new.float() - old.float()) ** 2).sum(dim=(0, 1, 3))

    def pick(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class KeyDeviation(Deviation):
    """On the keys after RoPE (LMCache)."""

    name = "k"

    def pick(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return keys


class ValueDeviation(Deviation):
    """On the values (the CacheBlend paper)."""

    name = "v"

    def pick(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values


# ---------------------------------------------------------------------------- the cache


class _Probed(Exception):
    """Raised by :class:`_Probe` inside the check layer's attention, right after its K/V are
    computed: the rest of that call is not needed. Caught only by :func:`blend`."""


class _Step:
    """What :meth:`BlendCache.update` does during one layer call."""

    def update(self, cache: BlendCache, keys: Any, values: Any, layer_idx: int) -> Any:
        raise NotImplementedError


class _Scatter(_Step):
    """Write the active tokens' K/V at their positions; attend over the whole cache."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def update(self, cache: BlendCache, keys: Any, values: Any, layer_idx: int) -> Any:
        layer = cache.layers[layer_idx]
        layer.keys[:, :, self.positions] = keys.to(layer.keys.dtype)
        layer.values[:, :, self.positions] = values.to(layer.values.dtype)
        return layer.keys, layer.values


class _Probe(_Step):
    """Record the fresh K/V and stop the layer."""

    probed: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, cache: BlendCache, keys: Any, values: Any, layer_idx: int) -> Any:
        self.probed = (keys, values)
        raise _Probed


class _Append(_Step):
    """Plain ``DynamicCache`` behaviour: decoding after the blend."""

    def update(self, cache: BlendCache, keys: Any, values: Any, layer_idx: int) -> Any:
        return DynamicCache.update(cache, keys, values, layer_idx)


class BlendCache(DynamicCache):
    """A full-length cache: ``C_p``, the re-rotated chunk KV, then zero slots for the query.

    ``kv``: ``(layers, 2, kv_heads, P + n, head_dim)``; ``total``: ``P + n + m`` slots.
    """

    def __init__(self, kv: torch.Tensor, config: Any, total: int) -> None:
        super().__init__(config=config)
        layers, _, heads, cached, dim = kv.shape
        for i in range(layers):
            k = kv.new_zeros(1, heads, total, dim)
            v = kv.new_zeros(1, heads, total, dim)
            k[0, :, :cached] = kv[i, 0]
            v[0, :, :cached] = kv[i, 1]
            super().update(k, v, i)  # lazy init of layer i with the full-length tensors
        self.step: _Step = _Append()

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kw: Any):
        return self.step.update(self, key_states, value_states, layer_idx)


# ---------------------------------------------------------------------------- the blend


@dataclass
class Blended:
    """The result of :func:`blend`.

    ``first_logits``: ``(vocab,)`` float32, the next-token logits after the query;
    ``cache``: ready for decoding at position ``next_position`` (``P + n + m``);
    ``recomputed``: context-local indices (0 = first context token) recomputed from
    ``check_layer`` on, sorted; ``deviation``: ``(n,)`` float32, each context token's deviation
    at the check layer.
    """

    first_logits: torch.Tensor
    cache: BlendCache
    next_position: int
    recomputed: torch.Tensor
    deviation: torch.Tensor


def check_blendable(config: Any, ratio: float, check_layer: int) -> None:
    """Refuse what :func:`blend` cannot do exactly (one ``UnsupportedBlend`` message each)."""
    if not 0.0 <= ratio <= 1.0:
        raise UnsupportedBlend(f"the recompute ratio must be in [0, 1]; got {ratio}")
    layers = int(config.num_hidden_layers)
    if not 1 <= check_layer < layers:
        raise UnsupportedBlend(
            f"the check layer must be in 1..{layers - 1} (layer-0 K/V never deviate: they depend "
            f"only on token and position); got {check_layer}"
        )
    try:
        check_attention(config)
        check_no_sliding(config)
        rope = model_rope(config)
    except ValueError as exc:
        raise UnsupportedBlend(str(exc)) from exc
    if config.model_type in _OTHER_DECODER_LAYOUT:
        raise UnsupportedBlend(
            f"{config.model_type!r}: {_OTHER_DECODER_LAYOUT[config.model_type]}; CacheBlend "
            "calls embed_tokens, layers, norm and lm_head"
        )
    if isinstance(rope, LayerRopes):
        raise UnsupportedBlend(
            f"{config.model_type!r} has per-layer RoPE ({rope.rope_type}): CacheBlend calls "
            "the decoder layers with one rotary embedding"
        )


@torch.inference_mode()
def blend(
    model: Any,
    context_kv: torch.Tensor,
    context_ids: Sequence[int],
    query_ids: Sequence[int],
    *,
    ratio: float = DEFAULT_RATIO,
    check_layer: int = DEFAULT_CHECK_LAYER,
    deviation: Deviation | None = None,
) -> Blended:
    """Blend the query into a TurboRAG context (see the module doc).

    Args:
        context_kv: ``(layers, 2, kv_heads, P + n, head_dim)``: ``C_p`` and the chunks' KV
            re-rotated to contiguous positions (for dynamic / longrope RoPE assembled for a
            forward of length ``P + n + m``), on the model's device and in its dtype.
        context_ids: the ``n`` token ids the last ``n`` slots of ``context_kv`` hold, in order.
        query_ids: the ``m`` query tokens, prefilled after the context.
        ratio: fraction of context tokens recomputed from ``check_layer`` on.
        deviation: :class:`KeyDeviation` (default) or :class:`ValueDeviation`.
    """
    lm = causal_lm(model)
    check_blendable(lm.config, ratio, check_layer)
    deviation = deviation or KeyDeviation()
    dec = decoder(model)
    n, m = len(context_ids), len(query_ids)
    p = context_kv.shape[-2] - n
    if p < 0 or m < 1:
        raise ValueError(f"{n} context tokens need a context KV of at least {n} slots and a query")
    total = p + n + m
    device = context_kv.device
    cache = BlendCache(context_kv, lm.config, total)
    h = dec.embed_tokens(torch.tensor([list(context_ids) + list(query_ids)], device=device))
    active = torch.arange(n + m, device=device)  # context-local index of each row of h
    recomputed = torch.arange(n, device=device)
    score = torch.zeros(n, device=device)
    reset_rotary(model)
    for index, layer in enumerate(dec.layers):
        if index == check_layer:
            probe = _Probe()
            cache.step = probe
            try:
                _call(dec, layer, h, p + active, total, cache)
            except _Probed:
                pass
            assert probe.probed is not None
            stored = cache.layers[index]
            cached = (stored.keys[:, :, p + active], stored.values[:, :, p + active])
            score = deviation.of(probe.probed, cached)[:n]  # active is still 0..n+m-1 here
            top = torch.topk(score, int(n * ratio)).indices.sort().values
            keep = torch.cat([top, torch.arange(n, n + m, device=device)])
            h, active, recomputed = h[:, keep], active[keep], top
        cache.step = _Scatter(p + active)
        h = _call(dec, layer, h, p + active, total, cache)
    cache.step = _Append()
    logits = lm.lm_head(dec.norm(h[:, -1:]))[0, -1].float()
    return Blended(logits, cache, total, recomputed, score)


def _call(dec: Any, layer: Any, h: torch.Tensor, positions: torch.Tensor, total: int, cache: Any):
    """One decoder layer over the rows ``h`` at ``positions`` (``(q,)``), causal by position
    over the ``total``-slot cache."""
    pos = positions[None]
    out = layer(
        h,
        attention_mask=key_position_mask(torch.arange(total, device=h.device), positions, h.dtype),
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        position_embeddings=dec.rotary_emb(h, pos),
    )
    return out[0] if isinstance(out, tuple) else out
