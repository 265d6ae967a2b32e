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


def check_attention(config: object) -> None:
    """Refuse attention implementations that cannot take an additive 4D mask (flash, flex) and
    sliding-window layers (a 4D mask would silently bypass the window)."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {impl!r} cannot take a 4D mask; load the model with "
            f"attn_implementation one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    layer_types = getattr(config, "layer_types", None)
    sliding = (
        any(t != "full_attention" for t in layer_types)
        if layer_types
        else getattr(config, "sliding_window", None) is not None
    )
    if sliding:
        raise ValueError(
            "the model has sliding-window attention layers: a per-position 4D mask would bypass "
            "the window"
        )
