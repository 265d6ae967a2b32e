"""The retrieval index in LanceDB: the index and its published versions (``lance.py``), the
tables' columns and schemas (``tables.py``), the ANN vector index (``ann.py``), the BM25
full-text index and its in-memory copy (``bm25.py``), the searches (``search.py``) and
optimize / prune (``upkeep.py``)."""
