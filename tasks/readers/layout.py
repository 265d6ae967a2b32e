"""How structured readers (HTML, Word) write their text, so that one chunker reads them all.

A heading is a line of its own holding its title (recorded in the heading map); paragraphs are
separated by a blank line; the lines of one run (the items of a list, the rows of a table, cells
joined by `` | ``) follow each other; a code block is fenced by lines of backticks::

    Install          <- heading (level 1)

    Run it with:

    ```
    pip install x
    ```

    - one
    - two
"""

from __future__ import annotations

import re

from coinrag.tasks.readers.base import Heading

_WHITE = re.compile(r"[ \t\n\r\f\v\xa0]+")
LINE_BREAK = "\x00"  # a <br> inside inline text, until the text is written


def squash(text: str) -> str:
    """Inline text as a browser shows it: runs of white space one space, a
    :data:`LINE_BREAK` a line break. ``"a \\n  b\\x00 c "`` -> ``"a b\\nc"``."""
    if LINE_BREAK not in text:
        return _WHITE.sub(" ", text).strip()
    lines = (_WHITE.sub(" ", line).strip() for line in text.split(LINE_BREAK))
    return "\n".join(line for line in lines if line)


class TextBuilder:
    """The text of a structured document, written block by block: a heading, a paragraph or a
    code block is a block of its own (a blank line before it); the lines of one ``run`` (the
    items of a list, the rows of a table) follow each other on consecutive lines."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0  # characters written
        self.run: str | None = None  # the run the last line belongs to
        self.headings: list[Heading] = []

    def line(self, text: str, run: str | None = None) -> int:
        """Write ``text`` (no-op when empty): on the next line if it continues ``run``, else
        after a blank line. Returns the offset where ``text`` starts."""
        if not text:
            return self.size
        if self.parts:
            sep = "\n" if run is not None and run == self.run else "\n\n"
            self.parts.append(sep)
            self.size += len(sep)
        start = self.size
        self.parts.append(text)
        self.size += len(text)
        self.run = run
        return start

    def end_run(self) -> None:
        """The next line starts a new block, whatever its run."""
        self.run = None

    def heading(self, level: int, title: str) -> None:
        """A heading line, recorded in ``headings`` (``¶`` signs at its end cut)."""
        title = title.rstrip("¶ ").replace("\n", " ")
        if title:
            self.end_run()
            self.headings.append(Heading(self.line(title), level, title))
            self.end_run()

    def code(self, code: str) -> None:
        """A fenced code block: ``code`` verbatim between two fence lines (blank lines around
        it dropped; the fence is longer than any backtick run at the start of a line in it)."""
        code = code.strip("\n").rstrip()
        if code.strip():
            fence = "`" * max([3, *(len(m) + 1 for m in re.findall(r"(?m)^\s*(`{3,})", code))])
            self.end_run()
            self.line(f"{fence}\n{code}\n{fence}")
            self.end_run()

    def text(self) -> str:
        """Everything written, ending with a newline (``""`` when nothing was)."""
        return "".join(self.parts) + "\n" if self.parts else ""
