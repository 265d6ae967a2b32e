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

from collections.abc import Sequence
from typing import Any, TypeVar

from coinrag.inference.embedders import Embedder
from coinrag.inference.methods.assets import Index
from coinrag.inference.methods.base import METHODS, Answer, Asset, MissingAssets, OnToken, RagMethod
from coinrag.inference.models import LoadedModel
from coinrag.inference.prompt import RagPrompt, require_question
from coinrag.inference.retrieve import Retriever
from coinrag.schemas.settings import DEFAULT_RAG_METHODS
from coinrag.storage.store import Store

T = TypeVar("T")
DEFAULT_METHODS = DEFAULT_RAG_METHODS


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
        max_new_tokens: int = 32,
        methods: Sequence[str] = DEFAULT_METHODS,
        model_ref: str | None = None,
        kv_dtype: str | None = None,
        kv_codec: str | None = None,
    ) -> None:
        """``kv_codec``: how the store's KV is encoded (default: the store's recorded setting)."""
        self.store = store
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.prompt = prompt or RagPrompt.for_tokenizer(self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self.embedder = embedder
        self.model_ref = model_ref or str(loaded.model_dir)
        self.device = str(next(self.model.parameters()).device)
        self.kv_dtype = kv_dtype or dtype_name(self.model)
        self.kv_codec = kv_codec or _store_kv_codec(store)
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
        max_new_tokens: int = 32,
        methods: Sequence[str] = DEFAULT_METHODS,
    ) -> RagEngine:
        """Load everything ``methods`` need from ``store_path``; model and embedder default to
        the store's. The KV methods' model computes in the store's ``kv_dtype`` (the dtype its
        KV was built in)."""
        from coinrag.inference.kv_dtype import resolve_kv_dtype
        from coinrag.inference.models import load_model
        from coinrag.schemas.settings import settings_from_toml

        methods = list(dict.fromkeys(methods))
        _check_names(methods)
        store = Store.at(store_path)
        if not store.exists():
            raise MissingAssets(f"{store} is not a coinrag store (run coinrag build first)")
        settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
        kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        ref = model or settings.model
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
        )

    # ------------------------------------------------------------------ what methods share

    def model_at(self, dtype: str) -> LoadedModel:
        """The generation model computing in ``dtype`` (loaded once per dtype)."""
        if dtype not in self._models:
            from coinrag.inference.models import load_model

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

    def retrieve(self, question: str, method: str, kc: int, k: int) -> Any:
        return self.method(method).retrieve(question, kc, k)

    def answer(
        self,
        question: str,
        method: str = "coinrag",
        kc: int = 4,
        k: int = 10,
        *,
        doc_ids: Sequence[str] | None = None,
        on_token: OnToken | None = None,
    ) -> Answer:
        """Retrieve (among ``doc_ids`` only, if given), then answer with ``method``
        (``BlankQuestion``, a ValueError, for a blank question: before anything loads)."""
        require_question(question)
        return self.method(method).answer(question, kc, k, doc_ids=doc_ids, on_token=on_token)

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


def _check_names(methods: Sequence[str]) -> None:
    if not methods:
        raise ValueError(f"no method asked for: give some of {', '.join(METHODS)}")
    for name in methods:
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not one of {', '.join(METHODS)}")


def _store_kv_codec(store: Store) -> str:
    """The ``kv_codec`` recorded in ``STORE/coinrag.toml`` (``none`` where it has none)."""
    from coinrag.schemas.settings import settings_from_toml

    return settings_from_toml(store.read_toml(), store.uri(store.settings_path)).kv_codec
