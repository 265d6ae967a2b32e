"""HTML (``.html``, ``.htm``): the text a person reads on the page, and its headings.

Two modes, the reader's option ``html_mode`` (``schemas.settings.HTML_MODES``):

- ``main`` (the default): the page's main content as trafilatura finds it: navigation,
  sidebars, headers and footers dropped (by their tags, roles and classes, and lists and
  tables dense in links). When the page marks its content (exactly one ``<main>``, else one
  ``role="main"``), only that element is given to trafilatura, as an ``<article>``; a page
  without such a mark whose headings trafilatura all dropped is read again with its body in an
  ``<article>`` (:func:`main_content`). Before, the tree is prepared so that trafilatura keeps
  the content it drops on documentation pages (:func:`prepare_for_trafilatura`). It runs with
  ``fast=True`` (no fallback extractors) and no dedup (its cache would make a page's text
  depend on the pages read before it);
  A page that marks its content and whose content is mostly links (at least
  ``NAVIGATION_LINK_SHARE`` of its characters inside ``<a>``: an index or a
  table of contents, Sphinx's ``genindex-*.html``, ``contents.html`` and the toctree pages) is
  left out (:class:`LeftOut` ``navigation_page``): it repeats every title of the site and would
  outrank the pages it points to;
- ``whole``: all the text of ``<body>``; only what a browser never shows is dropped
  (``script``, ``style``, ``template``, comments).

Both write the text in the conventions of every structured reader, so that one section
chunker serves all formats (:class:`TextBuilder`): a heading is a line of its own holding just
its title, recorded in ``headings``; blocks are separated by a blank line; a list item is a
line ``- item`` (``1. item`` in an ordered list; nested lists indented by two spaces a level;
an item's later paragraphs indented under its text); a table is one line per row, its cells
joined by `` | ``; a ``<pre>`` is a fenced code block (a line `````, the code verbatim, a line
`````); a definition list's terms and descriptions are paragraphs. Elsewhere runs of white
space are one space and a ``<br>`` a line break, as a browser shows them. Permalink anchors (an
``<a href="#...">`` whose text is only ``¶``, ``§``, ``#`` or ``🔗``, which Sphinx and MkDocs put
after each heading) are dropped. The main mode loses the ``start`` of an ordered list
(trafilatura drops it): its items are numbered from 1.

Decoding: a byte order mark, else the charset a ``<meta>`` (or an XML declaration) in the first
1024 bytes declares (``iso-8859-1``, ``latin1`` and ``ascii`` read as ``windows-1252``, as
browsers do), else UTF-8; bytes that do not decode are a :class:`ReadError` ``undecodable``;
a page without text ``empty_text``. The title: the page's only ``<h1>``, else its ``og:title``,
else its ``<title>``.

Worked example (the whole mode)::

    <html><title>T</title><body><nav>Home</nav><h1>Intro<a href="#intro">¶</a></h1>
    <p>Hello,
       <b>world</b>.</p><ul><li>a</li><li>b</li></ul><table><tr><td>1</td><td>2</td></tr>
    </table></body></html>
    -> "Home\\n\\nIntro\\n\\nHello, world.\\n\\n- a\\n- b\\n\\n1 | 2\\n",
       headings (6, 1, "Intro"), title "Intro"
"""

from __future__ import annotations

import codecs
import re
from typing import Any, ClassVar

from lxml import etree, html

from coinrag.schemas.settings import HTML_MODES
from coinrag.tasks.readers.base import LeftOut, ReadDocument, Reader, ReadError
from coinrag.tasks.readers.layout import LINE_BREAK, TextBuilder, squash

PRESCAN_BYTES = 1024  # how far a <meta charset> is looked for, as in the HTML standard
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_META_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
_XML_ENCODING = re.compile(rb"""^\s*<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""", re.I)
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>")
_AS_WINDOWS_1252 = {"ascii", "iso8859-1"}  # codecs browsers read as windows-1252
PERMALINK_SIGNS = {"¶", "§", "#", "🔗"}
NEVER_SHOWN = ("script", "style", "template")
INLINE_CODE = ("span", "code", "kbd", "samp", "tt", "var")  # unwrapped for trafilatura
HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
BLOCKS = {"p", "div", "ul", "ol", "dl", "table", "pre", "blockquote", "section", "form", *HEADINGS}


def decode_html(data: bytes, name: str) -> str:
    """The text of an HTML file: by its BOM, else its declared charset, else UTF-8 (see the
    module); :class:`ReadError` ``undecodable`` when the bytes do not decode."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return _decode(data[len(bom) :], encoding, "its byte order mark", name)
    head = data[:PRESCAN_BYTES]
    declared = _XML_ENCODING.match(head) or _META_CHARSET.search(head)
    label = declared.group(1).decode("ascii") if declared else None
    encoding, source = "utf-8", "the default"
    if label is not None:
        try:
            codec = codecs.lookup(label).name
        except LookupError:
            source = f"the default (the declared charset {label!r} is unknown)"
        else:
            source = f"the declared charset {label!r}"
            encoding = "cp1252" if codec in _AS_WINDOWS_1252 else codec
            if encoding.startswith(("utf-16", "utf-32")):  # no BOM: a browser reads UTF-8
                encoding = "utf-8"
    return _decode(data, encoding, source, name)


def _decode(data: bytes, encoding: str, source: str, name: str) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ReadError(
            "undecodable",
            f"{name}: not {encoding} (by {source}) at byte offset {exc.start} "
            f"({data[exc.start : exc.start + 4]!r}: {exc.reason}); save the page as UTF-8 or "
            "declare its charset in a <meta charset> tag",
        ) from None


_PARSER = html.HTMLParser(remove_comments=True, remove_pis=True)
_LOCAL_LINKS = etree.XPath("//a[starts-with(@href, '#')]")
_MAIN = etree.XPath("//main")
_ROLE_MAIN = etree.XPath("//*[@role='main']")
_ANY_HEADING = etree.XPath("//h1 | //h2 | //h3 | //h4 | //h5 | //h6")
_OUTER_LINKS = etree.XPath(".//a[not(ancestor::a)]")
# A page's main content with this share of its characters in link text is navigation. On the
# 530 pages of the Python docs' HTML the shares split in two: indexes and tables of contents
# at 0.73-0.96 (genindex-*, contents, library/internet ...), the pages with content of their
# own at 0.66 or less (tutorial/index, with its paragraphs, 0.66; faq/library 0.17).
NAVIGATION_LINK_SHARE = 0.7
# How trafilatura reads a page here: only ``.body`` of its XML is used ("python" would render
# a text too); no fallback extractors (``fast``); tables kept, images, formatting and links
# dropped (the writer makes the text's own conventions); no dedup, whose cache would make a
# page's text depend on the pages read before it.
TRAFILATURA_OPTIONS = {
    "output_format": "xml",
    "fast": True,
    "include_comments": False,
    "include_tables": True,
    "include_images": False,
    "include_formatting": False,
    "include_links": False,
    "deduplicate": False,
    "with_metadata": False,
}


def parse_html(text: str, name: str) -> html.HtmlElement:
    """The page's tree with what is never shown and the permalink anchors removed."""
    try:
        root = html.document_fromstring(_XML_DECLARATION.sub("", text, count=1), _PARSER)
    except etree.ParserError:
        raise ReadError("empty_text", f"{name}: the page has no content") from None
    etree.strip_elements(root, *NEVER_SHOWN, with_tail=False)
    for a in _LOCAL_LINKS(root):
        if a.text_content().strip() in PERMALINK_SIGNS:
            a.drop_tree()  # keeps the tail
    return root


class _Item:
    """A list item being written: its marker (``"  - "``) until its first line is written,
    then the indentation of its next lines."""

    def __init__(self, marker: str) -> None:
        self.marker: str | None = marker
        self.indent = " " * len(marker)


class PageWriter:
    """Walks a tree and writes it with a :class:`TextBuilder`. What each element is (a heading,
    a list, ...) the subclass says by :meth:`kind`, for its own vocabulary: HTML tags
    (:class:`HtmlBodyWriter`) or trafilatura's XML (:class:`TrafilaturaWriter`)."""

    def __init__(self) -> None:
        self.out = TextBuilder()
        self.inline: list[str] = []  # the inline text not yet written
        self.items: list[_Item] = []  # the list items open, innermost last
        self.list_depth = 0

    def kind(self, el: etree._Element) -> str:
        """One of ``skip inline break heading paragraph list item table code block``."""
        raise NotImplementedError

    def level(self, el: etree._Element) -> int:
        """A heading's level (1 = top)."""
        raise NotImplementedError

    def ordered(self, el: etree._Element) -> bool:
        """Whether a list is numbered."""
        raise NotImplementedError

    def write(self, root: etree._Element) -> TextBuilder:
        """Write ``root``'s content; the builder holds the text and the headings."""
        self.children(root)
        self.flush()
        return self.out

    def children(self, el: etree._Element) -> None:
        if el.text:
            self.inline.append(el.text)
        for child in el:
            self.node(child)
            if child.tail:
                self.inline.append(child.tail)

    def node(self, el: etree._Element) -> None:
        kind = self.kind(el)
        if kind == "inline":
            self.children(el)
        elif kind == "break":
            self.inline.append(LINE_BREAK)
        elif kind in ("paragraph", "block"):  # the common case, two frames a level deep
            self.flush()
            self.children(el)
            self.flush()
        elif kind != "skip":
            self.flush()
            getattr(self, f"write_{kind}")(el)
            self.flush()

    def flush(self) -> None:
        """Write the inline text gathered as a paragraph, or as a line of the open item."""
        text = squash("".join(self.inline))
        self.inline.clear()
        if not text:
            return
        if not self.items:
            self.out.line(text)
            return
        item = self.items[-1]
        lead, item.marker = item.marker or item.indent, None
        self.out.line(lead + text.replace("\n", "\n" + item.indent), run="list")

    def write_heading(self, el: etree._Element) -> None:
        self.out.heading(self.level(el), self.flat_text(el))

    def write_code(self, el: etree._Element) -> None:
        pieces = []
        for event, e in etree.iterwalk(el, events=("start", "end")):
            if event == "start":
                pieces.append("\n" if self.kind(e) == "break" else e.text or "")
            elif e is not el:
                pieces.append(e.tail or "")
        self.out.code("".join(pieces))

    def write_list(self, el: etree._Element) -> None:
        if self.list_depth == 0:
            self.out.end_run()
        self.list_depth += 1
        number = int(el.get("start", "1")) if el.get("start", "").isdigit() else 1
        for child in el:
            if self.kind(child) == "item":
                indent = "  " * (self.list_depth - 1)
                self.items.append(_Item(indent + (f"{number}. " if self.ordered(el) else "- ")))
                self.children(child)
                self.flush()
                self.items.pop()
                number += 1
            else:
                self.node(child)
            if child.tail:
                self.inline.append(child.tail)
        self.list_depth -= 1
        if self.list_depth == 0:
            self.out.end_run()

    def write_item(self, el: etree._Element) -> None:  # an item outside any list
        self.children(el)

    def write_table(self, el: etree._Element) -> None:
        self.out.end_run()
        for row in self.rows(el):
            cells = [self.flat_text(cell) for cell in row]
            if any(cells):
                self.out.line(" | ".join(cells), run="table")
        self.out.end_run()

    def rows(self, table: etree._Element) -> list[list[etree._Element]]:
        """The rows of ``table`` (not of tables inside it), each a list of its cells."""
        raise NotImplementedError

    def flat_text(self, el: etree._Element) -> str:
        """``el``'s text on one line (blocks inside it separated by a space)."""
        pieces: list[str] = []
        self._flat(el, pieces)
        return squash("".join(pieces)).replace("\n", " ")

    def _flat(self, el: etree._Element, pieces: list[str]) -> None:
        kind = self.kind(el)
        if kind == "skip":
            return
        gap = "" if kind == "inline" else " "
        pieces.append(gap + (el.text or ""))
        for child in el:
            self._flat(child, pieces)
            pieces.append(child.tail or "")
        pieces.append(gap)


class HtmlBodyWriter(PageWriter):
    """The ``whole`` mode: every element of an HTML ``<body>`` (see the module)."""

    KINDS: ClassVar[dict[str, str]] = {
        **dict.fromkeys(HEADINGS, "heading"),
        **dict.fromkeys(("p", "dt", "figcaption", "caption", "summary", "legend"), "paragraph"),
        **dict.fromkeys(("ul", "ol", "menu", "dir"), "list"),
        "li": "item",
        "table": "table",
        **dict.fromkeys(("pre", "listing", "plaintext", "xmp"), "code"),
        **dict.fromkeys(("br",), "break"),
        **dict.fromkeys(
            ("title", "meta", "link", "base", "img", "svg", "math", "iframe", "object", "embed"),
            "skip",
        ),
        **dict.fromkeys(("canvas", "video", "audio", "select", "input", "textarea", "map"), "skip"),
        **dict.fromkeys(
            (
                *("address", "article", "aside", "blockquote", "body", "center", "dd", "details"),
                *("dialog", "div", "dl", "fieldset", "figure", "footer", "form", "header"),
                *("hgroup", "hr", "main", "nav", "noscript", "search", "section", "html", "head"),
                *("tr", "td", "th", "thead", "tbody", "tfoot"),
            ),
            "block",
        ),
    }

    def kind(self, el: etree._Element) -> str:
        if not isinstance(el.tag, str):
            return "skip"
        return self.KINDS.get(el.tag.lower(), "inline")

    def level(self, el: etree._Element) -> int:
        return int(el.tag[1])

    def ordered(self, el: etree._Element) -> bool:
        return el.tag == "ol"

    def rows(self, table: etree._Element) -> list[list[etree._Element]]:
        return [
            [c for c in tr if c.tag in ("td", "th")]
            for tr in table.iter("tr")
            if next(tr.iterancestors("table")) is table
        ]


class TrafilaturaWriter(PageWriter):
    """The ``main`` mode: trafilatura's XML (``head rend="h2"``, ``p``, ``list rend="ol"``,
    ``item``, ``table``/``row``/``cell``, ``code`` (a ``<pre>``), ``quote``, ``lb``). A
    definition list (``list rend="dl"``) is written as blocks: its terms and descriptions are
    paragraphs, as in the ``whole`` mode."""

    KINDS: ClassVar[dict[str, str]] = {
        "head": "heading",
        "p": "paragraph",
        "list": "list",
        "item": "item",
        "table": "table",
        "code": "code",
        "lb": "break",
        **dict.fromkeys(("graphic", "done"), "skip"),
        **dict.fromkeys(("body", "main", "doc", "div", "quote", "row", "cell"), "block"),
    }

    def kind(self, el: etree._Element) -> str:
        tag = el.tag if isinstance(el.tag, str) else ""
        if tag == "list" and el.get("rend") == "dl" or tag == "item" and _is_dl_item(el):
            return "paragraph" if el.get("rend", "").startswith("dt") else "block"
        return self.KINDS.get(tag, "inline")

    def level(self, el: etree._Element) -> int:
        rend = el.get("rend", "")
        return int(rend[1]) if re.fullmatch(r"h[1-6]", rend) else 3  # trafilatura's default

    def ordered(self, el: etree._Element) -> bool:
        return el.get("rend") == "ol"

    def rows(self, table: etree._Element) -> list[list[etree._Element]]:
        return [
            [c for c in row if c.tag == "cell"]
            for row in table.iter("row")
            if next(row.iterancestors("table")) is table
        ]


def _folded_length(text: str) -> int:
    return len(" ".join(text.split()))


def link_share(el: etree._Element) -> float:
    """The share of ``el``'s characters (runs of white space as one) that are link text (the
    permalink anchors are gone already: :func:`parse_html`)."""
    total = _folded_length(el.text_content())
    links = sum(_folded_length(a.text_content()) for a in _OUTER_LINKS(el))
    return links / total if total > 0 else 0.0


def _is_dl_item(el: etree._Element) -> bool:
    return el.get("rend", "")[:3] in ("dt-", "dd-")


def main_content(root: html.HtmlElement) -> etree._Element | None:
    """trafilatura's XML body of the page's main content (None: it found none); ``root`` is
    first prepared for it (:func:`prepare_for_trafilatura`) and changed.

    The page's one ``<main>`` (else its one ``role="main"``) is given alone, in an
    ``<article>``. A page whose content sits in no container trafilatura knows
    (``<body><h1>..``, as pandoc writes it) gets its wild-text recovery, which keeps paragraphs
    but no heading and no list: when the result has no heading and the page has one, the body
    is read again wrapped in an ``<article>``, the container trafilatura looks for second."""
    landmarks = _MAIN(root) or _ROLE_MAIN(root)
    if len(landmarks) == 1:  # the page says where its content is: only that is read
        root = html.Element("html")
        etree.SubElement(etree.SubElement(root, "body"), "article").append(landmarks[0])
    root = prepare_for_trafilatura(root)
    body = _trafilatura_body(root)  # it reads a copy: root is left as it is
    page = root.find("body")
    if (
        len(landmarks) != 1
        and page is not None
        and (body is None or body.find(".//head") is None)
        and _ANY_HEADING(root)
    ):
        article = html.Element("article")
        article.text, page.text = page.text, None
        article.extend(list(page))
        page.append(article)
        retry = _trafilatura_body(root)
        body = body if retry is None else retry
    return body


def _trafilatura_body(root: html.HtmlElement) -> etree._Element | None:
    import trafilatura

    document = trafilatura.bare_extraction(root, **TRAFILATURA_OPTIONS)
    return None if document is None else document.body


def prepare_for_trafilatura(root: html.HtmlElement) -> html.HtmlElement:
    """``root`` changed in place so that trafilatura keeps the content it would lose, each
    change for a loss seen on the Python docs (Sphinx):

    - titled sections (a ``<section>`` opening with a heading: a part of the content) are
      opened up (:func:`_open_up`);
    - ``<blockquote>`` is unwrapped: trafilatura flattens the tables and lists of a quote into
      paragraphs, and Sphinx indents tables and code in one;
    - definition lists become blocks (``dt`` a paragraph, ``dd`` a ``div``): trafilatura drops
      the tables in a ``dd``; the whole mode writes a definition list so too;
    - a ``div`` holding no block becomes a paragraph, and in one that holds blocks each run of
      text and inline elements between them is wrapped in one: trafilatura drops the text a
      ``div`` holds itself (Sphinx's "Return value: New reference." of a C function);
    - a table inside a list item becomes one paragraph a row, its cells joined by `` | ``:
      trafilatura keeps the cells' text but not the rows;
    - inline code and spans are unwrapped and each ``<pre>`` made one ``<span>`` (see the
      module).
    """
    titled = {s for s in root.iter("section") if _opens_with_heading(s)}
    outer = [s for s in titled if not any(a in titled for a in s.iterancestors("section"))]
    for section in outer:
        _open_up(section)
    etree.strip_tags(root, "blockquote", *INLINE_CODE)
    for dl in root.iter("dl"):
        dl.tag = "div"
        for child in dl:
            child.tag = {"dt": "p", "dd": "div"}.get(child.tag, child.tag)
    holding_blocks: set[etree._Element] = set()
    for block in root.iter(*BLOCKS):
        for parent in block.iterancestors():
            if parent in holding_blocks:
                break
            holding_blocks.add(parent)
    for div in list(root.iter("div")):
        if div in holding_blocks:
            _wrap_inline_runs(div)
        elif div.text_content().strip():
            div.tag = "p"
    for section in outer:
        etree.strip_tags(section, "div")
    for table in [t for t in root.iter("table") if next(t.iterancestors("li"), None) is not None]:
        writer, block = HtmlBodyWriter(), html.Element("div")
        for row in writer.rows(table):
            etree.SubElement(block, "p").text = " | ".join(writer.flat_text(c) for c in row)
        block.tail = table.tail
        table.getparent().replace(table, block)
    for pre in root.iter("pre"):
        for br in pre.iter("br"):
            br.tail = "\n" + (br.tail or "")
        code, tail = pre.text_content(), pre.tail
        pre.clear()  # its attributes, children and tail
        etree.SubElement(pre, "span").text = code
        pre.tail = tail
    return root


def _opens_with_heading(section: etree._Element) -> bool:
    """Whether the first child of ``section`` that shows something is a heading (empty
    ``<a>``/``<span>`` anchors before it skipped)."""
    for child in section:
        if child.tag in ("a", "span") and not len(child) and not (child.text or "").strip():
            continue
        return child.tag in HEADINGS
    return False


def _open_up(section: etree._Element) -> None:
    """A titled section's ids and classes dropped, its links unwrapped, its ``<aside>`` made
    ``<div>``: all of it is content, but trafilatura deletes any element whose id or class
    holds a word such as ``share``, ``related``, ``cookie``, ``menu``, ``meta``, ``nav`` or
    ``sidebar`` (Sphinx's ids are the section titles: "How do I share global variables across
    modules?" lost its section, ``http.cookiejar`` its page; its ``.. sidebar::`` is an
    ``<aside class="sidebar">``), drops asides (Sphinx's topics and footnotes) and drops lists
    dense in links as link farms (a toctree page, the FAQ's list of IDEs)."""
    etree.strip_attributes(section, "id", "class")
    for aside in section.iter("aside"):
        aside.tag = "div"
    etree.strip_tags(section, "a")


def _wrap_inline_runs(div: html.HtmlElement) -> None:
    """Each run of ``div``'s own text and inline children between its blocks wrapped in a
    ``<p>``: ``<div>a<b>b</b><p>c</p>d</div>`` -> ``<div><p>a<b>b</b></p><p>c</p><p>d</p>``."""
    run = None
    if div.text and div.text.strip():
        run = etree.SubElement(div, "p")
        run.text, div.text = div.text, None
        div.insert(0, run)
    for child in list(div):
        if child is run:
            continue
        if child.tag not in BLOCKS:
            if run is None:
                run = html.Element("p")
                child.addprevious(run)
            run.append(child)  # with its tail
            continue
        run = None
        if child.tail and child.tail.strip():
            run = html.Element("p")
            run.text, child.tail = child.tail, None
            child.addnext(run)


def _check_not_navigation(root: html.HtmlElement, name: str) -> None:
    """Raise :class:`LeftOut` ``navigation_page`` when the page's one main landmark is mostly
    link text (a page without a landmark is not judged: its menus would count)."""
    landmarks = _MAIN(root) or _ROLE_MAIN(root)
    if len(landmarks) != 1:
        return
    share = link_share(landmarks[0])
    if share >= NAVIGATION_LINK_SHARE:
        raise LeftOut(
            "navigation_page",
            f"{name}: {share:.0%} of its main content is link text (an index or a table of "
            f'contents); html_mode = "whole" keeps such pages',
        )


def page_title(root: html.HtmlElement) -> str | None:
    """The page's only ``<h1>``, else its ``og:title``, else its ``<title>`` (white space
    squashed); None: none of them."""
    h1 = root.findall(".//h1")
    og = root.find(".//meta[@property='og:title']")
    for title in (
        h1[0].text_content() if len(h1) == 1 else None,
        None if og is None else og.get("content"),
        root.findtext(".//title"),
    ):
        if title and title.strip():
            return squash(title).replace("\n", " ")
    return None


class HtmlReader(Reader, name="html"):
    """An HTML page: its main content (``html_mode="main"``) or its whole body (``"whole"``)."""

    suffixes = (".html", ".htm")
    version = "2"  # 2: navigation pages left out
    option_names = ("html_mode",)

    def __init__(self, html_mode: str = "main", **options: Any) -> None:
        if html_mode not in HTML_MODES:
            raise ValueError(f"html_mode {html_mode!r} is not one of {', '.join(HTML_MODES)}")
        if options:
            raise TypeError(f"the html reader takes only html_mode, not {sorted(options)}")
        super().__init__(html_mode=html_mode)

    def read(self, data: bytes, name: str) -> ReadDocument:
        root = parse_html(decode_html(data, name), name)
        title = page_title(root)
        if self.options["html_mode"] == "whole":
            out = HtmlBodyWriter().write(root)
        else:
            _check_not_navigation(root, name)
            body = main_content(root)
            out = TextBuilder() if body is None else TrafilaturaWriter().write(body)
        text = out.text()
        if not text.strip():
            raise ReadError(
                "empty_text",
                f"{name}: no text in the page (html_mode={self.options['html_mode']!r}); "
                "a page of images or scripts only has nothing to index",
            )
        return ReadDocument(text, title, headings=tuple(out.headings))
