"""Nugget recovery: each candidate span the LLM wrote found in its chunk at exact token offsets.
The stage (``stage.py``) over the matching (``match.py``: exact, then fuzzy, else abandoned),
the canonical forms and word boundaries (``canon.py``), the fuzzy window search (``fuzzy.py``)
and the snapping of characters to token boundaries (``tokens.py``)."""
