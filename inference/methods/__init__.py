"""RAG methods: one class per method behind one interface, and the engine that runs them.

- ``base.py``: :class:`RagMethod` (the interface: assets needed, retrieval, ``run`` over the
  method's ``generate``), the registry ``METHODS`` (``RagMethod.registry``, filled by
  subclassing), :class:`Answer`, :class:`MissingAssets`;
- ``engine.py``: :class:`RagEngine` (model, prompt and store loaded once; the methods asked
  for and their assets);
- ``assets.py``, ``retrievals.py``: the index, chunk tokens and stored KV methods read, and how
  the chunk and nugget methods retrieve;
- the methods: ``coinrag.py``, ``turborag.py`` (both ``kv_reuse.py``), ``standard.py``,
  ``cartridge.py``; the baselines ``cacheblend.py`` (``cacheblend``, ``cacheblend-v``) and
  ``kvlink.py``; CoinRAG's ablations ``coinrag_ablations.py`` (``coinrag-isolated``,
  ``coinrag-noalign``, ``coinrag-onestage``).

A new method is a module here named as the method (or listed in ``base.METHOD_MODULES``),
with one subclass of :class:`RagMethod` (``name=...``), and its name in
``schemas.settings.RAG_METHODS``; ``METHODS`` imports the module when the name is first looked
up (a process imports only the methods it uses).
"""

from coinrag.inference.methods.base import (
    METHODS,
    Answer,
    CorruptAssets,
    MissingAssets,
    RagMethod,
    methods_for,
    repair_command,
    unavailable_methods,
)
from coinrag.inference.methods.engine import RagEngine

__all__ = [
    "METHODS",
    "Answer",
    "CorruptAssets",
    "MissingAssets",
    "RagEngine",
    "RagMethod",
    "methods_for",
    "repair_command",
    "unavailable_methods",
]
