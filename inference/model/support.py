"""Which models the KV code reproduces exactly, decided from the model's config alone.

Exact means: a chunk's stored KV is what the model's own forward gives it, and a context
assembled from stored KV is what one forward over the same tokens at the same positions gives
(``README.md``, "Model families"). That holds for the architectures ``inference.rope`` verified
(RoPE applied with ``rotate_half`` after the q/k norms, one rope parameter set per model or
per layer type), whose layers are full-attention or sliding-window layers
(``inference.model.layers``). Anything else is refused here by name, with the feature that keeps it
out, before any work: the CLI's preflight calls :func:`check_model_reference`, which reads
``config.json`` (or a GGUF's header) and never loads weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from coinrag.inference.model.layers import AttentionLayers, UnsupportedAttention
from coinrag.inference.rope import (
    UNSUPPORTED_FEATURES,
    VERIFIED_ARCHITECTURES,
    UnsupportedRope,
    model_rope,
)

# GGUF `general.architecture` -> transformers model_type, for the verified architectures that
# transformers' GGUF loader reads.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen2moe": "qwen2_moe",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gptneox": "gpt_neox",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "olmo2": "olmo2",
}


class UnsupportedModel(ValueError):
    """A model whose KV the build and the KV-reuse methods cannot reproduce exactly; the
    message names its model type and the feature."""


def _unverified(model_type: str) -> UnsupportedModel:
    feature = UNSUPPORTED_FEATURES.get(model_type, "architecture not verified for KV reuse")
    return UnsupportedModel(
        f"model type {model_type!r}: {feature} is not supported (supported model types: "
        f"{', '.join(VERIFIED_ARCHITECTURES)})"
    )


def check_config(config: Any) -> None:
    """Refuse a transformers config whose model is not exact here (:class:`UnsupportedModel`,
    one line: model type, feature, what is supported)."""
    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", None) or type(text).__name__)
    if model_type not in VERIFIED_ARCHITECTURES:
        raise _unverified(model_type)
    if getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModel(
            f"model type {model_type!r}: bidirectional attention is not supported (causal only)"
        )
    try:
        AttentionLayers.from_config(text)
        model_rope(text)
    except (UnsupportedAttention, UnsupportedRope) as exc:
        raise UnsupportedModel(f"model type {model_type!r}: {exc}") from None


def check_model_reference(found: Path) -> None:
    """:func:`check_config` of a located model (``inference.model.loading.locate_model``): a
    folder's ``config.json``; a GGUF's converted folder when it exists, else its header's
    architecture (the only thing checked before conversion)."""
    folder = found if found.is_dir() else _converted_folder(found)
    if folder is not None:
        check_config(_read_config(folder))
        return
    arch = gguf_architecture(found)
    model_type = GGUF_ARCHITECTURES.get(arch)
    if model_type is None:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} ({found.name}): not a verified architecture "
            f"(supported GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )


def _read_config(folder: Path) -> Any:
    """The transformers config of ``folder/config.json`` (no weights read); a model type that
    is not verified is refused from the JSON alone, before transformers parses it."""
    from transformers import AutoConfig

    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{path} is unreadable: {exc}") from None
    model_type = str(raw.get("model_type")) if isinstance(raw, dict) else None
    if model_type not in VERIFIED_ARCHITECTURES:
        raise _unverified(str(model_type))
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModel(
            f"model type {model_type!r}: {path} does not load: {first}"
        ) from None


def _converted_folder(gguf: Path) -> Path | None:
    from coinrag.inference.model.loading import cache_dir, file_sha256

    folder = cache_dir() / "models" / f"gguf-{file_sha256(gguf)[:16]}"
    return folder if (folder / "config.json").is_file() else None


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header (no tensor touched).
    ValueError when the file is not a GGUF or has no such key."""
    with path.open("rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(size))[0]

        def string() -> str:
            return f.read(read("<Q")).decode("utf-8", errors="replace")

        def skip(kind: int) -> None:
            if kind == _GGUF_STRING:
                f.seek(read("<Q"), 1)
            elif kind == _GGUF_ARRAY:
                inner, count = read("<I"), read("<Q")
                if inner in _GGUF_SCALARS:
                    f.seek(_GGUF_SCALARS[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_GGUF_SCALARS[kind], 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("<I")  # version
        read("<Q")  # tensors
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            if key == "general.architecture" and kind == _GGUF_STRING:
                return string()
            skip(kind)
    raise ValueError(f"{path} has no general.architecture")
