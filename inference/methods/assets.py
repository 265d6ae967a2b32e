"""The store assets the chunk and nugget methods read, as :class:`~inference.methods.base.Asset`
kinds (each loaded once per engine), and the read errors they turn into what to rebuild.

- :class:`Index`: the retriever over the store's LanceDB index, with the engine's embedder and
  reranker (``engine.rerank``: its chunks' KV the stored KV where the store keeps whole chunks'
  KV, else encoded live, :func:`rerank_context`);
- :class:`ChunkTokenIds`: chunks' token ids (``inference.context.builders.ChunkTokens``);
- :class:`StoredKv`: the store's KV for the engine's model at the store's ``kv_dtype``, as an
  ``inference.context.builders.StoredKvContext`` (``C_p`` read and checked once);
  :class:`StoredChunkKv` (whole chunks: turborag) and :class:`StoredNuggetKv` (nugget spans:
  coinrag) are the two ways methods use it, one shared context. A store built with ``kv_keep =
  "nuggets"`` holds only the KV of nugget spans: :class:`StoredNuggetKv` reads them as from a
  store of whole chunks, and :class:`StoredChunkKv` is unavailable (one message naming the
  setting, before any model loads).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from coinrag.inference.context.builders import (
    ChunkTokens,
    ContextBuilder,
    IsolatedNuggetContext,
    PrefixMismatch,
    StoredKvContext,
    UnalignedContext,
)
from coinrag.inference.methods.base import Asset, CorruptAssets, MissingAssets
from coinrag.inference.model.encode import kv_layout
from coinrag.inference.retrieval.retriever import Evidence, Retriever
from coinrag.schemas.settings import BuildSettings
from coinrag.storage.kv import CorruptKvEntry, KvStore, MissingKvEntry, UnstoredKvSlice
from coinrag.storage.store import Store

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine


class Index(Asset[Retriever]):
    """The retriever over the store's index (refused if the index was embedded by another
    embedder than the engine's)."""

    @classmethod
    def load(cls, engine: RagEngine) -> Retriever:
        from coinrag.inference.retrieval.embedders import store_embedder_of

        embedder = engine.embedder
        if isinstance(embedder, str):  # in the store's embed_dtype: its index's fingerprint
            embedder = store_embedder_of(engine.store_settings, embedder)
        from coinrag.inference.retrieval.rerank import open_reranker
        from coinrag.storage.index.lance import LanceIndex

        index = LanceIndex.open(engine.store, engine.published)
        reranker = open_reranker(engine.rerank, lambda: rerank_context(engine))
        return Retriever(engine.store, embedder, index, mode=engine.retrieval, reranker=reranker)


def rerank_context(engine: RagEngine) -> ContextBuilder:
    """The chunks' KV a reranker of ``engine`` reads: the store's (:class:`StoredChunkKv`)
    where it keeps whole chunks' KV of the engine's model, else encoded live by that model."""
    from coinrag.inference.context.builders import LiveKvContext
    from coinrag.inference.model.encode import pad_id

    if StoredChunkKv.unavailable(engine.store, engine.store_settings) is None:
        try:
            return engine.asset(StoredChunkKv)
        except MissingAssets:
            pass  # no KV built (kv = false): encode the candidates
    loaded = engine.model_at(engine.kv_dtype)
    return LiveKvContext(engine.store, loaded.model, engine.prompt, pad_id(loaded.tokenizer))


class ChunkTokenIds(Asset[ChunkTokens]):
    """Chunks' token ids, read once per chunk."""

    @classmethod
    def load(cls, engine: RagEngine) -> ChunkTokens:
        return ChunkTokens(engine.store)


class StoredKv(Asset[StoredKvContext]):
    """The store's KV of the engine's model (at the store's ``kv_dtype``), its ``C_p`` checked
    against the engine's prompt."""

    @classmethod
    def load(cls, engine: RagEngine) -> StoredKvContext:
        loaded = engine.model_at(engine.kv_dtype)
        store = engine.store
        try:
            layout = kv_layout(loaded, engine.prompt, kv_codec=engine.kv_codec, keep=engine.kv_keep)
            kv = KvStore.open(store, layout.kv_fp, layout)
            return StoredKvContext(store, loaded.model, engine.prompt, kv)
        except CorruptKvEntry as exc:
            raise CorruptAssets(store, "the prompt prefix", exc) from exc
        except (MissingKvEntry, FileNotFoundError) as exc:
            message = _no_kv_message(store, loaded.model_fp, layout.dtype, layout.kv_codec)
            raise MissingAssets(message) from exc
        except PrefixMismatch as exc:
            raise MissingAssets(str(exc)) from exc


class StoredChunkKv(StoredKv):
    """The stored KV of whole chunks (turborag reads each retrieved chunk entire): none in a
    store that keeps only the KV of nugget spans."""

    @classmethod
    def unavailable(cls, store: Store, settings: BuildSettings) -> str | None:
        if settings.kv_keep == "chunks":
            return None
        return (
            f"needs the KV of whole chunks, and store {store} keeps only the KV of nugget "
            f'spans (kv_keep = "{settings.kv_keep}"): use --method coinrag or standard, or '
            'rebuild the store with --kv-keep chunks (kv_keep = "chunks")'
        )

    @classmethod
    def load(cls, engine: RagEngine) -> StoredKvContext:
        reason = cls.unavailable(engine.store, engine.store_settings)
        if reason:
            raise MissingAssets(reason)
        return engine.asset(StoredKv)


class StoredNuggetKv(StoredKv):
    """The stored KV of nugget spans (coinrag reads only the retrieved nuggets' slices)."""

    @classmethod
    def load(cls, engine: RagEngine) -> StoredKvContext:
        return engine.asset(StoredKv)


class UnalignedNuggetKv(StoredKv):
    """The nuggets' stored slices at the positions they were encoded at, not re-rotated
    (the ``coinrag-noalign`` ablation; shares the stored KV and ``C_p``)."""

    @classmethod
    def load(cls, engine: RagEngine) -> StoredKvContext:
        return UnalignedContext.sharing(engine.asset(StoredKv))


class IsolatedNuggetKv(StoredKv):
    """The nuggets' tokens encoded alone after the stored ``C_p``, online (the
    ``coinrag-isolated`` ablation)."""

    @classmethod
    def load(cls, engine: RagEngine) -> StoredKvContext:
        from coinrag.inference.model.encode import pad_id

        stored = engine.asset(StoredKv)
        return IsolatedNuggetContext.sharing(
            stored, pad_id(engine.model_at(engine.kv_dtype).tokenizer)
        )


def stored_context(
    context: ContextBuilder,
    evidence: Sequence[Evidence],
    n_query: int,
    timings: dict[str, float],
) -> tuple[torch.Tensor, int]:
    """``context.build(...)`` (``(C_ctx, total)``; ``timings`` gets ``kv_load`` and
    ``assembly``), with a missing entry (or a span the store does not keep) as
    :class:`MissingAssets` and a corrupt one as :class:`CorruptAssets` naming its chunk and
    document."""
    with kv_read_errors(context, evidence):
        return context.build(evidence, n_query, timings)


@contextmanager
def kv_read_errors(context: ContextBuilder, evidence: Sequence[Evidence]) -> Iterator[None]:
    """Turn the KV store's read errors inside the block into :class:`MissingAssets` (what to
    rebuild; also a span a nuggets store does not hold) and :class:`CorruptAssets` (naming the
    chunk and document)."""
    try:
        yield
    except (MissingKvEntry, UnstoredKvSlice) as exc:
        raise MissingAssets(f"{exc}: rebuild the store's KV (coinrag build)") from exc
    except CorruptKvEntry as exc:
        what = next(
            (
                f"chunk {e.chunk_id} (document {e.doc_id})"
                for e in evidence
                if e.content_key == exc.content_key
            ),
            f"entry {exc.content_key}",
        )
        raise CorruptAssets(context.store, what, exc) from exc


def _codec_note(kv_codec: str) -> str:
    return "" if kv_codec == "none" else f", kv_codec {kv_codec}"


def _no_kv_message(store: Store, model_fp: str, dtype: str, kv_codec: str = "none") -> str:
    """Why a model cannot answer from ``store``: both fingerprints (the model asked for, the
    models the store's KV was built by, with their dtypes) and the ways out."""
    from coinrag.storage.gc import kv_fps
    from coinrag.storage.kv import KvError

    built: set[str] = set()
    for kv_fp in kv_fps(store):
        try:
            layout = KvStore.open(store, kv_fp).layout
        except (KvError, FileNotFoundError, KeyError):
            continue
        built.add(f"{layout.model_fp} ({layout.dtype}{_codec_note(layout.kv_codec)})")
    have = (
        f"its KV was built by model {', '.join(sorted(built))}"
        if built
        else "it holds no KV at all (built with kv = false?)"
    )
    return (
        f"store {store} has no KV for model {model_fp} in {dtype}{_codec_note(kv_codec)}; "
        f"{have}: query with the "
        "store's own model (no --model), or run `coinrag build SOURCE --store ... --model ... "
        f"--kv-dtype {dtype}` with this model first (or set kv_dtype in the store's coinrag.toml "
        "to the dtype it was built in)"
    )
