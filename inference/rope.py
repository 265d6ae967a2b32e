"""Re-rotation of cached RoPE keys to new positions (Llama, Mistral, Qwen2/3, Phi-3, OLMo 2,
GPT-NeoX, Gemma 2/3: the architectures of ``_ARCHITECTURES``).

transformers caches keys *after* RoPE. A key encoded at position ``p`` is
``s * R(a(p)) k_raw`` where ``R`` rotates each dimension pair ``(i, i + rotary_dim/2)``
(the ``rotate_half`` convention) by the angle ``a_i(p) = fl32(p * inv_freq_i)`` and ``s`` is
the rope type's ``attention_scaling`` (1 except for YaRN / LongRoPE, which multiply cos and sin
by it). Rotations compose, so moving the key to position ``q`` is the pure rotation
``R(a(q) - a(p))``: the scale ``s`` is already inside the cached key and is never applied again.

Everything model-specific comes from transformers itself: the rotary-embedding class of the
model's architecture is instantiated from the config (that is how the model gets its
``inv_freq`` and ``attention_scaling``), and the seq-len dependent variants (``dynamic``,
``longrope``) are recomputed with ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
exactly as its ``dynamic_rope_update`` decorator does. No RoPE formula is re-derived here.

Precision: the absolute angles ``a(p)`` are formed in float32 exactly as transformers forms
them (``position.float() * inv_freq``, so the same rounding), their difference is taken and
turned into cos/sin in float64, and the rotation itself runs in float32 before casting back to
the keys' dtype. The re-rotated key therefore equals the key the model computes at the new
position up to float32 rounding of the products (~1e-7 relative), also far from position 0.
A pure ``delta * inv_freq`` rotation (``shift_keys`` without ``old_start``) is mathematically
the same but misses the model's own float32 rounding of ``p * inv_freq``: it differs from a
fresh prefill by up to ``~|p| * 2**-24`` rad per pair (about 1e-4 rad at p = 3000).

Per-layer RoPE (:class:`LayerRopes`, :func:`model_rope`): Gemma 3 rotates its sliding layers
with the local base (``rope_parameters["sliding_attention"]``, from ``rope_local_base_freq``)
and its full layers with the global base and scaling (``rope_parameters["full_attention"]``);
which layer is which is ``config.layer_types`` (``inference.layers.AttentionLayers``). Each
layer's keys are re-rotated with that layer's :class:`RopeSpec`, taken from the model's own
rotary module for that layer type. Code that places KV of every layer takes a
:data:`ModelRope`: a :class:`RopeSpec` (one RoPE for every layer) or a :class:`LayerRopes`.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

__all__ = [
    "ForwardFrequencies",
    "LayerRopes",
    "ModelRope",
    "RopeSpec",
    "UnsafeRerotation",
    "UnsupportedRope",
    "model_rope",
    "rerotate_keys",
    "reset_rotary",
    "shift_keys",
]


class UnsupportedRope(ValueError):
    """The model's RoPE variant (or architecture) cannot be re-rotated exactly; refused by name."""


class UnsafeRerotation(ValueError):
    """The re-rotation is not determined by the given arguments (e.g. dynamic NTK without the
    sequence lengths the frequencies depend on)."""


@dataclass(frozen=True)
class _Arch:
    module: str  # transformers.models.<module>.modeling_<module>
    rotary: str  # its rotary-embedding class
    partial: bool = False  # applies RoPE to the first rotary_dim dims only (partial_rotary_factor)
    per_layer_type: bool = False  # one rope parameter set per layer type (rope_parameters[type])


# Architectures whose attention applies RoPE with transformers' `rotate_half` convention on the
# first `rotary_dim` dims of every key head, every layer, checked against the transformers 5.23
# modeling files (keys cached after q/k norms and RoPE; Gemma 2's soft-capping and Gemma 3's
# QK-norm act before the cache or on the scores, never on a cached key's position).
# Architectures with interleaved rotation (GPT-J style), NoPE layers (SmolLM3, Llama 4,
# Cohere 2) or multimodal M-RoPE (Qwen2-VL, ...) are not listed: `UNSUPPORTED_FEATURES` names
# why.
_ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaRotaryEmbedding"),
    "mistral": _Arch("mistral", "MistralRotaryEmbedding"),
    "mixtral": _Arch("mixtral", "MixtralRotaryEmbedding"),
    "qwen2": _Arch("qwen2", "Qwen2RotaryEmbedding"),
    "qwen2_moe": _Arch("qwen2_moe", "Qwen2MoeRotaryEmbedding"),
    "qwen3": _Arch("qwen3", "Qwen3RotaryEmbedding"),
    "qwen3_moe": _Arch("qwen3_moe", "Qwen3MoeRotaryEmbedding"),
    "phi3": _Arch("phi3", "Phi3RotaryEmbedding", partial=True),
    "olmo2": _Arch("olmo2", "Olmo2RotaryEmbedding"),
    "gpt_neox": _Arch("gpt_neox", "GPTNeoXRotaryEmbedding", partial=True),
    "gemma2": _Arch("gemma2", "Gemma2RotaryEmbedding"),
    "gemma3_text": _Arch("gemma3", "Gemma3RotaryEmbedding", per_layer_type=True),
}
VERIFIED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))

# What keeps a known architecture out (the preflight names it).
UNSUPPORTED_FEATURES: dict[str, str] = {
    "gptj": "interleaved (GPT-J style) RoPE",
    "codegen": "interleaved (GPT-J style) RoPE",
    "gpt_neo": "no RoPE (learned positions)",
    "gpt2": "no RoPE (learned positions)",
    "smollm3": "NoPE layers",
    "llama4": "NoPE and chunked-attention layers",
    "llama4_text": "NoPE and chunked-attention layers",
    "cohere2": "NoPE full-attention layers",
    "qwen2_vl": "multimodal M-RoPE",
    "qwen2_vl_text": "multimodal M-RoPE",
    "qwen2_5_vl": "multimodal M-RoPE",
    "qwen2_5_vl_text": "multimodal M-RoPE",
    "gemma3": "multimodal Gemma 3 (give the text model: model_type gemma3_text)",
    "gemma3n": "per-layer KV sharing and AltUp",
}


# Rope types whose frequencies do not depend on the sequence length.
_STATIC_TYPES = frozenset({"default", "linear", "yarn", "llama3"})
# Rope types whose frequencies depend on the forward's sequence length (max position id + 1).
_SEQ_LEN_TYPES = frozenset({"dynamic", "longrope"})
SUPPORTED_ROPE_TYPES = _STATIC_TYPES | _SEQ_LEN_TYPES

_DELTA_CACHE_MAX = 4096


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The RoPE variant of one model, as its transformers implementation computes it.

    Build it with :meth:`RopeSpec.from_config`. Hashable by identity.

    Attributes:
        model_type: ``config.model_type`` (one of the verified architectures).
        rope_type: ``config.rope_parameters["rope_type"]``: default, linear, dynamic, yarn,
            llama3 or longrope.
        head_dim: size of one key head (last dim of the cached keys).
        rotary_dim: number of leading dims of a head that RoPE rotates (``2 * len(inv_freq)``);
            equals ``head_dim`` except for partial rotary (Phi-3 ``partial_rotary_factor``).
        inv_freq: float32 tensor of shape ``(rotary_dim // 2,)``: the frequencies the model's
            rotary embedding holds after init, i.e. those used for any forward whose length
            does not exceed ``max_position_embeddings`` (dynamic) or
            ``original_max_position_embeddings`` (longrope, the "short" factors).
        attention_scaling: factor transformers multiplies cos and sin by (YaRN / LongRoPE
            ``attention_factor``; 1.0 otherwise). Already contained in every cached key.
        max_position_embeddings: ``config.max_position_embeddings``; the threshold above which
            dynamic NTK recomputes its frequencies.
        original_max_position_embeddings: from ``rope_parameters`` where the type has it
            (yarn, llama3, longrope; the longrope short/long threshold), else None.
        long_inv_freq: longrope only: float32 ``(rotary_dim // 2,)`` frequencies used for a
            forward longer than ``original_max_position_embeddings``; None otherwise.
        layer_type: for per-layer RoPE (Gemma 3), the layer type this RoPE is for
            (``sliding_attention`` / ``full_attention``); None when every layer has it.
    """

    model_type: str
    rope_type: str
    head_dim: int
    rotary_dim: int
    inv_freq: torch.Tensor
    attention_scaling: float
    max_position_embeddings: int
    original_max_position_embeddings: int | None = None
    long_inv_freq: torch.Tensor | None = None
    layer_type: str | None = None
    _config: Any = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: Any, layer_type: str | None = None) -> RopeSpec:
        """Read the RoPE variant of ``config`` (a transformers ``PretrainedConfig``): the one of
        every layer, or, for an architecture with one rope parameter set per layer type
        (Gemma 3), the one of the layers of ``layer_type`` (:func:`model_rope` gives each
        layer its own).

        Raises:
            UnsupportedRope: the architecture is not one whose RoPE convention was verified,
                the rope type is not supported (named in the message), the config is
                multimodal (M-RoPE), or has per-layer rope parameters and no ``layer_type``
                (or an architecture that does not read them per layer).
        """
        config = config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", None) or type(config).__name__
        arch = _ARCHITECTURES.get(model_type)
        if arch is None:
            feature = UNSUPPORTED_FEATURES.get(model_type, "architecture not verified")
            raise UnsupportedRope(
                f"architecture {model_type!r} is not supported for key re-rotation ({feature}; "
                f"verified: {', '.join(VERIFIED_ARCHITECTURES)}); multimodal / M-RoPE, "
                "interleaved-RoPE and NoPE-layer architectures are refused"
            )
        params = getattr(config, "rope_parameters", None)
        if not params:
            raise UnsupportedRope(f"{model_type!r} config has no rope_parameters")
        per_layer = "rope_type" not in params and "type" not in params
        if per_layer and not arch.per_layer_type:
            raise UnsupportedRope(
                f"{model_type!r} rope_parameters look per-layer (keys {sorted(params)}); "
                "per-layer RoPE is not supported for this architecture"
            )
        if per_layer and layer_type is None:
            raise UnsupportedRope(
                f"{model_type!r} has per-layer RoPE (rope_parameters per layer type "
                f"{sorted(params)}): read it with model_rope(config), each layer its own"
            )
        if arch.per_layer_type:
            layer_type = layer_type or "full_attention"
            if not isinstance(params.get(layer_type), dict):
                raise UnsupportedRope(
                    f"{model_type!r} has no rope_parameters for layer type {layer_type!r}"
                )
            params = params[layer_type]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if "mrope_section" in params or "mrope" in str(rope_type):
            raise UnsupportedRope(f"rope type 'mrope' (multimodal RoPE, {rope_type!r}) is refused")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRope(
                f"rope type {rope_type!r} is not supported for key re-rotation "
                f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})"
            )
        if arch.per_layer_type and rope_type in _SEQ_LEN_TYPES:
            raise UnsupportedRope(
                f"{model_type!r} layer type {layer_type!r}: rope type {rope_type!r} depends on "
                "the sequence length, which is not supported with per-layer RoPE"
            )

        config = copy.deepcopy(config)  # transformers' init functions standardize in place
        modeling = importlib.import_module(
            f"transformers.models.{arch.module}.modeling_{arch.module}"
        )
        rotary = getattr(modeling, arch.rotary)(config)
        prefix = f"{layer_type}_" if arch.per_layer_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq").detach()
        inv_freq = inv_freq.to(device="cpu", dtype=torch.float32).clone()
        attention_scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
        if not arch.per_layer_type:
            params = config.rope_parameters

        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        rotary_dim = 2 * inv_freq.numel()
        if rotary_dim > head_dim or (rotary_dim != head_dim and not arch.partial):
            raise UnsupportedRope(
                f"{model_type!r} with rope type {rope_type!r}: rotary dim {rotary_dim} does not "
                f"fit head dim {head_dim} the way this architecture applies RoPE "
                "(partial_rotary_factor is only applied by Phi-3 and GPT-NeoX here)"
            )

        long_inv_freq = None
        if rope_type == "longrope":
            # As transformers' longrope_frequency_update: long factors are computed with
            # seq_len = original_max_position_embeddings + 1; attention_scaling stays the init one.
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
                config, None, seq_len=int(params["original_max_position_embeddings"]) + 1
            )
            long_inv_freq = long_inv_freq.detach().to(device="cpu", dtype=torch.float32).clone()

        original = params.get("original_max_position_embeddings")
        return cls(
            model_type=model_type,
            rope_type=rope_type,
            head_dim=int(head_dim),
            rotary_dim=int(rotary_dim),
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
            max_position_embeddings=int(config.max_position_embeddings),
            original_max_position_embeddings=None if original is None else int(original),
            long_inv_freq=long_inv_freq,
            layer_type=layer_type if arch.per_layer_type else None,
            _config=config if rope_type == "dynamic" else None,
        )

    def rotate_layers(
        self,
        keys: torch.Tensor,
        old_positions: torch.Tensor | Sequence[int],
        new_positions: torch.Tensor | Sequence[int],
        *,
        old_seq_len: int | None = None,
        new_seq_len: int | None = None,
    ) -> torch.Tensor:
        """:func:`rerotate_keys` of ``keys`` ``(layers, ..., kv_heads, tokens, head_dim)``: one
        RoPE for every layer (the :data:`ModelRope` interface)."""
        return rerotate_keys(
            keys,
            old_positions,
            new_positions,
            self,
            old_seq_len=old_seq_len,
            new_seq_len=new_seq_len,
        )

    def same_frequencies(self, seq_len_a: int, seq_len_b: int) -> bool:
        """Forwards of these lengths use the same frequencies (always, unless dynamic or
        longrope)."""
        if not self.seq_len_dependent:
            return True
        return torch.equal(self.inv_freq_for(seq_len_a), self.inv_freq_for(seq_len_b))

    @property
    def seq_len_dependent(self) -> bool:
        """True when the frequencies depend on the forward's length (dynamic, longrope)."""
        return self.rope_type in _SEQ_LEN_TYPES

    def inv_freq_for(self, seq_len: int | None) -> torch.Tensor:
        """Float32 frequencies ``(rotary_dim // 2,)`` a fresh transformers rotary embedding uses
        for a forward of length ``seq_len`` (its largest position id + 1).

        ``seq_len`` is ignored for position-independent types and required for dynamic and
        longrope. Dynamic mirrors ``dynamic_rope_update`` of a module that has not been grown by
        an earlier, longer forward: the init frequencies up to ``max_position_embeddings``, else
        ``ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=tensor(seq_len))``.
        """
        if not self.seq_len_dependent:
            return self.inv_freq
        if seq_len is None:
            raise UnsafeRerotation(
                f"rope type {self.rope_type!r}: frequencies depend on the forward's sequence "
                "length; pass old_seq_len and new_seq_len"
            )
        seq_len = int(seq_len)
        if self.rope_type == "longrope":
            assert self.long_inv_freq is not None and self.original_max_position_embeddings
            if seq_len > self.original_max_position_embeddings:
                return self.long_inv_freq
            return self.inv_freq
        # dynamic
        if seq_len <= self.max_position_embeddings:
            return self.inv_freq
        key = ("dynamic", seq_len)
        cached = self._cache.get(key)
        if cached is None:
            # transformers passes `torch.max(position_ids) + 1`, an int64 tensor: same arithmetic.
            inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](
                self._config, None, seq_len=torch.tensor(seq_len, dtype=torch.int64)
            )
            cached = inv.detach().to(device="cpu", dtype=torch.float32).clone()
            self._cache[key] = cached
        return cached


class LayerRopes:
    """Each decoder layer's RoPE (per-layer RoPE: Gemma 3's local and global bases).

    ``specs[i]`` is layer ``i``'s :class:`RopeSpec` (one object per layer type). Keys of every
    layer, ``(layers, ..., kv_heads, tokens, head_dim)``, are re-rotated layer by layer group
    with their own spec (:meth:`rotate_layers`), exactly as :func:`rerotate_keys` rotates one
    layer. Build it with :func:`model_rope`. Only position-independent rope types (default,
    linear, yarn, llama3) are accepted per layer.
    """

    def __init__(self, specs: Sequence[RopeSpec]) -> None:
        self.specs = tuple(specs)
        self.model_type = self.specs[0].model_type
        self.head_dim = self.specs[0].head_dim
        groups: dict[int, list[int]] = {}
        for i, spec in enumerate(self.specs):
            groups.setdefault(id(spec), []).append(i)
        self._groups = [(self.specs[idx[0]], idx) for idx in groups.values()]

    @property
    def rope_type(self) -> str:
        """The rope types of the layer types, e.g. ``full_attention: linear, sliding_attention:
        default`` (for messages)."""
        named = {s.layer_type: s.rope_type for s, _ in self._groups}
        return ", ".join(f"{t}: {r}" for t, r in sorted(named.items(), key=lambda x: str(x[0])))

    @property
    def seq_len_dependent(self) -> bool:
        return any(s.seq_len_dependent for s, _ in self._groups)

    def same_frequencies(self, seq_len_a: int, seq_len_b: int) -> bool:
        return all(s.same_frequencies(seq_len_a, seq_len_b) for s, _ in self._groups)

    def rotate_layers(
        self,
        keys: torch.Tensor,
        old_positions: torch.Tensor | Sequence[int],
        new_positions: torch.Tensor | Sequence[int],
        *,
        old_seq_len: int | None = None,
        new_seq_len: int | None = None,
    ) -> torch.Tensor:
        """Keys ``(layers, ..., kv_heads, tokens, head_dim)`` (dim 0: the model's layers) moved
        from ``old_positions`` to ``new_positions``, each layer with its own RoPE; same shape
        and dtype. Differentiable (one rotation per layer type, then re-interleaved)."""
        if keys.shape[0] != len(self.specs):
            raise ValueError(
                f"keys have {keys.shape[0]} layers on dim 0, the model {len(self.specs)}"
            )
        parts: list[torch.Tensor | None] = [None] * len(self.specs)
        for spec, layers in self._groups:
            index = torch.tensor(layers, device=keys.device)
            moved = rerotate_keys(
                keys.index_select(0, index),
                old_positions,
                new_positions,
                spec,
                old_seq_len=old_seq_len,
                new_seq_len=new_seq_len,
            )
            for j, layer in enumerate(layers):
                parts[layer] = moved[j]
        return torch.stack([p for p in parts if p is not None])


ModelRope = RopeSpec | LayerRopes
"""What places the KV of every layer: one :class:`RopeSpec` for all layers, or a
:class:`LayerRopes`. Both have ``rotate_layers``, ``same_frequencies``, ``seq_len_dependent``,
``rope_type`` and ``head_dim``."""


def model_rope(config: Any) -> ModelRope:
    """The RoPE of every layer of ``config``'s model: its :class:`RopeSpec` when all layers
    share one rope parameter set (every verified architecture but Gemma 3), else a
    :class:`LayerRopes` giving layer ``i`` the spec of ``config.layer_types[i]``.

    Raises:
        UnsupportedRope: as :meth:`RopeSpec.from_config`, for any layer type's RoPE.
    """
    text = config.get_text_config(decoder=True)
    arch = _ARCHITECTURES.get(getattr(text, "model_type", ""))
    if arch is None or not arch.per_layer_type:
        return RopeSpec.from_config(text)
    from coinrag.inference.layers import AttentionLayers

    types = AttentionLayers.from_config(text).types
    by_type = {t: RopeSpec.from_config(text, layer_type=t) for t in dict.fromkeys(types)}
    return LayerRopes([by_type[t] for t in types])


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    """The rope parameter dicts of a config: one, or one per layer type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and "rope_type" not in params and "type" not in params:
        return [dict(v) for v in params.values() if isinstance(v, dict)]
    return [params]


@dataclass(frozen=True)
class ForwardFrequencies:
    """Which RoPE frequencies a freshly initialised transformers rotary embedding uses for one
    forward, as a function of that forward's length ``seq_len`` (its largest position id + 1).

    Only ``dynamic`` and ``longrope`` depend on it (``transformers.modeling_rope_utils.
    dynamic_rope_update``): dynamic NTK keeps its init frequencies up to
    ``max_position_embeddings`` and above that computes them from ``seq_len`` itself; longrope
    uses its short factors up to ``original_max_position_embeddings`` and its long factors
    above. A right-padded batch is one forward of length ``|p| + longest chunk``: its shorter
    rows get the frequencies of that length, not of their own (see :meth:`key`).

    Works from the config alone (any architecture, also those :class:`RopeSpec` refuses), so the
    KV stage can batch by it. Picklable (it travels to scale-out workers).

    Attributes:
        thresholds: per rope parameter set (one, or one per layer type): ``(rope_type,
            threshold)`` with threshold the length above which that type changes frequencies
            (None for types that never do).
    """

    thresholds: tuple[tuple[str, int | None], ...]

    @classmethod
    def from_config(cls, config: Any) -> ForwardFrequencies:
        out = []
        for params in _rope_parameter_sets(config):
            rope_type = str(params.get("rope_type", params.get("type", "default")))
            threshold = None
            if "dynamic" in rope_type:  # as dynamic_rope_update tests it
                threshold = int(config.max_position_embeddings)
            elif rope_type == "longrope":
                original = params.get("original_max_position_embeddings") or getattr(
                    config, "original_max_position_embeddings", None
                )
                threshold = int(original)
            out.append((rope_type, threshold))
        return cls(tuple(out))

    @property
    def seq_len_dependent(self) -> bool:
        return any(t is not None for _, t in self.thresholds)

    def key(self, seq_len: int) -> tuple[int, ...]:
        """Equal keys <=> forwards of these lengths use the same frequencies (in a fresh module).

        >>> f = ForwardFrequencies((("dynamic", 64),))
        >>> f.key(35) == f.key(64), f.key(65) == f.key(85)
        (True, False)
        """
        out = []
        for rope_type, threshold in self.thresholds:
            if threshold is None:
                out.append(0)
            elif rope_type == "longrope":
                out.append(int(seq_len > threshold))
            else:  # dynamic: one frequency set per length above the threshold
                out.append(int(seq_len) if seq_len > threshold else 0)
        return tuple(out)

    def batches(self, lengths: Sequence[int], offset: int, batch_size: int) -> list[range]:
        """Cut items ``0..len(lengths)-1`` (in that order) into consecutive runs of at most
        ``batch_size`` items whose forwards at ``offset + length`` use the same frequencies, so
        that right-padding a run to its longest item gives every item the keys it gets alone.

        >>> ForwardFrequencies((("dynamic", 64),)).batches([80, 80, 70, 30, 20], 5, 4)
        [range(0, 2), range(2, 3), range(3, 5)]
        """
        runs: list[range] = []
        start = 0
        for i in range(1, len(lengths) + 1):
            if (
                i == len(lengths)
                or i - start == batch_size
                or self.key(offset + lengths[i]) != self.key(offset + lengths[start])
            ):
                runs.append(range(start, i))
                start = i
        return runs


def reset_rotary(model: Any) -> None:
    """Put every dynamic-NTK rotary embedding of ``model`` back into its initial state.

    transformers' ``dynamic_rope_update`` keeps state between forwards: a forward longer than
    ``max_position_embeddings`` grows ``inv_freq`` (and ``max_seq_len_cached``) and the grown
    frequencies stay for every later forward of a length in ``(max_position_embeddings,
    grown]``; only a forward shorter than ``max_position_embeddings`` resets them. So what a
    forward computes would depend on what the same model object computed before (an earlier
    query, a longer chunk). Call this before a forward that starts a new sequence (the prefix,
    a KV batch, a query prefill, a training example); the decode steps that continue a sequence
    keep transformers' own behaviour. Longrope needs no reset (it sets its frequencies on every
    forward); the other types have no state.
    """
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if not hasattr(module, "original_max_seq_len"):
            continue
        types = rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]
        for layer_type, kind in types:
            if not isinstance(kind, str) or "dynamic" not in kind:
                continue
            prefix = "" if layer_type is None else f"{layer_type}_"
            original = getattr(module, f"{prefix}original_inv_freq", None)
            grown = getattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)
            if not isinstance(original, torch.Tensor) or grown == module.original_max_seq_len:
                continue  # never grown, or reset by transformers itself: inv_freq is the init one
            # As transformers' own reset (which also leaves attention_scaling alone: dynamic
            # NTK's is 1.0 before and after growth).
            module.register_buffer(f"{prefix}inv_freq", original, persistent=False)
            setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def _as_positions(positions: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    pos = torch.as_tensor(positions)
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must be integer positions, got dtype {pos.dtype}")
    if pos.dim() != 1:
        raise ValueError(f"{name} must have shape (tokens,), got {tuple(pos.shape)}")
    pos = pos.to(device="cpu", dtype=torch.int64)
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"{name} must be >= 0")
    return pos


def _check_keys(keys: torch.Tensor, spec: RopeSpec) -> None:
    if keys.dim() < 3:
        raise ValueError(f"keys must be (..., kv_heads, tokens, head_dim), got {tuple(keys.shape)}")
    if keys.shape[-1] != spec.head_dim:
        raise ValueError(f"keys head_dim {keys.shape[-1]} != spec.head_dim {spec.head_dim}")


def _check_seq_len(seq_len: int | None, positions: torch.Tensor, name: str) -> None:
    if seq_len is not None and positions.numel() and int(seq_len) <= int(positions.max()):
        raise ValueError(
            f"{name}={seq_len} must exceed the largest position {int(positions.max())}"
        )


def _rotate(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate ``keys`` (..., tokens, head_dim) by per-token angles given as float32 ``cos``/``sin``
    of shape (tokens, rotary_dim // 2); same as ``k * cos2 + rotate_half(k) * sin2`` with
    ``cos2 = cat(cos, cos)``. Computed in float32, returned in the keys' dtype; differentiable
    when ``keys`` requires grad."""
    k = keys.to(torch.float32)
    half = rotary_dim // 2
    cos = cos.to(k.device)
    sin = sin.to(k.device)
    x1 = k[..., :half]
    x2 = k[..., half:rotary_dim]
    if torch.is_grad_enabled() and k.requires_grad:  # differentiable path (training)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., rotary_dim:]]
        return torch.cat(parts, dim=-1).to(keys.dtype)
    out = torch.empty_like(k)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, -sin)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out[..., half:rotary_dim]).addcmul_(x1, sin)  # x2 cos + x1 sin
    if rotary_dim < k.shape[-1]:
        out[..., rotary_dim:] = k[..., rotary_dim:]
    return out.to(keys.dtype)


def rerotate_keys(
    keys: torch.Tensor,
    old_positions: torch.Tensor | Sequence[int],
    new_positions: torch.Tensor | Sequence[int],
    spec: RopeSpec,
    *,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Move cached (post-RoPE) keys from ``old_positions`` to ``new_positions``.

    Args:
        keys: ``(..., kv_heads, tokens, head_dim)``, any leading dims (batch, layers, ...),
            any float dtype, any device; as transformers caches them (after RoPE, including
            ``attention_scaling``).
        old_positions: ``(tokens,)`` integer positions the keys were encoded at.
        new_positions: ``(tokens,)`` integer target positions.
        spec: the model's :class:`RopeSpec`.
        old_seq_len: dynamic / longrope only: length of the forward that produced the cache,
            i.e. its largest position id + 1 (e.g. ``offset + chunk_len`` for a chunk encoded
            at ``offset``), not just the slice's. Ignored for the other types.
        new_seq_len: dynamic / longrope only: length of the forward whose keys are to be
            reproduced (largest position id + 1 there). Ignored for the other types.

    Returns:
        Tensor of the same shape and dtype as ``keys``: the keys the model computes for the same
        tokens at ``new_positions`` (up to float32 rounding). Only the RoPE rotation is changed;
        ``attention_scaling`` is not applied again.

    Rope types:
        default, linear, yarn, llama3: frequencies are position independent; exact.
        longrope: exact. The frequency set (short or long factors) is chosen per forward from
            its length exactly as transformers does (long when length >
            ``original_max_position_embeddings``); ``attention_scaling`` is the same for both.
        dynamic (NTK): handled exactly, given the lengths: the frequencies are those of a
            forward of length ``old_seq_len`` / ``new_seq_len`` computed by transformers' own
            dynamic init function; keys are un-rotated at the old and rotated at the new
            frequencies. Both lengths are required (:class:`UnsafeRerotation` otherwise),
            because the same positions get different frequencies depending on how long the
            forward was. Caveat (transformers' own behaviour): a rotary module that an earlier,
            longer forward has grown keeps the grown frequencies for lengths in
            ``(max_position_embeddings, grown]``; this reproduces a fresh module, which is
            what coinrag's forwards run with (:func:`reset_rotary` before each sequence).

    Raises:
        UnsafeRerotation: dynamic / longrope without ``old_seq_len`` and ``new_seq_len``.
        ValueError: shape mismatches, negative positions, a seq_len not above its positions.
        TypeError: non-integer positions.
    """
    _check_keys(keys, spec)
    old = _as_positions(old_positions, "old_positions")
    new = _as_positions(new_positions, "new_positions")
    tokens = keys.shape[-2]
    if old.numel() != tokens or new.numel() != tokens:
        raise ValueError(
            f"positions must have shape ({tokens},) to match keys; got "
            f"{tuple(old.shape)} and {tuple(new.shape)}"
        )
    if spec.seq_len_dependent and (old_seq_len is None or new_seq_len is None):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: frequencies depend on the forward's sequence length; "
            "pass old_seq_len (largest position id + 1 of the forward that built the cache) and "
            "new_seq_len (same for the forward being reproduced)"
        )
    _check_seq_len(old_seq_len, old, "old_seq_len")
    _check_seq_len(new_seq_len, new, "new_seq_len")
    f_old = spec.inv_freq_for(old_seq_len)
    f_new = spec.inv_freq_for(new_seq_len)
    # Absolute angles exactly as transformers forms them (float32 product), difference in float64.
    a_old = old.to(torch.float32)[:, None] * f_old
    a_new = new.to(torch.float32)[:, None] * f_new
    theta = a_new.to(torch.float64) - a_old.to(torch.float64)
    cos = theta.cos().to(torch.float32)
    sin = theta.sin().to(torch.float32)
    return _rotate(keys, cos, sin, spec.rotary_dim)


def _delta_cos_sin(spec: RopeSpec, delta: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    key = ("delta", delta, inv_freq.data_ptr())
    cached = spec._cache.get(key)
    if cached is None:
        theta = float(delta) * inv_freq.to(torch.float64)
        cached = (theta.cos().to(torch.float32), theta.sin().to(torch.float32))
        if len(spec._cache) >= _DELTA_CACHE_MAX:
            spec._cache.clear()
        spec._cache[key] = cached
    return cached


def shift_keys(
    keys: torch.Tensor,
    delta: int,
    spec: RopeSpec,
    *,
    old_start: int | None = None,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Move a contiguous slice of cached keys by a constant ``delta`` positions.

    Args:
        keys: ``(..., kv_heads, tokens, head_dim)`` post-RoPE keys of a contiguous slice.
        delta: ``new_start - old_start`` (may be negative).
        spec: the model's :class:`RopeSpec`.
        old_start: position of the slice's first token when it was encoded. Given, this is
            ``rerotate_keys`` with ``old = old_start + arange(tokens)``, ``new = old + delta``:
            exact, including the model's float32 rounding of the absolute angles
            (recommended). Omitted, it is a pure rotation by ``delta * inv_freq`` (cos/sin
            cached per delta), which differs from a fresh prefill by up to
            ``~max(position) * 2**-24`` rad per pair.
        old_seq_len, new_seq_len: as in :func:`rerotate_keys` (dynamic / longrope only).

    Returns:
        Tensor of the same shape and dtype as ``keys``.

    Raises:
        UnsafeRerotation: dynamic / longrope without both seq lens, or without ``old_start``
            when the old and new forwards use different frequencies (then the rotation is not
            a function of ``delta`` alone).
    """
    _check_keys(keys, spec)
    tokens = keys.shape[-2]
    if old_start is not None:
        old = torch.arange(old_start, old_start + tokens, dtype=torch.int64)
        return rerotate_keys(
            keys, old, old + int(delta), spec, old_seq_len=old_seq_len, new_seq_len=new_seq_len
        )
    if spec.seq_len_dependent and (old_seq_len is None or new_seq_len is None):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: pass old_seq_len and new_seq_len (and old_start)"
        )
    f_old = spec.inv_freq_for(old_seq_len)
    f_new = spec.inv_freq_for(new_seq_len)
    if f_old is not f_new and not torch.equal(f_old, f_new):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: the forwards of length {old_seq_len} and {new_seq_len} "
            "use different frequencies, so the rotation depends on absolute positions; "
            "pass old_start"
        )
    cos, sin = _delta_cos_sin(spec, int(delta), f_old)
    return _rotate(keys, cos[None, :], sin[None, :], spec.rotary_dim)
