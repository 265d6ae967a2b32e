"""Chunking: cut a document's tokens into chunks of at most ``chunk_size`` tokens.

The tokenizer is the generation model's, so a chunk is exactly the token sequence whose KV is
computed later. Invariants (tested):

- chunks are contiguous and cover the document: ``"".join(c.text) == document``;
- ``text == document[char_start:char_end] == tokenizer.decode(token_ids)``;
- ``n_tokens <= chunk_size``.

Four ways to place boundaries:

- ``fixed`` (the paper's): every ``chunk_size`` tokens;
- ``sentence``: the last sentence end (else paragraph, else word boundary) in the second half of
  the window, so that chunks do not start mid-sentence or mid-word;
- ``content``: content-defined cuts at sentence ends and blank lines chosen by a hash of the
  text around them (``tasks/chunk_content.py``), so an edit re-chunks only the chunks near it,
  where with ``fixed`` and ``sentence`` every later boundary moves;
- ``section``: chunks start at the document's headings (``heading_starts``, from the reader's
  heading map); a section that fits is never split, small ones share a chunk, a long one is cut
  at blank lines and block ends, else as ``sentence``, never inside a fenced code block or a
  table row when avoidable (``tasks/chunk_section.py``).

A boundary that would split a multi-byte character across two byte-level tokens moves back by a
token (the decode check), so every chunk's text is valid and exact.

Worked example (fixed, chunk_size=4, one token per word)::

    "a b c d e f"  ->  ["a b c d", " e f"]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from coinrag.schemas.keys import CODE_VERSION, chunk_id, content_key, fingerprint, text_hash
from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import CHUNKERS, BuildSettings
from coinrag.schemas.tables import ChunkRow, with_place
from coinrag.tasks.chunk_content import SENTENCE_END, ContentParams, content_plan, token_text
from coinrag.tasks.place import DocumentMaps


def chunker_fingerprint(method: str, chunk_size: int, content: ContentParams | None = None) -> str:
    """Fingerprint of a chunking method and its sizes; part of every chunk_id.

    ``content``: the content chunker's sizes (default ``ContentParams.for_chunk_size``).
    """
    return Chunker.registry[method](chunk_size, content).fingerprint


@dataclass(frozen=True)
class TokenizedText:
    """A document as tokens: ids and each token's (start, end) char offsets; the char offsets
    where its heading lines start (ascending, from the reader's heading map; only the
    ``section`` chunker reads them)."""

    text: str
    ids: list[int]
    ends: list[int]  # ends[i] = char offset where token i ends (monotone, last == len(text))
    heading_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        prev = 0
        for h in self.heading_starts:
            if not prev <= h <= len(self.text):
                raise ValueError(
                    f"heading_starts must be ascending offsets in 0..{len(self.text)} (the "
                    f"document's length); got {h} after {prev}: pass the reader's heading map "
                    "of this very text"
                )
            prev = h


def tokenize(tokenizer: Any, text: str, heading_starts: Sequence[int] = ()) -> TokenizedText:
    """Tokenize without special tokens; make token ends monotone and covering the text."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    ends: list[int] = []
    prev = 0
    for _, end in enc["offset_mapping"]:
        prev = max(prev, end)
        ends.append(prev)
    if ends:
        ends[-1] = len(text)
    return TokenizedText(text, ids, ends, tuple(heading_starts))


def _decodes_exactly(tokenizer: Any, doc: TokenizedText, a: int, b: int) -> bool:
    start = doc.ends[a - 1] if a > 0 else 0
    piece = tokenizer.decode(doc.ids[a:b], clean_up_tokenization_spaces=False)
    return piece == doc.text[start : doc.ends[b - 1]]


def is_sentence_cut(doc: TokenizedText, cut: int) -> bool:
    """Whether cut ``cut`` (0 < cut <= n: the next chunk starts at token ``cut``) follows a
    sentence end and whitespace follows or precedes it: ``"... end.| Next"``."""
    end = doc.ends[cut - 1]
    before = doc.text[max(0, end - 8) : end]
    nxt = token_text(doc.text, doc.ends, cut) if cut < len(doc.ids) else " "
    return bool(SENTENCE_END.search(before)) and (nxt[:1].isspace() or before[-1:].isspace())


def _sentence_boundary(doc: TokenizedText, a: int, b: int, chunk_size: int) -> int:
    """Best cut in (a + chunk_size/2, b]: after a sentence end, else a newline, else a word."""
    lo = a + max(1, chunk_size // 2)
    best_para = best_word = None
    for cut in range(b, lo, -1):  # cut = index of the first token of the next chunk
        if is_sentence_cut(doc, cut):
            return cut
        end = doc.ends[cut - 1]
        nxt = token_text(doc.text, doc.ends, cut) if cut < len(doc.ids) else " "
        if best_para is None and ("\n" in nxt[:1] or doc.text[end - 1 : end] == "\n"):
            best_para = cut
        if best_word is None and nxt[:1].isspace():
            best_word = cut
    return best_para or best_word or b


def boundaries(
    tokenizer: Any,
    doc: TokenizedText,
    chunk_size: int,
    method: str = "fixed",
    content: ContentParams | None = None,
) -> list[tuple[int, int]]:
    """Token ranges ``[a, b)`` of the chunks of a document (``method``: a registered
    :class:`Chunker`; an unknown one raises ``UnknownPlugin`` listing them)."""
    return Chunker.registry[method](chunk_size, content).ranges(tokenizer, doc)


class Chunker(Registered):
    """Where a document's chunks end: one subclass per ``chunker`` setting, registered by name
    (``class FixedChunker(Chunker, name="fixed")``). ``chunk_size``: the most tokens of a chunk;
    ``content``: the content chunker's sizes (default ``ContentParams.for_chunk_size``)."""

    registry: ClassVar[Registry[Chunker]] = Registry(
        "chunker", CHUNKERS, modules={"section": "coinrag.tasks.chunk_section"}
    )

    def __init__(self, chunk_size: int, content: ContentParams | None = None) -> None:
        self.chunk_size = chunk_size

    @classmethod
    def from_settings(cls, settings: BuildSettings) -> Chunker:
        """The chunker ``settings.chunker`` names, at ``settings.chunk_size``."""
        return cls.registry[settings.chunker](settings.chunk_size)

    def fingerprint_fields(self) -> dict[str, Any]:
        return {"method": self.name, "chunk_size": self.chunk_size, "v": 1}

    @property
    def fingerprint(self) -> str:
        """``keys.fingerprint("chunker", ...)`` of the method and its sizes."""
        return fingerprint("chunker", self.fingerprint_fields())

    def ranges(self, tokenizer: Any, doc: TokenizedText) -> list[tuple[int, int]]:
        """Token ranges ``[a, b)`` of the chunks of ``doc``: windows of ``chunk_size`` tokens,
        each ending where :meth:`cut` says, moved back off a split character."""
        n = len(doc.ids)
        out: list[tuple[int, int]] = []
        a = 0
        while a < n:
            b = min(a + self.chunk_size, n)
            if b < n:
                b = self.cut(doc, a, b)
            b = back_off(tokenizer, doc, a, b)
            out.append((a, b))
            a = b
        return out

    def cut(self, doc: TokenizedText, a: int, b: int) -> int:
        """The end of the chunk starting at token ``a`` whose window ends at ``b`` (< the end)."""
        return b


class FixedChunker(Chunker, name="fixed"):
    """The paper's: a cut every ``chunk_size`` tokens."""


class SentenceChunker(Chunker, name="sentence"):
    """The last sentence end (else paragraph, else word boundary) in the second half of the
    window."""

    def cut(self, doc: TokenizedText, a: int, b: int) -> int:
        return _sentence_boundary(doc, a, b, self.chunk_size)


class ContentChunker(Chunker, name="content"):
    """Content-defined cuts (``tasks/chunk_content.py``): an edit re-chunks only the chunks
    near it."""

    def __init__(self, chunk_size: int, content: ContentParams | None = None) -> None:
        super().__init__(chunk_size)
        self.params = (content or ContentParams.for_chunk_size(chunk_size)).validate()
        if self.params.max_tokens != chunk_size:
            raise ValueError(
                f"content chunker max_tokens {self.params.max_tokens} differs from chunk_size "
                f"{chunk_size}: pass ContentParams with max_tokens={chunk_size}"
            )

    def fingerprint_fields(self) -> dict[str, Any]:
        return {**super().fingerprint_fields(), "content": self.params.fingerprint_fields()}

    def ranges(self, tokenizer: Any, doc: TokenizedText) -> list[tuple[int, int]]:
        plan = content_plan(doc.text, doc.ends, self.params)
        return _ranges_from_cuts(tokenizer, doc, plan.cuts, self.chunk_size)


def back_off(tokenizer: Any, doc: TokenizedText, a: int, b: int) -> int:
    """Move the end ``b`` of chunk ``[a, b)`` back until no multi-byte character is split."""
    while b < len(doc.ids) and b - a > 1 and not _decodes_exactly(tokenizer, doc, a, b):
        b -= 1
    return b


def _ranges_from_cuts(
    tokenizer: Any, doc: TokenizedText, cuts: Sequence[int], chunk_size: int
) -> list[tuple[int, int]]:
    """Chunks ending at ``cuts`` (ascending) and at the end. A cut that would split a character
    moves back to the character's start; the remainder joins the next chunk (split again, the
    same way, if that makes it longer than ``chunk_size``)."""
    out: list[tuple[int, int]] = []
    a = 0
    for cut in [*cuts, len(doc.ids)]:
        while cut - a > chunk_size:
            b = back_off(tokenizer, doc, a, a + chunk_size)
            out.append((a, b))
            a = b
        if cut > a:
            b = back_off(tokenizer, doc, a, cut)
            if b < len(doc.ids) and not _decodes_exactly(tokenizer, doc, a, b):
                continue  # [a, cut) is inside one character: it joins the next chunk
            out.append((a, b))
            a = b
    return out


def chunk_document(
    tokenizer: Any,
    doc_id: str,
    doc_version: str,
    text: str,
    *,
    tokenizer_fp: str,
    chunk_size: int = 512,
    method: str = "fixed",
    content: ContentParams | None = None,
    heading_starts: Sequence[int] = (),
    run_id: str,
) -> list[ChunkRow]:
    """Cut one document version into chunk rows (``content``: see ``chunker_fingerprint``;
    ``heading_starts``: char offsets of its heading lines, ascending, for ``section``)."""
    chunker = Chunker.registry[method](chunk_size, content)
    chunker_fp = chunker.fingerprint
    doc = tokenize(tokenizer, text, heading_starts)
    rows = []
    for ordinal, (a, b) in enumerate(chunker.ranges(tokenizer, doc)):
        cs = doc.ends[a - 1] if a > 0 else 0
        ce = doc.ends[b - 1]
        ids = doc.ids[a:b]
        spans: list[int] = []
        prev = cs
        for i in range(a, b):
            spans += [prev - cs, doc.ends[i] - cs]
            prev = doc.ends[i]
        chunk_text = text[cs:ce]
        rows.append(
            ChunkRow(
                chunk_id=chunk_id(doc_version, ordinal, tokenizer_fp, chunker_fp),
                doc_id=doc_id,
                doc_version=doc_version,
                ordinal=ordinal,
                text=chunk_text,
                n_tokens=b - a,
                char_start=cs,
                char_end=ce,
                tok_start=a,
                tok_end=b,
                token_ids=ids,
                token_spans=spans,
                content_key=content_key(tokenizer_fp, ids),
                text_hash=text_hash(chunk_text),
                tokenizer_fp=tokenizer_fp,
                chunker_fp=chunker_fp,
                run_id=run_id,
                code_version=CODE_VERSION,
            )
        )
    return rows


def token_spans_pairs(flat: Sequence[int]) -> list[tuple[int, int]]:
    """``[s0, e0, s1, e1, ...]`` -> ``[(s0, e0), (s1, e1), ...]``."""
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


# ---------------------------------------------------------------------------- stage


def chunk_stage(
    store: Any,
    documents: Sequence[Any],
    tokenizer: Any,
    *,
    tokenizer_fp: str,
    chunk_size: int,
    method: str,
    run_id: str,
) -> tuple[list[ChunkRow], int]:
    """Chunk the document versions not yet chunked this way; return (all chunks, n_new).

    ``documents`` are ``tasks.ingest.SourceDocument``; chunks of versions chunked by an earlier
    build with the same tokenizer and chunker are read back, not recomputed.
    A document read from a file (``doc.origin``) gives the chunker its heading offsets (only
    ``section`` reads them; they are fixed by the version, which the reader's fingerprint
    enters) and every chunk its place (file, pages, section: ``tasks/place.py``).
    """
    import pyarrow.compute as pc

    from coinrag.storage.tables import append_rows, read_rows

    chunker_fp = chunker_fingerprint(method, chunk_size)
    existing = read_rows(
        store,
        ChunkRow,
        filter=(pc.field("tokenizer_fp") == tokenizer_fp) & (pc.field("chunker_fp") == chunker_fp),
    )
    by_version: dict[str, list[ChunkRow]] = {}
    for row in existing:
        by_version.setdefault(row.doc_version, []).append(row)
    out: list[ChunkRow] = []
    new: list[ChunkRow] = []
    for doc in documents:
        version = doc.version
        if version in by_version:
            out += sorted(by_version[version], key=lambda r: r.ordinal)
            continue
        rows = chunk_document(
            tokenizer,
            doc.doc_id,
            version,
            doc.text,
            tokenizer_fp=tokenizer_fp,
            chunk_size=chunk_size,
            method=method,
            heading_starts=tuple(doc.origin.heading_starts or ()) if doc.origin else (),
            run_id=run_id,
        )
        maps = DocumentMaps.of(doc.text, doc.origin)
        rows = [with_place(r, maps.place(r.char_start, r.char_end)) for r in rows]
        by_version[version] = rows
        new += rows
        out += rows
    append_rows(store, new, run_id, "chunk")
    return out, len(new)
