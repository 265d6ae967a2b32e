"""The retriever's tuning from the store itself: synthetic questions and the page split
(``fusion``: the hybrid fusion weight chosen on them), the training pairs of an adapted
embedder (``retriever_pairs``), and the judgment of an adapted embedder against the store's
before the index is re-embedded with it (``retriever_guard``)."""
