"""coinrag: the offline asset factory for KV-cache-reuse RAG.

The repository's top folders are this package's subpackages (``coinrag.flows``,
``coinrag.tasks``, ``coinrag.schemas``, ``coinrag.storage``, ``coinrag.inference``,
``coinrag.training``; ``pyproject.toml`` maps ``coinrag`` to the repository root), so an
installed coinrag claims one name in site-packages. See README.md, "The code on one screen".
"""
