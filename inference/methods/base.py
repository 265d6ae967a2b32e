"""One interface for every RAG method: :class:`RagMethod`, its registry, and what it returns.

A method is a subclass of :class:`RagMethod` registered by name (``class CoinRag(KvReuseMethod,
name="coinrag")`` in ``inference/methods/coinrag.py`` fills ``METHODS["coinrag"]``, imported on
first look-up: :data:`METHODS` is ``RagMethod.registry``, the plug-in registry of
``schemas/registry.py``; ``schemas.settings.RAG_METHODS`` declares its names for the CLI, which
checks them before anything loads). A method declares

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
``run`` opens a :class:`Turn` (the call, with the retrieval's time and evidence rows) and hands
it to the method's own :meth:`RagMethod.generate`, which decodes; ``run`` then makes the
answer.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from coinrag.inference.model.generate import Generation
from coinrag.schemas.registry import Registered, Registry
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


@dataclass(frozen=True)
class RetrievalRequest:
    """What a :class:`Retrieval` is asked: the evidence for ``question``, with ``kc`` chunks
    (stage 1) and ``k`` nuggets or documents, among ``doc_ids``' chunks only (an oracle's gold
    documents; None: every document), ranked in search mode ``mode``
    (``schemas.settings.RETRIEVAL_MODES``)."""

    question: str
    kc: int
    k: int
    doc_ids: Sequence[str] | None
    mode: str


class Retrieval(ABC):
    """How a method finds its evidence for a question. Methods whose retrievals give the same
    :meth:`key` for ``(kc, k)`` can share one result (``coinrag eval`` retrieves once per
    question and key)."""

    uses_kc: ClassVar[bool] = False  # the result depends on kc (chunks of stage 1)
    uses_k: ClassVar[bool] = False  # the result depends on k (nuggets, documents)

    def used(self, kc: int, k: int) -> tuple[int, int]:
        """``(kc, k)`` as far as the result depends on them, 0 for what it does not use."""
        return (kc if self.uses_kc else 0, k if self.uses_k else 0)

    def key(self, kc: int, k: int, mode: str = "") -> Hashable:
        return (type(self).__name__, *self.used(kc, k), mode)

    @abstractmethod
    def __call__(self, engine: RagEngine, request: RetrievalRequest) -> Any:
        """The evidence ``request`` asks for (its type is what the method's ``run`` takes),
        with the time it took."""

    @abstractmethod
    def spent_ms(self, found: Any) -> float:
        """The time (ms) finding ``found`` took: embedding the question and searching."""

    @abstractmethod
    def evidence(self, found: Any) -> list[dict[str, Any]]:
        """The answer's evidence rows for ``found``, in context order."""


# Methods that live in a module of another name (a variant beside the method it varies).
METHOD_MODULES = {
    "cacheblend-v": "cacheblend",
    "coinrag-isolated": "coinrag_ablations",
    "coinrag-noalign": "coinrag_ablations",
    "coinrag-onestage": "coinrag_ablations",
}


@dataclass
class Turn:
    """One :meth:`RagMethod.run` under way: what it was given and what the answer gathers.

    ``found``: the retrieval result (what the method's :class:`Retrieval` returned, evidence in
    context order); ``kc``, ``k``: recorded in the answer (a method records what it used);
    ``on_token``: called with each answer token id as it is decoded; ``timings`` (ms):
    ``retrieval``, and ``kv_load`` and ``assembly`` the method adds its KV work to;
    ``evidence``: the answer's evidence rows; ``mode``: the search mode of the evidence."""

    question: str
    found: Any
    kc: int
    k: int
    on_token: OnToken | None
    timings: dict[str, float]
    evidence: list[dict[str, Any]]
    mode: str


class RagMethod(Registered, ABC):
    """A RAG method over one engine's model, prompt and assets.

    Subclass with ``name=...`` to register (in :data:`METHODS`); set ``needs`` and
    ``retrieval``; implement :meth:`generate`. Constructed by the engine (once per engine),
    which loads the method's model and assets then, so a missing asset fails when the engine
    opens, and loading is never in a timing.
    """

    registry: ClassVar[Registry[RagMethod]] = Registry(
        "RAG method",
        RAG_METHODS,
        modules={n: f"{__package__}.{METHOD_MODULES.get(n, n)}" for n in RAG_METHODS},
    )
    needs: ClassVar[tuple[type[Asset[Any]], ...]] = ()
    retrieval: ClassVar[Retrieval]

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
        request = RetrievalRequest(question, kc, k, doc_ids, mode or self.engine.retrieval)
        return self.retrieval(self.engine, request)

    def run(
        self, question: str, retrieval: Any, kc: int, k: int, on_token: OnToken | None = None
    ) -> Answer:
        """Answer ``question`` from ``retrieval`` (what :meth:`retrieve` returned, evidence in
        context order); ``kc`` and ``k`` are recorded in the answer. The answer is
        :meth:`generate`'s over a :class:`Turn` opened with the retrieval's time and evidence."""
        how = self.retrieval
        timings = {"retrieval": how.spent_ms(retrieval), "kv_load": 0.0, "assembly": 0.0}
        evidence = how.evidence(retrieval)
        turn = Turn(question, retrieval, kc, k, on_token, timings, evidence, retrieval.mode)
        gen, active_tokens = self.generate(turn)
        return self.finish(gen, turn, active_tokens)

    @abstractmethod
    def generate(self, turn: Turn) -> tuple[Generation, int]:
        """Decode the answer to ``turn`` (its KV work added to ``turn.timings``): the
        generation, and the active context tokens (after the prompt prefix: a KV-memory
        proxy)."""

    def fingerprint(self) -> str:
        """The model fingerprint answers carry: the loaded model's."""
        return self.loaded.model_fp

    def finish(self, gen: Generation, turn: Turn, active_tokens: int) -> Answer:
        """The :class:`Answer` of ``gen`` for ``turn``: its ``timings`` hold ``retrieval``,
        ``kv_load`` and ``assembly``; ``prefill``, ``ttft`` (the four summed) and ``decode`` are
        added, each rounded to the microsecond."""
        spent = {**turn.timings, "prefill": gen.prefill_ms}
        spent["ttft"] = spent["retrieval"] + spent["kv_load"] + spent["assembly"] + gen.prefill_ms
        spent["decode"] = gen.decode_ms
        return Answer(
            answer=gen.text,
            method=self.name,
            evidence=turn.evidence,
            active_tokens=active_tokens,
            timings={key: round(v, 3) for key, v in spent.items()},
            kc=turn.kc,
            k=turn.k,
            model_fp=self.fingerprint(),
            retrieval=turn.mode,
            token_ids=gen.token_ids,
        )


METHODS = RagMethod.registry
"""``name -> RagMethod subclass`` (``schemas.settings.RAG_METHODS``), filled by subclassing; a
method's module, ``inference/methods/<name>.py`` (or the one ``METHOD_MODULES`` names), is
imported when its name is first looked up, so a process imports only the methods it uses
(``coinrag query --method standard`` never imports the cartridge code). ``in`` imports nothing;
iterating imports every method."""
