"""RAG methods: one class per method behind one interface, and the engine that runs them.

- ``base.py``: :class:`RagMethod` (the interface: assets needed, retrieval, ``run``), the
  registry ``METHODS`` (filled by subclassing), :class:`Answer`, :class:`MissingAssets`;
- ``engine.py``: :class:`RagEngine` (model, prompt and store loaded once; the methods asked
  for and their assets);
- ``assets.py``, ``retrievals.py``: the index, chunk tokens and stored KV methods read, and how
  the chunk and nugget methods retrieve;
- the methods: ``coinrag.py``, ``turborag.py`` (both ``kv_reuse.py``), ``standard.py``,
  ``cartridge.py``.

A new method is a module here with one subclass of :class:`RagMethod` (``name=...``), imported
below, and its name in ``schemas.settings.RAG_METHODS``.
"""

from coinrag.inference.methods import cartridge, coinrag, standard, turborag
from coinrag.inference.methods.base import (
    METHODS,
    Answer,
    CorruptAssets,
    MissingAssets,
    RagMethod,
    repair_command,
)
from coinrag.inference.methods.engine import RagEngine

__all__ = [
    "METHODS",
    "Answer",
    "CorruptAssets",
    "MissingAssets",
    "RagEngine",
    "RagMethod",
    "cartridge",
    "coinrag",
    "repair_command",
    "standard",
    "turborag",
]
