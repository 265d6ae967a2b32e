"""A folder SOURCE read by its readers: document ids, what is skipped, every file reject, and
the work a rebuild skips (files unchanged since the store's live rows are not parsed again)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coinrag.tasks.ingest import document_row, ingest
from coinrag.tasks.ingest_files import ReadOptions


def _write(root: Path, rel: str, data: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def test_ids_keep_the_extension_only_where_two_files_share_a_stem(tmp_path: Path) -> None:
    _write(tmp_path, "faq/general.md", "# General\n\nText.")
    _write(tmp_path, "faq/general.txt", "Text again.")
    _write(tmp_path, "notes.txt", "Notes.")
    ids = [d.doc_id for d in ingest(tmp_path).documents]
    assert ids == ["faq/general.md", "faq/general.txt", "notes"]


def test_hidden_excluded_and_unknown_files_are_skipped_not_rejected(tmp_path: Path) -> None:
    _write(tmp_path, "a.txt", "Kept.")
    _write(tmp_path, ".hidden.txt", "Hidden.")
    _write(tmp_path, ".git/config.txt", "Hidden folder.")
    _write(tmp_path, "_sources/a.rst.txt", "Excluded.")
    _write(tmp_path, "image.png", b"\x89PNG")
    result = ingest(tmp_path, ReadOptions(exclude=("_sources/*",)))
    assert [d.doc_id for d in result.documents] == ["a"]
    assert result.rejects == []
    assert result.skipped == 3  # .hidden.txt, the excluded one, image.png (.git: never walked)


def test_a_page_of_links_is_left_out_not_rejected(tmp_path: Path) -> None:
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "html"
    _write(tmp_path, "faq/general.html", (fixtures / "general.html").read_bytes())
    _write(tmp_path, "genindex-Y.html", (fixtures / "genindex-Y.html").read_bytes())
    result = ingest(tmp_path)
    assert [d.doc_id for d in result.documents] == ["faq/general"]
    assert result.rejects == []
    assert [(f.source, f.reason) for f in result.left_out] == [
        ("genindex-Y.html", "navigation_page")
    ]
    whole = ingest(tmp_path, ReadOptions(html_mode="whole"))
    assert [d.doc_id for d in whole.documents] == ["faq/general", "genindex-Y"]


def test_file_origin_records_reader_hash_and_headings(tmp_path: Path) -> None:
    data = "# Guide\n\nIntro.\n\n## Install\n\nRun it.\n"
    _write(tmp_path, "guide.md", data)
    (doc,) = ingest(tmp_path).documents
    origin = doc.origin
    assert origin is not None
    assert (origin.path, origin.format, origin.title) == ("guide.md", "markdown", "Guide")
    assert origin.sha256 == __import__("hashlib").sha256(data.encode()).hexdigest()
    assert origin.size == len(data.encode())
    assert origin.heading_titles == ["Guide", "Install"]
    assert origin.heading_levels == [1, 2]
    assert [data[s:].split("\n")[0] for s in origin.heading_starts] == ["# Guide", "## Install"]
    assert origin.page_starts is None


def test_a_new_reader_version_makes_a_new_document_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coinrag.tasks.readers.markdown import MarkdownReader

    _write(tmp_path, "a.md", "# A\n\nText.")
    _write(tmp_path, "b.txt", "Text.")
    before = {d.doc_id: d.version for d in ingest(tmp_path).documents}
    monkeypatch.setattr(MarkdownReader, "version", "2")
    after = {d.doc_id: d.version for d in ingest(tmp_path).documents}
    assert after["a"] != before["a"]
    assert after["b"] == before["b"]


def test_bad_files_are_rejects_with_reasons_and_the_rest_is_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    src = tmp_path / "src"
    _write(outside, "secret.txt", "Never read.")
    _write(src, "good.txt", "Good.")
    _write(src, "empty.txt", b"")
    _write(src, "big.txt", "x" * 200)
    os.symlink(outside / "secret.txt", src / "link.txt")
    os.symlink(outside, src / "linked_folder")
    os.symlink(src / "good.txt", src / "inside_link.txt")
    result = ingest(src, ReadOptions(max_file_bytes=100))
    assert sorted(d.doc_id for d in result.documents) == ["good", "inside_link"]
    reasons = sorted((r.source, r.reason) for r in result.rejects)
    assert reasons == [
        ("big.txt", "too_large"),
        ("empty.txt", "empty_file"),
        ("link.txt", "outside_source"),
        ("linked_folder", "outside_source"),
    ]
    assert all("Never read" not in d.text for d in result.documents)


def test_a_rebuild_reuses_the_live_rows_of_unchanged_files(tmp_path: Path) -> None:
    """Same path, size and mtime: not read; same bytes: read, hashed, not parsed."""
    src = tmp_path / "src"
    path = _write(src, "a.md", "# A\n\nText.")
    _write(src, "b.md", "# B\n\nMore.")
    first = ingest(src)
    assert first.parsed == 2
    known = {d.doc_id: document_row(d, "r") for d in first.documents}
    again = ingest(src, known=known)
    assert again.parsed == 0
    assert [d.version for d in again.documents] == [d.version for d in first.documents]
    os.utime(path, ns=(0, 0))  # touched, same bytes
    touched = ingest(src, known=known)
    assert touched.parsed == 0 and touched.documents[0].origin.mtime_ns == 0
    path.write_text("# A\n\nEdited.", encoding="utf-8")
    edited = ingest(src, known=known)
    assert edited.parsed == 1 and edited.documents[0].text.endswith("Edited.")
