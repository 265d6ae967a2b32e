"""Every setting of coinrag, declared once: what a build, a fine-tuning run and the cartridge
pipeline compute, with their defaults and checks.

- :class:`BuildSettings`: ``coinrag build`` / ``serve``, read from defaults < config file (TOML)
  < command line (:func:`load_settings`);
- :class:`RuntimeSettings`, :class:`ApiSettings`: how ``query`` / ``eval`` and ``api`` compute;
- :class:`QueryOptions`: what one question asks (``coinrag query``'s options and the server's
  request fields, generated from it); :class:`EvalOptions`: ``coinrag eval``'s options;
- :class:`FinetuneSettings`: nugget-aware fine-tuning (``coinrag train nuggets``,
  ``training/finetune.py``);
- :class:`CartridgeSettings`: the cartridge pipeline (``coinrag train cartridges``), and the
  two views of it the stages take: :class:`TeacherSettings` (``tasks/teacher.py``) and
  :class:`CartridgeTrainSettings` (``training/budget.py``); declared in
  ``schemas/training_settings.py``, importable from here.

Build settings
--------------

The config file holds the same names as the CLI options, in a ``[build]`` table::

    [build]
    extractor = "openai"        # openai | openai-batch | local | rules | none
    llm_model = "gpt-4o-mini"
    model = "smollm2"           # generation model: folder, .gguf file, or "smollm2"
    embedder = "minilm"         # packaged all-MiniLM-L6-v2, "mpnet", or a local folder
    embed_dtype = "float32"     # float32 | bfloat16 (stored vectors; bfloat16 ~2x faster)
    embed_window = 0            # word pieces embedded at once (0: the embedder's own)
    chunker = "fixed"           # fixed (the paper's) | sentence | content (edit-stable) | section
    chunk_size = 512
    tau = 0.7
    kv_dtype = "auto"           # auto | float32 | bfloat16 | float16 (KV forward and store)
    kv_codec = "none"           # none | int8 | int4 | int2 | int2mix | int2basis (stored KV)
    kv_keep = "chunks"          # chunks | nuggets (store only the KV of nugget spans)
    retrieval = "hybrid"        # dense | lexical | hybrid (how queries rank; per query too)
    rerank = "none"             # none | pages | support | upr (reorder the top chunks: a page's
                                # best first; pages by support; or by the model's likelihood)

Secrets never live here: the OpenAI client reads OPENAI_API_KEY (and OPENAI_BASE_URL) from the
environment, and nothing in this module reads or records them.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# How a setting is declared (schemas/fields.py), and the training pipelines' settings
# (schemas/training_settings.py): importable from here too, as every setting is.
from coinrag.schemas.fields import SettingsError as SettingsError
from coinrag.schemas.fields import check_choices as check_choices
from coinrag.schemas.fields import setting as setting
from coinrag.schemas.training_settings import FINETUNE_MODES as FINETUNE_MODES
from coinrag.schemas.training_settings import QUESTION_GENERATORS as QUESTION_GENERATORS
from coinrag.schemas.training_settings import CartridgeSettings as CartridgeSettings
from coinrag.schemas.training_settings import CartridgeTrainSettings as CartridgeTrainSettings
from coinrag.schemas.training_settings import FinetuneSettings as FinetuneSettings
from coinrag.schemas.training_settings import TeacherSettings as TeacherSettings
from coinrag.schemas.training_settings import check_visibility as check_visibility

EXTRACTORS = ("openai", "openai-batch", "local", "rules", "none")
# The KV forward's dtype: auto = bfloat16 where the device computes it natively, else float32
# (inference/model/kv_dtype.py decides, per machine).
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
EMBED_DTYPES = ("float32", "bfloat16")  # dtypes stored texts are embedded in (embed_dtype)
MIN_EMBED_WINDOW, MAX_EMBED_WINDOW = 32, 8192  # embed_window: room for a heading path .. BGE-M3
# How stored KV is encoded: none (as computed, bit for bit) | int8 | int4 | int2 | int2mix |
# int2basis (quantized per block: keys per channel, values per token, int2mix's per channel;
# int2basis: int2mix's keys in the store's calibrated key basis, storage/kv/basis.py;
# storage/kv/codecs.py, lowbit.py and mixed.py state the error bounds).
KV_CODECS = ("none", "int8", "int4", "int2", "int2mix", "int2basis")
# What the KV store keeps of each chunk (storage/kv/kept.py): the whole chunk's KV (every method
# can use it), or only the token ranges its nuggets cover (coinrag and training read only those).
KV_KEEPS = ("chunks", "nuggets")
# How the model runs query prefill and decoding (inference/model/forward.py): eager (a preallocated
# KV buffer, the model's layers driven over it) | compiled (the same step under torch.compile,
# bucketed shapes, warmed up before serving) | graphs (the same step captured as one CUDA graph
# per bucketed shape and replayed, inference/model/graphs.py) | auto (for coinrag api and eval:
# graphs on a CUDA device, compiled on another accelerator, eager on a CPU; eager for a one-shot
# coinrag query).
FORWARDS = ("auto", "eager", "compiled", "graphs")
# Where chunks end (tasks/chunk.py): every chunk_size tokens (fixed, the paper's) | at sentence
# ends | content-defined (edit-stable) | at the document's headings (section).
CHUNKERS = ("fixed", "sentence", "content", "section")
# Document readers by file format (tasks/readers/): what a folder SOURCE reads.
READERS = ("text", "markdown", "rst", "html", "pdf", "docx")
HTML_MODES = ("main", "whole")  # html reader: the main content (trafilatura) or the whole body
# How retrieval ranks chunks, nuggets and documents (inference.retrieval.retriever.SEARCH_MODES; a
# test keeps them equal): by embedding (dense), by BM25 over the words (lexical), or both fused
# (hybrid).
RETRIEVAL_MODES = ("dense", "lexical", "hybrid")
DEFAULT_RETRIEVAL = "hybrid"
# How the top chunks of a search are reordered before kc are kept
# (inference.retrieval.rerank.Reranker.registry; a test keeps them equal): not at all (none), each
# page's best chunk before any page's second (pages; support: pages by best + a share of 2nd best),
# or by the generation model's likelihood of the question given each chunk (upr, over its KV).
RERANKERS = ("none", "pages", "support", "upr")
DEFAULT_RERANK = "none"
RUNNERS = ("default", "dask", "ray")
KV_VERIFY_LEVELS = ("crc32c", "stat", "sha256")
# The RAG methods: the names of inference/methods' registry (METHODS; a test keeps them equal),
# known here so the CLI checks them before anything loads.
RAG_METHODS = (
    "coinrag",
    "turborag",
    "standard",
    "cartridge",
    "cacheblend",
    "cacheblend-v",
    "kvlink",
    "coinrag-isolated",
    "coinrag-noalign",
    "coinrag-onestage",
)
DEFAULT_RAG_METHODS = ("coinrag", "turborag", "standard")  # eval's default (cartridge: trained)
LOCAL_STORE_METHODS = ("cartridge",)  # read assets only a local store holds (cartridges)


def threads_setting() -> Any:
    """The ``threads`` setting (one declaration, a field of each settings class that runs
    models): torch's and the BLAS/OpenMP pools' threads, set once per process
    (``inference/model/threads.py``; 0 = auto: 1 on at most 2 usable CPUs, else min(physical cores,
    4))."""
    return setting(
        0,
        "Threads of torch and the BLAS/OpenMP pools (default 0: auto = 1 on a machine with at "
        "most 2 usable CPUs, else min(physical cores, 4)).",
        cli=True,
        min=0,
    )


def forward_setting() -> Any:
    """The ``forward`` setting (one declaration, a field of each settings class that answers
    questions): how the model runs query prefill and decoding (``inference/model/forward.py``)."""
    return setting(
        "auto",
        "Model forward: eager | compiled (torch.compile, warmed up first) | graphs (CUDA "
        "graphs, captured at warm-up) | auto (default: for api and eval graphs on CUDA, "
        "compiled on another accelerator, eager on a CPU; eager for query).",
        cli=True,
    )


def resident_kv_setting() -> Any:
    """The ``kv_resident_bytes`` setting (one declaration, a field of each settings class that
    answers questions): device bytes of stored KV slices a reader keeps on a GPU between
    questions (``inference/model/kv_transfer.py``; 0: none)."""
    return setting(
        0,
        "Bytes of GPU memory that keep recently read KV slices between questions (default 0: "
        "none; CUDA only).",
        cli=True,
        min=0,
    )


def check_forward(value: str) -> str:
    """``value`` if it is one of :data:`FORWARDS`, else a :class:`SettingsError` naming them."""
    if value not in FORWARDS:
        raise SettingsError(f"forward must be one of {', '.join(FORWARDS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class BuildSettings:
    """Everything that decides what a build produces (plus how hard it may push an endpoint).

    The fields marked ``cli=True`` are the options of ``coinrag build`` and ``coinrag serve``
    (generated from here; the others are set in the config file's ``[build]`` table).
    """

    extractor: str | None = setting(
        None,  # None: "openai" if OPENAI_API_KEY is set, else "local"
        "openai | openai-batch | local | rules | none "
        "(default: openai if OPENAI_API_KEY is set, else local).",
        cli=True,
    )
    llm_model: str = setting("gpt-4o-mini", "LLM for extraction (default {default}).", cli=True)
    model: str = setting(
        "smollm2",
        "Generation model whose tokenizer chunks: a folder, a .gguf file, or "
        "'smollm2' (default, the packaged SmolLM2-135M-Instruct).",
        cli=True,
    )
    html_mode: str = setting(
        "main",
        "main | whole: of an HTML file, read the main content (default; navigation, sidebars "
        "and footers dropped) or the whole body.",
        cli=True,
    )
    exclude: str = setting(
        "",
        "Comma-separated globs of SOURCE paths to leave out, relative to SOURCE "
        "('_sources/*,drafts/*'; * crosses folders).",
        cli=True,
    )
    max_file_bytes: int = 200 * 2**20  # a larger file of a folder SOURCE is rejected unread
    chunker: str = setting(
        "fixed",
        "fixed (default) | sentence | content (edit-stable) | section (chunks start at "
        "headings; a section that fits is not split).",
        cli=True,
    )
    chunk_size: int = setting(512, "Tokens per chunk (default {default}).", cli=True)
    tau: float = setting(0.7, "Fuzzy recovery threshold (default {default}).", cli=True)
    concurrency: int = setting(8, "Simultaneous LLM requests (default {default}).", cli=True)
    max_attempts: int = 5  # requests per chunk text and build: 429/5xx/timeouts, repairs
    # A chunk text whose replies were malformed in this many builds (same extractor
    # fingerprint) is abandoned: no LLM nuggets, not asked again (tasks/extract.py).
    abandon_after: int = 3
    retry_abandoned: bool = setting(
        False,  # one build: ask the abandoned chunk texts of this extractor again
        "Ask again the chunk texts abandoned after repeatedly malformed replies.",
        cli=True,
        flag="--retry-abandoned",
    )
    request_timeout: float = 60.0  # seconds, per request
    batch_poll_interval: float = 30.0  # seconds between Batch API status polls
    batch_max_rounds: int = 3  # resubmissions of failed/expired batch requests
    local_max_nuggets: int = 8  # local extractor: spans per chunk at least (1.5 per clause head)
    extract_batch_size: int = 32  # chunks per Prefect extraction task
    device: str = setting(
        "cpu", "Torch device of the generation model (default {default}).", cli=True
    )
    embedder: str = setting(
        "minilm",  # "minilm" | "mpnet" (packaged all-MiniLM-L6-v2 / all-mpnet-base-v2) | a folder
        "'minilm' (default, packaged all-MiniLM-L6-v2), 'mpnet' (packaged all-mpnet-base-v2: "
        "better on natural questions, about 5x slower to embed) or a local folder (BGE-M3).",
        cli=True,
    )
    embed_dtype: str = setting(
        "float32",  # dtype the embedder computes stored vectors in (EMBED_DTYPES)
        "float32 | bfloat16: dtype the embedder computes the index's vectors in (default "
        "float32; bfloat16 embeds 1.7-2.1x faster on a CPU with AVX512-BF16, vectors within "
        "cosine 0.9999 of float32's; part of the embedder's fingerprint: a change re-embeds).",
        cli=True,
    )
    embed_window: int = setting(
        0,  # word pieces per embedded text, the width of a chunk's windows (0: the embedder's own)
        "Word pieces the embedder sees at once, the width of a chunk's windows (default 0: the "
        "embedder's own); part of the embedder's fingerprint: a change re-embeds.",
        cli=True,
    )
    kv: bool = True  # build the per-chunk KV of `model`
    kv_dtype: str = setting(
        "auto",  # dtype of the KV forward and of the stored KV (KV_DTYPES)
        "auto | float32 | bfloat16 | float16: dtype of the KV forward and of the stored "
        "KV (default auto: bfloat16 where the device computes it natively, else float32).",
        cli=True,
    )
    kv_codec: str = setting(
        "none",  # how the stored KV is encoded (KV_CODECS)
        "none | int8 | int4 | int2 | int2mix | int2basis: how the stored KV is encoded "
        "(default none: as computed; int8 ~0.58, int4 ~0.33, int2, int2mix and int2basis "
        "~0.14 of the raw bfloat16 bytes, quantized per block; int2basis codes keys in a "
        "basis calibrated on the store's first chunks).",
        cli=True,
    )
    kv_keep: str = setting(
        "chunks",  # what is stored of each chunk's KV (KV_KEEPS)
        "chunks | nuggets: store each chunk's whole KV (default), or only the token ranges "
        "its nuggets cover (coinrag and training read those; turborag cannot run).",
        cli=True,
    )
    kv_batch_size: int = 4  # chunks per forward pass in the KV stage
    kv_fill_device: bool = True  # on a CUDA device: batches as large as its free memory holds
    retrieval: str = setting(
        DEFAULT_RETRIEVAL,
        "How queries of this store rank chunks and nuggets: dense | lexical | hybrid "
        "(default {default}).",
        cli=True,
    )
    rerank: str = setting(
        DEFAULT_RERANK,
        "How queries of this store reorder the top chunks of a search: none (default) | pages "
        "(each page's best chunk before any page's second) | support (so, pages ranked by best "
        "chunk + a share of the second: train fusion's, else 0.5) | upr (the model's likelihood "
        "of the question given each chunk, over its KV if any, else encoded per query: slow).",
        cli=True,
        choices=RERANKERS,
    )
    index: bool = True  # embed chunks, nuggets and documents into LanceDB
    prune: bool = setting(
        False,  # tombstone live documents that are absent from SOURCE
        "Tombstone the store's documents that are absent from SOURCE.",
        cli=True,
        flag="--prune",
    )
    embed_batch_size: int = 4096  # texts per embedding task (and per embeddings-cache file)
    # Scale-out (flows/scaleout.py): where the tasks run. Never changes what is built.
    runner: str = setting(
        "default", "Where tasks run: default (this process) | dask | ray.", cli=True
    )
    runner_address: str = setting(
        "",  # "" = a local cluster of `workers`
        "Dask scheduler (tcp://host:8786) or Ray address; default: a local cluster.",
        cli=True,
    )
    workers: int = setting(
        2, "Worker processes of a local Dask/Ray cluster (default {default}).", cli=True
    )
    kv_resources: str = setting(
        "",  # e.g. "GPU=1": only workers offering these take the KV tasks
        "Worker resources each KV task needs, e.g. GPU=1 (dask/ray).",
        cli=True,
    )
    # KV safety (README "The KV cache"): what a reused entry is checked with before the build
    # counts it valid, and the disk-space check before extraction. Config file only: the
    # space check's error names the config setting that turns it off.
    kv_verify: str = "crc32c"  # crc32c (every block of reused entries) | stat | sha256
    kv_space_check: bool = True  # refuse a build whose new KV does not fit on the store's disk
    kv_min_free_bytes: int = 0  # bytes the new KV must leave free on that disk
    threads: int = threads_setting()  # of the build process (never changes what is built)

    def resolved_extractor(self) -> str:
        """The extractor to use: the setting, else openai when a key is set, else local."""
        if self.extractor:
            return self.extractor
        return "openai" if os.environ.get("OPENAI_API_KEY") else "local"

    def validate(self) -> BuildSettings:
        """Raise :class:`SettingsError` naming the bad value; return self."""
        if self.extractor is not None and self.extractor not in EXTRACTORS:
            raise SettingsError(
                f"extractor {self.extractor!r} is not one of {', '.join(EXTRACTORS)}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise SettingsError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.embed_dtype not in EMBED_DTYPES:
            raise SettingsError(
                f"embed_dtype {self.embed_dtype!r} is not one of {', '.join(EMBED_DTYPES)}"
            )
        if self.embed_window and not MIN_EMBED_WINDOW <= self.embed_window <= MAX_EMBED_WINDOW:
            lo, hi = MIN_EMBED_WINDOW, MAX_EMBED_WINDOW
            raise SettingsError(f"embed_window {self.embed_window} is outside {lo}..{hi} (or 0)")
        if self.kv_codec not in KV_CODECS:
            raise SettingsError(f"kv_codec {self.kv_codec!r} is not one of {', '.join(KV_CODECS)}")
        if self.kv_keep not in KV_KEEPS:
            raise SettingsError(f"kv_keep {self.kv_keep!r} is not one of {', '.join(KV_KEEPS)}")
        if self.kv_keep == "nuggets" and self.kv and self.extractor == "none":
            raise SettingsError(
                'kv_keep = "nuggets" stores the KV of nugget spans, and extractor none extracts '
                'no nuggets: nothing would be stored; use kv_keep = "chunks" or an extractor'
            )
        if self.retrieval not in RETRIEVAL_MODES:
            raise SettingsError(
                f"retrieval {self.retrieval!r} is not one of {', '.join(RETRIEVAL_MODES)}"
            )
        if self.rerank not in RERANKERS:
            raise SettingsError(f"rerank {self.rerank!r} is not one of {', '.join(RERANKERS)}")
        if self.html_mode not in HTML_MODES:
            raise SettingsError(
                f"html_mode {self.html_mode!r} is not one of {', '.join(HTML_MODES)}"
            )
        if self.max_file_bytes < 1:
            raise SettingsError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.chunker not in CHUNKERS:
            raise SettingsError(f"chunker {self.chunker!r} is not one of {', '.join(CHUNKERS)}")
        if not 8 <= self.chunk_size <= 32768:
            raise SettingsError(f"chunk_size {self.chunk_size} is outside 8..32768")
        if not 0.0 < self.tau <= 1.0:
            raise SettingsError(f"tau {self.tau} is outside (0, 1]")
        for name in (
            "concurrency",
            "max_attempts",
            "abandon_after",
            "batch_max_rounds",
            "extract_batch_size",
            "kv_batch_size",
            "embed_batch_size",
            "workers",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.runner not in RUNNERS:
            raise SettingsError(f"runner {self.runner!r} is not one of {', '.join(RUNNERS)}")
        if self.runner_address and self.runner == "default":
            raise SettingsError(
                f"runner_address {self.runner_address!r} needs runner dask or ray, not default"
            )
        parse_resources(self.kv_resources)
        if self.kv_verify not in KV_VERIFY_LEVELS:
            raise SettingsError(
                f"kv_verify {self.kv_verify!r} is not one of {', '.join(KV_VERIFY_LEVELS)}"
            )
        if self.kv_min_free_bytes < 0:
            raise SettingsError(f"kv_min_free_bytes must be >= 0, got {self.kv_min_free_bytes}")
        if self.threads < 0:
            raise SettingsError(f"threads must be >= 0 (0: auto), got {self.threads}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for runs.parameters_json and STORE/coinrag.toml)."""
        return asdict(self)


def parse_resources(spec: str) -> dict[str, float]:
    """``"GPU=1,MEM=16e9"`` -> ``{"GPU": 1.0, "MEM": 16e9}`` (``""`` -> ``{}``)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        try:
            amount = float(value)
        except ValueError:
            amount = -1.0
        if not sep or not name.strip() or amount <= 0:
            raise SettingsError(
                f"kv_resources {spec!r}: {part!r} is not NAME=AMOUNT with AMOUNT > 0"
            )
        out[name.strip()] = amount
    return out


def setting_names() -> list[str]:
    return [f.name for f in dataclasses.fields(BuildSettings)]


def cli_settings(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings class that are command-line options (``setting(cli=True)``)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def load_settings(
    config_path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None
) -> BuildSettings:
    """Defaults, then the ``[build]`` table of a TOML file, then non-None ``overrides``."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if config_path is not None:
        path = Path(config_path)
        origin = str(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise SettingsError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc
    return settings_from_toml(data, origin, overrides)


def settings_from_toml(
    data: dict[str, Any], origin: str, overrides: dict[str, Any] | None = None
) -> BuildSettings:
    """Defaults, then the ``[build]`` table of parsed TOML (``origin`` names it in errors; a
    table without ``[build]`` is taken whole), then non-None ``overrides``."""
    values: dict[str, Any] = {}
    table = data.get("build", data)
    unknown = sorted(set(table) - set(setting_names()))
    if unknown:
        raise SettingsError(
            f"config file {origin}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(setting_names())}"
        )
    values.update(table)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return BuildSettings(**values).validate()
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


# ---------------------------------------------------------------------------- answering


@dataclass(frozen=True)
class RuntimeSettings:
    """How a reading process computes (``coinrag query``, ``coinrag eval``): options generated
    from the ``cli=True`` fields."""

    threads: int = threads_setting()
    forward: str = forward_setting()
    kv_resident_bytes: int = resident_kv_setting()

    def __post_init__(self) -> None:
        check_forward(self.forward)
        if self.kv_resident_bytes < 0:
            raise SettingsError(f"kv_resident_bytes must be >= 0, got {self.kv_resident_bytes}")


@dataclass(frozen=True)
class QueryOptions:
    """What one question asks, declared once: the options of ``coinrag query`` (generated by
    ``flows/settings_options.py``, with these defaults) and the fields of a server request
    (``inference/server/requests.py``, the same defaults; ``cap``: the :class:`ApiSettings`
    field that bounds it there). ``max_new_tokens`` is also ``coinrag api``'s and ``eval``'s
    default, ``kc``/``k`` eval's sweep default and the engine's."""

    method: str = setting("coinrag", " | ".join(RAG_METHODS), cli=True, choices=RAG_METHODS)
    kc: int = setting(4, "Chunks retrieved in stage 1.", cli=True, min=1, cap="max_kc")
    k: int = setting(
        10,
        "Nuggets retrieved in stage 2 (coinrag); documents (cartridge).",
        cli=True,
        min=1,
        cap="max_k",
    )
    max_new_tokens: int = setting(
        32, "Upper bound on answer tokens.", cli=True, min=1, cap="max_new_tokens"
    )
    oracle_doc: str | None = setting(
        None,
        "Oracle mode: answer from this document only (cartridge: its cartridge; the others: "
        "retrieval among its chunks).",
        cli=True,
    )
    retrieval: str | None = setting(  # search mode; None: the store's retrieval setting
        None,
        " | ".join(RETRIEVAL_MODES) + " (default: the store's retrieval setting).",
        cli=True,
        choices=RETRIEVAL_MODES,
    )

    @property
    def doc_ids(self) -> list[str] | None:
        """The documents retrieval is confined to: ``[oracle_doc]``, or None (all)."""
        return [self.oracle_doc] if self.oracle_doc else None


DEFAULT_QUERY = QueryOptions()  # the one place the query defaults are read from


@dataclass(frozen=True)
class EvalOptions:
    """The options of ``coinrag eval`` (generated by ``flows/settings_options.py``): lists are
    sweeps (``--kc 1 2 4``); None: the :class:`QueryOptions` default (``kc``, ``k``), the
    default methods the store can run, the store's retrieval setting."""

    methods: list[str] | None = setting(
        None, "Methods (default: coinrag turborag standard): --methods coinrag cartridge", cli=True
    )
    kc: list[int] | None = setting(None, "kc values to sweep: --kc 1 2 4", cli=True, min=1)
    k: list[int] | None = setting(None, "k values to sweep: --k 5 10", cli=True, min=1)
    max_new_tokens: int = setting(
        DEFAULT_QUERY.max_new_tokens, "Upper bound on answer tokens.", cli=True, min=1
    )
    limit: int | None = setting(None, "Only the first N questions.", cli=True, min=1)
    model: list[str] | None = setting(
        None,
        "Models to compare, LABEL=REF (REF: a model folder, a KVLink adapter folder, or default "
        "for the store's): --model trained=OUT base=default; run a method on one with --methods "
        "coinrag@base (a bare name runs on the first).",
        cli=True,
    )
    limit_for: list[str] | None = setting(
        None,
        "A method on the first N questions only: --limit-for standard=20 kvlink@links=20",
        cli=True,
    )
    retrieval: list[str] | None = setting(
        None,
        "Search modes to compare: --retrieval dense lexical hybrid (default: the store's "
        "retrieval setting; with --retrieval-only: all three).",
        cli=True,
        choices=RETRIEVAL_MODES,
    )
    rerank: str | None = setting(
        None,
        " | ".join(RERANKERS) + ": how the top chunks are reordered (default: the store's "
        "rerank setting).",
        cli=True,
        choices=RERANKERS,
    )
    retrieval_only: bool = setting(
        False,
        "Only hits of gold documents (chunks, two-stage, one-stage) per search mode: no model "
        "(unless --rerank upr), no KV.",
        cli=True,
    )

    @property
    def sweep(self) -> tuple[tuple[int, int], ...]:
        """The (kc, k) pairs to run: every ``kc`` with every ``k`` (defaults: QueryOptions')."""
        kcs, ks = self.kc or [DEFAULT_QUERY.kc], self.k or [DEFAULT_QUERY.k]
        return tuple((a, b) for a in kcs for b in ks)


@dataclass(frozen=True)
class ApiSettings:
    """The query server (``coinrag api``, ``inference/server/``): options generated from the
    ``cli=True`` fields; ``--config FILE`` reads an ``[api]`` table of the same names.

    Requests are answered one at a time per worker process (the model's rotary state and the
    CPU are shared); up to ``queue_limit`` more wait in its queue, and one past that is
    answered 503 with ``Retry-After``. Each client (an API key, else an address) has a share:
    at most ``client_queue_limit`` of its requests in progress or waiting, and a token bucket
    of ``client_burst`` requests refilled at ``client_rate`` per second; past either it gets
    429 with ``Retry-After`` while other clients are served (``inference/server/limits.py``;
    per worker process).

    Access (``inference/server/auth.py``): the keys of ``api_key_file`` (one per line, reread
    when the file changes) and the ``--api-key`` / ``$COINRAG_API_KEY`` of the command line
    (never a setting: settings are recorded, keys are secrets).
    """

    threads: int = threads_setting()
    forward: str = forward_setting()
    kv_resident_bytes: int = resident_kv_setting()
    queue_limit: int = setting(
        16, "Requests waiting for the model at most; more get 503 (default {default}).", cli=True
    )
    poll_interval: float = setting(
        1.0,
        "Seconds between checks of the store's published version (default {default}).",
        cli=True,
    )
    max_body_bytes: int = 65536  # larger request bodies get 413
    max_question_chars: int = 4096  # longer questions get 422
    max_kc: int = 64  # chunks retrieved in stage 1 at most
    max_k: int = 256  # nuggets (documents) at most
    max_new_tokens: int = 512  # answer tokens a request may ask for at most
    retry_after_s: int = 1  # Retry-After of a 503, and of a 429 for a client's full share
    api_key_file: str | None = setting(
        None,
        "File of API keys, one per line, reread when it changes (rotation without a restart); "
        "requests then need Authorization: Bearer KEY.",
        cli=True,
    )
    metrics_open: bool = setting(False, "Serve /metrics without an API key.", cli=True)
    insecure: bool = setting(
        False,
        "Listen on a non-loopback --host without any API key (every client may ask; logged "
        "as a warning).",
        cli=True,
    )
    client_queue_limit: int = setting(
        8,
        "Requests of one client (API key, else address) in progress or waiting at most; more "
        "get 429 (default {default}).",
        cli=True,
    )
    client_rate: float = setting(
        10.0,
        "Requests per second one client may send, sustained; faster gets 429 (default "
        "{default}; 0: no rate limit).",
        cli=True,
    )
    client_burst: int = 20  # requests one client may send at once (its token bucket's size)
    ui: bool = setting(
        True,
        "Serve the store explorer under /ui (behind the same keys; --no-ui: the API only).",
        cli=True,
    )
    eval_dir: str | None = setting(
        None,
        "A `coinrag eval --out` folder the explorer's Evaluations page shows (/ui/evals).",
        cli=True,
    )

    def validate(self) -> ApiSettings:
        names = ("queue_limit", "max_body_bytes", "max_question_chars", "max_kc", "max_k")
        for name in (*names, "client_queue_limit", "client_burst"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.poll_interval <= 0:
            raise SettingsError(f"poll_interval must be > 0, got {self.poll_interval}")
        if self.client_rate < 0:
            raise SettingsError(
                f"client_rate must be >= 0 (requests per second; 0: no limit), "
                f"got {self.client_rate}"
            )
        if self.threads < 0:
            raise SettingsError(f"threads must be >= 0 (0: auto), got {self.threads}")
        if self.kv_resident_bytes < 0:
            raise SettingsError(f"kv_resident_bytes must be >= 0, got {self.kv_resident_bytes}")
        check_forward(self.forward)
        return self


def load_api_settings(
    config_path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None
) -> ApiSettings:
    """Defaults, then the ``[api]`` table of a TOML file, then non-None ``overrides``."""
    table: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8")).get("api", {})
        except FileNotFoundError as exc:
            raise SettingsError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc
        known = [f.name for f in dataclasses.fields(ApiSettings)]
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise SettingsError(
                f"config file {path}: unknown [api] setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(known)}"
            )
    values = {**table, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return ApiSettings(**values).validate()
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


# ---------------------------------------------------------------------------- cartridges
