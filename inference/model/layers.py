"""Which attention each decoder layer runs: full causal, or a causal sliding window.

transformers says it per layer (``config.layer_types``, or inferred from ``sliding_window`` for
models without it: Mistral, Phi-3) and builds each layer's cache and mask from it; this reads
the same answer (``transformers.cache_utils.get_layer_types_and_kwargs``) so the KV code never
guesses from a single ``sliding_window``.

A sliding layer of window ``W`` lets the query at position ``q`` attend to the keys at
positions ``q - W + 1 .. q`` (``masking_utils.sliding_window_overlay``: ``kv > q - W``), and
transformers' sliding cache (``DynamicSlidingWindowLayer``) keeps the last ``W - 1`` positions
between forwards. What that means for stored chunk KV and assembled contexts is stated in
``inference/model/encode.py`` and ``inference/context/assemble.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
KNOWN_TYPES = (FULL, SLIDING)


class UnsupportedAttention(ValueError):
    """A layer type the KV code cannot reproduce exactly (chunked, linear, NoPE, shared KV)."""


@dataclass(frozen=True)
class AttentionLayers:
    """Per decoder layer: its type (``full_attention`` / ``sliding_attention``) and window
    (``None`` for full attention; the number of positions a query sees, itself included).

    >>> AttentionLayers(("sliding_attention", "full_attention"), (4, None)).sliding
    True
    """

    types: tuple[str, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, config: Any) -> AttentionLayers:
        """The layers of a transformers config (the decoder's, for a composite config), as
        transformers builds their caches. Raises :class:`UnsupportedAttention` for any other
        layer type than full or sliding attention (named with its layers)."""
        from transformers.cache_utils import get_layer_types_and_kwargs

        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        types = [str(t) for t in types]
        other = sorted({t for t in types if t not in KNOWN_TYPES})
        if other:
            where = [i for i, t in enumerate(types) if t not in KNOWN_TYPES]
            raise UnsupportedAttention(
                f"layer type {', '.join(other)} (layers {where}) is not supported: only "
                f"{' and '.join(KNOWN_TYPES)} layers are reproduced exactly"
            )
        windows = tuple(
            int(k["sliding_window"]) if t == SLIDING else None
            for t, k in zip(types, kwargs, strict=True)
        )
        return cls(tuple(types), windows)

    @property
    def sliding(self) -> bool:
        """Some layer attends through a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def uniform(self) -> bool:
        """Every layer has the same type and window (one attention mask serves them all)."""
        return len(set(zip(self.types, self.windows, strict=True))) <= 1

    def window_of(self, layer_type: str) -> int | None:
        """The window of the layers of ``layer_type`` (None: full attention)."""
        return next(w for t, w in zip(self.types, self.windows, strict=True) if t == layer_type)
