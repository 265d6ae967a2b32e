"""The ``upr`` reranker: the generation model's likelihood of the question given each chunk
(UPR: Sachan et al. 2022, "Improving Passage Retrieval with Zero-Shot Question Generation").

A chunk is scored by the mean log-probability of the question's tokens after the RAG prompt
holding that chunk alone, cut where the question starts::

    prefix_ids + chunk ids + "\\n\\nQuestion: " + [question tokens: scored]
    \\___ C_p ⊕ the chunk's KV: a ContextBuilder ___/ \\____ prefilled over it ____/

The chunk's KV is the store's (:class:`~inference.context.builders.StoredKvContext`: what
turborag reads, so only the cue and the question are prefilled per candidate) where the store
keeps whole chunks' KV, else encoded per query after ``C_p`` by the model
(:class:`~inference.context.builders.LiveKvContext`: one padded forward of all candidates,
seconds on a CPU). The model computes in the store's ``kv_dtype``.

A question asked again (``eval``'s kc sweep asks each question once per kc) is scored once per
chunk content: the scores are memoised by ``(question, content_key)`` (:data:`MEMO_SIZE`).

Why it works where the embedder fails (measured on the 497 pages of the Python docs, html
store, hybrid search, docs/retrieval.md): a user's question ("Which module parses command-line
options and generates the --help message?") shares few words with the answer's heading, but the
model reading the chunk finds the question likely. ``depth`` and ``weight`` were chosen on the
store's headings (synthetic questions on the ``fusion`` pages of
``tasks.retrieval.fusion.page_split``, their own chunks masked), never on an evaluation set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from coinrag.inference.context.builders import ContextBuilder, LiveKvContext, StoredKvContext
from coinrag.inference.model.encode import causal_lm, kv_layout, pad_id
from coinrag.inference.model.prompt import QUESTION_HEADER, RagPrompt
from coinrag.inference.retrieval.rerank import Reranker
from coinrag.inference.retrieval.retriever import Evidence

if TYPE_CHECKING:
    from coinrag.inference.model.loading import LoadedModel
    from coinrag.inference.retrieval.retriever import ChunkHit
    from coinrag.schemas.settings import BuildSettings
    from coinrag.storage.store import Store

MEMO_SIZE = 4096  # (question, chunk content) scores kept


def question_logprobs(
    model: Any, contexts: Sequence[torch.Tensor], cue: Sequence[int], question: Sequence[int]
) -> list[float]:
    """Mean log-probability of the ``question`` tokens after each context ``(layers, 2, H, T_i,
    D)`` and the ``cue`` tokens (at least one), in order: one batched forward of ``cue +
    question`` over all contexts.

    The contexts are right-padded to the longest (``T``) in one cache; the padding is masked
    out, and row ``i``'s query tokens sit at positions ``T_i ..`` (their RoPE positions), so
    each row computes what a forward over its own context alone computes (up to the rounding
    of another matmul shape)."""
    from transformers import DynamicCache

    lm = causal_lm(model)
    device = next(model.parameters()).device
    lengths = [c.shape[-2] for c in contexts]
    longest, n = max(lengths), len(cue) + len(question)
    layers, _, heads, _, dim = contexts[0].shape
    kv = contexts[0].new_zeros((layers, 2, len(contexts), heads, longest, dim))
    for b, ctx in enumerate(contexts):
        kv[:, :, b, :, : lengths[b]] = ctx
    cache = DynamicCache(config=lm.config)
    for layer in range(layers):
        cache.update(kv[layer, 0], kv[layer, 1], layer)
    mask = torch.zeros((len(contexts), longest + n), dtype=torch.long, device=device)
    for b, t in enumerate(lengths):
        mask[b, :t] = 1
    mask[:, longest:] = 1
    positions = torch.tensor([[t + j for j in range(n)] for t in lengths], device=device)
    ids = torch.tensor([[*cue, *question]] * len(contexts), dtype=torch.long, device=device)
    logits = lm(
        input_ids=ids, past_key_values=cache, attention_mask=mask, position_ids=positions
    ).logits
    # the logits at position j predict token j + 1: the question's from the cue's last token on
    predicting = logits[:, len(cue) - 1 : len(cue) - 1 + len(question)].float()
    target = torch.tensor(list(question), dtype=torch.long, device=device)
    logprobs = torch.log_softmax(predicting, dim=-1)
    picked = logprobs.gather(2, target.expand(len(contexts), -1)[..., None])[..., 0]
    return [float(v) for v in picked.mean(dim=1)]


class QueryLikelihood(Reranker, name="upr"):
    """Reorders a search's top :attr:`depth` chunks by :func:`question_logprobs` of the question
    given each (combined with the search's score, ``Reranker.rerank``), the chunks' KV from
    ``context``."""

    depth: ClassVar[int] = 8
    weight: ClassVar[float] = 0.85

    def __init__(self, context: ContextBuilder) -> None:
        self.context = context
        tokenizer = context.prompt.tokenizer
        self.cue = tokenizer.encode(QUESTION_HEADER, add_special_tokens=False)
        self._memo: OrderedDict[tuple[str, str], float] = OrderedDict()

    @classmethod
    def open(cls, context_of: Callable[[], Any]) -> QueryLikelihood:
        return cls(context_of())

    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        todo = list(
            {h.content_key: h for h in hits if (question, h.content_key) not in self._memo}.values()
        )
        if todo:
            self._score(question, todo)
        found = [self._memo[(question, h.content_key)] for h in hits]
        while len(self._memo) > MEMO_SIZE:
            self._memo.popitem(last=False)
        return found

    def _score(self, question: str, hits: Sequence[ChunkHit]) -> None:
        """Score ``hits`` (distinct contents) into the memo."""
        context = self.context
        ids = context.prompt.tokenizer.encode(question, add_special_tokens=False)
        if not ids:  # nothing to be likely: every chunk alike (the search's order stands)
            self._memo.update({(question, h.content_key): 0.0 for h in hits})
            return
        evidence = [
            Evidence(h.chunk_id, h.doc_id, h.content_key, 0, h.n_tokens, h.text, h.score)
            for h in hits
        ]
        dtype = next(context.model.parameters()).dtype
        with torch.no_grad():  # not inference mode: a live context encodes in the grad mode
            prefix_kv, slices = context.load(evidence)
            contexts = []
            for piece in slices:
                total = context.prompt.n_prefix + piece.tokens + len(self.cue) + len(ids)
                ctx = context.place(prefix_kv, [piece], new_seq_len=total)
                contexts.append(ctx.to(context.device, dtype=dtype))
            found = question_logprobs(context.model, contexts, self.cue, ids)
        for hit, score in zip(hits, found, strict=True):
            self._memo[(question, hit.content_key)] = score


def rerank_context(store: Store, settings: BuildSettings, loaded: LoadedModel) -> ContextBuilder:
    """The chunks' KV a reranker reads for ``loaded`` (the store's model at its ``kv_dtype``):
    the store's stored KV where it keeps whole chunks' KV for this model, else encoded live."""
    from coinrag.storage.kv import KvStore, MissingKvEntry

    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    if settings.kv and settings.kv_keep == "chunks":
        layout = kv_layout(loaded, prompt, kv_codec=settings.kv_codec, keep=settings.kv_keep)
        try:
            return StoredKvContext(
                store, loaded.model, prompt, KvStore.open(store, layout.kv_fp, layout)
            )
        except (MissingKvEntry, FileNotFoundError):
            pass  # no KV of this model yet: encode the candidates
    return LiveKvContext(store, loaded.model, prompt, pad_id(loaded.tokenizer))


def store_reranker(name: str, store: Store, settings: BuildSettings) -> Reranker | None:
    """The reranker ``name`` for ``store`` (built with ``settings``), its model (the store's, at
    the store's ``kv_dtype``, on its ``device``) loaded only by a reranker that reads it;
    None for ``none``."""
    from coinrag.inference.model.kv_dtype import resolve_kv_dtype
    from coinrag.inference.model.loading import load_model
    from coinrag.inference.retrieval.rerank import open_reranker

    def context() -> ContextBuilder:
        dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        loaded = load_model(settings.model, device=settings.device, dtype=dtype)
        return rerank_context(store, settings, loaded)

    return open_reranker(name, context)
