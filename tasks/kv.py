"""The KV build stage: each chunk's per-layer K/V, computed once after the RAG prompt prefix.

For every chunk whose ``content_key`` has no valid entry in the KV store of
``kv_fp = (model_fp, prompt prefix)``, the model encodes the chunk after the prefix's cached KV
``C_p`` (``inference/model/encode.py``: where a chunk sits, how chunks are batched and why the
result is the chunk's own KV) and the chunk's part of the cache is stored (``storage/kv/``; the
layout: ``storage/kv/layout.py``). This module is the stage around that: what to compute, in which
units, written how, and what it did.

- ``C_p`` is computed once and stored; a later run reads it back and computes against the stored
  copy, so every entry of a kv_fp was computed against the same bits of ``C_p``.
- Chunks are sorted by length (stable, so document order among equal lengths; most chunks have
  exactly ``chunk_size`` tokens) and batched by ``inference.model.encode.KvBatching``.
- Units of work (:func:`kv_groups`): the sorted chunks are cut into groups of whole shards
  holding at least one whole batch; a group is computed batch by batch and stored as its
  shards. One driver, :func:`run_kv_stage`, plans, stores and counts; where the groups are
  computed is its :class:`KvWorkers`: :class:`LocalKv` computes them one after the other in
  this process (:func:`kv_stage`; its batches through ``inference/model/kv_pipeline.py``: on a
  CUDA device the copy of one batch's KV to pinned host memory overlaps the next forward, and
  with ``kv_fill_device`` a batch holds as many chunks as the device's free memory does), a
  runner's workers (``flows/scaleout.py``) compute each on a worker (:func:`stage_group_kv`:
  shards written under temporary names) and the driver, the holder of the store's lock,
  publishes them in group order. Both give the same batches, the same shard numbers and
  bit-identical entries (at the same batch size: a GPU's filled batches are larger).
- Entries are written ``slots_per_shard`` at a time (one Zarr shard each, written whole); after a
  shard is verified its manifest rows are appended, then ``progress`` is called. With
  ``overlap`` (default) a background thread writes (or publishes) shard ``i`` while the next
  batches are computed (at most one shard in flight). A run killed mid-way loses at most the
  shard being written; the next run recomputes only the chunks without a valid manifest row.
  An unchanged rerun computes nothing.
- What is stored of each chunk (``kept``, the setting ``kv_keep``): its whole KV (``None``,
  ``kv_keep = "chunks"``), or only the token ranges its nuggets cover (a mapping chunk_id ->
  ``storage.kv.KeptRanges``, from :func:`kept_ranges`; ``kv_keep = "nuggets"``). The chunk is
  encoded in full either way, so a kept slice is bit for bit the whole chunk's slice; an entry is
  keyed by its content_key and its ranges (``storage/kv/kept.py``), so a chunk whose nugget spans
  changed (a new extractor) gets a new entry and one whose spans did not is reused. A chunk with
  no nugget has nothing to keep: no forward pass, no entry (``nothing_kept``).
- Existing entries are checked at the level ``check`` before they are reused: ``crc32c``
  (default: shard folders and file sizes, then every block of every reused entry and each shard
  index read and crc32c-checked: finds deleted and truncated shards and flipped bytes), ``stat``
  (folders and sizes only, one stat per shard), ``sha256`` (every entry read and checked against
  the manifest's sha256) or ``none``. Entries that fail are rebuilt; the new manifest row
  supersedes the old one. Pass :func:`run_kv_stage` ``rebuild=`` the content_keys a reader
  found corrupt (:class:`storage.kv.CorruptKvEntry`) to rebuild just those. A stored ``C_p``
  that fails its check is recomputed first (:func:`settle_prefix_kv`); if the recomputed one is
  not bit for bit the damaged one, every entry is rebuilt against it.
- A codec that codes keys in a calibrated basis (``int2basis``: ``storage/kv/basis.py``) gets
  it before the first entry: calibrated on the ``CALIBRATION_CHUNKS`` chunks of the first run
  with the lowest content_keys (a spread of the corpus that does not depend on its order) and
  written once (:func:`settle_key_basis`). A stored basis that fails its check is replaced by
  a new one and every entry is rebuilt.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from coinrag.inference.model.calibrate import calibrated_key_basis
from coinrag.inference.model.encode import KvBatching, compute_prefix_kv, kv_layout, pad_id
from coinrag.inference.model.kv_pipeline import (
    compute_group_kv,
    device_free_bytes,
    fill_batch_size,
    groups_kv,
)
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import ForwardFrequencies
from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.tables import ChunkRow, KvManifestRow, NuggetRow
from coinrag.storage.kv import (
    KeptRanges,
    KvEntry,
    KvFingerprintMismatch,
    KvLayout,
    KvStore,
    StagedShard,
    codec_named,
)
from coinrag.storage.kv.basis import KeyBasis
from coinrag.storage.store import Store

ProgressFn = Callable[[int, int], None]  # (entries computed so far, entries to compute)
CALIBRATION_CHUNKS = 24  # chunks a key basis is calibrated on (about 12k tokens)


@dataclass
class KvCounts:
    """What one run of the stage did."""

    kv_fp: str
    chunks: int = 0  # chunks asked for
    model_fp: str = ""  # the model that computed the entries
    kv_dtype: str = ""  # the dtype they were computed in (kv_dtype "auto" resolved)
    nothing_kept: int = 0  # kv_keep = "nuggets": chunks without a nugget span (no KV needed)
    unique: int = 0  # distinct entries among them (content_keys, with the kept ranges)
    reused: int = 0  # already stored and valid
    rebuilt: int = 0  # had a manifest row that failed the check (or was named in `rebuild`)
    problems: dict[str, str] = field(default_factory=dict)  # content_key -> why it failed
    prefix_repaired: bool = False  # the stored C_p failed its check and was recomputed
    basis_written: str = ""  # "new" or "replaced": a key basis was calibrated and stored
    computed: int = 0  # entries computed and written by this run (includes `rebuilt`)
    forward_passes: int = 0  # batched model calls (the prefix's excluded)
    tokens: int = 0  # chunk tokens computed
    padded_tokens: int = 0  # padding tokens computed (right padding in mixed-length batches)
    shards: int = 0
    logical_bytes: int = 0  # bytes of the entries written (tokens x bytes per token)
    disk_bytes: int = 0  # bytes of the shard files written
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def kept_ranges(chunks: Sequence[ChunkRow], nuggets: Iterable[NuggetRow]) -> dict[str, KeptRanges]:
    """chunk_id -> the token ranges its nuggets cover (``kv_keep = "nuggets"``): every chunk
    of ``chunks``, with no ranges where it has no nugget. E.g. nuggets ``[3, 9)``, ``[7, 12)``,
    ``[20, 25)`` of one chunk -> ``[3, 12), [20, 25)``."""
    spans: dict[str, list[tuple[int, int]]] = {c.chunk_id: [] for c in chunks}
    for n in nuggets:
        if n.chunk_id in spans:
            spans[n.chunk_id].append((n.tok_start, n.tok_end))
    return {cid: KeptRanges.of_spans(s) for cid, s in spans.items()}


def build_kept_ranges(
    store: Store, chunks: Sequence[ChunkRow], keep: str, extractor_fp: str, tau: float
) -> dict[str, KeptRanges] | None:
    """What the KV stage keeps of each chunk for the setting ``keep`` (``kv_keep``): None for
    whole chunks, else :func:`kept_ranges` of the chunks' nuggets made by this extractor and
    tau (the nuggets the index gets: ``tasks.recover.stage.current_nuggets``)."""
    if keep == "chunks":
        return None
    from coinrag.tasks.recover.stage import current_nuggets

    nuggets = current_nuggets(store, [c.chunk_id for c in chunks], extractor_fp, tau)
    return kept_ranges(chunks, nuggets)


def chunk_entry(chunk: ChunkRow, kept: Mapping[str, KeptRanges] | None) -> KvEntry | None:
    """The entry the KV stage stores for ``chunk``: whole (``kept`` None), its kept ranges, or
    None when it keeps nothing (no nugget span)."""
    if kept is None:
        return KvEntry.of(chunk)
    ranges = kept.get(chunk.chunk_id)
    if ranges is None or not ranges.ranges:
        return None
    return KvEntry(chunk.chunk_id, chunk.content_key, chunk.n_tokens, ranges)


def stored_parts(
    entries: Sequence[tuple[ChunkRow, torch.Tensor]], kept: Mapping[str, KeptRanges] | None
) -> list[tuple[KvEntry, torch.Tensor]]:
    """Computed ``(chunk, kv)`` -> what the store writes: ``(entry, entry.cut(kv))``."""
    out = []
    for chunk, kv in entries:
        entry = chunk_entry(chunk, kept)
        if entry is None:  # plan_kv never plans such a chunk
            raise ValueError(f"chunk {chunk.chunk_id} keeps no token: it has no KV to store")
        out.append((entry, entry.cut(kv)))
    return out


def _batches(chunks: Sequence[ChunkRow], batch_size: int) -> list[list[ChunkRow]]:
    ordered = sorted(chunks, key=lambda c: -c.n_tokens)  # stable: document order within a length
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def kv_groups(
    chunks: Sequence[ChunkRow], batch_size: int, slots_per_shard: int
) -> list[list[ChunkRow]]:
    """The units of KV work: chunks sorted by length (stable), cut into groups of
    ``slots_per_shard * ceil(batch_size / slots_per_shard)`` chunks (whole shards, at least one
    whole batch). A group is computed in batches of ``batch_size`` and stored as consecutive
    shards of ``slots_per_shard``, so every runner (one process or many workers) forms the same
    batches and shards and stores bit-identical entries.

    E.g. 10 chunks, batch 4, 4 slots -> groups of 4, 4, 2; batch 8, 4 slots -> groups of 8, 2.
    """
    size = slots_per_shard * -(-batch_size // slots_per_shard)
    return _batches(chunks, size)


# ---------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class KvOptions:
    """How the stage computes and stores: the build's settings (:meth:`from_settings`; the
    defaults are :class:`schemas.settings.BuildSettings`'s) and the store's physical choices.

    ``batch_size``: chunks per forward pass; ``check``: how reused entries are checked
    (``crc32c`` | ``stat`` | ``sha256`` | ``none``); ``kv_codec``: how entries are stored
    (``none`` | ``int8`` | ``int4``, ``storage/kv/codecs.py``); ``slots_per_shard`` (0: derived
    from the entry size, shards of about 64 MiB) and ``block_tokens`` (0: the codec's block
    size); ``overlap``: write each shard in a background thread while the next is computed."""

    batch_size: int = BuildSettings.kv_batch_size
    check: str = BuildSettings.kv_verify
    kv_codec: str = BuildSettings.kv_codec
    slots_per_shard: int = 0
    block_tokens: int = 0
    overlap: bool = True
    fill_device: bool = BuildSettings.kv_fill_device

    @classmethod
    def from_settings(cls, settings: BuildSettings) -> KvOptions:
        return cls(
            batch_size=settings.kv_batch_size,
            check=settings.kv_verify,
            kv_codec=settings.kv_codec,
            fill_device=settings.kv_fill_device,
        )

    def layout_options(self, keep: str) -> dict[str, Any]:
        """The keyword arguments of ``inference.model.encode.kv_layout`` (``keep``: ``chunks`` |
        ``nuggets``, what is stored of each chunk)."""
        return {
            "kv_codec": self.kv_codec,
            "block_tokens": self.block_tokens,
            "slots_per_shard": self.slots_per_shard,
            "keep": keep,
        }


@dataclass(frozen=True)
class KvPrep:
    """What the driver needs from the model before it plans (:func:`prepare_kv`; picklable: a
    distributed build computes it on a worker, where ``kv_dtype = auto`` is resolved)."""

    layout: KvLayout
    tokenizer_fp: str | None  # None: not checked (a model without one, in tests)
    prefix_ids: tuple[int, ...]
    prefix_kv: torch.Tensor | None  # C_p, when the store holds no usable one
    frequencies: ForwardFrequencies  # how the chunks are batched (KvBatching)
    key_basis: KeyBasis | None = None  # a basis codec's, when the store holds no usable one
    calibration: dict[str, Any] = field(default_factory=dict)  # what key_basis came from


def prepare_kv(
    store: Store,
    loaded: Any,
    prompt: RagPrompt,
    options: KvOptions,
    keep: str,
    calibration: Sequence[ChunkRow] = (),
) -> KvPrep:
    """:class:`KvPrep` of a loaded model (``inference.model.loading.LoadedModel``) and ``prompt``,
    the layout of ``options`` and ``keep`` (``chunks`` | ``nuggets``): ``C_p`` computed only
    when ``store`` lacks one that passes its check, and a basis codec's key basis likewise,
    calibrated on the ``calibration`` chunks (:func:`calibration_chunks`). Read only: the
    driver creates the store and writes or repairs them."""
    layout = kv_layout(loaded, prompt, **options.layout_options(keep))
    kv = KvStore(store, layout)
    usable = kv.has_prefix() and kv.corrupt_prefix() is None
    basis, source = None, {}
    wanted = layout.codec.needs_basis and not (
        kv.key_basis.exists() and kv.key_basis.problem() is None
    )
    if wanted and calibration:
        texts = [c.token_ids for c in calibration]
        basis, queries = calibrated_key_basis(loaded.model, prompt, texts)
        keys = [c.content_key for c in calibration]
        source = {"chunks": keys, "tokens": sum(map(len, texts)), "queries": queries}
    return KvPrep(
        layout=layout,
        tokenizer_fp=getattr(loaded, "tokenizer_fp", None),
        prefix_ids=tuple(prompt.prefix_ids),
        prefix_kv=None if usable else compute_prefix_kv(loaded.model, prompt.prefix_ids),
        frequencies=ForwardFrequencies.from_config(loaded.model.config),
        key_basis=basis,
        calibration=source,
    )


def calibration_chunks(chunks: Sequence[ChunkRow], options: KvOptions) -> list[ChunkRow]:
    """The chunks a key basis is calibrated on where ``options``' codec needs one: the
    ``CALIBRATION_CHUNKS`` distinct ones with the lowest content_keys; else none."""
    if not codec_named(options.kv_codec).needs_basis:
        return []
    distinct = {c.content_key: c for c in chunks if c.token_ids}
    return [distinct[k] for k in sorted(distinct)[:CALIBRATION_CHUNKS]]


class GroupKv(ABC):
    """One group of :func:`kv_groups`, computed: what storing it takes, shard by shard, and
    the seconds its computation took (``forward``, ``extract``)."""

    seconds: dict[str, float]

    @abstractmethod
    def shard_writes(self, kv: KvStore, run_id: str) -> list[Callable[[], list[KvManifestRow]]]:
        """One call per shard, in order: each makes its shard valid and returns its rows."""


@dataclass
class ComputedGroup(GroupKv):
    """Entries computed in this process: each shard is written, verified and published here."""

    entries: list[tuple[KvEntry, torch.Tensor]]
    seconds: dict[str, float] = field(default_factory=dict)

    def shard_writes(self, kv: KvStore, run_id: str) -> list[Callable[[], list[KvManifestRow]]]:
        step = kv.layout.slots_per_shard
        parts = [self.entries[i : i + step] for i in range(0, len(self.entries), step)]
        return [partial(kv.write_entries, part, run_id) for part in parts]


@dataclass
class StagedGroup(GroupKv):
    """Shards a worker wrote under ``.tmp-`` names: each is published here (renamed into place,
    its manifest rows appended) by the holder of the store's write lock."""

    shards: list[StagedShard]
    seconds: dict[str, float] = field(default_factory=dict)

    def shard_writes(self, kv: KvStore, run_id: str) -> list[Callable[[], list[KvManifestRow]]]:
        return [partial(kv.publish_shard, shard, run_id) for shard in self.shards]


class KvWorkers(ABC):
    """Where the stage's model work runs: this process (:class:`LocalKv`) or a runner's
    workers (``flows/scaleout.py``). The driver, :func:`run_kv_stage`, is the same for all."""

    @abstractmethod
    def prepare(
        self, store: Store, options: KvOptions, keep: str, calibration: Sequence[ChunkRow] = ()
    ) -> KvPrep:
        """The layout (``options.layout_options(keep)``), ``C_p`` and a key basis if needed:
        :func:`prepare_kv`."""

    @abstractmethod
    def compute(self, job: KvJob, groups: list[list[ChunkRow]]) -> Iterator[GroupKv]:
        """Each group computed for ``job``, in the order of ``groups``."""

    def batch_size(self, options: KvOptions, chunk_tokens: int, prefix_tokens: int) -> int:
        """Chunks per forward for chunks of at most ``chunk_tokens`` tokens after
        ``prefix_tokens``: ``options.batch_size`` unless the workers' device holds more."""
        return options.batch_size


@dataclass(frozen=True)
class KvJob:
    """What every group of one run is computed with: the store (``kv``), its stored ``C_p``
    (``prefix_kv``), the run, what is kept of each chunk (``kept``: as
    :func:`run_kv_stage`'s) and the options."""

    kv: KvStore
    prefix_kv: torch.Tensor
    run_id: str
    kept: Mapping[str, KeptRanges] | None
    options: KvOptions

    def kept_of(self, group: Sequence[ChunkRow]) -> dict[str, KeptRanges] | None:
        """``kept`` of the chunks of ``group`` only (what a worker is sent)."""
        return None if self.kept is None else {c.chunk_id: self.kept[c.chunk_id] for c in group}


def group_entries(
    loaded: Any,
    prefix_kv: torch.Tensor,
    group: Sequence[ChunkRow],
    layout: KvLayout,
    batch_size: int,
    kept: Mapping[str, KeptRanges] | None,
) -> tuple[list[tuple[KvEntry, torch.Tensor]], dict[str, float]]:
    """What the store writes of one group (:func:`stored_parts`), computed in batches of
    ``batch_size``, and the seconds it took (``forward``, ``extract``)."""
    check_model(loaded, layout)
    secs: dict[str, float] = {}
    pad = pad_id(loaded.tokenizer)
    computed = compute_group_kv(loaded.model, prefix_kv, group, batch_size, pad, secs, layout)
    return stored_parts(computed, kept), secs


def check_model(loaded: Any, layout: KvLayout) -> None:
    """KvFingerprintMismatch unless ``loaded`` is the model ``layout``'s KV is computed with."""
    if loaded.model_fp != layout.model_fp:
        raise KvFingerprintMismatch(
            loaded.model_fp, layout.model_fp, "this worker's model is not the build's"
        )


class LocalKv(KvWorkers):
    """The stage's model work in this process, on ``loaded`` (``inference.model.loading.
    LoadedModel``), each chunk encoded after ``prompt``'s prefix. Groups are computed lazily,
    so the driver's writer stores one shard while the next group is computed."""

    def __init__(self, loaded: Any, prompt: RagPrompt) -> None:
        self.loaded, self.prompt = loaded, prompt

    def prepare(
        self, store: Store, options: KvOptions, keep: str, calibration: Sequence[ChunkRow] = ()
    ) -> KvPrep:
        return prepare_kv(store, self.loaded, self.prompt, options, keep, calibration)

    def compute(self, job: KvJob, groups: list[list[ChunkRow]]) -> Iterator[GroupKv]:
        """The groups through one pipeline (``inference/model/kv_pipeline.py``: on a CUDA
        device the next group's first forward runs while a group is handed to the writer)."""
        layout = job.kv.layout
        check_model(self.loaded, layout)
        pad = pad_id(self.loaded.tokenizer)
        computed = groups_kv(
            self.loaded.model, job.prefix_kv, groups, job.options.batch_size, pad, layout
        )
        for entries, secs in computed:
            yield ComputedGroup(stored_parts(entries, job.kept), secs)

    def batch_size(self, options: KvOptions, chunk_tokens: int, prefix_tokens: int) -> int:
        """``options.batch_size``, raised on a CUDA device to :func:`~coinrag.inference.model.
        kv_pipeline.fill_batch_size` of its free memory when ``options.fill_device``."""
        free = device_free_bytes(self.loaded.model) if options.fill_device else None
        if free is None or not chunk_tokens:
            return options.batch_size
        model = self.loaded.model
        size = next(model.parameters()).element_size()
        fill = fill_batch_size(model.config, size, chunk_tokens, prefix_tokens, free)
        return max(options.batch_size, fill)


def stage_group_kv(
    kv: KvStore,
    loaded: Any,
    group: Sequence[ChunkRow],
    run_id: str,
    batch_size: int,
    kept: Mapping[str, KeptRanges] | None = None,
) -> StagedGroup:
    """A worker's share of the stage: compute one group of :func:`kv_groups` against the
    stored ``C_p`` and write it as staged shards (``slots_per_shard`` each, under ``.tmp-``
    names, verified) of what is kept (``kept``: as :func:`run_kv_stage`'s); the write-lock
    holder publishes them in group order (:meth:`storage.kv.KvStore.publish_shard`)."""
    prefix_kv, _ = kv.read_prefix()
    entries, secs = group_entries(loaded, prefix_kv, group, kv.layout, batch_size, kept)
    step = kv.layout.slots_per_shard
    try:
        staged = [
            kv.stage_shard(entries[i : i + step], run_id) for i in range(0, len(entries), step)
        ]
    finally:
        kv.release_buffers()
    return StagedGroup(staged, secs)


def kv_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    loaded: Any,
    prompt: RagPrompt,
    run_id: str,
    options: KvOptions | None = None,
    progress: ProgressFn | None = None,
    *,
    kept: Mapping[str, KeptRanges] | None = None,
) -> KvCounts:
    """:func:`run_kv_stage` in this process (:class:`LocalKv`): ``loaded`` is an
    ``inference.model.loading.LoadedModel`` (``.model``, ``.tokenizer``, ``.model_fp``), ``prompt``
    the RAG prompt whose prefix the chunks are encoded after."""
    return run_kv_stage(
        store, chunks, LocalKv(loaded, prompt), run_id, options, progress, kept=kept
    )


def run_kv_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    workers: KvWorkers,
    run_id: str,
    options: KvOptions | None = None,
    progress: ProgressFn | None = None,
    *,
    kept: Mapping[str, KeptRanges] | None = None,
    rebuild: Iterable[str] = (),
) -> KvCounts:
    """The KV stage: compute and store the KV of every chunk that has no valid entry yet, the
    model work done by ``workers`` (this process or a runner's workers), everything else here.

    ``kept``: None to store whole chunks (``kv_keep = "chunks"``), else chunk_id -> the ranges
    to keep (``kv_keep = "nuggets"``, :func:`kept_ranges`; a chunk absent or without ranges
    keeps nothing and is not computed); the ranges are cut from the chunk's KV in the stored
    frame (keys at position 0 for a quantized codec), then encoded by the codec. ``rebuild``:
    entry keys or content_keys to recompute whatever their check says. ``progress(done,
    total)`` is called after each stored shard. Returns counts and timings (``seconds``:
    prefix, check, forward, extract (the last two summed over the groups), write, verify,
    manifest, wait_write (the stage waiting for the writer), total).
    """
    t_start = time.perf_counter()
    options = options or KvOptions()
    calibration = calibration_chunks(chunks, options)
    prep = workers.prepare(store, options, "chunks" if kept is None else "nuggets", calibration)
    kv = KvStore.create(store, prep.layout)
    counts = KvCounts(
        kv_fp=kv.kv_fp, chunks=len(chunks), model_fp=prep.layout.model_fp, kv_dtype=kv.layout.dtype
    )
    secs = counts.seconds
    t0 = time.perf_counter()
    if settle_prefix_kv(kv, prep, counts) | settle_key_basis(kv, prep, counts):
        rebuild = set(rebuild) | set(kv.manifest(refresh=True))
    prefix_kv = stored_prefix_kv(kv, prep.prefix_ids)
    secs["prefix"] = time.perf_counter() - t0
    todo = plan_kv(kv, chunks, prep.tokenizer_fp, counts, options.check, rebuild, kept)
    longest = max((c.n_tokens for c in todo), default=0)
    sized = workers.batch_size(options, longest, len(prep.prefix_ids))
    options = dataclasses.replace(options, batch_size=sized)
    groups = kv_groups(todo, options.batch_size, prep.layout.slots_per_shard)
    batching = KvBatching(options.batch_size, len(prep.prefix_ids), prep.frequencies)
    secs.update(forward=0.0, extract=0.0)
    writer = _Writer(kv, counts, progress, len(todo), options.overlap)
    try:
        done = workers.compute(KvJob(kv, prefix_kv, run_id, kept, options), groups)
        for group, computed in zip(groups, done, strict=True):
            for write in computed.shard_writes(kv, run_id):
                writer.submit(write)
            count_batches(counts, group, batching)
            for name, value in computed.seconds.items():
                secs[name] = secs.get(name, 0.0) + value
        writer.wait()
    finally:
        writer.close()
        kv.release_buffers()
    ws = kv.write_stats
    secs.update(write=ws.encode_write_s, verify=ws.verify_s, manifest=ws.manifest_s)
    secs["wait_write"] = writer.waited
    secs["total"] = time.perf_counter() - t_start
    return counts


def plan_kv(
    kv: KvStore,
    chunks: Sequence[ChunkRow],
    tokenizer_fp: str | None,
    counts: KvCounts,
    check: str = "crc32c",
    rebuild: Iterable[str] = (),
    kept: Mapping[str, KeptRanges] | None = None,
) -> list[ChunkRow]:
    """The chunks (one per entry: :func:`chunk_entry`, a content_key with the ranges ``kept``)
    whose KV must be computed: no manifest row, or a row that fails the ``check`` (``crc32c`` |
    ``stat`` | ``sha256`` | ``none``) or is named in ``rebuild`` (entry keys or content_keys).
    Chunks that keep nothing are left out (``counts.nothing_kept``). Fills ``counts`` (unique,
    reused, rebuilt, problems, seconds["check"]). Raises ValueError for a chunk cut by another
    tokenizer."""
    unique: dict[str, ChunkRow] = {}
    for chunk in chunks:
        if tokenizer_fp is not None and chunk.tokenizer_fp != tokenizer_fp:
            raise ValueError(
                f"chunk {chunk.chunk_id} was cut with tokenizer {chunk.tokenizer_fp}, "
                f"the model's is {tokenizer_fp}: its token ids mean nothing to this model"
            )
        entry = chunk_entry(chunk, kept)
        if entry is None:
            counts.nothing_kept += 1
            continue
        unique.setdefault(entry.key, chunk)
    counts.unique = len(unique)

    t0 = time.perf_counter()
    manifest = kv.manifest(refresh=True)
    stored = [key for key in unique if key in manifest]
    rebuild = set(rebuild)
    bad = {key for key in stored if key in rebuild or manifest[key].content_key in rebuild}
    if check != "none":
        problems = kv.entry_problems(stored, level=check)
        counts.problems.update(problems)
        bad |= set(problems)
    counts.rebuilt = len(bad)
    counts.reused = len(stored) - len(bad)
    counts.seconds["check"] = time.perf_counter() - t0
    return [c for ck, c in unique.items() if ck not in manifest or ck in bad]


def count_batches(counts: KvCounts, group: Sequence[ChunkRow], batching: KvBatching) -> None:
    """Add a computed group's forward passes, tokens and padding to ``counts``."""
    for batch in batching.split(group):
        n_real = sum(c.n_tokens for c in batch)
        counts.forward_passes += 1
        counts.tokens += n_real
        counts.padded_tokens += len(batch) * max(c.n_tokens for c in batch) - n_real


class _Writer:
    """Stores shards (each a call of :meth:`GroupKv.shard_writes`), in a background thread
    when ``overlap`` (at most one shard in flight, so the next group is computed, or awaited
    from the workers, while the previous shard is written and verified or published).

    Counts and ``progress`` are updated in the caller's thread once a shard's manifest rows
    exist. If the caller fails, the shard in flight is finished (it is complete and verified
    and gets its rows) before the error propagates.
    """

    def __init__(
        self,
        kv: KvStore,
        counts: KvCounts,
        progress: ProgressFn | None,
        total: int,
        overlap: bool,
    ) -> None:
        self.kv, self.counts = kv, counts
        self.progress, self.total = progress, total
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-writer") if overlap else None
        self.in_flight: Future[list[KvManifestRow]] | None = None
        self.before = (kv.write_stats.disk_bytes, kv.write_stats.shards)
        self.waited = 0.0

    def submit(self, write: Callable[[], list[KvManifestRow]]) -> None:
        self.wait()
        if self.pool is None:
            self._done(write())
        else:
            self.in_flight = self.pool.submit(write)

    def wait(self) -> None:
        if self.in_flight is not None:
            t0 = time.perf_counter()
            future, self.in_flight = self.in_flight, None
            rows = future.result()
            self.waited += time.perf_counter() - t0
            self._done(rows)

    def _done(self, rows: list[KvManifestRow]) -> None:
        ws, counts = self.kv.write_stats, self.counts
        counts.computed += len(rows)
        counts.logical_bytes += sum(r.bytes for r in rows)
        counts.shards = ws.shards - self.before[1]
        counts.disk_bytes = ws.disk_bytes - self.before[0]
        if self.progress is not None:
            self.progress(counts.computed, self.total)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def stored_prefix_kv(kv: KvStore, prefix_ids: Sequence[int]) -> torch.Tensor:
    """The stored ``C_p``, checked to be the KV of ``prefix_ids``."""
    prefix_kv, ids = kv.read_prefix()
    if ids != list(prefix_ids):
        raise KvFingerprintMismatch(kv.kv_fp, kv.layout.prefix_sha, "stored prefix ids differ")
    return prefix_kv


def settle_prefix_kv(kv: KvStore, prep: KvPrep, counts: KvCounts) -> bool:
    """Store ``C_p`` where ``kv`` lacks it, replace a stored one that fails its check
    (:func:`repair_prefix_kv`), both from ``prep.prefix_kv``. True when every stored entry
    must be rebuilt (the replaced ``C_p`` was not bit for bit the new one)."""
    fresh = prep.prefix_kv
    if fresh is None:
        return False
    if not kv.has_prefix():
        expected = kv.layout.entry_shape(len(prep.prefix_ids))
        if tuple(fresh.shape) != expected:
            raise ValueError(
                f"the model's cache has shape {tuple(fresh.shape)}, the layout expects {expected}"
            )
        kv.write_prefix(fresh, prep.prefix_ids)
    return repair_prefix_kv(kv, counts, lambda: fresh, prep.prefix_ids)


def repair_prefix_kv(
    kv: KvStore, counts: KvCounts, compute: Callable[[], torch.Tensor], prefix_ids: Sequence[int]
) -> bool:
    """Recompute (``compute()``: ``C_p`` of ``prefix_ids``) and replace a stored ``C_p`` that
    fails its check. True when every stored entry must be rebuilt: the recomputed ``C_p`` is
    not bit for bit the one they were computed against. Sets ``counts.prefix_repaired``."""
    problem = kv.corrupt_prefix()
    if problem is None:
        return False
    counts.prefix_repaired = True
    counts.problems["prefix"] = f"{problem} ({kv.kv_fp}/prefix)"
    return not kv.repair_prefix(compute(), prefix_ids)


def settle_key_basis(kv: KvStore, prep: KvPrep, counts: KvCounts) -> bool:
    """Store ``prep.key_basis`` where ``kv``'s codec needs a basis and lacks one, or has one
    that fails its check (then replaced: True, every stored entry must be rebuilt). A run
    without chunks to calibrate on stores none (and writes no entry)."""
    folder = kv.key_basis
    if not kv.layout.codec.needs_basis or prep.key_basis is None:
        return False
    if not folder.exists():
        folder.write(prep.key_basis, prep.calibration)
        counts.basis_written = "new"
        return False
    problem = folder.problem()
    if problem is None:  # another run stored one since prep looked: keep it
        return False
    counts.problems["key_basis"] = f"{problem} ({kv.kv_fp}/basis)"
    folder.replace(prep.key_basis, prep.calibration)
    counts.basis_written = "replaced"
    return True
