"""Retrieval: the search modes and the two-stage retriever (``retriever.py``), the embedders
(``embedders.py``, with the lean BERT forward of ``lean_encoder.py``) and the windows a long
chunk is embedded in (``windows.py``)."""
