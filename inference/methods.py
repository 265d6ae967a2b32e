"""The three RAG methods on one store's assets, with the same model and the same retrieval.

- ``standard``: prefill ``prefix ⊕ chunk tokens ⊕ query`` from scratch (no KV reuse);
- ``turborag``: load whole precomputed chunks' KV, re-rotated to contiguous positions after the
  cached prefix ``C_p``; prefill only the query;
- ``coinrag``: load only the retrieved nugget slices ``C_b[s:e]`` of those chunks, re-rotated
  likewise (``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ...``); prefill only the query.

A store built with ``kv_keep = "nuggets"`` holds only the KV of nugget spans: ``coinrag`` reads
them as from a store of whole chunks (the same bits), ``standard`` needs no KV, and ``turborag``
is refused with :class:`KvKeptNuggets` naming the setting.

Method code takes a :class:`~inference.retrieve.RetrievalResult` as input (:meth:`RagEngine.run`),
so any retriever plugs in unchanged; :meth:`RagEngine.answer` retrieves first (two-stage for
``coinrag``, top-kc chunks for the others).

Timings (milliseconds): ``retrieval`` (embedding + index search), ``kv_load``, ``assembly``
(rotation, concatenation, cache construction), ``prefill`` (query prefill up to the first
token's logits), ``ttft`` (the sum of those four) and ``decode`` (the remaining tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.compute as pc
import torch

from inference.assemble import KvSlice, assemble_context
from inference.encode import kv_layout, to_dynamic_cache
from inference.generate import prefill_and_decode
from inference.prompt import RagPrompt, require_question
from inference.retrieve import Evidence, RetrievalResult, Retriever
from inference.rope import RopeSpec
from schemas.settings import RAG_METHODS
from schemas.tables import ChunkRow
from storage.kv import CorruptKvEntry, KvStore, MissingKvEntry, UnstoredKvSlice
from storage.store import Store
from storage.tables import read_rows, read_table

METHODS = RAG_METHODS
WHOLE_CHUNK_METHODS = ("turborag",)  # load whole chunks' KV: need kv_keep = "chunks"


class MissingAssets(RuntimeError):
    """The store lacks what a method needs (KV, index): the message says which build step."""


class CorruptAssets(MissingAssets):
    """A stored KV entry (or the prompt prefix's) failed its check: never served; the message
    names the chunk and document and the build that recomputes it."""

    def __init__(self, store: Store, what: str, exc: CorruptKvEntry) -> None:
        super().__init__(
            f"the KV of {what} is corrupt ({exc.reason}, at kv/{exc.location}): "
            f"{repair_command(store)} recomputes it"
        )


class KvKeptNuggets(MissingAssets):
    """A method that needs whole chunks' KV (``turborag``) on a store that keeps only the KV of
    nugget spans (``kv_keep = "nuggets"``)."""

    def __init__(self, store: Store, method: str) -> None:
        super().__init__(
            f"--method {method} needs the KV of whole chunks, and store {store} keeps only the "
            f'KV of nugget spans (kv_keep = "nuggets"): use --method coinrag or standard, or '
            f'rebuild the store with --kv-keep chunks (kv_keep = "chunks")'
        )


def store_kv_keep(store: Store) -> str:
    """What the store's KV keeps of each chunk: its ``kv_keep`` setting (``STORE/coinrag.toml``,
    the published settings; ``"chunks"`` for a store built before the setting existed)."""
    from schemas.settings import settings_from_toml

    return settings_from_toml(store.read_toml(), store.uri(store.settings_path)).kv_keep


def methods_for(store: Store, methods: Sequence[str]) -> list[str]:
    """``methods`` the store's assets can run: all of them, less those that need whole chunks'
    KV (turborag) when it keeps only nugget spans."""
    if store_kv_keep(store) == "chunks":
        return list(methods)
    return [m for m in methods if m not in WHOLE_CHUNK_METHODS]


def repair_command(store: Store) -> str:
    """The build that repairs a store's KV: its last SOURCE, with the settings it was built with
    (``STORE/coinrag.toml``, for a local store)."""
    import json

    from schemas.tables import RunRow

    source = "SOURCE"
    try:
        runs = [r for r in read_rows(store, RunRow) if (r.flow, r.status) == ("build", "completed")]
        if runs:
            last = max(runs, key=lambda r: r.started_at)
            source = json.loads(last.parameters_json).get("source") or source
    except Exception:  # unreadable runs: the generic form still says what to run
        pass
    config = f" --config {store.uri(store.settings_path)}" if store.is_local else ""
    return f"`coinrag build {source} --store {store.url}{config}`"


def _no_kv_message(store: Store, model_fp: str, dtype: str) -> str:
    """Why a model cannot answer from ``store``: both fingerprints (the model asked for, the
    models the store's KV was built by, with their dtypes) and the ways out."""
    from storage.gc import kv_fps
    from storage.kv import KvError

    built: set[str] = set()
    for kv_fp in kv_fps(store):
        try:
            layout = KvStore.open(store, kv_fp).layout
        except (KvError, FileNotFoundError, KeyError):
            continue
        built.add(f"{layout.model_fp} ({layout.dtype})")
    have = (
        f"its KV was built by model {', '.join(sorted(built))}"
        if built
        else "it holds no KV at all (built with kv = false?)"
    )
    return (
        f"store {store} has no KV for model {model_fp} in {dtype}; {have}: query with the "
        "store's own model (no --model), or run `coinrag build SOURCE --store ... --model ... "
        f"--kv-dtype {dtype}` with this model first (or set kv_dtype in the store's coinrag.toml "
        "to the dtype it was built in)"
    )


@dataclass
class Answer:
    """One answered question."""

    answer: str
    method: str
    evidence: list[dict[str, Any]]  # {doc_id, chunk_id, tok_start, tok_end, text}
    active_tokens: int  # context tokens after the prompt prefix (KV-memory proxy)
    timings: dict[str, float]
    kc: int
    k: int
    model_fp: str = ""
    token_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_ids")
        return out


class RagEngine:
    """Model, prompt, KV store, index and retriever of one store, loaded once."""

    def __init__(
        self,
        store: Store,
        loaded: Any,
        embedder: Any,
        *,
        prompt: RagPrompt | None = None,
        max_new_tokens: int = 32,
        kv_keep: str | None = None,
    ) -> None:
        """``kv_keep``: what the store's KV keeps (``chunks`` | ``nuggets``; None: the store's
        setting, :func:`store_kv_keep`)."""
        self.store = store
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.prompt = prompt or RagPrompt.for_tokenizer(self.tokenizer)
        self.spec = RopeSpec.from_config(self.model.config)
        self.max_new_tokens = max_new_tokens
        try:
            layout = kv_layout(loaded, self.prompt, keep=kv_keep or store_kv_keep(store))
            self.kv = KvStore.open(store, layout.kv_fp, layout)
            self.prefix_kv, prefix_ids = self.kv.read_prefix()
        except CorruptKvEntry as exc:
            raise CorruptAssets(store, "the prompt prefix", exc) from exc
        except (MissingKvEntry, FileNotFoundError) as exc:
            raise MissingAssets(_no_kv_message(store, loaded.model_fp, layout.dtype)) from exc
        if prefix_ids != self.prompt.prefix_ids:
            raise MissingAssets("the stored prompt prefix differs from this prompt's")
        self.retriever = Retriever(store, embedder)
        self._chunk_ids: dict[str, list[int]] = {}

    @classmethod
    def open(
        cls,
        store_path: str,
        model: str | None = None,
        embedder: str | None = None,
        max_new_tokens: int = 32,
    ) -> RagEngine:
        """Load everything for ``store_path``; model and embedder default to the store's. The
        model computes in the store's ``kv_dtype`` (the dtype its KV was built in)."""
        from inference.embedders import load_embedder
        from inference.kv_dtype import resolve_kv_dtype
        from inference.models import load_model
        from schemas.settings import settings_from_toml

        store = Store.at(store_path)
        if not store.exists():
            raise MissingAssets(f"{store} is not a coinrag store (run coinrag build first)")
        settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
        dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        loaded = load_model(model or settings.model, device=settings.device, dtype=dtype)
        emb = load_embedder(embedder or settings.embedder)
        return cls(store, loaded, emb, max_new_tokens=max_new_tokens)

    # ------------------------------------------------------------------ assets

    def chunk_token_ids(self, chunk_ids: list[str]) -> dict[str, list[int]]:
        """Token ids of chunks (read once, then memoised)."""
        missing = [c for c in chunk_ids if c not in self._chunk_ids]
        if missing:
            table = read_table(
                self.store,
                ChunkRow,
                columns=["chunk_id", "token_ids"],
                filter=pc.field("chunk_id").isin(missing),
            )
            for cid, ids in zip(
                table.column("chunk_id").to_pylist(),
                table.column("token_ids").to_pylist(),
                strict=True,
            ):
                self._chunk_ids[cid] = ids
        return {c: self._chunk_ids[c] for c in chunk_ids}

    def assemble(
        self, evidence: Sequence[Evidence], n_query: int
    ) -> tuple[torch.Tensor, int, float]:
        """``(C_ctx, total, load seconds)``: the context of ``evidence`` (its KV slices, read
        from the store and re-rotated to contiguous positions after ``C_p``; ``(layers, 2,
        kv_heads, total, head_dim)`` in the store's dtype, ``total`` = ``|p|`` + the evidence's
        tokens) for a query of ``n_query`` tokens, and the seconds spent reading the KV.
        Raises :class:`MissingAssets` (no entry, or a span the store does not hold) or
        :class:`CorruptAssets`."""
        requests = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
        t0 = time.perf_counter()
        try:
            blocks = self.kv.read_slices(requests)
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
            raise CorruptAssets(self.store, what, exc) from exc
        load_s = time.perf_counter() - t0
        p = self.prompt.n_prefix
        slices = [
            KvSlice(block, p + e.tok_start, p + self.kv.chunk_tokens(e.content_key))
            for block, e in zip(blocks, evidence, strict=True)
        ]
        total = p + sum(s.tokens for s in slices)
        ctx = assemble_context(self.prefix_kv, slices, self.spec, new_seq_len=total + n_query)
        return ctx, total, load_s

    # ------------------------------------------------------------------ methods

    def retrieve(self, question: str, method: str, kc: int, k: int) -> RetrievalResult:
        if method == "coinrag":
            return self.retriever.two_stage(question, kc=kc, k=k)
        return self.retriever.chunks_only(question, kc=kc)

    def answer(self, question: str, method: str = "coinrag", kc: int = 4, k: int = 10) -> Answer:
        """Retrieve, then answer with ``method`` (``BlankQuestion``, a ValueError, for a blank
        question)."""
        require_question(question)
        if method not in METHODS:
            raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
        return self.run(question, method, self.retrieve(question, method, kc, k), kc=kc, k=k)

    def run(
        self, question: str, method: str, retrieval: RetrievalResult, kc: int = 0, k: int = 0
    ) -> Answer:
        """Answer from given retrieval results (evidence in assembly order)."""
        retrieval_ms = retrieval.embed_ms + retrieval.search_ms
        query_ids = self.prompt.query_ids(question)
        p = self.prompt.n_prefix
        timings = {"retrieval": retrieval_ms, "kv_load": 0.0, "assembly": 0.0}
        if method == "standard":
            chunk_ids = list(dict.fromkeys(e.chunk_id for e in retrieval.evidence))
            ids = self.chunk_token_ids(chunk_ids)
            context = [ids[c] for c in chunk_ids]
            gen = prefill_and_decode(
                self.model,
                self.tokenizer,
                None,
                0,
                self.prompt.standard_ids(context, question),
                max_new_tokens=self.max_new_tokens,
            )
            active = sum(len(c) for c in context)
        elif method in ("turborag", "coinrag"):
            if method in WHOLE_CHUNK_METHODS and not self.kv.layout.keeps_chunks:
                raise KvKeptNuggets(self.store, method)
            t0 = time.perf_counter()
            ctx, total, load_s = self.assemble(retrieval.evidence, len(query_ids))
            cache = to_dynamic_cache(
                ctx.to(next(self.model.parameters()).device), self.model.config
            )
            t2 = time.perf_counter()
            timings["kv_load"] = load_s * 1000
            timings["assembly"] = (t2 - t0 - load_s) * 1000
            gen = prefill_and_decode(
                self.model,
                self.tokenizer,
                cache,
                total,
                query_ids,
                max_new_tokens=self.max_new_tokens,
            )
            active = total - p
        else:
            raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
        timings["prefill"] = gen.prefill_ms
        timings["ttft"] = (
            timings["retrieval"] + timings["kv_load"] + timings["assembly"] + gen.prefill_ms
        )
        timings["decode"] = gen.decode_ms
        evidence = [
            {
                "doc_id": e.doc_id,
                "chunk_id": e.chunk_id,
                "tok_start": e.tok_start,
                "tok_end": e.tok_end,
                "text": e.text,
            }
            for e in retrieval.evidence
        ]
        return Answer(
            answer=gen.text,
            method=method,
            evidence=evidence,
            active_tokens=active,
            timings={key: round(v, 3) for key, v in timings.items()},
            kc=kc,
            k=k,
            model_fp=self.loaded.model_fp,
            token_ids=gen.token_ids,
        )
