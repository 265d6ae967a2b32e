"""A model's RoPE as its transformers implementation computes it: :class:`RopeSpec` (one
RoPE), :class:`LayerRopes` (one per layer type: Gemma 3), :func:`model_rope`, and the verified
architectures (``inference/rope/__init__.py`` says what re-rotation relies on)."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coinrag.inference.rope.frequencies import (
    SUPPORTED_ROPE_TYPES,
    RopeType,
    UnsafeRerotation,
    UnsupportedRope,
)
from coinrag.inference.rope.rotate import rerotate_keys, rotation_cos_sin


@dataclass(frozen=True)
class _Arch:
    module: str  # transformers.models.<module>.modeling_<module>
    rotary: str  # its rotary-embedding class
    partial: bool = False  # applies RoPE to the first rotary_dim dims only (partial_rotary_factor)
    per_layer_type: bool = False  # one rope parameter set per layer type (rope_parameters[type])

    @staticmethod
    def named(model_type: str) -> _Arch:
        """The verified architecture ``model_type`` (UnsupportedRope naming why not)."""
        arch = _ARCHITECTURES.get(model_type)
        if arch is None:
            feature = UNSUPPORTED_FEATURES.get(model_type, "architecture not verified")
            raise UnsupportedRope(
                f"architecture {model_type!r} is not supported for key re-rotation ({feature}; "
                f"verified: {', '.join(VERIFIED_ARCHITECTURES)}); multimodal / M-RoPE, "
                "interleaved-RoPE and NoPE-layer architectures are refused"
            )
        return arch

    def rope_parameters(
        self, config: Any, model_type: str, layer_type: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The rope parameters of ``config`` for ``layer_type`` (per-layer RoPE: default
        ``full_attention``), and that layer type."""
        params = getattr(config, "rope_parameters", None)
        if not params:
            raise UnsupportedRope(f"{model_type!r} config has no rope_parameters")
        per_layer = "rope_type" not in params and "type" not in params
        if per_layer and not self.per_layer_type:
            raise UnsupportedRope(
                f"{model_type!r} rope_parameters look per-layer (keys {sorted(params)}); "
                "per-layer RoPE is not supported for this architecture"
            )
        if per_layer and layer_type is None:
            raise UnsupportedRope(
                f"{model_type!r} has per-layer RoPE (rope_parameters per layer type "
                f"{sorted(params)}): read it with model_rope(config), each layer its own"
            )
        if not self.per_layer_type:
            return params, layer_type
        layer_type = layer_type or "full_attention"
        if not isinstance(params.get(layer_type), dict):
            raise UnsupportedRope(
                f"{model_type!r} has no rope_parameters for layer type {layer_type!r}"
            )
        return params[layer_type], layer_type


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


def _rope_type(
    model_type: str,
    rope_type: str,
    params: dict[str, Any],
    per_layer_type: bool,
    layer_type: str | None,
) -> type[RopeType]:
    """The registered :class:`RopeType` of ``rope_type`` (UnsupportedRope naming why not)."""
    if "mrope_section" in params or "mrope" in str(rope_type):
        raise UnsupportedRope(f"rope type 'mrope' (multimodal RoPE, {rope_type!r}) is refused")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRope(
            f"rope type {rope_type!r} is not supported for key re-rotation "
            f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})"
        )
    kind = RopeType.registry[rope_type]
    if per_layer_type and kind.seq_len_dependent:
        raise UnsupportedRope(
            f"{model_type!r} layer type {layer_type!r}: rope type {rope_type!r} depends on "
            "the sequence length, which is not supported with per-layer RoPE"
        )
    return kind


class _LayerRotation:
    """What :class:`RopeSpec` and :class:`LayerRopes` share: the re-rotation of the keys of every
    layer, each group of layers with its own spec (:meth:`layer_groups`)."""

    def layer_groups(self, layers: int) -> list[tuple[RopeSpec, list[int]]]:
        """``(spec, layer indices)`` per group of layers sharing a RoPE, for ``layers`` layers."""
        raise NotImplementedError

    def rotation_cos_sin(
        self, layers: int, new_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin ``(tokens, rotary_dim / 2)`` float32 of :meth:`rotate_layers` from
        position 0 to ``new_positions`` (``(tokens,)`` int64) where one rotation serves all
        ``layers`` layers and does not depend on lengths; None otherwise (per-layer RoPE,
        dynamic / longrope): what a decode that rotates keys as it places them needs."""
        groups = self.layer_groups(layers)
        spec = groups[0][0]
        if len(groups) != 1 or spec.seq_len_dependent:
            return None
        return rotation_cos_sin(spec, torch.zeros_like(new_positions), new_positions)

    def rotate_layers(
        self,
        keys: torch.Tensor,
        old_positions: torch.Tensor | Sequence[int],
        new_positions: torch.Tensor | Sequence[int],
        *,
        old_seq_len: int | None = None,
        new_seq_len: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keys ``(layers, ..., kv_heads, tokens, head_dim)`` (dim 0: the model's layers) moved
        from ``old_positions`` to ``new_positions`` (:func:`rerotate_keys`), each layer with its
        own RoPE; same shape and dtype. ``out``: where to write the result (``keys`` itself
        too), else a new tensor. One RoPE for every layer: one rotation; per-layer RoPE:
        differentiable (one rotation per layer type, then re-interleaved) unless ``out`` is
        given."""
        groups = self.layer_groups(keys.shape[0])
        lens = {"old_seq_len": old_seq_len, "new_seq_len": new_seq_len}
        if len(groups) == 1:
            return rerotate_keys(keys, old_positions, new_positions, groups[0][0], **lens, out=out)
        parts: list[torch.Tensor | None] = [None] * keys.shape[0]
        for spec, layers in groups:
            index = torch.tensor(layers, device=keys.device)
            chosen = keys.index_select(0, index)
            moved = rerotate_keys(chosen, old_positions, new_positions, spec, **lens)
            for j, layer in enumerate(layers):
                parts[layer] = moved[j]
        if out is not None:  # every group read above before anything is written
            for layer, part in enumerate(parts):
                out[layer] = part
            return out
        return torch.stack([p for p in parts if p is not None])


@dataclass(frozen=True, eq=False)
class RopeSpec(_LayerRotation):
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
        arch = _Arch.named(model_type)
        params, layer_type = arch.rope_parameters(config, model_type, layer_type)
        rope_type = params.get("rope_type", params.get("type", "default"))
        kind = _rope_type(model_type, rope_type, params, arch.per_layer_type, layer_type)

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
            long_inv_freq=kind.long_inv_freq(config, params),
            layer_type=layer_type if arch.per_layer_type else None,
            _config=config if kind.keeps_config else None,
        )

    def layer_groups(self, layers: int) -> list[tuple[RopeSpec, list[int]]]:
        """One group: every layer has this RoPE."""
        return [(self, list(range(layers)))]

    def same_frequencies(self, seq_len_a: int, seq_len_b: int) -> bool:
        """Forwards of these lengths use the same frequencies (always, unless dynamic or
        longrope)."""
        if not self.seq_len_dependent:
            return True
        return torch.equal(self.inv_freq_for(seq_len_a), self.inv_freq_for(seq_len_b))

    @property
    def seq_len_dependent(self) -> bool:
        """True when the frequencies depend on the forward's length (dynamic, longrope)."""
        return RopeType.registry[self.rope_type].seq_len_dependent

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
        return RopeType.registry[self.rope_type].inv_freq_for(self, int(seq_len))


class LayerRopes(_LayerRotation):
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

    def layer_groups(self, layers: int) -> list[tuple[RopeSpec, list[int]]]:
        """Each layer type's spec and its layers (ValueError unless ``layers`` is the model's
        count)."""
        if layers != len(self.specs):
            raise ValueError(f"keys have {layers} layers on dim 0, the model {len(self.specs)}")
        return self._groups


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
    from transformers.cache_utils import get_layer_types_and_kwargs

    # The layer types as transformers builds each layer's cache (model/layers.py reads the
    # same answer; the layers a type names are checked there, by model support).
    types = [str(t) for t in get_layer_types_and_kwargs(text)[0]]
    by_type = {t: RopeSpec.from_config(text, layer_type=t) for t in dict.fromkeys(types)}
    return LayerRopes([by_type[t] for t in types])
