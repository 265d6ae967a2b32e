"""The model side: loading (``loading.py``), the KV dtype, attention layers and masks, the
support check of a model family, the RAG prompt, model-side KV (``encode.py``: a chunk's KV
after the prompt prefix), the static forward (``forward.py``), decoding (``generate.py``,
``constrained.py``), threads and quiet library logs. Imports only ``rope/`` and ``llm/``
below it in ``inference/`` (``tests/test_layout.py``: ``LEVELS``)."""
