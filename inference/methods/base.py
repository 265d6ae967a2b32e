"""One interface for every RAG method: :class:`RagMethod`, its registry, and what it returns.

A method is a subclass of :class:`RagMethod` registered by name (``class CoinRag(KvReuseMethod,
name="coinrag")`` in ``inference/methods/coinrag.py`` fills ``METHODS["coinrag"]``, imported on
first look-up: :class:`MethodRegistry`; ``schemas.settings.RAG_METHODS`` lists the same
names for the CLI, which checks them before anything loads). A method declares

- ``needs``: the :class:`Asset` kinds it reads (the index, chunk token ids, stored chunk KV,
  stored nugget KV, cartridges, ...). The engine (``inference/methods/engine.py``) loads each
  kind once, when the first method needing it opens, and shares it between methods;
- ``retrieval``: how it finds its evidence (a :class:`Retrieval`: top chunks, two-stage
  nuggets, top documents with a cartridge, ...), which says whether ``kc`` and ``k`` matter
  and keys the results methods can share;
- ``model_dtype``: the dtype its model computes in (the store's KV dtype unless it says
  otherwise: KV slices are used as stored);

and answers through one path, :meth:`RagMethod.run` ``(question, retrieval, kc, k,
on_token)``: the retrieval result in, an :class:`Answer` (text, evidence, active tokens,
timings) out; ``on_token`` is called with each answer token id as it is decoded (streaming).

What a store can never serve is said by its assets, from the store's settings, before any model
loads (:meth:`Asset.unavailable`, e.g. ``StoredChunkKv`` on a store that keeps only nugget
spans): :meth:`RagMethod.unavailable`, :func:`unavailable_methods` and :func:`methods_for` (the
CLI's checks and ``eval``'s default methods); the method refuses to open there.

Timings (milliseconds): ``retrieval`` (embedding + index search), ``kv_load``, ``assembly``
(rotation, concatenation, cache construction), ``prefill`` (query prefill up to the first
token's logits), ``ttft`` (the sum of those four) and ``decode`` (the remaining tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from coinrag.inference.generate import Generation
from coinrag.inference.prompt import require_question
from coinrag.schemas.settings import RAG_METHODS, BuildSettings
from coinrag.storage.kv import CorruptKvEntry
from coinrag.storage.store import Store, store_settings

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine

T = TypeVar("T")
OnToken = Callable[[int], None]  # called with each answer token id as it is decoded


class MissingAssets(RuntimeError):
    """The store lacks what a method needs (KV, index): the message says which build step."""

    exit_code = 1
    http_status = 500


class CorruptAssets(MissingAssets):
    """A stored KV entry (or the prompt prefix's) failed its check: never served; the message
    names the chunk and document and the build that recomputes it."""

    def __init__(self, store: Store, what: str, exc: CorruptKvEntry) -> None:
        super().__init__(
            f"the KV of {what} is corrupt ({exc.reason}, at kv/{exc.location}): "
            f"{repair_command(store)} recomputes it"
        )


def repair_command(store: Store) -> str:
    """The build that repairs a store's KV: its last SOURCE, with the settings it was built with
    (``STORE/coinrag.toml``, for a local store)."""
    import json

    from coinrag.schemas.tables import RunRow
    from coinrag.storage.tables import read_rows

    source = "SOURCE"
    try:
        runs = [r for r in read_rows(store, RunRow) if (r.flow, r.status) == ("build", "completed")]
        if runs:
            last = max(runs, key=lambda r: r.started_at)
            source = json.loads(last.parameters_json).get("source") or source
    except (OSError, ValueError, KeyError):  # unreadable runs: the generic form still says it
        pass
    config = f" --config {path}" if (path := store.local_path(store.settings_path)) else ""
    return f"`coinrag build {source} --store {store.url}{config}`"


@dataclass
class Answer:
    """One answered question."""

    answer: str
    method: str
    evidence: list[dict[str, Any]]  # {doc_id, chunk_id, tok_start, tok_end, text} (or cartridge)
    active_tokens: int  # context tokens after the prompt prefix (KV-memory proxy)
    timings: dict[str, float]
    kc: int
    k: int
    model_fp: str = ""
    retrieval: str = ""  # the search mode that found the evidence (schemas RETRIEVAL_MODES)
    token_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_ids")
        return out

    def to_json_text(self) -> str:
        """The one JSON text of an answer (``coinrag query --json`` prints it, ``coinrag api``
        answers it)."""
        import json

        return json.dumps(self.to_json(), ensure_ascii=False)


class Asset(Generic[T]):
    """A kind of store asset methods read, loaded at most once per engine (:meth:`load`) and
    shared by every method that declares it in ``needs``. A new kind (e.g. trained link tokens)
    is one more subclass, next to the method that reads it."""

    @classmethod
    def unavailable(cls, store: Store, settings: BuildSettings) -> str | None:
        """Why a store built with ``settings`` can never hold this asset, said from its settings
        alone (before any model loads), e.g. ``"needs the KV of whole chunks, and store ...
        keeps only ..."``; None when it can (a missing asset is found by :meth:`load`)."""
        return None

    @classmethod
    def load(cls, engine: RagEngine) -> T:
        """The asset of ``engine``'s store and model; :class:`MissingAssets` naming the build
        step when the store lacks it."""
        raise NotImplementedError


def unavailable_methods(store: Store, methods: Sequence[str]) -> dict[str, str]:
    """Of ``methods`` (names in :data:`METHODS`), those ``store`` can never run, with why
    (:meth:`RagMethod.unavailable`; nothing is loaded)."""
    settings = store_settings(store)
    reasons = {name: METHODS[name].unavailable(store, settings) for name in methods}
    return {name: reason for name, reason in reasons.items() if reason}


def methods_for(store: Store, methods: Sequence[str]) -> list[str]:
    """``methods`` less those ``store`` can never run (:func:`unavailable_methods`)."""
    refused = unavailable_methods(store, methods)
    return [name for name in methods if name not in refused]


class Retrieval(ABC):
    """How a method finds its evidence for a question. Methods whose retrievals give the same
    :meth:`key` for ``(kc, k)`` can share one result (``coinrag eval`` retrieves once per
    question and key)."""

    uses_kc: ClassVar[bool] = False  # the result depends on kc (chunks of stage 1)
    uses_k: ClassVar[bool] = False  # the result depends on k (nuggets, documents)

    def key(self, kc: int, k: int, mode: str = "") -> Hashable:
        return (type(self).__name__, kc if self.uses_kc else 0, k if self.uses_k else 0, mode)

    @abstractmethod
    def __call__(
        self,
        engine: RagEngine,
        question: str,
        kc: int,
        k: int,
        doc_ids: Sequence[str] | None,
        mode: str,
    ) -> Any:
        """The evidence for ``question`` (its type is what the method's ``run`` takes), with
        the time it took; ``doc_ids``: only these documents (an oracle's gold documents);
        ``mode``: the search mode (``schemas.settings.RETRIEVAL_MODES``)."""


# Methods that live in a module of another name (a variant beside the method it varies).
METHOD_MODULES = {
    "cacheblend-v": "cacheblend",
    "coinrag-isolated": "coinrag_ablations",
    "coinrag-noalign": "coinrag_ablations",
    "coinrag-onestage": "coinrag_ablations",
}


class MethodRegistry(Mapping[str, "type[RagMethod]"]):
    """``name -> RagMethod subclass``, filled by subclassing. The names are
    ``schemas.settings.RAG_METHODS``; a method's module, ``inference/methods/<name>.py`` (or
    the one ``METHOD_MODULES`` names), is imported when its name is first looked up, so a
    process imports only the methods it uses (``coinrag query --method standard`` never
    imports the cartridge code). ``in`` imports
    nothing; iterating imports every method."""

    def __init__(self) -> None:
        self._classes: dict[str, type[RagMethod]] = {}

    def register(self, name: str, cls: type[RagMethod]) -> None:
        if name in self._classes:
            raise ValueError(f"two RAG methods named {name!r}")
        self._classes[name] = cls

    def __delitem__(self, name: str) -> None:  # a probe subclass of a test, unregistered
        del self._classes[name]

    def __getitem__(self, name: str) -> type[RagMethod]:
        if name not in self._classes and name in RAG_METHODS:
            module = METHOD_MODULES.get(name, name)
            import_module(f"{__package__}.{module}")  # this package, whatever it is named
        return self._classes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes or name in RAG_METHODS

    def __iter__(self) -> Iterator[str]:
        for name in RAG_METHODS:
            self[name]
        return iter(dict(self._classes))

    def __len__(self) -> int:
        return len(list(iter(self)))


METHODS = MethodRegistry()


class RagMethod(ABC):
    """A RAG method over one engine's model, prompt and assets.

    Subclass with ``name=...`` to register; set ``needs`` and ``retrieval``; implement
    :meth:`run`. Constructed by the engine (once per engine), which loads the method's model
    and assets then, so a missing asset fails when the engine opens, and loading is never in a
    timing.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[type[Asset[Any]], ...]] = ()
    retrieval: ClassVar[Retrieval]

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            METHODS.register(name, cls)
            cls.name = name

    def __init__(self, engine: RagEngine) -> None:
        self.engine = engine
        reason = self.unavailable(engine.store, engine.store_settings)
        if reason:
            raise MissingAssets(reason)
        self.loaded = engine.model_at(self.model_dtype(engine.kv_dtype, engine.device))
        for kind in self.needs:
            engine.asset(kind)

    @classmethod
    def unavailable(cls, store: Store, settings: BuildSettings) -> str | None:
        """Why the method can never run on a store built with ``settings`` (the first asset it
        needs that such a store cannot hold: :meth:`Asset.unavailable`), or None."""
        for kind in cls.needs:
            reason = kind.unavailable(store, settings)
            if reason:
                return f"--method {cls.name} {reason}"
        return None

    @classmethod
    def model_dtype(cls, kv_dtype: str, device: str) -> str:
        """The dtype the method's model computes in: the store's KV dtype (the KV slices are
        used as stored; standard RAG computes in it too, so the methods compare)."""
        return kv_dtype

    @property
    def uses_kc(self) -> bool:
        return self.retrieval.uses_kc

    @property
    def uses_k(self) -> bool:
        return self.retrieval.uses_k

    def retrieval_key(self, kc: int, k: int, mode: str | None = None) -> Hashable:
        """Equal for two methods whose retrievals for ``(kc, k)`` in search mode ``mode``
        (default: the engine's) are the same."""
        return self.retrieval.key(kc, k, mode or self.engine.retrieval)

    def retrieve(
        self,
        question: str,
        kc: int,
        k: int,
        doc_ids: Sequence[str] | None = None,
        mode: str | None = None,
    ) -> Any:
        """The evidence :meth:`run` takes (``doc_ids``: retrieve among these documents only;
        ``mode``: the search mode, default the engine's)."""
        return self.retrieval(self.engine, question, kc, k, doc_ids, mode or self.engine.retrieval)

    @abstractmethod
    def run(
        self, question: str, retrieval: Any, kc: int, k: int, on_token: OnToken | None = None
    ) -> Answer:
        """Answer ``question`` from ``retrieval`` (what :meth:`retrieve` returned, evidence in
        context order); ``kc`` and ``k`` are recorded in the answer."""

    def answer(
        self,
        question: str,
        kc: int,
        k: int,
        *,
        doc_ids: Sequence[str] | None = None,
        on_token: OnToken | None = None,
        mode: str | None = None,
    ) -> Answer:
        """Retrieve (in search mode ``mode``, default the engine's), then :meth:`run`
        (``BlankQuestion``, a ValueError, for a blank question)."""
        require_question(question)
        found = self.retrieve(question, kc, k, doc_ids, mode)
        return self.run(question, found, kc, k, on_token)

    def finish(
        self,
        gen: Generation,
        timings: dict[str, float],
        evidence: list[dict[str, Any]],
        active_tokens: int,
        kc: int,
        k: int,
        *,
        mode: str,
    ) -> Answer:
        """The :class:`Answer` of ``gen``: ``timings`` holds ``retrieval``, ``kv_load`` and
        ``assembly``; ``prefill``, ``ttft`` (the four summed) and ``decode`` are added, each
        rounded to the microsecond; ``mode``: the search mode the evidence was found in."""
        spent = {**timings, "prefill": gen.prefill_ms}
        spent["ttft"] = spent["retrieval"] + spent["kv_load"] + spent["assembly"] + gen.prefill_ms
        spent["decode"] = gen.decode_ms
        return Answer(
            answer=gen.text,
            method=self.name,
            evidence=evidence,
            active_tokens=active_tokens,
            timings={key: round(v, 3) for key, v in spent.items()},
            kc=kc,
            k=k,
            model_fp=self.loaded.model_fp,
            retrieval=mode,
            token_ids=gen.token_ids,
        )
