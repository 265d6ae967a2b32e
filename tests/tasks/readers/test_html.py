"""The HTML reader on real pages (Sphinx pages of Debian's Python 3.11 docs, in
tests/fixtures/html/) and on small pages written here: both modes, the conventions of the text,
the heading offsets, decoding and the errors."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest
from lxml import html
from store_fixtures import load_script

from coinrag.tasks.readers.base import ReadDocument, Reader, ReadError

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "html"
PAGES = ("general", "programming", "tomllib")
# What Sphinx's pages show around the content (sidebar, related bars, footer), line starts.
NAVIGATION = (
    "Navigation",
    "Table of Contents",
    "Previous topic",
    "Next topic",
    "This Page",
    "- Report a Bug",
    "- Show Source",
    "- index",
    "- modules |",
    "© Copyright",
    "Contents",
)
# Sphinx's typography (smartquotes) against the reST source's ASCII.
TYPOGRAPHY = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "…": "...", "–": "--"})


def read(page: str, mode: str = "main") -> ReadDocument:
    data = (FIXTURES / f"{page}.html").read_bytes()
    return Reader.registry["html"](html_mode=mode).read(data, f"{page}.html")


def read_bytes(data: bytes, mode: str = "whole") -> ReadDocument:
    return Reader.registry["html"](html_mode=mode).read(data, "page.html")


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.fixture(scope="module")
def faq_sections():
    return load_script(REPO / "infra" / "python_faq.py")


def test_registered_for_html_suffixes() -> None:
    assert Reader.registry["html"].suffixes == (".html", ".htm")
    assert Reader.registry["html"].option_names == ("html_mode",)  # what ingest passes it
    reader = Reader.registry["html"]()
    assert reader.options == {"html_mode": "main"}
    assert reader.fingerprint == Reader.registry["html"](html_mode="main").fingerprint
    assert reader.fingerprint != Reader.registry["html"](html_mode="whole").fingerprint
    with pytest.raises(ValueError, match="html_mode 'all' is not one of main, whole"):
        Reader.registry["html"](html_mode="all")


@pytest.mark.parametrize("mode", ["main", "whole"])
@pytest.mark.parametrize("page", PAGES)
def test_heading_offsets_point_at_their_lines(page: str, mode: str) -> None:
    doc = read(page, mode)
    assert doc.headings
    for h in doc.headings:
        assert doc.text[h.char_start :].startswith(h.title + "\n"), h
        assert h.char_start == 0 or doc.text[h.char_start - 1] == "\n", h
        assert "¶" not in h.title and not h.title.startswith("#")
    assert [h.char_start for h in doc.headings] == sorted(h.char_start for h in doc.headings)


@pytest.mark.parametrize("page", ["general", "programming"])
def test_main_mode_has_every_faq_section_title_as_a_heading(page: str, faq_sections) -> None:
    """Every section title of the page's reST source is a heading of the main text: among
    them "How do I share global variables across modules?", whose id trafilatura read as a
    share button until the reader opened the titled sections up."""
    source = (FIXTURES / f"{page}.rst.txt").read_text(encoding="utf-8")
    titles = [faq_sections.clean_rst(t) for t, _, _ in faq_sections.sections(source)]
    headings = {h.title.translate(TYPOGRAPHY) for h in read(page).headings}
    assert len(titles) > 20
    assert [t for t in titles if t not in headings] == []


def test_main_mode_drops_the_navigation_and_whole_mode_keeps_it() -> None:
    main, whole = read("programming"), read("programming", "whole")
    assert [line for line in lines(main.text) if line.startswith(NAVIGATION)] == []
    kept = {n for n in NAVIGATION if any(line.startswith(n) for line in lines(whole.text))}
    assert {"Navigation", "Previous topic", "Next topic", "This Page", "- Report a Bug"} <= kept
    assert main.title == whole.title == "Programming FAQ"
    assert len(main.text) > 0.8 * len(whole.text) - 15000  # the content, less the chrome


def test_main_mode_keeps_every_code_example_verbatim_as_a_fenced_block() -> None:
    page = html.parse(str(FIXTURES / "programming.html")).getroot()
    blocks = page.xpath("//div[@role='main']//pre")
    text = read("programming").text
    assert len(blocks) > 90
    missing = []
    for pre in blocks:
        code = pre.text_content().strip("\n").rstrip()
        if f"```\n{code}\n```" not in text:
            missing.append(code[:60])
    assert missing == []
    assert text.count("\n```\n") % 2 == 0


@pytest.mark.parametrize("mode", ["main", "whole"])
def test_a_table_is_one_line_a_row(mode: str) -> None:
    doc = read("tomllib", mode)
    table = (
        "Conversion Table\n\nTOML | Python\ntable | dict\nstring | str\ninteger | int\n"
        "float | float (configurable with parse_float)\nboolean | bool\n"
        "offset date-time | datetime.datetime (tzinfo attribute set to an instance of "
        "datetime.timezone)\n"
    )
    assert table in doc.text
    assert doc.title == "tomllib — Parse TOML files"
    assert doc.section_at(doc.text.index("TOML | Python")) == (
        "tomllib — Parse TOML files",
        "Conversion Table",
    )


def test_main_mode_keeps_lists_and_quotes_of_the_faq() -> None:
    text = read("general").text
    assert (
        "- A is the major version number – it is only incremented for really major changes "
        "in the language.\n- B is the minor version number"
    ) in text
    # the list of IDEs is all links: trafilatura dropped it as a link farm
    assert "- Wing IDE\n- Komodo IDE\n- PyCharm\n" in read("programming").text
    assert "I had extensive experience with implementing an interpreted language" in text


PAGE = """<html><head><title>Page title</title><style>p {{ color: red }}</style></head>
<body><nav><a href="/">Home</a></nav>
<h1>Intro<a class="headerlink" href="#intro">¶</a></h1>
<p>Hello,
   <b>world</b>  again.<br>New line.</p>
<ul><li>one<ul><li>one.a</li></ul></li><li><p>two</p><p>more of two</p></li></ul>
<ol start="3"><li>three</li><li>four</li></ol>
<h2 id="use">Use <a href="#use">#</a></h2>
<table><tr><th>Name</th><th>Value</th></tr><tr><td>a <i>b</i></td><td><p>1</p><p>2</p></td></tr>
</table>
<pre>x = 1
  y = [<span>2</span>]<br>z = 3</pre>
<dl><dt>term</dt><dd>its meaning</dd></dl>
<script>var hidden = 1;</script>{extra}</body></html>"""


def test_whole_mode_writes_every_convention() -> None:
    doc = read_bytes(PAGE.format(extra="").encode())
    assert doc.text == (
        "Home\n\nIntro\n\nHello, world again.\nNew line.\n\n"
        "- one\n  - one.a\n- two\n  more of two\n\n3. three\n4. four\n\nUse\n\n"
        "Name | Value\na b | 1 2\n\n```\nx = 1\n  y = [2]\nz = 3\n```\n\nterm\n\nits meaning\n"
    )
    assert [(h.char_start, h.level, h.title) for h in doc.headings] == [
        (6, 1, "Intro"),
        (doc.text.index("Use\n"), 2, "Use"),
    ]
    assert doc.title == "Intro"  # the only <h1>


def test_a_fence_is_longer_than_the_backticks_in_the_code() -> None:
    doc = read_bytes(b"<body><pre>```\nquoted\n```</pre></body>")
    assert doc.text == "````\n```\nquoted\n```\n````\n"


def test_main_mode_reads_only_the_main_landmark() -> None:
    prose = "<p>" + "A sentence of real content about the subject of the page. " * 6 + "</p>"
    extra = "<footer><p>Footer text</p></footer>"
    page = f"""<html><head><title>T</title></head><body>
    <header><ul><li><a href="/a">Menu A</a></li><li><a href="/b">Menu B</a></li></ul></header>
    <main><h1>Subject</h1>{prose}<h2>Details</h2>{prose}<pre>print(1)</pre>
    <table><tr><td>k</td><td>v</td></tr></table></main>{extra}</body></html>"""
    doc = read_bytes(page.encode(), mode="main")
    assert "Menu A" not in doc.text and "Footer text" not in doc.text
    assert doc.text.startswith("Subject\n\nA sentence of real content")
    assert "\n\nDetails\n\n" in doc.text and "```\nprint(1)\n```" in doc.text
    assert "k | v" in doc.text
    assert [h.title for h in doc.headings] == ["Subject", "Details"]


def test_main_mode_keeps_the_headings_of_a_page_without_a_container() -> None:
    """Content straight in ``<body>`` (pandoc's standalone HTML): trafilatura alone keeps its
    paragraphs but none of its headings and lists."""
    prose = "<p>" + "A sentence of real content about the subject of the page. " * 6 + "</p>"
    page = f"""<html><head><title>Notes</title></head><body><h1>Notes</h1>{prose}
    <h2>Steps</h2><ol><li>Open the valve</li><li>Wait a minute</li></ol>{prose}</body></html>"""
    doc = read_bytes(page.encode(), mode="main")
    assert [h.title for h in doc.headings] == ["Notes", "Steps"]
    assert "\n\nSteps\n\n1. Open the valve\n2. Wait a minute\n\nA sentence" in doc.text


def test_main_mode_keeps_what_sphinx_nests_in_quotes_and_definitions() -> None:
    """trafilatura flattens a table inside a blockquote (Sphinx's indented blocks) and drops
    one inside a ``dd`` and the text a ``dd`` holds itself (C functions' "Return value")."""
    prose = "<p>" + "A sentence of real content about the subject of the page. " * 6 + "</p>"
    page = f"""<html><body><div role="main"><section id="flags"><h1>Flags</h1>{prose}
    <blockquote><div><table><tr><th>Flag</th><th>Meaning</th></tr>
    <tr><td><code>EPOLLIN</code></td><td>Available for read</td></tr></table></div></blockquote>
    <dl><dt id="f">int f(void)</dt><dd><em>Return value: New reference.</em><p>Does f.</p>
    <table><tr><td>x</td><td>y</td></tr></table></dd></dl>{prose}</section></div></body></html>"""
    text = read_bytes(page.encode(), mode="main").text
    assert "\n\nFlag | Meaning\nEPOLLIN | Available for read\n\n" in text
    assert "\n\nint f(void)\n\nReturn value: New reference.\n\nDoes f.\n\nx | y\n\n" in text


def test_decoding_by_bom_meta_charset_and_default() -> None:
    body = "<html><body><p>café – ok</p></body></html>"
    assert read_bytes(codecs.BOM_UTF16_LE + body.encode("utf-16-le")).text == "café – ok\n"
    assert read_bytes(codecs.BOM_UTF8 + body.encode()).text == "café – ok\n"
    latin = '<html><head><meta charset="iso-8859-1"></head><body><p>caf\xe9 \x96 ok</p></body>'
    assert read_bytes(latin.encode("latin-1")).text == "café – ok\n"  # read as windows-1252
    http_equiv = (
        '<meta http-equiv="Content-Type" content="text/html; charset=koi8-r">'
        "<p>" + "привет" + "</p>"
    )
    assert read_bytes(http_equiv.encode("koi8-r")).text == "привет\n"
    assert read_bytes(body.encode()).text == "café – ok\n"  # UTF-8 by default


def test_undecodable_bytes_are_rejected_with_the_offset() -> None:
    with pytest.raises(ReadError) as err:
        read_bytes(b"<html><body><p>caf\xe9</p></body></html>")
    assert err.value.reason == "undecodable"
    assert "page.html: not utf-8 (by the default) at byte offset 18" in err.value.detail
    with pytest.raises(ReadError) as err:
        read_bytes(b'<meta charset="utf-8"><p>\xff</p>', mode="main")
    assert err.value.reason == "undecodable" and "'utf-8'" in err.value.detail


@pytest.mark.parametrize("mode", ["main", "whole"])
@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"   ",
        b"<html><head><title>Only a title</title></head><body></body></html>",
        b"<html><body><script>document.write('x')</script><img src='a.png'></body></html>",
    ],
)
def test_a_page_without_text_is_empty_text(data: bytes, mode: str) -> None:
    with pytest.raises(ReadError) as err:
        read_bytes(data, mode)
    assert err.value.reason == "empty_text"
    assert err.value.detail.startswith("page.html: ")


def test_nuggets_can_be_spans_of_the_text() -> None:
    """A sentence of the answer is one span of the text (white space as shown, no markup)."""
    text = read("programming").text
    sentence = (
        "The canonical way to share information across modules within a single program is "
        "to create a special module (often called config or cfg)."
    )
    assert sentence in text
    assert [m for m in ("<p>", "<div", "<span", 'class="', "&lt;", "&amp;", "¶") if m in text] == []


@pytest.mark.parametrize("page", ["faq_index", "genindex-Y"])
def test_main_mode_leaves_out_a_page_of_links(page: str) -> None:
    """A table of contents and an index page of the Python docs are navigation: left out
    (``LeftOut``, not a reject) in the main mode, read whole in the whole mode."""
    from coinrag.tasks.readers.base import LeftOut
    from coinrag.tasks.readers.html import NAVIGATION_LINK_SHARE, link_share

    data = (FIXTURES / f"{page}.html").read_bytes()
    main = html.fromstring(data).xpath("//*[@role='main']")[0]
    assert link_share(main) >= NAVIGATION_LINK_SHARE
    with pytest.raises(LeftOut) as caught:
        read(page)
    assert caught.value.reason == "navigation_page"
    assert f"{page}.html" in caught.value.detail and "link text" in caught.value.detail
    assert read(page, "whole").text.strip()


@pytest.mark.parametrize("page", PAGES)
def test_pages_with_content_of_their_own_are_not_navigation(page: str) -> None:
    from coinrag.tasks.readers.html import NAVIGATION_LINK_SHARE, link_share

    main = html.parse(str(FIXTURES / f"{page}.html")).getroot().xpath("//*[@role='main']")[0]
    assert link_share(main) < NAVIGATION_LINK_SHARE / 2
    assert read(page).text.strip()


def test_link_share_counts_characters_of_link_text() -> None:
    from coinrag.tasks.readers.html import link_share

    el = html.fromstring('<div><p>ab <a href="x">cd</a> <a href="y"><b>ef</b></a></p></div>')
    assert link_share(el) == pytest.approx(4 / 8)  # "ab cd ef": 8 characters, 4 in links
    assert link_share(html.fromstring("<div></div>")) == 0.0
