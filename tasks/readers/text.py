"""Plain text (``.txt``): the file's UTF-8 text as it is (a leading BOM dropped), no maps."""

from __future__ import annotations

from coinrag.tasks.readers.base import Heading, ReadDocument, Reader, ReadError


def decode_utf8(data: bytes, name: str) -> str:
    """``data`` as UTF-8 without a leading BOM, or :class:`ReadError` ``invalid_utf8`` naming
    the byte offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReadError(
            "invalid_utf8", f"{name}: invalid UTF-8 at byte offset {exc.start} ({exc.reason})"
        ) from None
    return text.removeprefix("\ufeff")


class TextReader(Reader, name="text"):
    """A ``.txt`` file: its text, untouched."""

    suffixes = (".txt",)
    version = "1"

    def read(self, data: bytes, name: str) -> ReadDocument:
        return ReadDocument(decode_utf8(data, name))


class MarkedUpTextReader(Reader):
    """A text format whose headings are marked in the text itself (Markdown, reST): the file's
    UTF-8 text, untouched, its :meth:`headings`, and as its title its first level-1 heading."""

    def headings(self, text: str) -> tuple[Heading, ...]:
        """Every heading of ``text``, in order (offsets into ``text``)."""
        raise NotImplementedError

    def read(self, data: bytes, name: str) -> ReadDocument:
        text = decode_utf8(data, name)
        headings = self.headings(text)
        title = next((h.title for h in headings if h.level == 1), None)
        return ReadDocument(text, title, headings=headings)
