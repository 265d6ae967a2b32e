"""The OpenAI-compatible LLM client the extractors and question generators call
(``client.py``) and the prices of its models (``pricing.py``)."""
