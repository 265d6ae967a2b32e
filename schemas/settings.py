"""Build settings: one dataclass, read from defaults < config file (TOML) < command line.

The config file holds the same names as the CLI options, in a ``[build]`` table::

    [build]
    extractor = "openai"        # openai | openai-batch | local | rules | none
    llm_model = "gpt-4o-mini"
    model = "smollm2"           # generation model: folder, .gguf file, or "smollm2"
    embedder = "minilm"         # packaged all-MiniLM-L6-v2, or a local BGE-M3 folder
    chunker = "fixed"           # fixed (the paper's) | sentence | content (edit-stable)
    chunk_size = 512
    tau = 0.7
    kv_dtype = "auto"           # auto | float32 | bfloat16 | float16 (KV forward and store)
    kv_keep = "chunks"          # chunks | nuggets (store only the KV of nugget spans)

Secrets never live here: the OpenAI client reads OPENAI_API_KEY (and OPENAI_BASE_URL) from the
environment, and nothing in this module reads or records them.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXTRACTORS = ("openai", "openai-batch", "local", "rules", "none")
# The KV forward's dtype: auto = bfloat16 where the device computes it natively, else float32
# (inference/kv_dtype.py decides, per machine).
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
# What the KV store keeps of each chunk (storage/kv/kept.py): the whole chunk's KV (every method
# can use it), or only the token ranges its nuggets cover (coinrag and training read only those).
KV_KEEPS = ("chunks", "nuggets")
CHUNKERS = ("fixed", "sentence", "content")
RUNNERS = ("default", "dask", "ray")
KV_VERIFY_LEVELS = ("crc32c", "stat", "sha256")
RAG_METHODS = ("coinrag", "turborag", "standard")  # the methods of inference/methods.py


class SettingsError(ValueError):
    """A setting with an invalid value, or an unknown setting name."""


@dataclass(frozen=True)
class BuildSettings:
    """Everything that decides what a build produces (plus how hard it may push an endpoint)."""

    extractor: str | None = None  # None: "openai" if OPENAI_API_KEY is set, else "local"
    llm_model: str = "gpt-4o-mini"
    model: str = "smollm2"
    chunker: str = "fixed"
    chunk_size: int = 512
    tau: float = 0.7
    concurrency: int = 8  # simultaneous requests to the LLM endpoint
    max_attempts: int = 5  # per chunk, for 429/5xx/timeouts/malformed answers
    request_timeout: float = 60.0  # seconds, per request
    batch_poll_interval: float = 30.0  # seconds between Batch API status polls
    batch_max_rounds: int = 3  # resubmissions of failed/expired batch requests
    local_max_nuggets: int = 8  # local extractor: spans per chunk at least (1.5 per clause head)
    extract_batch_size: int = 32  # chunks per Prefect extraction task
    device: str = "cpu"
    embedder: str = "minilm"  # "minilm" (packaged all-MiniLM-L6-v2) or a local folder (BGE-M3)
    kv: bool = True  # build the per-chunk KV of `model`
    kv_dtype: str = "auto"  # dtype of the KV forward and of the stored KV (KV_DTYPES)
    kv_keep: str = "chunks"  # what is stored of each chunk's KV (KV_KEEPS)
    kv_batch_size: int = 4  # chunks per forward pass in the KV stage
    index: bool = True  # embed chunks, nuggets and documents into LanceDB
    prune: bool = False  # tombstone live documents that are absent from SOURCE
    embed_batch_size: int = 4096  # texts per embedding task (and per embeddings-cache file)
    # Scale-out (flows/runners.py): where the tasks run. Never changes what is built.
    runner: str = "default"  # default (in the flow process) | dask | ray
    runner_address: str = ""  # Dask scheduler / Ray address; "" = a local cluster of `workers`
    workers: int = 2  # worker processes of the local Dask/Ray cluster
    kv_resources: str = ""  # e.g. "GPU=1": only workers offering these take the KV tasks
    # KV safety (README "The KV cache"): what a reused entry is checked with before the build
    # counts it valid, and the disk-space check before extraction.
    kv_verify: str = "crc32c"  # crc32c (every block of reused entries) | stat | sha256
    kv_space_check: bool = True  # refuse a build whose new KV does not fit on the store's disk
    kv_min_free_bytes: int = 0  # bytes the new KV must leave free on that disk

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
        if self.kv_keep not in KV_KEEPS:
            raise SettingsError(f"kv_keep {self.kv_keep!r} is not one of {', '.join(KV_KEEPS)}")
        if self.kv_keep == "nuggets" and self.kv and self.extractor == "none":
            raise SettingsError(
                'kv_keep = "nuggets" stores the KV of nugget spans, and extractor none extracts '
                'no nuggets: nothing would be stored; use kv_keep = "chunks" or an extractor'
            )
        if self.chunker not in CHUNKERS:
            raise SettingsError(f"chunker {self.chunker!r} is not one of {', '.join(CHUNKERS)}")
        if not 8 <= self.chunk_size <= 32768:
            raise SettingsError(f"chunk_size {self.chunk_size} is outside 8..32768")
        if not 0.0 < self.tau <= 1.0:
            raise SettingsError(f"tau {self.tau} is outside (0, 1]")
        for name in (
            "concurrency",
            "max_attempts",
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
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for runs.parameters_json and STORE/coinrag.toml)."""
        return dataclasses.asdict(self)


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
