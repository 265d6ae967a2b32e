"""The retriever's tuning from the store itself: synthetic questions and the page split
(``fusion``: the hybrid fusion weight chosen on them), and the training pairs of an adapted
embedder (``retriever_pairs``)."""
