"""LLM nugget extractors: one backend per module, one interface (``base.Extractor``)."""
