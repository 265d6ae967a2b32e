"""Prefix assembly: ``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ... ⊕ Rot(C_bk[sk:ek]; Δk)``.

Layout contract (the same everywhere in coinrag; ``storage/kv.py`` stores exactly this):

- one KV block is a tensor ``(layers, 2, kv_heads, tokens, head_dim)``: index 0 of dim 1 holds
  keys *after* RoPE (as transformers caches them), index 1 values; the model's dtype;
- a chunk's block was computed once, right after the RAG prompt prefix ``p``, so its token ``i``
  sits at position ``|p| + i``; a nugget slice ``[s, e)`` of it starts at ``|p| + s``;
- the assembled context puts the slices after ``C_p`` in the order given, at contiguous
  positions: slice ``i`` starts at ``Δ_i = |p| + Σ_{j<i} (e_j - s_j)``. Only keys are rotated:
  values do not depend on position;
- RoPE whose frequencies depend on the forward's length (dynamic, longrope): every key, ``C_p``'s
  included, gets the frequencies of the forward the context stands for (``new_seq_len``: the
  context plus the query prefilled after it), i.e. the layer-0 keys of the model's own forward
  over the same tokens at the same positions (``tests/test_rope_seq_len.py``).

The result is handed to the model as a ``transformers.DynamicCache`` (batch 1), built with
``DynamicCache(config=...)`` and ``.update(k, v, layer_idx)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference.rope import RopeSpec, rerotate_keys


@dataclass(frozen=True)
class KvSlice:
    """A contiguous run of cached tokens and where it was encoded.

    ``kv``: ``(layers, 2, kv_heads, n, head_dim)``; ``old_start``: position of its first token
    in the forward that computed it; ``old_seq_len``: that forward's length (``|p| + chunk
    tokens``; needed only by seq-len dependent RoPE such as dynamic NTK).
    """

    kv: torch.Tensor
    old_start: int
    old_seq_len: int

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[-2])


def assemble_context(
    prefix_kv: torch.Tensor,
    slices: Sequence[KvSlice],
    spec: RopeSpec,
    *,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Concatenate ``prefix_kv`` and the re-rotated slices at contiguous positions.

    Args:
        prefix_kv: ``(layers, 2, kv_heads, P, head_dim)``, encoded at positions ``0..P-1``.
        slices: in context order.
        spec: the model's RoPE.
        new_seq_len: length of the forward whose cache this stands for (dynamic / longrope
            only; defaults to the assembled length): with the query prefilled after the
            context, the context plus the query. Every key, ``C_p``'s included, gets the
            frequencies a forward of that length uses, as the model's own forward over the
            same tokens at the same positions gives them.

    Returns:
        ``(layers, 2, kv_heads, P + Σ n_i, head_dim)``, same dtype as ``prefix_kv``.

    >>> # two slices of 3 and 2 tokens after a 5-token prefix land at positions 5..7 and 8..9
    """
    n_prefix = prefix_kv.shape[-2]
    total = n_prefix + sum(s.tokens for s in slices)
    seq_len = new_seq_len or total
    parts = [prefix_kv]
    if spec.seq_len_dependent and not torch.equal(
        spec.inv_freq_for(n_prefix), spec.inv_freq_for(seq_len)
    ):
        # C_p was encoded in a forward of its own length; a forward of length seq_len uses
        # other frequencies (dynamic NTK above max_position_embeddings, longrope's long factors).
        parts = [_rotated(KvSlice(prefix_kv, 0, n_prefix), 0, spec, seq_len)]
    start = n_prefix
    for s in slices:
        moved = s.old_start != start or spec.seq_len_dependent
        parts.append(_rotated(s, start, spec, seq_len) if moved else s.kv)
        start += s.tokens
    return torch.cat(parts, dim=-2)


def _rotated(s: KvSlice, start: int, spec: RopeSpec, seq_len: int) -> torch.Tensor:
    """``s.kv`` with its keys moved to positions ``start..`` of a forward of length ``seq_len``."""
    old = torch.arange(s.old_start, s.old_start + s.tokens)
    new = torch.arange(start, start + s.tokens)
    keys = rerotate_keys(s.kv[:, 0], old, new, spec, old_seq_len=s.old_seq_len, new_seq_len=seq_len)
    return torch.stack([keys.to(s.kv.dtype), s.kv[:, 1]], dim=1)


def to_dynamic_cache(kv: torch.Tensor, config: Any) -> Any:
    """A batch-1 ``DynamicCache`` holding ``kv`` ``(layers, 2, kv_heads, T, head_dim)``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    return cache


def from_cache(cache: Any, batch_index: int = 0) -> torch.Tensor:
    """``(layers, 2, kv_heads, T, head_dim)`` of one batch row of a transformers cache."""
    return torch.stack(
        [torch.stack([lay.keys[batch_index], lay.values[batch_index]]) for lay in cache.layers]
    )
