"""The model forward of query prefill and greedy decoding: which implementation runs it.

``inference.model.generate`` (the one place where every method prefills its query and decodes) asks
:func:`forward_for` for the model's :class:`ModelForward` and runs a :class:`ForwardRun`: one
sequence, ``prefill(ids)`` then ``step(token)`` per answer token, each returning the next-token
logits ``(vocab,)`` float32 of the **last** position only (no logits over the vocabulary for
the other query positions: on SmolLM2 that head alone is 49,152 x 576 per position).

The implementations (chosen by subclass; :func:`use_forward` sets a model's, from the
``forward`` setting of ``schemas.settings``):

- :class:`StaticForward` ("eager", the default where supported): a preallocated KV buffer
  (:class:`KvBuffer`: per layer a keys and a values tensor ``(1, kv_heads, capacity,
  head_dim)``), one per capacity bucket, reused across queries. The assembled context
  ``(layers, 2, kv_heads, T, head_dim)`` (``storage/kv/layout.py``) is copied into it once (the
  ``DynamicCache`` copied it at its first update too), and the model's own decoder layers
  (transformers' modules, weights and attention interface) are driven over it: each layer
  writes its new keys and values in place at their positions (no concatenation per step) and
  attends to the positions written so far; a single query (a decode step) attends by two
  float32 matmuls (:func:`static_attention`).
- :class:`CompiledForward` ("compiled"): the same step under ``torch.compile`` (inductor,
  ``fullgraph=True``: a graph break is an error, never a silent fallback), with static shapes:
  the capacity is a bucket (:func:`capacity_bucket`) and the query is right-padded to a bucket
  (:func:`query_bucket`), so a served stream of questions repeats a few shapes. Padding is
  harmless: attention is causal, and a padded position is overwritten by the next token before
  any later position could see it. Prefills longer than ``max_compiled_query`` run the same
  step uncompiled (compute-bound there: nothing to gain, minutes of compilation to lose).
- :class:`~coinrag.inference.model.graphs.GraphForward` ("graphs", ``inference/model/
  graphs.py``): the same bucketed, whole-buffer step captured once per shape as a CUDA graph
  and replayed (one launch per step); eager over the same static inputs without CUDA.
- :class:`TransformersForward`: the transformers model call with a ``DynamicCache`` (with
  ``logits_to_keep=1``): the fallback for what the static step does not drive (RoPE whose
  frequencies depend on the forward's length: dynamic NTK, longrope; sliding-window or
  mixed-attention layers; other architectures than Llama / Qwen2 / Qwen3 / Mistral).

Every implementation computes what transformers' own forward computes over the same tokens at the
same positions: ``tests/inference/test_forward.py`` holds the static, compiled and graphs ones
to it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from coinrag.inference.model.encode import cache_to_kv, causal_lm, to_dynamic_cache
from coinrag.inference.rope import RopeSpec, UnsupportedRope
from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import FORWARDS

log = logging.getLogger(__name__)

# Architectures whose decoder layers the static step drives (transformers' Llama family: one
# RMSNorm/attention/MLP layer, no embedding or logit scaling; Qwen3 adds per-head q/k norms
# inside its attention module, which the step calls as is).
STATIC_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MIN_CAPACITY = 256  # the smallest KV buffer (tokens)
KV_BLOCK = 512  # keys per block of torch's CPU flash attention (static_attention rounds alike)


def capacity_bucket(tokens: int) -> int:
    """The KV buffer length for ``tokens`` positions: ``MIN_CAPACITY`` doubled until it holds
    them (256, 512, 1024, ...): a few buffers and compiled shapes serve every length."""
    size = MIN_CAPACITY
    while size < tokens:
        size *= 2
    return size


def query_bucket(tokens: int) -> int:
    """The padded length of a query prefill of ``tokens`` tokens (compiled forward): 1 (a
    decode step) stays 1; else the next of 16, 32, 64, ..."""
    if tokens <= 1:
        return 1
    size = 16
    while size < tokens:
        size *= 2
    return size


class ForwardRun(ABC):
    """One sequence: the context, then :meth:`prefill` once, then :meth:`step` per token."""

    position: int  # the position the next token takes

    @abstractmethod
    def prefill(self, input_ids: Sequence[int]) -> torch.Tensor:
        """Run ``input_ids`` at positions ``position..``; the last one's next-token logits
        ``(vocab,)`` float32."""

    def step(self, token_id: int) -> torch.Tensor:
        """One decode step: ``token_id`` at ``position``; its next-token logits."""
        return self.prefill([token_id])


class ModelForward(Registered, ABC):
    """How one model runs a query after a context (the subclass says how). A subclass declared
    with a ``name`` is the ``forward`` setting's value of that name (``kind``): ``eager``,
    ``compiled``, ``graphs`` (``inference/model/graphs.py``, imported on first use)."""

    registry: ClassVar[Registry[ModelForward]] = Registry(
        "forward",
        tuple(f for f in FORWARDS if f != "auto"),
        modules={"graphs": "coinrag.inference.model.graphs"},
    )
    name_attr: ClassVar[str] = "kind"
    kind: ClassVar[str] = ""  # the ``forward`` setting's value this is (eager / compiled / graphs)
    # the warm-up answers at the served max_new_tokens: the shapes it compiles or captures are
    # those of a served answer (the same KV buffer bucket)
    warms_served_shapes: ClassVar[bool] = False

    def __init__(self, model: Any) -> None:
        self.model = model

    @abstractmethod
    def begin(
        self, context: Any | None, context_len: int, query_len: int, max_new_tokens: int
    ) -> ForwardRun:
        """A run after ``context`` (a KV tensor ``(layers, 2, kv_heads, context_len,
        head_dim)``, a transformers cache of ``context_len`` tokens, or None: no context when
        ``context_len`` is 0) for a prefill of ``query_len`` tokens and at most
        ``max_new_tokens`` decode steps."""


# ---------------------------------------------------------------------------- transformers


class TransformersForward(ModelForward):
    """The transformers model call on a ``DynamicCache``, last-position logits only."""

    kind = "eager"

    def begin(
        self, context: Any | None, context_len: int, query_len: int, max_new_tokens: int
    ) -> ForwardRun:
        cache = context
        if isinstance(context, torch.Tensor):
            cache = to_dynamic_cache(context, causal_lm(self.model).config)
        return _TransformersRun(self.model, cache, context_len)


class _TransformersRun(ForwardRun):
    def __init__(self, model: Any, cache: Any | None, position: int) -> None:
        self.model = model
        self.cache = cache
        self.position = position
        self.device = next(model.parameters()).device

    def prefill(self, input_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(input_ids)], device=self.device)
        n = ids.shape[1]
        positions = torch.arange(self.position, self.position + n, device=self.device)[None]
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.past_key_values
        self.position += n
        return out.logits[0, -1].float()


# ---------------------------------------------------------------------------- static cache


def static_unsupported(model: Any) -> str | None:
    """Why :class:`StaticForward` cannot run ``model`` (then :class:`TransformersForward`
    does), or None."""
    lm = causal_lm(model)
    config = lm.config
    if config.model_type not in STATIC_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(STATIC_MODEL_TYPES)}"
    base = getattr(lm, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the {type(lm).__name__} has no model.{name}"
    if not hasattr(lm, "lm_head"):
        return f"the {type(lm).__name__} has no lm_head"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if (
        layer_types != {"full_attention"}
        or getattr(config, "sliding_window", None)
        and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False))
    ):
        return f"layers of types {sorted(layer_types)} / a sliding window"
    try:
        spec = RopeSpec.from_config(config)
    except UnsupportedRope as exc:
        return str(exc)
    if spec.seq_len_dependent:
        return f"rope type {spec.rope_type!r} depends on the forward's length"
    return None


class _BufferWriter:
    """What a decoder layer sees as its cache: ``update`` writes the new keys and values into
    the layer's buffers at ``positions`` and returns its keys and values up to ``end``."""

    def __init__(self, kv: Sequence[torch.Tensor], positions: torch.Tensor, end: int) -> None:
        self.kv = kv
        self.positions = positions
        self.end = end

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv[2 * layer_idx], self.kv[2 * layer_idx + 1]  # (1, kv_heads, cap, dim)
        k.index_copy_(2, self.positions, keys)
        v.index_copy_(2, self.positions, values)
        return k[:, :, : self.end], v[:, :, : self.end]


STATIC_ATTENTION = "coinrag_static"  # the attention function static_step runs the layers with


def static_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for the static step: a single query (a decode step)
    as two small matmuls on the KV heads, each holding its group of query heads (torch's CPU
    flash kernel spends ~0.8 ms per layer on one query: more than the layer's matmuls); longer
    queries as transformers' SDPA. ``query`` ``(1, heads, q, D)``, ``key``/``value`` ``(1,
    kv_heads, T, D)``, ``attention_mask`` bool ``(1, 1, q, T)`` or None (all ``T`` visible).
    Returns ``((1, q, heads, D), None)`` as transformers' functions do. Computed in float32
    (the bf16 batched matmul of these shapes is the slower kernel on a CPU), rounding where
    torch's flash kernel rounds (in bf16, greedy answers part from transformers' only where an
    exponential's last bit differs: torch's kernel uses its own approximate exp)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head i -> kv head i // g
    scale = scaling if scaling is not None else dim**-0.5
    scores = torch.matmul(grouped.float(), key.float().transpose(2, 3)) * scale
    if attention_mask is not None:  # scores: (1, kv_heads, g, T)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    # torch's flash kernel, rounding for rounding: blocks of KV_BLOCK keys, running max and
    # sum in float32, the unnormalised exponentials rounded to the model's dtype before they
    # weigh the values, the sum's reciprocal multiplied in at the end
    top = total = acc = None
    for start in range(0, scores.shape[-1], KV_BLOCK):
        block = scores[..., start : start + KV_BLOCK]
        new_top = block.amax(-1, keepdim=True)
        if top is not None:
            new_top = torch.maximum(top, new_top)
        weights = torch.exp(block - new_top)
        part = weights.sum(-1, keepdim=True)
        values = value[:, :, start : start + KV_BLOCK].float()
        weighted = torch.matmul(weights.to(value.dtype).float(), values)
        if top is None:
            total, acc = part, weighted
        else:
            rescale = torch.exp(top - new_top)
            total, acc = total * rescale + part, acc * rescale + weighted
        top = new_top
    out = (acc * (1.0 / total)).to(value.dtype)  # (1, kv_heads, g, D)
    return out.reshape(batch, 1, heads, dim), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(STATIC_ATTENTION, static_attention)


class attention_of_static_step:
    """Within: ``lm``'s layers attend with :func:`static_attention` (its config names the
    attention function each layer looks up at call time); restored on exit."""

    def __init__(self, lm: Any) -> None:
        self.config = lm.config

    def __enter__(self) -> None:
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = STATIC_ATTENTION

    def __exit__(self, *exc: object) -> None:
        self.config._attn_implementation = self.saved


def static_step(
    lm: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
    kv: Sequence[torch.Tensor],
    last: torch.Tensor,
    end: int,
    masked: bool,
) -> torch.Tensor:
    """One forward of ``ids`` ``(1, q)`` at ``positions`` ``(q,)`` over the buffers ``kv``
    (per layer its keys then its values, each ``(1, kv_heads, capacity, head_dim)``: separate
    tensors, so a compiled step mutates each in place; written at ``positions``), attending
    to buffer positions ``< end`` that are ``<=`` each query's position (``masked``: a mask
    says so; unmasked: a single query attends to all ``end`` positions). Returns the
    next-token logits ``(vocab,)`` float32 of query index ``last`` (a ``(1,)`` tensor).

    The model's own modules compute it (embedding, rotary embedding, decoder layers with their
    attention function, final norm, LM head), so it is transformers' forward over the same
    tokens and cache, less the cache bookkeeping and the logits of other positions."""
    base = lm.model
    hidden = base.embed_tokens(ids)
    position_ids = positions[None]
    rotary = base.rotary_emb(hidden, position_ids)
    mask = None
    if masked:
        keys_at = torch.arange(end, device=ids.device)
        mask = (keys_at[None, :] <= positions[:, None])[None, None]
    writer = _BufferWriter(kv, positions, end)
    for layer in base.layers[: lm.config.num_hidden_layers]:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=writer,
            use_cache=True,
            position_embeddings=rotary,
        )
    hidden = base.norm(hidden.index_select(1, last))
    return lm.lm_head(hidden)[0, 0].float()


class KvBuffer:
    """A preallocated KV cache of ``capacity`` positions: per layer a keys and a values tensor
    ``(1, kv_heads, capacity, head_dim)`` (``tensors``: keys of layer 0, values of layer 0,
    keys of layer 1, ...), in the model's dtype and on its device."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, **like: Any):
        self.capacity = capacity
        shape = (1, kv_heads, capacity, head_dim)
        self.tensors = [torch.zeros(shape, **like) for _ in range(2 * layers)]
        self.owner: object = None

    def write(self, context: torch.Tensor) -> None:
        """Copy ``context`` ``(layers, 2, kv_heads, T, head_dim)`` to positions ``0..T-1``
        (one copy, cast to the buffer's dtype where it differs)."""
        t = context.shape[-2]
        for i, tensor in enumerate(self.tensors):
            tensor[0, :, :t].copy_(context[i // 2, i % 2])


class StaticForward(ModelForward, name="eager"):
    """A preallocated KV buffer per capacity bucket, the model's layers driven over it.

    One sequence at a time per model (the buffer is shared: the server answers on one model
    thread, ``eval`` one question after another); a run whose buffer another run took since
    refuses to continue rather than read someone else's keys."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.lm = causal_lm(model)
        config = self.lm.config
        self.layers = int(config.num_hidden_layers)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._buffers: dict[int, KvBuffer] = {}
        self._lock = threading.Lock()
        _register_attention()

    def capacity(self, context_len: int, query_len: int, max_new_tokens: int) -> int:
        """Positions a run needs: the context, the query, the decode steps."""
        return context_len + query_len + max_new_tokens

    def buffer(self, capacity: int) -> KvBuffer:
        """The KV buffer of ``capacity_bucket(capacity)`` positions (allocated once)."""
        size = capacity_bucket(capacity)
        if size not in self._buffers:
            like = {"dtype": self.dtype, "device": self.device}
            self._buffers[size] = KvBuffer(self.layers, self.kv_heads, size, self.head_dim, **like)
        return self._buffers[size]

    def begin(
        self, context: Any | None, context_len: int, query_len: int, max_new_tokens: int
    ) -> ForwardRun:
        if context is not None and context_len:
            if not isinstance(context, torch.Tensor):  # a transformers cache (batch 1)
                context = cache_to_kv(context)[0]
            if context.shape[-2] != context_len:  # keys are not one per position 0..n-1:
                return TransformersForward(self.model).begin(  # the buffer cannot hold them
                    context, context_len, query_len, max_new_tokens
                )
        buffer = self.buffer(self.capacity(context_len, query_len, max_new_tokens))
        if context is not None and context_len:
            buffer.write(context)
        owner = object()
        with self._lock:
            buffer.owner = owner
        return _StaticRun(self, buffer, context_len, owner)

    def run_step(self, buffer: KvBuffer, ids: Sequence[int], position: int) -> torch.Tensor:
        """The step for ``ids`` at ``position..`` (eager: attends to the positions written so
        far, ``< position + len(ids)``)."""
        n = len(ids)
        ids_t = torch.tensor([list(ids)], device=self.device)
        positions = torch.arange(position, position + n, device=self.device)
        last = torch.tensor([n - 1], device=self.device)
        with attention_of_static_step(self.lm):
            return static_step(self.lm, ids_t, positions, buffer.tensors, last, position + n, n > 1)


class _StaticRun(ForwardRun):
    def __init__(self, forward: StaticForward, buffer: KvBuffer, position: int, owner: object):
        self.forward = forward
        self.buffer = buffer
        self.position = position
        self.owner = owner

    def prefill(self, input_ids: Sequence[int]) -> torch.Tensor:
        n = len(input_ids)
        if self.position + n > self.buffer.capacity:
            raise ValueError(
                f"position {self.position + n} is past the KV buffer's {self.buffer.capacity}: "
                "begin the run with more max_new_tokens"
            )
        if self.buffer.owner is not self.owner:
            raise RuntimeError(
                "another sequence took this model's KV buffer: one sequence at a time per "
                "model (answer on one thread, or load the model once per thread)"
            )
        logits = self.forward.run_step(self.buffer, input_ids, self.position)
        self.position += n
        return logits


class CompiledForward(StaticForward, name="compiled"):
    """:class:`StaticForward`'s step under ``torch.compile`` (inductor, ``fullgraph=True``,
    static shapes: capacity and query buckets). The first call of a new shape compiles it
    (minutes on one loaded CPU thread): ``coinrag api`` and ``eval`` answer once untimed per
    method before serving."""

    warms_served_shapes = True
    max_compiled_query: ClassVar[int] = 256  # longer prefills run the step uncompiled

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import torch._dynamo

        # one graph per (query bucket, capacity bucket): room for all of them
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # freezing: the weights are constants of the graph, so inductor prepacks every linear
        # for oneDNN (about a third faster than the eager matmuls on one AVX-512 core)
        self._compiled = torch.compile(
            static_step, fullgraph=True, dynamic=False, options={"freezing": True}
        )
        self.shapes: set[tuple[int, int]] = set()  # (query bucket, capacity) compiled so far

    def capacity(self, context_len: int, query_len: int, max_new_tokens: int) -> int:
        """Room for the query padded to its bucket too."""
        return context_len + query_bucket(query_len) + max_new_tokens

    def run_step(self, buffer: KvBuffer, ids: Sequence[int], position: int) -> torch.Tensor:
        n = len(ids)
        q = query_bucket(n)
        capacity = buffer.capacity
        if q > self.max_compiled_query or position + q > capacity:
            return super().run_step(buffer, ids, position)
        padded = list(ids) + [int(ids[-1])] * (q - n)
        ids_t = torch.tensor([padded], device=self.device)
        positions = torch.arange(position, position + q, device=self.device)
        last = torch.tensor([n - 1], device=self.device)
        self.shapes.add((q, capacity))
        with attention_of_static_step(self.lm):
            return self._compiled(self.lm, ids_t, positions, buffer.tensors, last, capacity, True)


# ---------------------------------------------------------------------------- choosing


_FORWARDS: weakref.WeakKeyDictionary[Any, ModelForward] = weakref.WeakKeyDictionary()
_MADE: weakref.WeakKeyDictionary[Any, dict[str, ModelForward]] = weakref.WeakKeyDictionary()
_DEFAULT: dict[str, Any] = {"setting": "eager", "serving": False}  # set_default_forward


def make_forward(model: Any, kind: str = "eager") -> ModelForward:
    """A new forward of ``kind`` (``eager`` | ``compiled`` | ``graphs``) for ``model``; the
    transformers call where the static step cannot drive it (logged)."""
    if kind not in ModelForward.registry:
        known = ", ".join(ModelForward.registry.known())
        raise ValueError(f"forward {kind!r} is not one of {known}")
    why = static_unsupported(model)
    if why is not None:
        log.info("the %s forward falls back to transformers' own call: %s", kind, why)
        return TransformersForward(model)
    return ModelForward.registry[kind](model)


def forward_for(model: Any) -> ModelForward:
    """The forward ``model`` runs with: the one :func:`use_forward` set, else the process's
    default (:func:`set_default_forward`, resolved for the model's device; made on first use,
    then kept as long as the model lives)."""
    found = _FORWARDS.get(model)
    if found is None:
        device = str(next(model.parameters()).device)
        kind = resolve_forward(_DEFAULT["setting"], serving=_DEFAULT["serving"], device=device)
        found = _FORWARDS[model] = make_forward(model, kind)
    return found


def use_forward(model: Any, kind: str) -> ModelForward:
    """Make ``model`` run with a forward of ``kind`` (``eager`` | ``compiled`` | ``graphs``) from
    now on;
    the one of that kind it ran with before, if any (its buffers and compiled graphs kept: a
    benchmark switches back and forth)."""
    made = _MADE.setdefault(model, {})
    current = _FORWARDS.get(model)
    if current is not None:
        made.setdefault(current.kind, current)
    if kind not in made:
        made[kind] = make_forward(model, kind)
    _FORWARDS[model] = made[kind]
    return made[kind]


def install_forward(model: Any, forward: ModelForward) -> ModelForward:
    """Make ``model`` run with ``forward`` (any :class:`ModelForward`, e.g. a benchmark's
    reference) until :func:`use_forward` says otherwise."""
    _FORWARDS[model] = forward
    return forward


def set_default_forward(setting: str, *, serving: bool) -> None:
    """What every model of this process runs with unless :func:`use_forward` says otherwise:
    the ``forward`` setting (``auto`` | ``eager`` | ``compiled`` | ``graphs``) of a serving
    process (``coinrag api``, ``eval``) or not (``coinrag query``); :func:`resolve_forward`
    decides per model."""
    resolve_forward(setting, serving=serving)  # a bad value fails here, not at first use
    _DEFAULT.update(setting=setting, serving=serving)


def resolve_forward(setting: str, *, serving: bool, device: str = "cpu") -> str:
    """The forward a process runs for the ``forward`` setting. ``auto``, for a serving process
    (``coinrag api``, ``eval``: the warm-up pays off over many questions): ``graphs`` on a CUDA
    device (each step one graph launch: a decode step at 7B dims is launch-bound, RESULTS.md
    "GPU check"), ``compiled`` on another accelerator; ``eager`` on a CPU (measured on one
    AVX-512 core: inductor's graphs are no faster than the eager static step, whose time is
    the matmuls, and compiling them takes minutes; README, "The model forward") and for a
    one-shot ``coinrag query``."""
    if setting not in FORWARDS:
        raise ValueError(f"forward {setting!r} is not one of {', '.join(FORWARDS)}")
    if setting != "auto":
        return setting
    from coinrag.inference.model.kv_dtype import device_type

    kind = device_type(device)
    if not serving or kind == "cpu":
        return "eager"
    return "graphs" if kind == "cuda" else "compiled"
