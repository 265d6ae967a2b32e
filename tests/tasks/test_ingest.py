"""Ingest: the three source formats, and every kind of reject with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coinrag.tasks.ingest import SourceError, ingest


def test_folder_of_text_and_markdown(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("Alpha text.", encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text("# Beta\n\nBeta text.", encoding="utf-8")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    result = ingest(tmp_path)
    assert [d.doc_id for d in result.documents] == ["a", "sub/b"]
    assert result.documents[1].metadata == {"path": "sub/b.md"}
    assert result.rejects == []


def test_jsonl_keeps_other_fields_as_metadata(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text(
        json.dumps({"id": "x", "text": "Some text.", "title": "X", "year": 2020})
        + "\n\n"
        + json.dumps({"id": 7, "text": "Numeric id."})
        + "\n",
        encoding="utf-8",
    )
    result = ingest(src)
    assert [d.doc_id for d in result.documents] == ["x", "7"]
    assert result.documents[0].metadata == {"title": "X", "year": 2020}


def test_parquet_source(tmp_path: Path) -> None:
    src = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table({"id": ["p1", "p2"], "text": ["One.", "Two."], "lang": ["en", "fr"]}), src
    )
    result = ingest(src)
    assert [(d.doc_id, d.metadata) for d in result.documents] == [
        ("p1", {"lang": "en"}),
        ("p2", {"lang": "fr"}),
    ]


def test_parquet_without_text_column_is_a_source_error(tmp_path: Path) -> None:
    src = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["p1"], "body": ["x"]}), src)
    with pytest.raises(SourceError, match="text"):
        ingest(src)


def test_rejects_carry_reasons_and_never_stop_the_others(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    good = json.dumps({"id": "ok", "text": "Fine."}).encode()
    lines = [
        good,
        json.dumps({"id": "empty", "text": "   "}).encode(),
        json.dumps({"id": "ok", "text": "Same id again."}).encode(),
        b'{"id": "bad", "text": "caf\xe9"}',
        b"{not json",
        json.dumps({"text": "no id"}).encode(),
        json.dumps({"id": "last", "text": "Still read."}).encode(),
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    result = ingest(src)
    assert [d.doc_id for d in result.documents] == ["ok", "last"]
    reasons = [(r.doc_id, r.reason) for r in result.rejects]
    assert reasons == [
        ("empty", "empty_text"),
        ("ok", "duplicate_id"),
        (None, "invalid_utf8"),
        (None, "bad_record"),
        (None, "bad_record"),
    ]
    utf8 = result.rejects[2]
    offset = sum(len(line) + 1 for line in lines[:3]) + lines[3].index(b"\xe9")
    assert f"byte offset {offset}" in utf8.detail and str(src) in utf8.detail


def test_invalid_utf8_file_in_folder_reports_file_and_offset(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("Good.", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfedef")
    result = ingest(tmp_path)
    assert [d.doc_id for d in result.documents] == ["good"]
    (reject,) = result.rejects
    assert reject.reason == "invalid_utf8"
    assert "bad.txt" in reject.detail and "byte offset 3" in reject.detail


@pytest.mark.parametrize("name", ["missing", "single.txt", "data.csv"])
def test_unusable_sources_raise(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name != "missing":
        path.write_text("x")
    with pytest.raises(SourceError):
        ingest(path)


def test_empty_folder_is_a_source_error(tmp_path: Path) -> None:
    (tmp_path / "style.css").write_text("body {}", encoding="utf-8")
    with pytest.raises(SourceError, match=r"holds no files coinrag reads \(\.docx, .*\.txt\)"):
        ingest(tmp_path)
