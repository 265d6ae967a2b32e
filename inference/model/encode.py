"""Model-side KV: running the model to get KV, and converting transformers caches to tensors.

The layout every function here produces and takes is stated once, in
``storage/kv/layout.py``: one block is ``(layers, 2, kv_heads, tokens, head_dim)`` (index 0 of
dim 1 the keys, after RoPE, 1 the values), in the model's dtype. transformers holds the same
numbers per layer as ``cache.layers[i].keys`` / ``.values`` of shape ``(batch, kv_heads, seq,
head_dim)``; :func:`cache_to_kv` / :func:`from_cache` and :func:`to_dynamic_cache` /
:func:`prefix_cache` are the only conversions between the two.

Where a chunk's KV comes from (what the KV stage stores, ``tasks/kv.py``):
:func:`compute_chunk_kv` runs ``forward(chunk_ids, past_key_values=C_p)``, so the chunk attends to
the RAG prompt prefix ``p`` and sits at positions ``|p| .. |p| + n - 1``, exactly where it sits
when it is the first chunk after the prefix in a standard RAG prompt. ``C_p`` is
:func:`compute_prefix_kv`.

- Batching (:class:`KvBatching`): chunks of one batch are right-padded to the longest. Right
  padding leaves the real tokens' KV unchanged because attention is causal: a real token never
  attends to a later (padding) token, and positions start at ``|p|`` for every row, *provided
  the RoPE frequencies do not depend on the forward's length*. For ``dynamic`` and ``longrope``
  they do (a padded batch is one forward of length ``|p| + longest``), so a batch only holds
  chunks whose own lengths give the same frequencies (``inference.rope.ForwardFrequencies``):
  in practice every chunk of one length, or every chunk below the threshold.
- Every forward starts from a fresh rotary state (``inference.rope.reset_rotary``: dynamic NTK
  would otherwise keep frequencies grown by an earlier, longer forward). So each entry is what
  ``forward(chunk, past_key_values=C_p)`` gives alone, bit for bit with batch size 1, and up to
  float rounding in a batch (other matmul shapes round differently in the last bits;
  ``tests/inference/test_kv_store.py`` states the tolerance).
- ``C_p`` is expanded over the batch into a fresh ``DynamicCache`` per batch (forward appends to
  the cache it is given).
- The KV stage runs its batches through ``inference/model/kv_pipeline.py`` (the same forwards;
  on a CUDA device the copy of one batch's KV to host memory overlaps the next batch's forward).

Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``; ``inference.
layers``): every forward here runs on a cache that keeps every position of every layer
(:func:`full_cache`), so the stored block holds the chunk's **whole** KV in every layer, while
the model still applies its own masks, sliding ones included (the window is the mask's, not
the cache's). So a sliding layer's K/V of chunk token ``t`` are what one forward over ``prefix +
chunk`` gives it: computed from the positions ``|p| + t - W + 1 .. |p| + t`` of that forward
(through the layer's input, from a window of earlier layers too). For a chunk longer than the
window ``W`` its first tokens are out of its last tokens' window in that layer, and once the
chunk is assembled, a sliding layer of the query sees only the last ``W - 1`` positions of the
context (``inference/context/assemble.py``). transformers' own sliding cache would keep only the
last ``W - 1`` positions, which is why the model's default cache is never used to encode.

Cartridges (``training/cartridges.py``) use :func:`prefix_kv` and :func:`document_kv`: the same
prefix KV as a tensor autograd may use, and a document encoded right after the prefix in one
forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import ForwardFrequencies, ModelRope, reset_rotary
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KvLayout

# ---------------------------------------------------------------------------- the model


def causal_lm(model: Any) -> Any:
    """The transformers causal LM under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def decoder(model: Any) -> Any:
    """The transformer without the LM head (``Qwen2Model`` / ``LlamaModel``; under a peft
    wrapper too): no logits are needed to get the cache."""
    lm = causal_lm(model)
    base = getattr(lm, "base_model", None)
    return base if base is not None and base is not lm else lm


def pad_id(tokenizer: Any) -> int:
    """The id right padding uses: the tokenizer's pad token, else its eos token, else 0 (with
    causal attention and right padding the value never changes a real token's KV)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


@dataclass(frozen=True)
class KvModel:
    """What a KV layout needs of a model: its config (dims), fingerprint and dtype; no weights
    (``tasks/kv_space.py`` projects a build's KV from these alone)."""

    config: Any  # a transformers config
    model_fp: str
    dtype: str  # "float32", "bfloat16", ...

    @classmethod
    def of(cls, loaded: Any) -> KvModel:
        """The model of ``loaded`` (``inference.model.loading.LoadedModel``; dtype from its
        weights)."""
        if isinstance(loaded, KvModel):
            return loaded
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        return cls(loaded.model.config, loaded.model_fp, dtype)


def kv_layout(model: Any, prompt: RagPrompt, **options: Any) -> KvLayout:
    """The KV layout of a model and prompt: the one function every writer and reader of a
    build's KV gets it from (the KV stage, its workers, the disk-space check, the query
    engine, training). ``model``: a loaded model (``inference.model.loading.LoadedModel``) or a
    :class:`KvModel`; ``options``: ``kv_codec``, ``keep``, ``block_tokens``,
    ``slots_per_shard`` (``tasks.kv.KvOptions.layout_options``)."""
    m = KvModel.of(model)
    return KvLayout.for_config(m.config, m.model_fp, prompt.prefix_sha, m.dtype, **options)


# ---------------------------------------------------------------------------- cache <-> tensor


def cache_to_kv(cache: Any, start: int = 0) -> torch.Tensor:
    """A transformers cache as ``(batch, layers, 2, kv_heads, seq - start, head_dim)``.

    One copy (a single stack over layers and K/V), whatever the number of layers.
    """
    parts = []
    for layer in cache.layers:
        parts += (layer.keys[:, :, start:], layer.values[:, :, start:])
    stacked = torch.stack(parts, dim=1)  # (batch, 2 * layers, heads, seq, dim)
    batch, _, heads, seq, dim = stacked.shape
    return stacked.view(batch, len(cache.layers), 2, heads, seq, dim)


def from_cache(cache: Any, batch_index: int = 0) -> torch.Tensor:
    """``(layers, 2, kv_heads, T, head_dim)`` of one batch row of a transformers cache."""
    return cache_to_kv(cache)[batch_index]


def full_cache() -> Any:
    """An empty ``DynamicCache`` whose layers keep every position (none is a sliding-window
    layer, whatever the model): what the encoding forwards run on, so the cache holds the
    whole KV of every layer. The model's sliding masks still apply (they come from its
    config, not from the cache)."""
    from transformers import DynamicCache

    return DynamicCache()


def to_dynamic_cache(kv: torch.Tensor, config: Any | None) -> Any:
    """A batch-1 ``DynamicCache`` holding ``kv`` ``(layers, 2, kv_heads, T, head_dim)``.

    With the model's ``config`` it is the cache the model builds for itself: a sliding layer
    keeps the last ``W - 1`` positions (``DynamicSlidingWindowLayer``), so a query prefilled
    after it attends to what one forward over the whole context would show it. With
    ``config=None`` every layer keeps every position (:func:`full_cache`; for forwards that
    pass their own per-layer masks, KVLink)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    return cache


def prefix_cache(model: Any, prefix_kv: torch.Tensor, batch: int) -> Any:
    """A fresh cache holding ``C_p`` (``(layers, 2, H, P, D)``) for ``batch`` rows, every
    position of every layer kept (:func:`full_cache`)."""
    cache = full_cache()
    for i in range(prefix_kv.shape[0]):
        k = prefix_kv[i, 0].unsqueeze(0).expand(batch, -1, -1, -1)
        v = prefix_kv[i, 1].unsqueeze(0).expand(batch, -1, -1, -1)
        cache.update(k, v, i)
    return cache


# ---------------------------------------------------------------------------- the prefix


def compute_prefix_kv(
    model: Any, prefix_ids: Sequence[int], *, differentiable: bool = False
) -> torch.Tensor:
    """``C_p``: the KV of the prompt prefix alone, ``(layers, 2, kv_heads, |p|, head_dim)``:
    an inference-mode tensor (next to tensors that need gradients use :func:`prefix_kv`), or,
    ``differentiable``, computed in the caller's grad mode (gradients reach the encoding: the
    fine-tuning's live context, ``inference/context/builders.py``)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prefix_ids)], dtype=torch.long, device=device)
    reset_rotary(model)
    with torch.inference_mode(not differentiable):
        out = decoder(model)(input_ids=ids, past_key_values=full_cache(), use_cache=True)
    return cache_to_kv(out.past_key_values)[0]


def prefix_kv(model: Any, prompt: RagPrompt) -> torch.Tensor:
    """``C_p`` of ``prompt`` as a plain tensor (usable next to tensors that need gradients):
    :func:`compute_prefix_kv`, copied out of inference mode."""
    return compute_prefix_kv(model, prompt.prefix_ids).clone()


def document_kv(model: Any, prompt: RagPrompt, doc_ids: Sequence[int]) -> torch.Tensor:
    """KV of ``doc_ids`` encoded right after the prompt prefix (positions ``|p|..``), in one
    forward over prefix and document: ``(layers, 2, kv_heads, len(doc_ids), head_dim)``."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt.prefix_ids) + list(doc_ids)], device=device)
    reset_rotary(model)
    with torch.no_grad():
        out = decoder(model)(input_ids=ids, past_key_values=full_cache(), use_cache=True)
    return from_cache(out.past_key_values)[..., prompt.n_prefix :, :].clone()


# ---------------------------------------------------------------------------- chunks


@dataclass(frozen=True)
class KvBatching:
    """How a group of chunks is cut into forward passes: consecutive runs of at most
    ``batch_size`` chunks whose forwards after ``prefix_tokens`` tokens use the same RoPE
    frequencies (for ``default`` / ``linear`` / ``yarn`` / ``llama3`` RoPE simply every
    ``batch_size`` chunks). Picklable: the flow process of a distributed build counts the
    workers' batches with it.

    E.g. dynamic NTK with ``max_position_embeddings`` 64, a 5-token prefix, batch size 4:
    chunks of 80, 80, 70, 30, 20 tokens -> batches [80, 80], [70], [30, 20].
    """

    batch_size: int
    prefix_tokens: int
    frequencies: ForwardFrequencies

    @classmethod
    def for_model(cls, model: Any, prefix_tokens: int, batch_size: int) -> KvBatching:
        return cls(batch_size, prefix_tokens, ForwardFrequencies.from_config(model.config))

    def split(self, group: Sequence[ChunkRow]) -> list[list[ChunkRow]]:
        """The batches of ``group``, in its order."""
        runs = self.frequencies.batches(
            [c.n_tokens for c in group], self.prefix_tokens, self.batch_size
        )
        return [[group[i] for i in run] for run in runs]


def right_padded(rows: Sequence[Sequence[int]], pad: int, device: Any) -> torch.Tensor:
    """``(len(rows), longest)`` token ids, right-padded with ``pad``, on ``device``: copied
    there without waiting for the device's queued work (on a GPU the KV pipeline launches the
    next batch while the previous one still runs; a CPU tensor is returned as made)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids.to(device, non_blocking=True)


def forward_after_prefix(
    model: Any, prefix_kv: torch.Tensor, rows: Sequence[Sequence[int]], pad_id: int = 0
) -> Any:
    """One forward of ``rows`` (token ids, right-padded to the longest with ``pad_id``) after
    ``C_p`` (``(layers, 2, H, |p|, D)``), at positions ``|p|..`` in every row, from a fresh
    rotary state, in the caller's grad mode. Returns the transformers cache: ``|p| + longest``
    tokens per row; ``cache_to_kv(cache, start=|p|)[b, ..., :len(rows[b]), :]`` is row ``b``'s
    KV (the padding after it never changes it: attention is causal).

    The one chunk forward of the KV stage (:func:`compute_chunk_kv`, in inference mode) and of
    fine-tuning's live context (``inference/context/builders.py``, with gradients).
    """
    device = next(model.parameters()).device
    p = prefix_kv.shape[-2]
    ids = right_padded(rows, pad_id, device)
    positions = torch.arange(p, p + ids.shape[1], device=device)[None].expand(len(rows), -1)
    cache = prefix_cache(causal_lm(model), prefix_kv.to(device), len(rows))
    reset_rotary(model)
    out = decoder(model)(
        input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True
    )
    return out.past_key_values


def check_one_frequency(model: Any, prefix_tokens: int, batch: Sequence[ChunkRow]) -> None:
    """ValueError when the chunks of ``batch`` after ``prefix_tokens`` need different RoPE
    frequencies (dynamic / longrope: one padded forward would give the shorter ones wrong keys;
    :class:`KvBatching` forms batches that do not)."""
    frequencies = ForwardFrequencies.from_config(model.config)
    if len({frequencies.key(prefix_tokens + c.n_tokens) for c in batch}) > 1:
        raise ValueError(
            f"chunks of {sorted({c.n_tokens for c in batch})} tokens after a "
            f"{prefix_tokens}-token prefix need different RoPE frequencies "
            f"({frequencies.thresholds}): one padded forward would give the shorter ones wrong "
            "keys; batch them with KvBatching"
        )


def compute_chunk_kv(
    model: Any,
    prefix_kv: torch.Tensor,
    batch: Sequence[ChunkRow],
    pad_id: int = 0,
    timings: dict[str, float] | None = None,
) -> list[torch.Tensor]:
    """Each chunk's KV after ``C_p``: ``[(layers, 2, kv_heads, n_tokens, head_dim), ...]``.

    One batched forward (right-padded to the longest chunk), from a fresh rotary state;
    ``timings`` accumulates ``forward`` and ``extract`` seconds. Raises ValueError for a batch
    whose chunks need different RoPE frequencies (dynamic / longrope: see :class:`KvBatching`).
    """
    t0 = time.perf_counter()
    p = prefix_kv.shape[3]
    check_one_frequency(model, p, batch)
    with torch.inference_mode():
        cache = forward_after_prefix(model, prefix_kv, [c.token_ids for c in batch], pad_id)
    t1 = time.perf_counter()
    kv = cache_to_kv(cache, start=p).cpu()
    if timings is not None:
        timings["forward"] = timings.get("forward", 0.0) + t1 - t0
        timings["extract"] = timings.get("extract", 0.0) + time.perf_counter() - t1
    return [kv[b, :, :, :, : c.n_tokens] for b, c in enumerate(batch)]


def keys_to_position_zero(kv: torch.Tensor, spec: ModelRope, start: int) -> torch.Tensor:
    """A chunk's KV as computed (keys after RoPE at ``start .. start + n - 1``, in a forward
    of length ``start + n``) -> float32, keys rotated back to position 0: the frame of a
    quantized store (``storage/kv/layout.py``; KVQuant: per-channel key quantization before
    RoPE). Exact up to float32 rounding; values unchanged.

    E.g. a 40-token chunk after a 21-token prefix: its key ``t`` is rotated by ``-a(21 + t)``
    at the frequencies of a 61-token forward (``inference.rope``: those of dynamic NTK and
    longrope depend on it)."""
    n = kv.shape[3]
    old = torch.arange(start, start + n)
    keys = spec.rotate_layers(
        kv[:, 0].to(torch.float32),
        old,
        torch.zeros(n, dtype=torch.long),
        old_seq_len=start + n,
        new_seq_len=1,
    )
    return torch.stack([keys, kv[:, 1].to(torch.float32)], dim=1)


def bare_forward_seconds(
    loaded: Any, chunks: Sequence[ChunkRow], batch_size: int = 4, repeats: int = 1
) -> float:
    """Seconds of the model forward alone over ``chunks``, batched as the KV stage batches
    them (no prefix, no cache kept, nothing stored): the floor the stage is compared with."""
    model = loaded.model
    device = next(model.parameters()).device
    pad = pad_id(loaded.tokenizer)
    ordered = sorted(chunks, key=lambda c: -c.n_tokens)
    batching = KvBatching.for_model(model, 0, batch_size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for batch in batching.split(ordered):
            ids = right_padded([c.token_ids for c in batch], pad, device)
            reset_rotary(model)
            with torch.inference_mode():
                decoder(model)(input_ids=ids, use_cache=False)
        best = min(best, time.perf_counter() - t0)
    return best
