"""What the CLI checks before any work: before a Prefect server starts, a model loads or a store
folder is created. Each check is cheap (paths, names, the environment, a lock probe) and raises
:class:`Preflight` with one line that names the thing and the fix, and the exit status.

Exit statuses: 1 for something missing or busy (a file, a store, a key, a lock), 2 for a value
that can never work (README, "Exit codes").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coinrag.schemas.settings import ApiSettings, BuildSettings, RuntimeSettings, SettingsError
from coinrag.storage.store import Store, StoreLocationError, StoreLocked

OPENAI_EXTRACTORS = ("openai", "openai-batch")


class Preflight(Exception):
    """A problem found before any work; ``exit_code`` (alias ``code``) is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = code

    @property
    def code(self) -> int:
        return self.exit_code


def store_at(path: str) -> Store:
    """The store ``path`` names (a bad URL: exit 2)."""
    try:
        return Store.at(path)
    except ValueError as exc:
        raise Preflight(f"--store {path}: {exc}", 2) from None


def store_to_write(path: str, check_lock: bool = True) -> Store:
    """A store a build may create or update (``Store.check_creatable``: for a local store, a
    folder or a folder to create, never a file, with a writable nearest existing folder above
    it); with ``check_lock``, not locked by another writer."""
    store = store_at(path)
    try:
        store.check_creatable(f"--store {path}")
    except StoreLocationError as exc:
        raise Preflight(str(exc)) from None
    if check_lock:
        unlocked(store)
    return store


def built_store(path: str) -> Store:
    """A store a build has written (query, eval, train, delete, gc, lineage read it)."""
    store = store_at(path)
    try:
        store.check_not_a_file(f"--store {path}")
    except StoreLocationError as exc:
        raise Preflight(str(exc)) from None
    if not store.exists():
        raise Preflight(
            f"{store} is not a coinrag store: run coinrag build SOURCE --store {path} first"
        )
    return store


def store_methods(store: Store, methods: Sequence[str]) -> None:
    """The store's assets can serve ``methods`` (``inference.methods.unavailable_methods``:
    e.g. a store that keeps only nugget spans, ``kv_keep = "nuggets"``, has no whole chunks'
    KV for ``turborag``): exit 1 with the first method's reason, naming the setting."""
    from coinrag.inference.methods import unavailable_methods

    refused = unavailable_methods(store, methods)
    if refused:
        raise Preflight(next(iter(refused.values())))


def unlocked(store: Store) -> None:
    """No other writer holds the store (commands that take its write lock)."""
    try:
        store.check_unlocked()
    except StoreLocked as exc:
        raise Preflight(str(exc)) from None


def source(path: str) -> None:
    """SOURCE exists and has a known format."""
    from coinrag.tasks.ingest import SourceError, check_source

    try:
        check_source(path)
    except SourceError as exc:
        raise Preflight(str(exc)) from None
    except OSError as exc:
        raise Preflight(f"source {path} is unreadable: {exc}") from None


def runtime_settings(given: dict[str, Any]) -> RuntimeSettings:
    """The runtime options given (``--threads``, ``--forward``) as settings; a bad value exits
    with status 2."""
    try:
        return RuntimeSettings(**given)
    except SettingsError as exc:
        raise Preflight(str(exc), 2) from None


def model(ref: str | None, exact: bool = True) -> None:
    """``--model`` names a model folder, a GGUF file, the packaged default, or a KVLink
    adapter folder (``kvlink.json``) whose base model is one of those; with ``exact`` (any
    use of its KV), a model whose KV is reproduced exactly (``inference.model.support``: from its
    ``config.json`` or GGUF header, no weights loaded), else exit 2 naming the model type and
    the feature."""
    from coinrag.inference.context.link import is_link_adapter, read_link_adapter_info
    from coinrag.inference.model.loading import ModelNotFound, locate_model
    from coinrag.inference.model.support import UnsupportedModel, check_model_reference

    try:
        if ref is not None and is_link_adapter(ref):
            ref = read_link_adapter_info(ref).model
        found = locate_model(ref)
    except ModelNotFound as exc:
        raise Preflight(str(exc)) from None
    if not exact:
        return
    try:
        check_model_reference(found)
    except UnsupportedModel as exc:
        raise Preflight(f"--model {ref or 'smollm2'}: {exc}", 2) from None


def embedder(ref: str | None) -> None:
    """``--embedder`` names a local encoder folder or the packaged default."""
    from coinrag.inference.retrieval.embedders import EmbedderNotFound, locate_embedder

    try:
        locate_embedder(ref)
    except EmbedderNotFound as exc:
        raise Preflight(str(exc)) from None


def openai_key(option: str, value: str) -> None:
    """An OpenAI-backed choice (``--extractor openai``, ``--generator openai``) needs a key."""
    if not os.environ.get("OPENAI_API_KEY"):
        raise Preflight(
            f"{option} {value} needs OPENAI_API_KEY in the environment: export it "
            f"(and OPENAI_BASE_URL for another endpoint), or choose another {option}"
        )


def device(name: str) -> None:
    """A torch device this machine has (``cpu`` always; others need torch to say so)."""
    if name == "cpu":
        return
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise Preflight(f"--device {name!r} is not a torch device ({exc})", 2) from None
    available = {
        "cuda": torch.cuda.is_available(),
        "mps": torch.backends.mps.is_available(),
    }.get(dev.type, True)
    if not available:
        raise Preflight(f"--device {name}: this machine has no {dev.type} device; use cpu")


def build_settings(settings: BuildSettings) -> None:
    """What a build's settings name: the model (exact when the build computes KV), the
    embedder, the extractor's key, the device."""
    model(settings.model, exact=settings.kv)
    if settings.index:
        embedder(settings.embedder)
    extractor = settings.resolved_extractor()
    if extractor in OPENAI_EXTRACTORS:
        openai_key("--extractor", extractor)
    device(settings.device)


def prefect_api(command: str) -> None:
    """``serve`` and ``watch`` talk to a running Prefect server."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise Preflight(
            f"coinrag {command} needs a running Prefect server: start one with "
            "python infra/prefect_server.py --home DIR, then export the PREFECT_API_URL it prints"
        )


def api_access(host: str, api_key: str | None, settings: ApiSettings) -> str | None:
    """``coinrag api``'s keys and address, before the port is bound and the model loads:
    ``--api-key`` usable (exit 2), the keys file readable (exit 1) with usable keys (exit 2),
    and no non-loopback ``--host`` without a key (exit 2) unless ``insecure``: then the
    warning to log (once) is returned."""
    from coinrag.inference.server.auth import (
        KEY_HINT,
        BadKey,
        check_key,
        is_loopback,
        read_keys_file,
    )
    from coinrag.schemas.secrets import API_KEY_ENV

    try:
        if api_key:
            check_key(api_key, f"--api-key (or ${API_KEY_ENV})")
        if settings.api_key_file:
            read_keys_file(settings.api_key_file)
    except BadKey as exc:
        raise Preflight(str(exc), 2) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Preflight(
            f"--api-key-file {settings.api_key_file} is unreadable ({type(exc).__name__}: "
            f"{getattr(exc, 'strerror', None) or exc}): give a text file of keys, one per line"
        ) from None
    if api_key or settings.api_key_file or is_loopback(host):
        return None
    if not settings.insecure:
        raise Preflight(
            f"--host {host} is reachable from other machines and no API key is set: "
            f"export {API_KEY_ENV}=$({KEY_HINT}) "
            "(or --api-key-file FILE, one key per line), or pass --insecure to serve anyone",
            2,
        )
    return (
        f"--insecure: listening on {host} without an API key; anyone who reaches the port "
        "may query, read /health and /metrics"
    )


def output_folder(path: Path, option: str) -> None:
    """An output folder (created if absent) is not a file."""
    if path.exists() and not path.is_dir():
        raise Preflight(f"{option} {path} is a file, not a folder")
