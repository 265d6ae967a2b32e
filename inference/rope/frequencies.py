"""Which RoPE frequencies a forward uses: the rope types as plug-ins, and the rotary state.

A rope type (``config.rope_parameters["rope_type"]``) is a subclass of :class:`RopeType`
registered by its transformers name (``class DynamicRope(RopeType, name="dynamic")``):
``RopeType.registry[name]`` (an unknown name raises ``UnknownPlugin`` listing the supported
ones). A type says whether its frequencies depend on the forward's length (``dynamic``,
``longrope``), the length above which they change (:meth:`RopeType.threshold`), which lengths
share frequencies (:meth:`RopeType.frequency_key`), and the frequencies of a forward of a given
length (:meth:`RopeType.inv_freq_for`), all computed by transformers' own
``ROPE_INIT_FUNCTIONS`` as its ``dynamic_rope_update`` does (``inference/rope/__init__.py``).

:class:`ForwardFrequencies` batches by it from a config alone; :func:`reset_rotary` puts a
model's dynamic-NTK rotary modules back into their initial state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from coinrag.schemas.registry import Registered, Registry

if TYPE_CHECKING:
    from coinrag.inference.rope.spec import RopeSpec

# The rope types whose re-rotation was verified against transformers (registered below).
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic", "longrope")


class UnsupportedRope(ValueError):
    """The model's RoPE variant (or architecture) cannot be re-rotated exactly; refused by name."""


class UnsafeRerotation(ValueError):
    """The re-rotation is not determined by the given arguments (e.g. dynamic NTK without the
    sequence lengths the frequencies depend on)."""


class RopeType(Registered):
    """One rope type: a frequency set fixed at init (the base class: default, linear, yarn,
    llama3), or one that depends on the forward's length (dynamic, longrope)."""

    registry: ClassVar[Registry[RopeType]] = Registry("rope type", ROPE_TYPES)
    seq_len_dependent: ClassVar[bool] = False
    keeps_config: ClassVar[bool] = False  # RopeSpec keeps the config to recompute frequencies

    @classmethod
    def of(cls, rope_type: str) -> type[RopeType]:
        """The type a forward behaves as, for any name (also one :class:`RopeSpec` refuses):
        a name containing ``dynamic`` as ``dynamic_rope_update`` tests it, a registered name,
        else one whose frequencies are fixed."""
        if "dynamic" in rope_type:
            return DynamicRope
        return cls.registry[rope_type] if rope_type in cls.registry else RopeType

    @classmethod
    def threshold(cls, config: Any, params: dict[str, Any]) -> int | None:
        """The forward length (largest position id + 1) above which the frequencies change;
        None for a type whose frequencies never do."""
        return None

    @classmethod
    def frequency_key(cls, seq_len: int, threshold: int) -> int:
        """Equal for forward lengths that use the same frequencies (given :meth:`threshold`)."""
        return 0

    @classmethod
    def long_inv_freq(cls, config: Any, params: dict[str, Any]) -> torch.Tensor | None:
        """Float32 ``(rotary_dim // 2,)`` frequencies of a long forward (longrope), else None."""
        return None

    @classmethod
    def inv_freq_for(cls, spec: RopeSpec, seq_len: int) -> torch.Tensor:
        """The frequencies a fresh rotary embedding uses for a forward of length ``seq_len``."""
        return spec.inv_freq


class DefaultRope(RopeType, name="default"):
    pass


class LinearRope(RopeType, name="linear"):
    pass


class YarnRope(RopeType, name="yarn"):
    pass


class Llama3Rope(RopeType, name="llama3"):
    pass


class DynamicRope(RopeType, name="dynamic"):
    """Dynamic NTK: the init frequencies up to ``max_position_embeddings``, above that
    computed from the forward's length itself."""

    seq_len_dependent = True
    keeps_config = True

    @classmethod
    def threshold(cls, config: Any, params: dict[str, Any]) -> int | None:
        return int(config.max_position_embeddings)

    @classmethod
    def frequency_key(cls, seq_len: int, threshold: int) -> int:
        return int(seq_len) if seq_len > threshold else 0  # one set per length above

    @classmethod
    def inv_freq_for(cls, spec: RopeSpec, seq_len: int) -> torch.Tensor:
        if seq_len <= spec.max_position_embeddings:
            return spec.inv_freq
        key = ("dynamic", seq_len)
        cached = spec._cache.get(key)
        if cached is None:
            # transformers passes `torch.max(position_ids) + 1`, an int64 tensor: same arithmetic.
            inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](
                spec._config, None, seq_len=torch.tensor(seq_len, dtype=torch.int64)
            )
            cached = inv.detach().to(device="cpu", dtype=torch.float32).clone()
            spec._cache[key] = cached
        return cached


class LongRope(RopeType, name="longrope"):
    """LongRoPE: short factors up to ``original_max_position_embeddings``, long ones above."""

    seq_len_dependent = True

    @classmethod
    def threshold(cls, config: Any, params: dict[str, Any]) -> int | None:
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        return int(original)

    @classmethod
    def frequency_key(cls, seq_len: int, threshold: int) -> int:
        return int(seq_len > threshold)

    @classmethod
    def long_inv_freq(cls, config: Any, params: dict[str, Any]) -> torch.Tensor | None:
        # As transformers' longrope_frequency_update: long factors are computed with
        # seq_len = original_max_position_embeddings + 1; attention_scaling stays the init one.
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
            config, None, seq_len=int(params["original_max_position_embeddings"]) + 1
        )
        return long_inv_freq.detach().to(device="cpu", dtype=torch.float32).clone()

    @classmethod
    def inv_freq_for(cls, spec: RopeSpec, seq_len: int) -> torch.Tensor:
        assert spec.long_inv_freq is not None and spec.original_max_position_embeddings
        if seq_len > spec.original_max_position_embeddings:
            return spec.long_inv_freq
        return spec.inv_freq


SUPPORTED_ROPE_TYPES = frozenset(ROPE_TYPES)
assert set(RopeType.registry) == SUPPORTED_ROPE_TYPES, "ROPE_TYPES names every rope type"


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
            out.append((rope_type, RopeType.of(rope_type).threshold(config, params)))
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
            else:
                out.append(RopeType.of(rope_type).frequency_key(seq_len, threshold))
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
