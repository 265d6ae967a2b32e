"""Contexts from stored KV: slices placed and re-rotated into one contiguous prefix
(``assemble.py``), the context builders serving and fine-tuning share (``builders.py``),
CacheBlend's selective recompute (``blend.py``) and KVLink's link tokens (``link.py``)."""
