"""Cartridge RAG (CAS section 3): select ``k`` documents, load their trained cartridges from the
store, concatenate them after the prompt prefix, prefill only the query, decode.

The context is ``C_p ⊕ Rot(Z_1; |p|) ⊕ Rot(Z_2; |p| + p_1) ⊕ ...``: the same assembly function
the cartridges were trained with (``inference.context.assemble.assemble_cartridges``: cartridges are
stored at canonical positions and re-rotated to contiguous slots), so serving sees the structure
training saw. Selection: ``doc_ids`` given, or the top-``k`` documents of a retriever
(``inference.retrieval.retriever.Retriever.documents(question, k)``, anything with that method
works), kept in retrieval order. :meth:`CartridgeRag.oracle` loads the right document's cartridge
only.

Which cartridges: the newest stored version per document of one ``cartridge_fp``. Without one
given, the ``cartridge_fp`` of the most recently written version in the store is used (the last
training run). A cartridge trained after another prompt prefix is refused.

Token accounting, per answer: ``context_tokens = |p| + Σ p_i`` (what the model attends over and
holds as KV), ``query_tokens`` (prefilled), ``prompt_tokens`` = both. :func:`text_rag_answer`
gives the text-RAG baseline on the same prompt (``prefix + doc tokens + query``, one prefill).

As a method of the engine (:class:`CartridgeMethod`, ``--method cartridge``): the store's
cartridges are an asset (:class:`Cartridges`, a local store's only), retrieval is
:class:`TopDocuments` (``k`` documents that have a cartridge; ``kc`` unused), and the model
computes in the dtype cartridges are trained in (``inference.model.loading.default_dtype``), which
may differ from the store's KV dtype.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from coinrag.inference.context.assemble import assemble_cartridges
from coinrag.inference.methods.base import (
    Asset,
    OnToken,
    RagMethod,
    Retrieval,
    RetrievalRequest,
    Turn,
)
from coinrag.inference.model.encode import prefix_kv
from coinrag.inference.model.generate import Generation, prefill_and_decode
from coinrag.inference.model.loading import LoadedModel, default_dtype
from coinrag.inference.model.prompt import RagPrompt, require_question
from coinrag.inference.rope import model_rope
from coinrag.schemas.settings import DEFAULT_QUERY
from coinrag.schemas.tables import CartridgeManifestRow
from coinrag.storage.cartridges import CartridgeStore, MissingCartridge, version_order
from coinrag.storage.store import Store

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine


@dataclass
class CartridgeAnswer:
    """An answer and what it cost."""

    answer: str
    token_ids: list[int]
    doc_ids: list[str]
    cartridge_ids: list[str]
    context_tokens: int  # |p| + Σ p_i
    query_tokens: int
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.query_tokens


class CartridgeRag:
    """Answers questions from the cartridges of one store and one generation model."""

    def __init__(
        self,
        store: Store,
        loaded: LoadedModel,
        *,
        prompt: RagPrompt | None = None,
        cartridge_fp: str | None = None,
        retriever: Any = None,
        keep_loaded: bool = True,
    ) -> None:
        self.loaded = loaded
        self.prompt = prompt or RagPrompt.for_tokenizer(loaded.tokenizer)
        self.rope = model_rope(loaded.model.config)
        self.cstore = CartridgeStore.open(store, loaded.model_fp)
        latest = self.cstore.latest(cartridge_fp)
        if not latest:
            raise MissingCartridge(
                f"no stored cartridges for model {loaded.model_fp}"
                + (f" and cartridge_fp {cartridge_fp}" if cartridge_fp else "")
            )
        if cartridge_fp is None:  # the last training run's
            newest = max(latest.values(), key=lambda r: version_order(r.location)[1])
            cartridge_fp = newest.cartridge_fp
        self.cartridge_fp = cartridge_fp
        self.rows: dict[str, CartridgeManifestRow] = {}
        for row in sorted(latest.values(), key=lambda r: version_order(r.location)):
            if row.cartridge_fp == cartridge_fp:
                self.rows[row.doc_id] = row
        bad = {r.prefix_sha for r in self.rows.values()} - {self.prompt.prefix_sha}
        if bad:
            raise ValueError(
                f"cartridges {cartridge_fp} were trained after prompt prefix {sorted(bad)}, "
                f"not {self.prompt.prefix_sha}: use the system prompt they were trained with"
            )
        self.retriever = retriever
        self.keep_loaded = keep_loaded
        self._loaded_kv: dict[str, torch.Tensor] = {}
        self._device = next(loaded.model.parameters()).device
        self.prefix = prefix_kv(loaded.model, self.prompt)

    @property
    def doc_ids(self) -> list[str]:
        """Documents that have a cartridge."""
        return sorted(self.rows)

    def cartridge(self, doc_id: str) -> torch.Tensor:
        """The cartridge of ``doc_id`` ``(layers, 2, kv_heads, p, head_dim)`` on the device."""
        kv = self._loaded_kv.get(doc_id)
        if kv is None:
            row = self.rows.get(doc_id)
            if row is None:
                raise MissingCartridge(f"document {doc_id!r} has no cartridge {self.cartridge_fp}")
            kv = self.cstore.read(row).to(self._device)
            if self.keep_loaded:
                self._loaded_kv[doc_id] = kv
        return kv

    def select(
        self, question: str, k: int, retriever: Any = None, mode: str | None = None
    ) -> tuple[list[str], float]:
        """Top-``k`` document ids from the retriever (``retriever``, else this one's; best
        first), ranked in search mode ``mode`` (default: the retriever's), and the time it
        took (ms)."""
        retriever = retriever or self.retriever
        if retriever is None:
            raise ValueError("no retriever: pass doc_ids")
        t0 = time.perf_counter()
        # Only documents with a trained cartridge can be loaded: over-fetch, keep those, best
        # first (a store where few documents have cartridges still answers).
        fetch = k
        while True:
            hits = retriever.documents(question, fetch, mode=mode)
            chosen = [h["doc_id"] for h in hits if h["doc_id"] in self.rows][:k]
            if len(chosen) == k or len(hits) < fetch:
                break
            fetch *= 4
        if not chosen:
            raise MissingCartridge(
                f"none of the retrieved documents has a cartridge {self.cartridge_fp}"
            )
        return chosen, (time.perf_counter() - t0) * 1000.0

    def answer(
        self,
        question: str,
        doc_ids: Sequence[str] | None = None,
        *,
        k: int = 2,
        max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
        on_token: OnToken | None = None,
    ) -> CartridgeAnswer:
        """Answer with the cartridges of ``doc_ids`` (in that order), or of the retriever's top
        ``k`` documents (``BlankQuestion``, a ValueError, for a blank question); ``on_token``
        gets each answer token id as it is decoded."""
        require_question(question)
        t0 = time.perf_counter()
        retrieve_ms = 0.0
        if doc_ids is None:
            doc_ids, retrieve_ms = self.select(question, k)
        doc_ids = list(doc_ids)
        t1 = time.perf_counter()
        carts = [self.cartridge(d) for d in doc_ids]
        t2 = time.perf_counter()
        with torch.no_grad():
            ctx = assemble_cartridges(self.prefix, carts, self.rope)
        t3 = time.perf_counter()
        query = self.prompt.query_ids(question)
        gen = prefill_and_decode(
            self.loaded.model,
            self.loaded.tokenizer,
            ctx,
            int(ctx.shape[-2]),
            query,
            max_new_tokens=max_new_tokens,
            on_token=on_token,
        )
        return CartridgeAnswer(
            answer=gen.text,
            token_ids=gen.token_ids,
            doc_ids=doc_ids,
            cartridge_ids=[self.rows[d].cartridge_id for d in doc_ids],
            context_tokens=int(ctx.shape[-2]),
            query_tokens=len(query),
            timings={
                "retrieve_ms": retrieve_ms,
                "load_ms": (t2 - t1) * 1000.0,
                "assemble_ms": (t3 - t2) * 1000.0,
                "prefill_ms": gen.prefill_ms,
                "decode_ms": gen.decode_ms,
                "total_ms": (time.perf_counter() - t0) * 1000.0,
            },
        )

    def oracle(
        self, question: str, doc_id: str, *, max_new_tokens: int = DEFAULT_QUERY.max_new_tokens
    ) -> CartridgeAnswer:
        """Answer with the right document's cartridge only."""
        return self.answer(question, [doc_id], max_new_tokens=max_new_tokens)


def text_rag_answer(
    loaded: LoadedModel,
    prompt: RagPrompt,
    docs: Sequence[Sequence[int]],
    question: str,
    *,
    doc_ids: Sequence[str] = (),
    max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
) -> CartridgeAnswer:
    """Text RAG on the same prompt: prefill ``prefix + doc tokens (in order) + query`` at once."""
    ids = prompt.standard_ids(docs, question)
    query = len(prompt.query_ids(question))
    t0 = time.perf_counter()
    gen = prefill_and_decode(
        loaded.model, loaded.tokenizer, None, 0, ids, max_new_tokens=max_new_tokens
    )
    return CartridgeAnswer(
        answer=gen.text,
        token_ids=gen.token_ids,
        doc_ids=list(doc_ids),
        cartridge_ids=[],
        context_tokens=len(ids) - query,
        query_tokens=query,
        timings={
            "prefill_ms": gen.prefill_ms,
            "decode_ms": gen.decode_ms,
            "total_ms": (time.perf_counter() - t0) * 1000.0,
        },
    )


# ---------------------------------------------------------------------------- the method


class Cartridges(Asset[CartridgeRag]):
    """The store's newest cartridges for the engine's model in the dtype they are trained in
    (a local store's only)."""

    @classmethod
    def load(cls, engine: RagEngine) -> CartridgeRag:
        engine.store.require_local("reading cartridges")
        loaded = engine.model_at(CartridgeMethod.model_dtype(engine.kv_dtype, engine.device))
        return CartridgeRag(engine.store, loaded, prompt=engine.prompt)


@dataclass(frozen=True)
class DocumentSelection:
    """The documents whose cartridges make the context, in context order."""

    doc_ids: list[str]
    ms: float  # the time retrieval took
    mode: str = ""  # the search mode that ranked the documents


class TopDocuments(Retrieval):
    """The top-``k`` documents that have a cartridge (:meth:`CartridgeRag.select`, over the
    engine's index); ``doc_ids`` given: those documents, in order, without a search (the
    oracle)."""

    uses_k = True

    def __call__(self, engine: RagEngine, request: RetrievalRequest) -> DocumentSelection:
        if request.doc_ids is not None:
            return DocumentSelection(list(request.doc_ids), 0.0, request.mode)
        from coinrag.inference.methods.assets import Index

        chosen, ms = engine.asset(Cartridges).select(
            request.question, request.k, engine.asset(Index), request.mode
        )
        return DocumentSelection(chosen, ms, request.mode)

    def spent_ms(self, found: DocumentSelection) -> float:
        return found.ms

    def evidence(self, found: DocumentSelection) -> list[dict[str, Any]]:
        """``{doc_id}`` per document (the method adds its ``cartridge_id``)."""
        return [{"doc_id": d} for d in found.doc_ids]


class CartridgeMethod(RagMethod, name="cartridge"):
    """Cartridge RAG through the engine: the selected documents' cartridges after ``C_p``;
    evidence ``{doc_id, cartridge_id}``; the answer records ``kc = 0`` and ``k`` = the
    documents used."""

    needs = (Cartridges,)  # the index only when a question is searched (not for an oracle)
    retrieval = TopDocuments()

    @classmethod
    def model_dtype(cls, kv_dtype: str, device: str) -> str:
        return default_dtype(device)

    def generate(self, turn: Turn) -> tuple[Generation, int]:
        rag = self.engine.asset(Cartridges)
        got = rag.answer(
            turn.question,
            turn.found.doc_ids,
            max_new_tokens=self.engine.max_new_tokens,
            on_token=turn.on_token,
        )
        t = got.timings
        turn.timings.update(kv_load=t["load_ms"], assembly=t["assemble_ms"])
        for row, cartridge_id in zip(turn.evidence, got.cartridge_ids, strict=True):
            row["cartridge_id"] = cartridge_id
        turn.kc, turn.k = 0, len(got.doc_ids)
        gen = Generation(got.token_ids, got.answer, t["prefill_ms"], t["decode_ms"])
        return gen, got.context_tokens - rag.prompt.n_prefix
