"""Derived, re-creatable files kept outside any store: ``$COINRAG_CACHE`` (default
``~/.cache/coinrag``) and the content hashes of large files.

Converted models, the working state of object-store builds and the SHA-256 sidecars below live
there; deleting the folder costs only recomputation.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_BLOCK = 1 << 22  # bytes read per update (4 MiB)


def cache_dir() -> Path:
    """Where converted models (and other derived, re-creatable files) live."""
    return Path(os.environ.get("COINRAG_CACHE", Path.home() / ".cache" / "coinrag"))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex, 64 characters) of a file's bytes.

    Cached in a sidecar ``$COINRAG_CACHE/sha256/<hash of the resolved path>`` keyed by the
    file's (size, mtime in ns): a file rewritten since gets a new stamp and is hashed again, so
    a GGUF of gigabytes is read once, and a training data file edited in place is re-hashed.
    """
    path = Path(path)
    stat = path.stat()
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    sidecar = cache_dir() / "sha256" / hashlib.sha256(str(path.resolve()).encode()).hexdigest()
    if sidecar.is_file():
        cached_stamp, _, digest = sidecar.read_text().partition(" ")
        if cached_stamp == stamp:
            return digest
    digest = bytes_sha256(path)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    sidecar.write_text(f"{stamp} {digest}")
    return digest


def bytes_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's bytes, read in 4 MiB blocks; no sidecar (a file checked once)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def move_into_place(folder: Path, target: Path, marker: str = "config.json") -> None:
    """Rename the finished ``folder`` to ``target`` (the last step of writing a folder under a
    temporary name); where another process placed ``target`` first (its ``marker`` file is
    there), theirs is kept and ``folder`` is left for the caller to remove."""
    try:
        folder.rename(target)
    except OSError:
        if not (target / marker).is_file():
            raise
