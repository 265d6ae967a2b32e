"""Hashes, ids and fingerprints: the identities every asset is keyed by.

Two kinds of key, never mixed up (see docs/design.md):

- row identity, where an asset sits in the corpus: ``doc_id`` (the user's), ``doc_version``,
  ``chunk_id``, ``nugget_id``;
- content key, what an asset's value depends on: a chunk's ``content_key`` hashes the tokenizer
  fingerprint and its token ids, so the same tokens give the same key in any document or build.

Every function here is pure and deterministic. Hashes are SHA-256, hex, truncated where stated.

>>> doc_version("hello", {})
'dv-...'  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# Bump when a change of code changes the value of any asset it produces.
CODE_VERSION = "coinrag-0.1.0"

_ID_HEX = 24  # 96 bits: ample against collisions for corpora of billions of rows


def sha256_hex(*parts: str | bytes) -> str:
    """SHA-256 over length-prefixed parts (so ("ab","c") and ("a","bc") differ)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: the form that is hashed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def text_hash(text: str) -> str:
    """Hash of a text alone, e.g. the input of an LLM call: ``th-`` + 24 hex."""
    return "th-" + sha256_hex("text", text)[:_ID_HEX]


def doc_version(text: str, metadata: Mapping[str, Any]) -> str:
    """Version of a document: hash of its text and metadata."""
    return "dv-" + sha256_hex("doc", text, canonical_json(dict(metadata)))[:_ID_HEX]


def chunk_id(doc_version_: str, ordinal: int, tokenizer_fp: str, chunker_fp: str) -> str:
    """Row identity of a chunk: its document version, its position, how it was cut."""
    return (
        "ch-" + sha256_hex("chunk", doc_version_, str(ordinal), tokenizer_fp, chunker_fp)[:_ID_HEX]
    )


def content_key(tokenizer_fp: str, token_ids: Iterable[int]) -> str:
    """Content key of a chunk: what its KV, nuggets and embeddings depend on."""
    ids = ",".join(str(int(t)) for t in token_ids)
    return "ck-" + sha256_hex("content", tokenizer_fp, ids)[:_ID_HEX]


def nugget_id(chunk_id_: str, tok_start: int, tok_end: int) -> str:
    """Row identity of a nugget: its chunk and its token span ``[tok_start, tok_end)``."""
    return "ng-" + sha256_hex("nugget", chunk_id_, str(tok_start), str(tok_end))[:_ID_HEX]


def window_id(chunk_id_: str, char_start: int, char_end: int) -> str:
    """Row identity of a chunk's window: its chunk and its characters ``[char_start,
    char_end)``."""
    return "wn-" + sha256_hex("window", chunk_id_, str(char_start), str(char_end))[:_ID_HEX]


def fingerprint(kind: str, fields: Mapping[str, Any]) -> str:
    """Fingerprint of a producer (tokenizer, model, extractor, embedder): ``kind-`` + 16 hex.

    ``fields`` must hold everything the producer's output depends on and nothing secret.
    """
    return f"{kind}-" + sha256_hex(kind, canonical_json(dict(fields)))[:16]


def new_run_id(flow: str) -> str:
    """A unique, sortable run id: ``<flow>-<UTC timestamp>-<8 hex>``."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{flow}-{stamp}-{uuid.uuid4().hex[:8]}"
