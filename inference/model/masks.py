"""Additive 4D attention masks for forwards over a cache whose keys are not a plain prefix.

A mask here is a float tensor ``(1, 1, queries, keys)`` in the model's dtype: ``0`` where the
query may attend to the key, ``finfo(dtype).min`` where it may not. transformers hands a 4D mask
to the attention as it is (``masking_utils._preprocess_mask_arguments``), and both ``sdpa`` and
``eager`` read a float mask the same way. A *boolean* 4D mask would not do: ``eager`` adds the
mask to the scores, so ``True``/``False`` would add 1/0 instead of masking (seen on Qwen2:
logits off by 0.45, while ``sdpa`` accepted it).

Always pass a mask with gapped or shuffled positions: without one, transformers reads
non-contiguous ``position_ids`` of a cache-less forward as packed sequences and builds a
block-diagonal mask.
"""

from __future__ import annotations

import torch

from coinrag.inference.model.layers import AttentionLayers

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # those that take an additive 4D mask as given


def key_position_mask(
    key_positions: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``(1, 1, q, k)``: query ``i`` sees key ``j`` iff ``key_positions[j] <= query_positions[i]``.

    Causal attention by position for a cache in any order (keys may sit after the queries in
    the cache, positions may have gaps). E.g. keys at ``[0, 1, 5]`` and queries at ``[2, 5]``:
    ``[[0, 0, min], [0, 0, 0]]``.
    """
    allowed = key_positions.view(1, -1) <= query_positions.view(-1, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    mask.masked_fill_(~allowed.to(mask.device), torch.finfo(dtype).min)
    return mask[None, None]


def window_mask(
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    dtype: torch.dtype,
    window: int | None,
) -> torch.Tensor:
    """:func:`key_position_mask`, and for a sliding layer (``window`` ``W``) only the keys at
    positions ``> q - W`` (transformers' ``sliding_window_overlay`` by position). E.g. keys
    at ``[0, 1, 5]``, a query at 5, ``W = 5``: ``[[min, 0, 0]]``."""
    mask = key_position_mask(key_positions, query_positions, dtype)
    if window is None:
        return mask
    near = key_positions.view(1, -1).to(query_positions.device) > (
        query_positions.view(-1, 1) - window
    )
    return mask.masked_fill(~near[None, None], torch.finfo(dtype).min)


def layer_masks(
    config: object, key_positions: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument of a forward over a cache in any order: one
    :func:`window_mask` when every layer has the same attention (full, or one window: Llama,
    Mistral, Phi-3), else one per layer type, keyed as the model keys its own masks
    (``{"full_attention": ..., "sliding_attention": ...}``: Gemma 2/3, Qwen2 with sliding
    layers, whose forwards take such a dict as given)."""
    layers = AttentionLayers.from_config(config)
    if layers.uniform:
        return window_mask(key_positions, query_positions, dtype, layers.windows[0])
    return {
        t: window_mask(key_positions, query_positions, dtype, layers.window_of(t))
        for t in dict.fromkeys(layers.types)
    }


def check_attention(config: object) -> None:
    """Refuse attention implementations that cannot take an additive 4D mask (flash, flex)."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {impl!r} cannot take a 4D mask; load the model with "
            f"attn_implementation one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )


def check_no_sliding(config: object) -> None:
    """Refuse sliding-window layers (for a forward that passes one 4D mask to every layer
    itself: it would silently bypass the window)."""
    if AttentionLayers.from_config(config).sliding:
        raise ValueError(
            "the model has sliding-window attention layers: a per-position 4D mask would bypass "
            "the window"
        )
