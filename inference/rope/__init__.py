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
which layer is which is ``config.layer_types`` (``inference.model.layers.AttentionLayers``). Each
layer's keys are re-rotated with that layer's :class:`RopeSpec`, taken from the model's own
rotary module for that layer type. Code that places KV of every layer takes a
:data:`ModelRope`: a :class:`RopeSpec` (one RoPE for every layer) or a :class:`LayerRopes`.

The code is split by job: ``rope_frequencies.py`` (the rope types as registered plug-ins,
:class:`ForwardFrequencies`, :func:`reset_rotary`), ``rope_spec.py`` (:class:`RopeSpec`,
:class:`LayerRopes`, :func:`model_rope`, the verified architectures), ``rope_rotate.py``
(:func:`rerotate_keys`, :func:`shift_keys`); this module is their one import point.
"""

from __future__ import annotations

from coinrag.inference.rope.frequencies import (
    SUPPORTED_ROPE_TYPES,
    ForwardFrequencies,
    RopeType,
    UnsafeRerotation,
    UnsupportedRope,
    reset_rotary,
)
from coinrag.inference.rope.rotate import rerotate_keys, shift_keys
from coinrag.inference.rope.spec import (
    UNSUPPORTED_FEATURES,
    VERIFIED_ARCHITECTURES,
    LayerRopes,
    ModelRope,
    RopeSpec,
    model_rope,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "UNSUPPORTED_FEATURES",
    "VERIFIED_ARCHITECTURES",
    "ForwardFrequencies",
    "LayerRopes",
    "ModelRope",
    "RopeSpec",
    "RopeType",
    "UnsafeRerotation",
    "UnsupportedRope",
    "model_rope",
    "rerotate_keys",
    "reset_rotary",
    "shift_keys",
]
