"""The store explorer of ``coinrag api``: pages under ``/ui`` (``pages.py``)."""
