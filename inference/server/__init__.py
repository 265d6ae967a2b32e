"""The warm query server of ``coinrag api``: ``app.py`` (FastAPI endpoints, one process's
state), ``versions.py`` (the published versions served, refcounted, and the watcher that swaps
them), ``queue.py`` (the model thread and its bounded queue), ``requests.py`` (request checks),
``auth.py`` (API keys), ``limits.py`` (each client's share: 429), ``metrics.py``
(Prometheus)."""
