"""``coinrag eval``: answers per method, model and (kc, k) (``evaluate.py``), retrieval alone
(``retrieval_only.py``) and the report: Table 3 and the plots (``report.py``)."""
