"""The context ``C_ctx`` of a list of evidence, built one way for serving and for fine-tuning.

``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ...``: the prompt prefix's KV, then each evidence's
slice of its chunk's KV, re-rotated to contiguous positions (:func:`inference.context.assemble.
assemble_context`). Where the prefix's and the chunks' KV come from is the only difference
between the builders, and the one thing a subclass says (:meth:`ContextBuilder.load`):

- :class:`StoredKvContext`: read from the KV store, as the build computed them (the serving
  methods; fine-tuning in ``frozen`` mode). The stored prefix must be this prompt's
  (:class:`PrefixMismatch`); read errors (``storage.kv.MissingKvEntry``, ``CorruptKvEntry``,
  ``UnstoredKvSlice`` for a span a store of nugget spans does not hold) reach the caller, who
  says what to rebuild.
- :class:`LiveKvContext`: encoded inside the step by the model being trained (fine-tuning in
  ``live`` mode), with the encode path of the KV stage (``inference.model.encode``) in the caller's
  grad mode: gradients reach how the prefix and the chunks are encoded.

So the structure the model is trained on is the structure it serves (``tests/
test_finetune.py`` compares them tensor for tensor). ``FINETUNE_CONTEXTS`` maps the
fine-tuning mode (``schemas.settings.FINETUNE_MODES``) to its builder.

Shapes: KV blocks are ``(layers, 2, kv_heads, tokens, head_dim)`` (``storage/kv/layout.py``);
the built context is ``(layers, 2, kv_heads, T, head_dim)`` on the model's device, in the
model's dtype (stored KV in another dtype is cast), with ``T = |p| + Σ (e_i - s_i)``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import pyarrow.compute as pc
import torch

from coinrag.inference.context.assemble import KvSlice, place_slices, rotate_placed_keys
from coinrag.inference.model.encode import (
    cache_to_kv,
    causal_lm,
    compute_prefix_kv,
    forward_after_prefix,
)
from coinrag.inference.model.kv_transfer import (
    ResidentKv,
    host_buffer,
    on_cuda,
    resident_kv_bytes,
    to_device,
)
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.retrieval.retriever import Evidence
from coinrag.inference.rope import ForwardFrequencies, model_rope
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KvLayout, KvStore
from coinrag.storage.store import Store
from coinrag.storage.tables import read_table


class PrefixMismatch(ValueError):
    """The store's prompt prefix ``C_p`` was computed for another prompt than this one's."""


class ChunkTokens:
    """Token ids of a store's chunks, read once per chunk (then memoised)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._ids: dict[str, list[int]] = {}

    def __call__(self, chunk_ids: Sequence[str]) -> dict[str, list[int]]:
        """``{chunk_id: token ids}`` for ``chunk_ids`` (in that order)."""
        missing = [c for c in dict.fromkeys(chunk_ids) if c not in self._ids]
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
                self._ids[cid] = list(ids)
        return {c: self._ids[c] for c in chunk_ids}


class ContextBuilder(ABC):
    """Builds ``C_ctx`` for ``model`` and ``prompt`` from one store's evidence."""

    reads_stored_kv: ClassVar[bool] = False  # needs the store's KV (a build with kv = true)

    def __init__(self, store: Store, model: Any, prompt: RagPrompt) -> None:
        self.store = store
        self.model = model
        self.prompt = prompt
        self.spec = model_rope(causal_lm(model).config)
        self.chunk_token_ids = ChunkTokens(store)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @abstractmethod
    def load(self, evidence: Sequence[Evidence]) -> tuple[torch.Tensor, list[KvSlice]]:
        """``(C_p, slices)``: the prefix's KV ``(layers, 2, H, |p|, D)`` and one
        :class:`KvSlice` per evidence (in order), each at the positions it was encoded at."""

    def build(
        self, evidence: Sequence[Evidence], n_query: int, timings: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(C_ctx, total)``: the assembled KV ``(layers, 2, H, T, D)`` and ``T``, for a query
        of ``n_query`` tokens prefilled after it. ``timings`` (milliseconds) gets ``kv_load``
        (:meth:`load`) and ``assembly`` (rotation, concatenation, the move to the model's
        device and dtype) added."""
        t0 = time.perf_counter()
        prefix_kv, slices = self.load(evidence)
        t1 = time.perf_counter()
        total = self.prompt.n_prefix + sum(s.tokens for s in slices)
        ctx = self.place(prefix_kv, slices, new_seq_len=total + n_query)
        dtype = next(self.model.parameters()).dtype  # stored KV may be in another dtype
        ctx = ctx.to(self.device, dtype=dtype)
        if timings is not None:
            timings["kv_load"] = timings.get("kv_load", 0.0) + (t1 - t0) * 1000
            timings["assembly"] = timings.get("assembly", 0.0) + (time.perf_counter() - t1) * 1000
        return ctx, total

    def place(
        self, prefix_kv: torch.Tensor, slices: Sequence[KvSlice], *, new_seq_len: int
    ) -> torch.Tensor:
        """``C_p`` then the slices, re-rotated to the positions :meth:`slice_starts` gives
        them (the paper's ``Rot``); ``(layers, 2, H, |p| + Σ n_i, D)``."""
        starts = self.slice_starts(
            prefix_kv.shape[-2], [s.old_start for s in slices], [s.tokens for s in slices]
        )
        return place_slices(prefix_kv, slices, starts, self.spec, new_seq_len=new_seq_len)

    def slice_starts(
        self, n_prefix: int, old_starts: Sequence[int], lengths: Sequence[int]
    ) -> list[int]:
        """The position each slice's first token takes in ``C_ctx``: contiguous after ``C_p``
        (slice ``i`` at ``|p| + Σ_{j<i} n_j``), wherever it was encoded (``old_starts``)."""
        starts, at = [], n_prefix
        for n in lengths:
            starts.append(at)
            at += n
        return starts

    @classmethod
    @abstractmethod
    def for_finetuning(
        cls, store: Store, model: Any, prompt: RagPrompt, *, layout: KvLayout, pad_id: int
    ) -> ContextBuilder:
        """The builder fine-tuning uses for ``model`` (``layout``: the store's KV of the base
        model; ``pad_id``: right padding of batched chunks)."""


class StoredKvContext(ContextBuilder):
    """``C_p`` and the chunks' KV as the build stored them (read through ``storage.kv``; no
    gradients reach them)."""

    reads_stored_kv = True

    def __init__(self, store: Store, model: Any, prompt: RagPrompt, kv: KvStore) -> None:
        super().__init__(store, model, prompt)
        self.kv = kv
        self.prefix_kv, ids = kv.read_prefix()
        if list(ids) != list(prompt.prefix_ids):
            raise PrefixMismatch("the stored prompt prefix differs from this prompt's")
        budget = resident_kv_bytes()
        # on a GPU with kv_resident_bytes: hot slices stay on the device (inference/model/
        # kv_transfer.py); None: every slice read and the context assembled on the host
        self.resident = ResidentKv(budget) if budget and on_cuda(self.device) else None
        self._device_prefix: torch.Tensor | None = None

    @classmethod
    def for_finetuning(
        cls, store: Store, model: Any, prompt: RagPrompt, *, layout: KvLayout, pad_id: int
    ) -> StoredKvContext:
        return cls(store, model, prompt, KvStore.open(store, layout.kv_fp, layout))

    decodes_into_context: ClassVar[bool] = True  # build() decodes the slices into C_ctx

    def build(
        self, evidence: Sequence[Evidence], n_query: int, timings: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, int]:
        """:meth:`ContextBuilder.build` with each slice decoded straight into its place in
        ``C_ctx`` (``KvStore.read_slices_into``: no slice tensors, no concatenation) and all
        keys rotated at once (:func:`~coinrag.inference.context.assemble.rotate_placed_keys`), or,
        for keys stored at position 0 where the codec can (a quantized codec's compiled decode,
        one RoPE for every layer), each key rotated as it is decoded into place (no second pass
        over the context); the same values bit for bit either way
        (``tests/inference/test_kv_keep_codecs.py``). No gradient reaches
        stored KV, so this holds in any grad mode (fine-tuning's ``frozen`` contexts too). Where
        it does not apply (dynamic / longrope RoPE, a subclass that encodes its slices) the
        general path."""
        if not self.decodes_into_context or self.spec.seq_len_dependent:
            return super().build(evidence, n_query, timings)
        if self.resident is not None:
            return self.build_resident(evidence, timings)
        t0 = time.perf_counter()
        p = self.prompt.n_prefix
        lengths = [e.tok_end - e.tok_start for e in evidence]
        shape = self.kv.layout.entry_shape(p + sum(lengths))
        ctx = host_buffer(shape, self.prefix_kv.dtype, self.device)  # pinned for a GPU
        ctx[..., :p, :] = self.prefix_kv
        old_starts = [p + e.tok_start for e in evidence]
        new = _runs(self.slice_starts(p, old_starts, lengths), lengths)
        rope = None  # keys stored at position 0: rotated by the decode where the codec can
        if self.kv.layout.keys_at_zero:
            angles = self.spec.rotation_cos_sin(self.kv.layout.layers, new)
            rope = None if angles is None else (angles[0].numpy(), angles[1].numpy())
        requests = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
        rotated = self.kv.read_slices_into(requests, ctx[..., p:, :], rope=rope)
        t1 = time.perf_counter()
        if not rotated:
            if self.kv.layout.keys_at_zero:
                old = torch.zeros(sum(lengths), dtype=torch.long)
            else:
                old = _runs(old_starts, lengths)
            rotate_placed_keys(ctx, p, old, new, self.spec)
        ctx = to_device(ctx, self.device, next(self.model.parameters()).dtype)  # one copy
        if timings is not None:
            timings["kv_load"] = timings.get("kv_load", 0.0) + (t1 - t0) * 1000
            timings["assembly"] = timings.get("assembly", 0.0) + (time.perf_counter() - t1) * 1000
        return ctx, ctx.shape[-2]

    def build_resident(
        self, evidence: Sequence[Evidence], timings: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, int]:
        """:meth:`build` with the slices :attr:`resident` keeps on the device: the others read
        into one host buffer (pinned on a GPU) and copied once, kept, and the context
        assembled and its keys re-rotated where the model is (the same arithmetic as
        :meth:`build`, on that device)."""
        t0 = time.perf_counter()
        resident, device = self.resident, self.device
        assert resident is not None
        layout, p = self.kv.layout, self.prompt.n_prefix
        keys = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
        lengths = [e.tok_end - e.tok_start for e in evidence]
        found = [resident.get(k) for k in keys]
        missing = [i for i, f in enumerate(found) if f is None]
        if missing:
            shape = layout.entry_shape(sum(lengths[i] for i in missing))
            host = host_buffer(shape, layout.torch_dtype, device)
            self.kv.read_slices_into([keys[i] for i in missing], host)
            moved, at = to_device(host, device, layout.torch_dtype), 0
            for i in missing:
                found[i] = moved[..., at : at + lengths[i], :].clone()  # its own storage
                resident.put(keys[i], found[i])
                at += lengths[i]
        if self._device_prefix is None:
            self._device_prefix = self.prefix_kv.to(device)
        shape = layout.entry_shape(p + sum(lengths))
        ctx = torch.empty(shape, dtype=self.prefix_kv.dtype, device=device)
        ctx[..., :p, :] = self._device_prefix
        at = p
        for kv, n in zip(found, lengths, strict=True):
            ctx[..., at : at + n, :] = kv
            at += n
        t1 = time.perf_counter()
        old_starts = [p + e.tok_start for e in evidence]
        starts = self.slice_starts(p, old_starts, lengths)
        if layout.keys_at_zero:
            old = torch.zeros(sum(lengths), dtype=torch.long)
        else:
            old = _runs(old_starts, lengths)
        new = _runs(starts, lengths)
        rotate_placed_keys(ctx, p, old.to(device), new.to(device), self.spec)
        ctx = ctx.to(dtype=next(self.model.parameters()).dtype)
        if timings is not None:
            timings["kv_load"] = timings.get("kv_load", 0.0) + (t1 - t0) * 1000
            timings["assembly"] = timings.get("assembly", 0.0) + (time.perf_counter() - t1) * 1000
        return ctx, ctx.shape[-2]

    def load(self, evidence: Sequence[Evidence]) -> tuple[torch.Tensor, list[KvSlice]]:
        p = self.prompt.n_prefix
        requests = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
        blocks = self.kv.read_slices(requests) if requests else []
        at_zero = self.kv.layout.keys_at_zero
        slices = [  # the chunk's forward had |p| + its tokens (however few an entry keeps)
            KvSlice(block, p + e.tok_start, p + self.kv.chunk_tokens(e.content_key), at_zero)
            for block, e in zip(blocks, evidence, strict=True)
        ]
        return self.prefix_kv, slices


class LiveKvContext(ContextBuilder):
    """``C_p`` and the evidence's chunks encoded by ``model`` itself, in the caller's grad mode,
    as the KV stage encodes them (``inference.model.encode``): a fresh rotary state per forward, and
    one right-padded forward after ``C_p`` per run of chunks whose lengths give the same RoPE
    frequencies; the nugget slices are cut from that KV."""

    def __init__(self, store: Store, model: Any, prompt: RagPrompt, pad_id: int = 0) -> None:
        super().__init__(store, model, prompt)
        self.pad_id = pad_id

    @classmethod
    def for_finetuning(
        cls, store: Store, model: Any, prompt: RagPrompt, *, layout: KvLayout, pad_id: int
    ) -> LiveKvContext:
        return cls(store, model, prompt, pad_id)

    def load(self, evidence: Sequence[Evidence]) -> tuple[torch.Tensor, list[KvSlice]]:
        prefix_kv = compute_prefix_kv(self.model, self.prompt.prefix_ids, differentiable=True)
        chunk_kv = self._encode(prefix_kv, list(dict.fromkeys(e.chunk_id for e in evidence)))
        p = self.prompt.n_prefix
        slices = [
            KvSlice(
                chunk_kv[e.chunk_id][:, :, :, e.tok_start : e.tok_end],
                p + e.tok_start,
                p + chunk_kv[e.chunk_id].shape[-2],
            )
            for e in evidence
        ]
        return prefix_kv, slices

    def _encode(self, prefix_kv: torch.Tensor, chunk_ids: list[str]) -> dict[str, torch.Tensor]:
        """Each chunk's KV after ``C_p``: ``{chunk_id: (layers, 2, H, n_tokens, D)}``."""
        tokens = self.chunk_token_ids(chunk_ids)
        rows = [tokens[c] for c in chunk_ids]
        kvs = encode_after_prefix(self.model, prefix_kv, rows, self.pad_id)
        return dict(zip(chunk_ids, kvs, strict=True))


def encode_after_prefix(
    model: Any, prefix_kv: torch.Tensor, rows: Sequence[Sequence[int]], pad_id: int = 0
) -> list[torch.Tensor]:
    """Each row of token ids encoded alone right after ``C_p`` (positions ``|p|..``), as the KV
    stage encodes chunks: one right-padded forward per run of rows whose lengths give the same
    RoPE frequencies, in the caller's grad mode. Returns ``(layers, 2, H, len(row), D)`` per
    row, in order."""
    if not rows:
        return []
    p = prefix_kv.shape[-2]
    frequencies = ForwardFrequencies.from_config(causal_lm(model).config)
    encoded: list[torch.Tensor | None] = [None] * len(rows)
    for run in frequencies.batches([len(r) for r in rows], p, len(rows)):
        cache = forward_after_prefix(model, prefix_kv, [rows[i] for i in run], pad_id)
        kv = cache_to_kv(cache, start=p)  # right padding: causal, so harmless
        for b, i in enumerate(run):
            encoded[i] = kv[b, :, :, :, : len(rows[i])]
    return [e for e in encoded if e is not None]


class UnalignedContext(StoredKvContext):
    """The ``no position alignment`` ablation: the stored slices keep the positions their keys
    were encoded at (``|p| + s .. |p| + e - 1`` of their chunk), concatenated after ``C_p`` with
    no ``Rot``; the query still starts at ``T = |p| + Σ n_i``. Keys of two slices may then
    share positions, and a key may sit after the query's positions: that is the ablation."""

    @classmethod
    def sharing(cls, stored: StoredKvContext) -> UnalignedContext:
        """This builder over ``stored``'s KV store and ``C_p`` (nothing read again)."""
        new = cls.__new__(cls)
        new.__dict__.update(stored.__dict__)
        return new

    def slice_starts(
        self, n_prefix: int, old_starts: Sequence[int], lengths: Sequence[int]
    ) -> list[int]:
        return list(old_starts)


class IsolatedNuggetContext(StoredKvContext):
    """The ``isolated encoding`` ablation: each evidence span's tokens (a nugget's
    ``token_ids[s:e]`` of its chunk, not re-tokenised) encoded **alone** right after the stored
    ``C_p``, online, with no chunk context before it; then placed as CoinRAG places its slices.
    The encoding is in :meth:`build`'s ``kv_load`` time (so in TTFT)."""

    decodes_into_context = False  # its slices are encoded, not read

    @classmethod
    def sharing(cls, stored: StoredKvContext, pad_id: int) -> IsolatedNuggetContext:
        new = cls.__new__(cls)
        new.__dict__.update(stored.__dict__)
        new.pad_id = pad_id
        return new

    def load(self, evidence: Sequence[Evidence]) -> tuple[torch.Tensor, list[KvSlice]]:
        tokens = self.chunk_token_ids([e.chunk_id for e in evidence])
        rows = [tokens[e.chunk_id][e.tok_start : e.tok_end] for e in evidence]
        dtype = next(self.model.parameters()).dtype
        prefix_kv = self.prefix_kv.to(self.device, dtype=dtype)
        with torch.inference_mode():
            kvs = encode_after_prefix(self.model, prefix_kv, rows, self.pad_id)
        p = self.prompt.n_prefix
        return prefix_kv, [KvSlice(kv, p, p + kv.shape[-2]) for kv in kvs]


# Fine-tuning's mode (schemas.settings.FINETUNE_MODES) -> who encodes the context.
FINETUNE_CONTEXTS: dict[str, type[ContextBuilder]] = {
    "live": LiveKvContext,
    "frozen": StoredKvContext,
}


def _runs(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``(Σ n_i,)`` int64: ``starts[i] .. starts[i] + lengths[i] - 1`` for each run in turn."""
    if not lengths:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
