"""The store: a directory the user owns, its layout, and the one-writer lock.

```
STORE/
  coinrag.toml            settings the store was last built with (never secrets)
  tables/<table>/         Parquet, one schema per table in schemas/tables.py
  kv/<kv_fp>/             Zarr: per-chunk K/V of one generation model and prompt prefix
  index/                  LanceDB: chunks, nuggets, documents
  cartridges/<model_fp>/  Zarr: trained cartridges
  models/                 models written by training flows
  reports/                plots and evaluation results
  .prefect/               Prefect task-cache records of this store
  .lock                   held by the one writing build
```
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


class StoreLocked(RuntimeError):
    """Another process holds the store's write lock."""


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def safe_component(name: str) -> str:
    """Check that ``name`` can be one path component inside the store (no ``/``, no ``..``).

    Ids chosen by users never become paths; only our own hashes and run ids do, and this guard
    makes that a checked rule rather than a habit.
    """
    if not _SAFE_NAME.match(name) or name in {".", ".."}:
        raise ValueError(f"{name!r} is not a safe store path component")
    return name


@dataclass(frozen=True)
class Store:
    """Paths of one store. Creating the object touches nothing; :meth:`init` makes the folders."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> Store:
        return cls(Path(path).expanduser().resolve())

    def init(self) -> Store:
        for sub in ("tables", "kv", "index", "cartridges", "models", "reports"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        return self

    def exists(self) -> bool:
        return (self.root / "tables").is_dir()

    def table_dir(self, table: str) -> Path:
        return self.root / "tables" / safe_component(table)

    def kv_dir(self, kv_fp: str) -> Path:
        return self.root / "kv" / safe_component(kv_fp)

    @property
    def index_dir(self) -> Path:
        return self.root / "index"

    def cartridges_dir(self, model_fp: str) -> Path:
        return self.root / "cartridges" / safe_component(model_fp)

    @property
    def reports_dir(self) -> Path:
        return self.root / "reports"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def prefect_dir(self) -> Path:
        return self.root / ".prefect"

    @property
    def settings_path(self) -> Path:
        return self.root / "coinrag.toml"

    def write_settings(
        self, settings: dict[str, Any] | None, published: dict[str, Any] | None = None
    ) -> None:
        """Record the settings of the last build (``[build]``) and, with ``published``, the
        state it published (``[published]``: run id and index table versions) as TOML.

        One atomic write (temporary file, then rename): this is the commit point of a build or
        a deletion. Readers see the old file or the new one, never a mix. ``settings=None``
        keeps the recorded ``[build]`` table; ``published=None`` keeps ``[published]``. Values
        are str/int/float/bool or nested tables of them.
        """
        current = self.read_toml()
        tables = {
            "build": current.get("build", {}) if settings is None else settings,
            "published": current.get("published") if published is None else published,
        }
        lines = ["# settings of the last build of this store and what it published (coinrag)"]
        for name, table in tables.items():
            if table is not None:
                lines += _toml_table(name, table)
        tmp = self.settings_path.with_suffix(f".toml.tmp-{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, self.settings_path)

    def read_toml(self) -> dict[str, Any]:
        """``STORE/coinrag.toml`` as a dict (empty if it does not exist yet)."""
        import tomllib

        if not self.settings_path.is_file():
            return {}
        return tomllib.loads(self.settings_path.read_text(encoding="utf-8"))

    def published(self) -> dict[str, Any] | None:
        """What the last completed build (or deletion) published, or None if nothing has been
        published yet (a store written by stages alone, or by an older coinrag)."""
        return self.read_toml().get("published")

    @contextmanager
    def write_lock(self, run_id: str) -> Iterator[None]:
        """Hold ``STORE/.lock`` for the duration; a second writer gets :class:`StoreLocked`.

        An OS-level lock (flock): it is released when the holder dies, so a killed build never
        leaves the store locked.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Path(path).read_text(encoding="utf-8", errors="replace").strip()
                raise StoreLocked(
                    f"store {self.root} is being written by another build ({holder or 'unknown'}); "
                    "wait for it to finish, or stop it"
                ) from None
            os.ftruncate(fd, 0)
            info = f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since "
            os.write(fd, (info + datetime.now(UTC).isoformat()).encode())
            yield
        finally:
            os.close(fd)


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """TOML lines of one table: scalars first, then its sub-tables (``[name.sub]``)."""
    lines = [f"[{name}]"]
    subs = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict):
            subs.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {json.dumps(value)}")
    for key, value in subs:
        lines += _toml_table(f"{name}.{_toml_key(key)}", value)
    return lines


def _toml_key(key: Any) -> str:
    """A bare TOML key where allowed (letters, digits, ``_``, ``-``), else a quoted one."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)
