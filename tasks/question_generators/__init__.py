"""Self-study question generators: one backend per module, one interface (``base``)."""
