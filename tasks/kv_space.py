"""Will the new KV fit? The disk-space check that runs before extraction.

A build's KV is by far its largest asset: ``tokens x layers x 2 x kv_heads x head_dim x dtype
bytes`` (SmolLM2-135M in float32: 46,080 bytes per token, 23.6 MB per 512-token chunk). Right
after chunking, before any LLM call or forward pass, the build projects the bytes of the entries
it will add (the chunks whose content_key has no entry under the KV fingerprint yet, as the KV
stage will write them: :meth:`storage.kv.KvLayout.disk_bytes`, plus :data:`MARGIN`) and refuses
to start when they, plus ``kv_min_free_bytes``, exceed the free space of the store's file
system. Object stores are not checked (no free space to ask for; each shard is staged in a
local temporary folder one at a time).

The projection goes through the :class:`~storage.kv.KvLayout` the KV stage will use (dims from
the model's config, no weights loaded), so a layout that stores fewer bytes per token (another
dtype, a codec) is projected as it will be written. With ``kv_keep = "nuggets"`` the nugget
spans are not known yet (extraction comes later): the chunks whose content has no entry are
projected whole, an upper bound (a chunk whose spans changed keeps its old entry until gc and
gets a new one: not counted, as its nuggets are not known either).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KvLayout, kv_free_bytes, stored_content_keys
from coinrag.storage.store import Store

MARGIN = 0.05  # on top of the shards' projected bytes: manifest rows, file-system slack

# What makes the KV smaller, as the refusal lists it (settings of --config's [build] table).
SHRINK_HINTS = (
    "kv_codec = int8 or int4 (about 0.58 or 0.33 of the bfloat16 bytes)",
    "kv = false (no KV: retrieval and the standard method only)",
    "a smaller --model (bytes per token = layers x 2 x KV heads x head dim x dtype bytes)",
    "fewer documents in SOURCE",
)


class KvSpaceError(RuntimeError):
    """The KV a build would add does not fit on the store's file system (nothing was built)."""

    exit_code = 1

    def __init__(self, estimate: KvSpaceEstimate, where: str) -> None:
        self.estimate = estimate
        e = estimate
        keep = f" (kv_min_free_bytes keeps {e.min_free_bytes:,} free)" if e.min_free_bytes else ""
        super().__init__(
            f"not enough disk space for the KV cache: {e.entries:,} new chunk entries "
            f"({e.tokens:,} tokens x {e.token_bytes:,} bytes per token, {e.dtype}"
            f"{'' if e.kv_codec == 'none' else ', kv_codec ' + e.kv_codec}) project "
            f"{e.projected_bytes:,} bytes ({_human(e.projected_bytes)}) on disk, but {where} "
            f"has {e.free_bytes:,} bytes ({_human(e.free_bytes or 0)}) free{keep}; "
            f"to shrink it: {'; '.join(SHRINK_HINTS)}; to build anyway: "
            "kv_space_check = false in the [build] table of --config"
        )


@dataclass(frozen=True)
class KvSpaceEstimate:
    """What the KV stage will add, against the space there is (bytes)."""

    kv_fp: str
    dtype: str
    kv_codec: str
    entries: int  # distinct content_keys without a stored entry
    tokens: int  # their tokens
    token_bytes: int  # the layout's bytes per token as stored (the codec's)
    projected_bytes: int  # their shards on disk, with MARGIN
    free_bytes: int | None  # None: not checked (object store)
    min_free_bytes: int = 0

    @property
    def fits(self) -> bool:
        if self.free_bytes is None:
            return True
        return self.projected_bytes + self.min_free_bytes <= self.free_bytes


def estimate_kv_space(
    chunks: Sequence[ChunkRow],
    layout: KvLayout,
    stored: Container[str],
    free_bytes: int | None,
    min_free_bytes: int = 0,
) -> KvSpaceEstimate:
    """The pure core: the entries of ``chunks`` not in ``stored`` (one per content_key) as the
    KV stage will write them, against ``free_bytes``.

    E.g. 2 new 512-token chunks, float32 SmolLM2-135M: 1,024 tokens x 46,080 bytes per token;
    ``layout.disk_bytes([512, 512])`` = 47,219,972, x 1.05 = 49,580,970 projected bytes.
    """
    new: dict[str, int] = {}
    for chunk in chunks:
        if chunk.content_key not in stored:
            new.setdefault(chunk.content_key, chunk.n_tokens)
    tokens = list(new.values())
    projected = int(layout.disk_bytes(tokens) * (1 + MARGIN)) if tokens else 0
    return KvSpaceEstimate(
        kv_fp=layout.kv_fp,
        dtype=layout.dtype,
        kv_codec=layout.kv_codec,
        entries=len(tokens),
        tokens=sum(tokens),
        token_bytes=layout.token_bytes,
        projected_bytes=projected,
        free_bytes=free_bytes,
        min_free_bytes=min_free_bytes,
    )


def build_layout(settings: BuildSettings, tokenizer: Any) -> KvLayout:
    """The KV layout the build's KV stage will use (``inference.model.encode.kv_layout``, as the
    stage calls it), from the model's config and cached weights hash: no weights loaded."""
    from transformers import AutoConfig

    from coinrag.inference.model.encode import KvModel, kv_layout
    from coinrag.inference.model.kv_dtype import resolve_kv_dtype
    from coinrag.inference.model.loading import reference_model_fingerprint, resolve_model_dir
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.tasks.kv import KvOptions

    dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype  # as the stage loads it
    model = KvModel(
        AutoConfig.from_pretrained(resolve_model_dir(settings.model)),
        reference_model_fingerprint(settings.model, settings.device, dtype),
        dtype,
    )
    options = KvOptions.from_settings(settings).layout_options(settings.kv_keep)
    return kv_layout(model, RagPrompt.for_tokenizer(tokenizer), **options)


def check_kv_space(
    store: Store, chunks: Sequence[ChunkRow], settings: BuildSettings, tokenizer: Any
) -> KvSpaceEstimate:
    """Project the KV the build will add; raise :class:`KvSpaceError` when it does not fit."""
    layout = build_layout(settings, tokenizer)
    estimate = estimate_kv_space(
        chunks,
        layout,
        stored_content_keys(store, layout),
        kv_free_bytes(store),
        settings.kv_min_free_bytes,
    )
    if not estimate.fits:
        raise KvSpaceError(estimate, f"the file system of {store.url}")
    return estimate


def _human(n: int) -> str:
    """Bytes in decimal units: ``81_234_567_890`` -> ``"81.2 GB"``."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"
