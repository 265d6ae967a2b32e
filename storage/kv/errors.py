"""The KV store's errors: :class:`KvError` and the ways an entry can fail to be served.

Each names the entry and what is wrong, e.g. ``corrupt KV entry ck-1 at
kv-9/shard-000003#slot-2: sha256 differs from the manifest``; a command stops with its
``exit_code`` (1) on any of them.
"""

from __future__ import annotations


class KvError(RuntimeError):
    """Base of the KV store's errors."""

    exit_code = 1


class CorruptKvEntry(KvError):
    """A stored entry failed a check (crc32c, sha256, size, slot identity): never served."""

    def __init__(self, content_key: str, location: str, reason: str) -> None:
        self.content_key = content_key
        self.location = location
        self.reason = reason
        super().__init__(f"corrupt KV entry {content_key} at {location}: {reason}")


class MissingKvEntry(KvError, KeyError):
    """No valid manifest row for this content_key under this kv_fp."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "missing KV entry"


class UnstoredKvSlice(KvError, LookupError):
    """Chunk tokens an entry does not hold (``kv_keep = "nuggets"`` keeps only nugget spans):
    never served (as zeros or otherwise)."""

    def __init__(self, content_key: str, start: int, end: int, held: str) -> None:
        self.content_key = content_key
        self.start = start
        self.end = end
        super().__init__(
            f"tokens [{start}, {end}) of chunk content {content_key} are not stored: this KV "
            f'store keeps only the KV of nugget spans (kv_keep = "nuggets"), and its entries of '
            f"that chunk hold {held}"
        )


class KvFingerprintMismatch(KvError):
    """KV built for one fingerprint was asked for by another."""

    def __init__(self, stored: str, expected: str, detail: str = "") -> None:
        self.stored = stored
        self.expected = expected
        msg = (
            f"KV fingerprint mismatch: the stored KV was built for {stored}, but {expected} "
            "was asked for; KV is tied to the model weights, dtype, RoPE and prompt prefix, "
            "so it must be rebuilt (run the kv stage) for the current model"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


def read_problem(exc: BaseException) -> str:
    """A failed read as a short reason (Zarr's checksum error quotes raw bytes: not in a
    message a user reads)."""
    if "checksum" in str(exc).lower():
        return "read failed: a crc32c does not match"
    return f"read failed: {exc}"
