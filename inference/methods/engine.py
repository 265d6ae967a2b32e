"""The RAG methods on one store's assets, with the same model, prompt and retrieval.

:class:`RagEngine` loads the model, the prompt and the store once, then opens the methods
asked for (``inference.methods.METHODS``), each loading its model and the assets it needs
(shared between methods: one stored-KV context, one retriever). Method code takes a retrieval
result as input (:meth:`RagEngine.run`), so any retriever plugs in unchanged;
:meth:`RagEngine.answer` retrieves first, as the method retrieves (two-stage for ``coinrag``,
top-kc chunks for ``turborag`` and ``standard``, top-k documents for ``cartridge``).

A warm server keeps one engine: methods not opened at first open on first use.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from coinrag.inference.methods.assets import Index
from coinrag.inference.methods.base import (
    METHODS,
    Answer,
    Asset,
    MissingAssets,
    OnToken,
    RagMethod,
    methods_for,
    store_settings,
)
from coinrag.inference.model.loading import LoadedModel
from coinrag.inference.model.prompt import RagPrompt, require_question
from coinrag.inference.retrieval.embedders import Embedder
from coinrag.inference.retrieval.rerank import Reranker
from coinrag.inference.retrieval.retriever import Retriever, search_mode
from coinrag.schemas.settings import (
    DEFAULT_QUERY,
    DEFAULT_RAG_METHODS,
    QueryOptions,
    settings_from_toml,
)
from coinrag.storage.store import Store

T = TypeVar("T")


def dtype_name(model: Any) -> str:
    """``"float32"`` etc.: the dtype ``model``'s parameters are in."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


class RagEngine:
    """Model, prompt and store of one store, loaded once; the methods asked for and their
    assets.

    ``loaded``: the generation model (its dtype is the store's KV dtype unless ``kv_dtype``
    says otherwise); ``embedder``: an embedder, or a reference (``"minilm"``, a folder) loaded
    when retrieval first needs it; ``model_ref``: what ``loaded`` was loaded from, to load it in
    another dtype for a method that computes in one (cartridges: the default dtype).
    """

    def __init__(
        self,
        store: Store,
        loaded: LoadedModel,
        embedder: Embedder | str,
        *,
        prompt: RagPrompt | None = None,
        max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
        methods: Sequence[str] = DEFAULT_RAG_METHODS,
        model_ref: str | None = None,
        kv_dtype: str | None = None,
        kv_codec: str | None = None,
        published: dict[str, Any] | None = None,
        link_adapter: str | None = None,
        kv_keep: str | None = None,
        retrieval: str | None = None,
        rerank: str | None = None,
    ) -> None:
        """``kv_codec``: how the store's KV is encoded; ``kv_keep``: what it keeps of each chunk
        (``chunks`` | ``nuggets``); both default to the store's recorded settings.
        ``published``: the store's ``[published]`` record this engine reads (its index versions;
        default: the one published when the index first loads); ``link_adapter``: a folder of
        trained KVLink link tokens (``kvlink`` needs one); ``retrieval``: the search mode of
        questions that name none (default: the store's ``retrieval`` setting); ``rerank``: how
        the top chunks are reordered (``schemas.settings.RERANKERS``; default: the store's
        ``rerank`` setting)."""
        self.store = store
        self.published = published
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.prompt = prompt or RagPrompt.for_tokenizer(self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self.embedder = embedder
        self.model_ref = model_ref or str(loaded.model_dir)
        self.device = str(next(self.model.parameters()).device)
        self.kv_dtype = kv_dtype or dtype_name(self.model)
        recorded = store_settings(store)
        self.kv_codec = kv_codec or recorded.kv_codec
        self.kv_keep = kv_keep or recorded.kv_keep
        self.retrieval = search_mode(retrieval or recorded.retrieval).name
        self.rerank = Reranker.registry[rerank or recorded.rerank].name
        # what the methods' assets are checked against (Asset.unavailable)
        self.store_settings = dataclasses.replace(
            recorded, kv_codec=self.kv_codec, kv_keep=self.kv_keep
        )
        self.link_adapter = link_adapter
        self._models = {dtype_name(self.model): loaded}
        self._assets: dict[type[Asset[Any]], Any] = {}
        self.methods: dict[str, RagMethod] = {}
        for name in methods:
            self.method(name)

    @classmethod
    def open(
        cls,
        store_path: str,
        model: str | None = None,
        embedder: str | None = None,
        max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
        methods: Sequence[str] | None = None,
        rerank: str | None = None,
    ) -> RagEngine:
        """Load everything ``methods`` need from ``store_path`` (default: the default methods
        the store can run, ``methods_for``: a store keeping only nugget spans has no turborag);
        model, embedder and ``rerank`` (how the top chunks are reordered) default to the
        store's. The KV methods' model computes in the
        store's ``kv_dtype`` (the dtype its KV was built in). ``model`` may be a KVLink adapter
        folder (``coinrag train kvlink``): the transformer its ``kvlink.json`` names is loaded,
        and ``kvlink`` uses its links."""
        from coinrag.inference.context.link import is_link_adapter, read_link_adapter_info
        from coinrag.inference.model.kv_dtype import resolve_kv_dtype
        from coinrag.inference.model.loading import load_model

        store = Store.at(store_path)
        if methods is None:
            _check_names(DEFAULT_RAG_METHODS)
        else:
            methods = list(dict.fromkeys(methods))
            _check_names(methods)
        if not store.exists():
            raise MissingAssets(f"{store} is not a coinrag store (run coinrag build first)")
        if methods is None:
            methods = methods_for(store, DEFAULT_RAG_METHODS)
        toml = store.read_toml()  # read once: the settings and the published version agree
        settings = settings_from_toml(toml, store.uri(store.settings_path))
        kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        ref = model or settings.model
        link_adapter = None
        if model is not None and is_link_adapter(model):
            link_adapter, ref = model, read_link_adapter_info(model).model
        first = METHODS[methods[0]].model_dtype(kv_dtype, settings.device)
        loaded = load_model(ref, device=settings.device, dtype=first)
        return cls(
            store,
            loaded,
            embedder or settings.embedder,
            max_new_tokens=max_new_tokens,
            methods=methods,
            model_ref=ref,
            kv_dtype=kv_dtype,
            kv_codec=settings.kv_codec,
            published=toml.get("published"),
            link_adapter=link_adapter,
            kv_keep=settings.kv_keep,
            rerank=rerank,
        )

    def reopen(self, toml: dict[str, Any] | None = None) -> RagEngine:
        """A new engine on the store's version now published (``toml``: ``coinrag.toml`` as
        already read), sharing this engine's models, embedder and prompt (only the store views
        are new: the index at the new versions, the KV manifest, chunk tokens). Opens the same
        methods, so every asset loads now. :class:`VersionRefused` when the version needs
        another model than the one loaded (another ``model``, ``kv_dtype`` or embedder, or no
        KV for this model); the message names both."""
        from coinrag.inference.model.kv_dtype import resolve_kv_dtype

        toml = self.store.read_toml() if toml is None else toml
        settings = settings_from_toml(toml, self.store.uri(self.store.settings_path))
        kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        run_id = (toml.get("published") or {}).get("run_id", "")
        if kv_dtype != self.kv_dtype:
            raise VersionRefused(
                f"published run {run_id} has KV in {kv_dtype}; the served model computes in "
                f"{self.kv_dtype}: restart the server to serve it"
            )
        index = (toml.get("published") or {}).get("index") or {}
        embedder_fp = getattr(self._embedder_loaded(), "fingerprint", None)
        if embedder_fp and index.get("embedder_fp") not in (None, embedder_fp):
            raise VersionRefused(
                f"published run {run_id} was embedded by {index['embedder_fp']}; the served "
                f"embedder is {embedder_fp}: restart the server to serve it"
            )
        engine = copy.copy(self)  # the same models, prompt and settings; its own assets
        engine.published = toml.get("published")
        engine.kv_codec = settings.kv_codec
        engine.kv_keep = settings.kv_keep
        engine.store_settings = settings
        engine._assets = {}
        engine.methods = {}
        engine.embedder = self._embedder_loaded()
        try:
            for name in self.methods:
                engine.method(name)
        except MissingAssets as exc:
            raise VersionRefused(f"published run {run_id}: {exc}") from exc
        return engine

    def _embedder_loaded(self) -> Embedder | str:
        """The loaded embedder (the index's retriever's), else the reference."""
        retriever = self._assets.get(Index)
        return retriever.embedder if retriever is not None else self.embedder

    def fingerprints(self) -> dict[str, str]:
        """What this engine serves: the model's, its KV's and the index's embedder's
        fingerprints (those of assets loaded so far), with the KV dtype and codec."""
        from coinrag.inference.methods.assets import StoredKv

        out = {"model_fp": self.loaded.model_fp, "kv_dtype": self.kv_dtype}
        out["kv_codec"] = self.kv_codec
        kv = self._assets.get(StoredKv)
        if kv is not None:
            out["kv_fp"] = kv.kv.kv_fp
        retriever = self._assets.get(Index)
        if retriever is not None:
            out["embedder_fp"] = retriever.embedder.fingerprint
        return out

    def close(self) -> None:
        """Drop this engine's store views (index tables, KV readers, chunk tokens); the models
        stay (another engine may share them). The engine answers nothing afterwards."""
        for asset in self._assets.values():
            closer = getattr(asset, "close", None)
            if callable(closer):
                closer()
        self._assets.clear()
        self.methods.clear()

    # ------------------------------------------------------------------ what methods share

    def model_at(self, dtype: str) -> LoadedModel:
        """The generation model computing in ``dtype`` (loaded once per dtype)."""
        if dtype not in self._models:
            from coinrag.inference.model.loading import load_model

            self._models[dtype] = load_model(self.model_ref, device=self.device, dtype=dtype)
        return self._models[dtype]

    def asset(self, kind: type[Asset[T]]) -> T:
        """The store's asset of ``kind``, loaded on first use (then shared)."""
        if kind not in self._assets:
            self._assets[kind] = kind.load(self)
        return self._assets[kind]

    @property
    def retriever(self) -> Retriever:
        return self.asset(Index)

    def method(self, name: str) -> RagMethod:
        """The method ``name``, opened on first use (its model and assets loaded)."""
        if name not in self.methods:
            _check_names([name])
            self.methods[name] = METHODS[name](self)
        return self.methods[name]

    # ------------------------------------------------------------------ answering

    def retrieve(
        self, question: str, method: str, kc: int, k: int, retrieval: str | None = None
    ) -> Any:
        """``method``'s evidence for ``question`` in search mode ``retrieval`` (default: the
        engine's)."""
        return self.method(method).retrieve(question, kc, k, mode=retrieval)

    def answer(
        self,
        question: str,
        method: str = DEFAULT_QUERY.method,
        kc: int = DEFAULT_QUERY.kc,
        k: int = DEFAULT_QUERY.k,
        *,
        doc_ids: Sequence[str] | None = None,
        on_token: OnToken | None = None,
        retrieval: str | None = None,
    ) -> Answer:
        """Retrieve (among ``doc_ids`` only, if given; in search mode ``retrieval``, default
        the engine's), then answer with ``method`` (``BlankQuestion``, a ValueError, for a
        blank question: before anything loads)."""
        require_question(question)
        if retrieval is not None:
            search_mode(retrieval)  # an unknown mode is refused before any work
        chosen = self.method(method)
        found = chosen.retrieve(question, kc, k, doc_ids, retrieval)
        return chosen.run(question, found, kc, k, on_token)

    def ask(self, question: str, options: QueryOptions, on_token: OnToken | None = None) -> Answer:
        """Answer ``question`` as ``options`` ask (``coinrag query``'s options, a server
        request): its method, kc, k, oracle document, search mode and ``max_new_tokens``."""
        self.max_new_tokens = options.max_new_tokens
        return self.answer(
            question,
            options.method,
            options.kc,
            options.k,
            doc_ids=options.doc_ids,
            on_token=on_token,
            retrieval=options.retrieval,
        )

    def run(
        self,
        question: str,
        method: str,
        retrieval: Any,
        kc: int = 0,
        k: int = 0,
        *,
        on_token: OnToken | None = None,
    ) -> Answer:
        """Answer from given retrieval results (evidence in assembly order)."""
        return self.method(method).run(question, retrieval, kc, k, on_token)


class VersionRefused(MissingAssets):
    """A published version the loaded model cannot serve (another KV dtype, embedder, or no KV
    for this model): the server keeps serving the version it has."""


def _check_names(methods: Sequence[str]) -> None:
    if not methods:
        raise ValueError(f"no method asked for: give some of {', '.join(METHODS)}")
    for name in methods:
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not one of {', '.join(METHODS)}")
