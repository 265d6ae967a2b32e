"""The current producers of a store: the fingerprints its settings make now.

An asset is stale exactly when a fingerprint it was made with differs from the current one
(``docs/design.md``). This computes the current ones from :class:`BuildSettings` (usually
``STORE/coinrag.toml``) with the same code the build uses, so an unchanged build's recorded
fingerprints equal these (tested). Cost: the tokenizer, the generation model's config and cached
weights hash (no weights are loaded), and the embedder (loaded: its fingerprint needs its
config; about a second for MiniLM).
"""

from __future__ import annotations

from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.views import PRODUCERS
from coinrag.storage.store import store_settings  # noqa: F401  (re-exported)


def current_producers(settings: BuildSettings) -> dict[str, str]:
    """``schemas.views.PRODUCERS`` -> the value ``settings`` produce now.

    ``tau`` is the recovery threshold as text (``"0.7"``).
    """
    from coinrag.inference.model.kv_dtype import resolve_kv_dtype
    from coinrag.inference.model.loading import (
        load_tokenizer,
        reference_model_fingerprint,
        tokenizer_fingerprint,
    )
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.tasks.chunk import chunker_fingerprint
    from coinrag.tasks.extractors.factory import make_extractor

    values = {
        "tokenizer_fp": tokenizer_fingerprint(load_tokenizer(settings.model)),
        "chunker_fp": chunker_fingerprint(settings.chunker, settings.chunk_size),
        "extractor_fp": make_extractor(settings).fingerprint,
        "tau": str(settings.tau),
        "model_fp": reference_model_fingerprint(
            settings.model,
            settings.device,
            resolve_kv_dtype(settings.kv_dtype, settings.device).dtype,
        ),
        "cartridge_model_fp": reference_model_fingerprint(settings.model, settings.device),
        "embedder_fp": store_embedder_of(settings).fingerprint,
    }
    assert tuple(values) == PRODUCERS, "keep PRODUCERS and this function in step"
    return values
