"""Who may ask the query server: API keys, sent as ``Authorization: Bearer KEY`` (the OpenAI
convention, as vLLM's ``--api-key``).

Keys come from ``--api-key`` (or ``$COINRAG_API_KEY``) and from ``--api-key-file``: one key per
line, blank lines and ``#`` comments skipped. The file is reread when it changes (its size,
mtime or inode: one ``stat`` per authenticated request), so keys rotate without a restart:
write the new file next to the old one and rename it over (``mv``: atomic). A file that
disappears or cannot be read leaves only the ``--api-key`` valid (it fails closed) until it is
back. A key is at least :data:`MIN_KEY_CHARS` characters without whitespace.

Keys are compared in constant time (``hmac.compare_digest``, against every key). They are
registered with the secrets scrubber (``schemas.secrets``) as soon as they are read, and the
server identifies a client by a digest of its key (:func:`client_of_key`), so no key reaches a
log line, a metric, the reader lease or a table.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import threading
from pathlib import Path

from coinrag.schemas.secrets import register_secrets

log = logging.getLogger("coinrag.api")

MIN_KEY_CHARS = 16
KEY_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"  # makes a good key


class BadKey(ValueError):
    """A key or a keys file that can never work (exit 2 at start)."""


def check_key(key: str, where: str) -> str:
    """``key`` if it is usable: at least :data:`MIN_KEY_CHARS` characters, no whitespace (the
    message names ``where`` it came from, never the key itself)."""
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key) or not key.isprintable():
        raise BadKey(
            f"{where}: an API key must be at least {MIN_KEY_CHARS} printable characters "
            f"without spaces (got {len(key)} characters); make one with: {KEY_HINT}"
        )
    return key


def read_keys_file(path: str | os.PathLike[str], strict: bool = True) -> tuple[str, ...]:
    """The keys of a keys file, in order. ``strict``: a bad line raises :class:`BadKey`
    (naming its line number, not its text); otherwise it is skipped with a warning."""
    keys = []
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(check_key(line, f"{path} line {number}"))
        except BadKey as exc:
            if strict:
                raise
            log.warning("API keys file: %s (line skipped)", exc)
    register_secrets(keys)
    return tuple(dict.fromkeys(keys))


def client_of_key(key: str) -> str:
    """How the server names the client of ``key`` (limits, never logged): a digest."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def is_loopback(host: str) -> bool:
    """Whether ``host`` listens on this machine only: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``); any other name counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ApiKeys:
    """The keys the server accepts: ``key`` (``--api-key``) and those of ``file``, reread
    when it changes. With neither, :attr:`enabled` is False and every request is let in."""

    def __init__(self, key: str | None = None, file: str | os.PathLike[str] | None = None) -> None:
        self.static: tuple[str, ...] = (check_key(key, "--api-key"),) if key else ()
        register_secrets(self.static)
        self.file = Path(file) if file else None
        self._lock = threading.Lock()
        self._signature: tuple[int, ...] | None = None
        self._file_keys: tuple[str, ...] = ()
        if self.file is not None:
            self._file_keys = read_keys_file(self.file)
            self._signature = self._stat()

    @property
    def enabled(self) -> bool:
        return bool(self.static) or self.file is not None

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.file)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def keys(self) -> tuple[str, ...]:
        """The keys valid now (the file reread first if it changed)."""
        if self.file is not None:
            signature = self._stat()
            if signature != self._signature:
                with self._lock:
                    if signature != self._signature:
                        self._reload(signature)
        return self.static + self._file_keys

    def _reload(self, signature: tuple[int, ...] | None) -> None:
        try:
            keys = read_keys_file(self.file, strict=False)  # type: ignore[arg-type]
        except (OSError, UnicodeDecodeError) as exc:
            keys = ()
            log.warning(
                "API keys file %s unreadable (%s): only --api-key is valid until it is back",
                self.file,
                type(exc).__name__,
            )
        else:
            log.info("API keys file %s reread: %d key(s)", self.file, len(keys))
        self._file_keys, self._signature = keys, signature

    def client(self, authorization: str | None) -> str | None:
        """The client of a request's ``Authorization`` header (:func:`client_of_key`), or
        None when it carries no valid ``Bearer`` key. Constant time in the key: every valid
        key is compared, with ``hmac.compare_digest``."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        sent = given.strip().encode()
        found = None
        for key in self.keys():
            if hmac.compare_digest(key.encode(), sent):
                found = key
        return client_of_key(found) if found is not None else None
