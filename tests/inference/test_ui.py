"""The store explorer (``/ui`` of ``coinrag api``, ``inference/server/ui/``) in a real browser:
Playwright for Python drives Debian's chromium (``/usr/bin/chromium``, launched by its path; no
browser download) against a real server (tests/api_harness.py: the app on uvicorn, 127.0.0.1)
over a store built once for this module (three sample documents and one that holds markup).

Every page loads with no console error and no request leaving 127.0.0.1; each highlighted
nugget's text is its row's text in the ``nuggets`` table; the sign-in gate (no key, wrong key,
right key; the cookie HttpOnly and SameSite=Strict); a document holding ``<script>`` shows as
text; the Ask page streams the answer and evidence ``coinrag query --json`` gives. A missing
chromium fails these tests (``.ci/run`` installs it), it does not skip them.

``COINRAG_UI_SCREENSHOTS=DIR`` also saves the store, document and Ask pages' screenshots
there (``docs/ui/`` holds the committed ones).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from api_harness import serving
from store_fixtures import sample_docs, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.retrieval.retriever import FUSION_NORMALISER
from coinrag.inference.server.app import ServerConfig
from coinrag.schemas.tables import NuggetRow
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CHROMIUM = Path("/usr/bin/chromium")
KEY = "coinrag-ui-test-key-5e1f2a9c"
QUESTION = "Who directed 2001: A Space Odyssey?"
MAX_NEW_TOKENS = 8
MARKUP_DOC = {
    "id": "markup <doc>&1",
    "text": "A page that holds markup: <script>document.title = 'pwned'; alert(1)</script> and "
    "<img src=x onerror=alert(2)> & an ampersand. Stanley Kubrick directed films.",
    "title": "<b>markup</b>",
}


@pytest.fixture(scope="module")
def ui_store(tmp_path_factory, sample_corpus: Path, prefect_harness) -> Path:
    """Three sample documents and :data:`MARKUP_DOC`, built with the rules extractor."""
    from coinrag.flows.build import build_flow

    root = tmp_path_factory.mktemp("ui")
    source = write_corpus(root / "docs.jsonl", [*sample_docs(sample_corpus, 3), MARKUP_DOC])
    build_flow(str(source), str(root / "store"), {"extractor": "rules"})
    return root / "store"


@pytest.fixture(scope="module")
def ui_server(ui_store: Path):
    config = ServerConfig(
        store=str(ui_store),
        methods=("coinrag", "standard"),
        max_new_tokens=MAX_NEW_TOKENS,
        settings={"threads": 1, "eval_dir": str(ui_store.parent / "eval")},
        api_key=KEY,
    )
    with serving(config) as (base, server):
        yield base, server


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        yield browser
        browser.close()


class Watched:
    """A browser context (signed in with the Bearer header unless ``key`` is None) that records
    console errors, page errors and every request URL."""

    def __init__(self, browser, base: str, key: str | None = KEY) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base = base
        self.context = browser.new_context(
            extra_http_headers=headers, viewport={"width": 1200, "height": 900}
        )
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog {d.message}"), d.dismiss()))

    def goto(self, path: str, status: int = 200):
        response = self.page.goto(self.base + path)
        assert response is not None and response.status == status, (path, response)
        return response

    def check_clean(self) -> None:
        assert not self.errors, self.errors
        outside = [u for u in self.requests if not u.startswith(self.base + "/")]
        assert not outside, f"requests leaving {self.base}: {outside}"

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser, ui_server):
    w = Watched(browser, ui_server[0])
    yield w
    w.close()


def _screenshot(page, name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000
    folder = os.environ.get("COINRAG_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(folder) / path.name)


def _quoted(doc_id: str) -> str:
    from urllib.parse import quote

    return quote(doc_id, safe="")


def test_sign_in_gate(browser, ui_server) -> None:
    """No key: the sign-in page (and no store data); a wrong key: refused; the right key: the
    page asked for, the key kept in an HttpOnly SameSite=Strict cookie scripts cannot read."""
    base, _ = ui_server
    for path in ("/ui", "/ui/documents", f"/ui/documents/{_quoted(MARKUP_DOC['id'])}"):
        bare = httpx.get(base + path, follow_redirects=False)
        assert bare.status_code == 303 and bare.headers["location"].startswith("/ui/login")
        assert "Kubrick" not in bare.text
    assert httpx.post(f"{base}/ui/ask/stream", json={"question": QUESTION}).status_code == 401
    w = Watched(browser, base, key=None)
    try:
        w.goto("/ui/documents")
        assert w.page.url.startswith(f"{base}/ui/login") and w.page.title().startswith("Sign in")
        w.page.fill("input[name=key]", "not-the-key-0000000000")
        w.page.click("button[type=submit]")
        assert w.page.locator(".error[role=alert]").is_visible()
        assert not w.context.cookies()
        assert [e for e in w.errors if "401" in e] == w.errors != []  # the refusal's status
        w.errors.clear()
        w.page.fill("input[name=key]", KEY)
        w.page.click("button[type=submit]")
        w.page.wait_for_url(f"{base}/ui/documents")
        assert w.page.locator("#documents").is_visible()
        (cookie,) = w.context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
        assert w.page.evaluate("document.cookie") == ""
        w.goto("/ui")  # the cookie alone opens every page
        assert w.page.locator("#n-documents").inner_text() == "4"
        w.page.click("text=Sign out")
        w.page.wait_for_url(f"{base}/ui/login")
        assert not w.context.cookies()
        # a wrong key refused, the error a 401 (not the page)
        wrong = httpx.post(f"{base}/ui/login", data={"key": "x" * 20, "next": "/ui"})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        w.check_clean()
    finally:
        w.close()


def test_every_page_loads_clean(watched, ui_server, ui_store: Path, tmp_path: Path) -> None:
    """Each page answers 200 with the CSP header, logs no console error and requests nothing
    outside 127.0.0.1; every id on a lineage page is a link."""
    nugget = read_rows(Store.at(ui_store), NuggetRow)[0]
    run_id = ui_server[1].holder.current.run_id
    pages = [
        "/ui",
        "/ui/documents",
        "/ui/documents?q=curie",
        f"/ui/documents/{_quoted(nugget.doc_id)}",
        "/ui/ask",
        "/ui/evals",
        "/ui/lineage",
        f"/ui/lineage?id={_quoted(nugget.doc_id)}",
        f"/ui/lineage?id={nugget.chunk_id}",
        f"/ui/lineage?id={nugget.nugget_id}",
        f"/ui/lineage?id={run_id}",
    ]
    for path in pages:
        response = watched.goto(path)
        csp = response.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp, path
    ids = watched.page.locator("td a.id")
    assert ids.count() > 5 and ids.first.get_attribute("href").startswith("/ui/lineage?id=")
    watched.goto("/ui/documents?q=curie")
    assert watched.page.locator("#documents tbody tr").count() == 1
    watched.goto("/ui/documents?q=%25")  # "%" matches itself, not everything
    assert watched.page.locator("#documents tbody tr").count() == 0
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/ui/lineage?id=no-such-id", "/ui/documents/no-such-doc"):
        missing = httpx.get(ui_server[0] + path, headers=auth)
        assert missing.status_code == 404 and "no-such" in missing.text
    watched.goto("/ui")
    _screenshot(watched.page, "store", tmp_path)
    watched.check_clean()


def test_highlighted_nuggets_are_the_nuggets_text(watched, ui_store: Path, tmp_path) -> None:
    """Each ``<mark data-nugget=ID>`` holds exactly that nugget's text in the nuggets table,
    and every nugget of the document is drawn (or listed as overlapping)."""
    store = Store.at(ui_store)
    nuggets = {n.nugget_id: n for n in read_rows(store, NuggetRow)}
    docs = sorted({n.doc_id for n in nuggets.values()})
    for doc_id in docs:
        watched.goto(f"/ui/documents/{_quoted(doc_id)}")
        marks = watched.page.locator("mark[data-nugget]")
        drawn = {}
        for i in range(marks.count()):
            mark = marks.nth(i)
            nugget = nuggets[mark.get_attribute("data-nugget")]
            drawn[nugget.nugget_id] = mark.text_content()
            assert drawn[nugget.nugget_id] == nugget.text
            title = mark.get_attribute("title")
            assert nugget.nugget_id in title and nugget.match_kind in title
            assert f"candidate: {nugget.candidate}" in title
        mine = {i for i, n in nuggets.items() if n.doc_id == doc_id}
        assert set(drawn) == mine, doc_id  # no overlaps in this corpus
        chunks = watched.page.locator("section.chunk")
        assert chunks.count() >= 1 and chunks.first.locator("header").inner_text()
    watched.goto(f"/ui/documents/{_quoted(docs[0])}")
    watched.page.locator("section.chunk details").first.evaluate("d => { d.open = true; }")
    _screenshot(watched.page, "document", tmp_path)
    watched.check_clean()


def test_a_document_holding_script_shows_as_text(watched) -> None:
    watched.goto(f"/ui/documents/{_quoted(MARKUP_DOC['id'])}")
    text = watched.page.locator("article.doc").inner_text()
    assert "<script>document.title = 'pwned'; alert(1)</script>" in text
    assert "<img src=x onerror=alert(2)>" in text
    assert watched.page.locator("article.doc script, article.doc img").count() == 0
    assert watched.page.title() == f"{MARKUP_DOC['id']} · coinrag"
    watched.goto(f"/ui/lineage?id={_quoted(MARKUP_DOC['id'])}")
    watched.goto(f"/ui/documents?q={_quoted('<doc>')}")
    assert watched.page.locator("#documents a.id").first.inner_text() == MARKUP_DOC["id"]
    title = watched.page.locator("#documents tbody td").nth(1)  # the record's title, as text
    assert title.inner_text() == MARKUP_DOC["title"] and title.locator("b").count() == 0
    watched.check_clean()  # no alert dialog, no console error


def _cli_query(store: Path, method: str) -> dict:
    args = ["query", QUESTION, "--store", str(store), "--method", method, "--kc", "2"]
    args += ["--k", "4", "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", "--threads", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_ask_page_streams_the_answer_of_coinrag_query(
    watched, ui_server, ui_store: Path, tmp_path
) -> None:
    """Both methods side by side: each card's answer and evidence are those of ``coinrag
    query --json``; the waterfall has its five stages; the KV map says coinrag loaded its
    context from the store and standard computed it."""
    base, _ = ui_server
    page = watched.page
    watched.goto("/ui/ask")
    page.fill("#question", QUESTION)
    page.fill("input[name=kc]", "2")
    page.fill("input[name=k]", "4")
    page.click("#ask-button")
    for method in ("coinrag", "standard"):
        card = page.locator(f"section.method[data-method={method}]")
        page.locator(f"section.method[data-method={method}][data-state=done]").wait_for(
            timeout=120_000
        )
        cli = _cli_query(ui_store, method)
        assert card.locator(".answer").text_content() == cli["answer"]
        items = card.locator(".evidence li")
        shown = [
            (items.nth(i).get_attribute("data-chunk"), items.nth(i).locator("mark").text_content())
            for i in range(items.count())
        ]
        assert shown == [(e["chunk_id"], e["text"]) for e in cli["evidence"]]
        scores = [float(items.nth(i).get_attribute("data-score")) for i in range(items.count())]
        assert scores == [e["score"] for e in cli["evidence"]]
        formula = card.locator(".scores").text_content()
        assert "0.65 × dense + 0.35 × lexical" in formula  # the default of a store with nuggets
        assert FUSION_NORMALISER.described in formula
        # each hybrid hit's parts: its ranks and own scores, and the fused sum's terms
        for i, e in enumerate(cli["evidence"]):
            p, shown_parts = e["score_parts"], items.nth(i).locator(".parts").text_content()
            terms = f"fused {p['dense_weight']:.2f} × {p['dense_norm']:.3f} + "
            assert terms in shown_parts, shown_parts
            rank = "not in its top rows" if p["dense_rank"] is None else f"#{p['dense_rank']}"
            assert f"dense{':' if p['dense_rank'] is None else ''} {rank}" in shown_parts
        assert card.locator(".weak").is_hidden()  # the question is about the store
        stages = card.locator(".waterfall .bar-row")
        assert [stages.nth(i).get_attribute("data-stage") for i in range(stages.count())] == [
            "retrieval",
            "kv_load",
            "assembly",
            "prefill",
            "decode",
        ]
        loaded = int(card.locator(".kv-summary").get_attribute("data-loaded"))
        spans = sum(e["tok_end"] - e["tok_start"] for e in cli["evidence"])
        assert loaded == (spans if method == "coinrag" else 0)
    _screenshot(page, "ask", tmp_path)
    # each piece of evidence links to its place, highlighted in its document's text
    first = page.locator("section.method[data-method=coinrag] .evidence li").first
    evidence_text = first.locator("mark").text_content()
    first.locator("a").click()
    page.wait_for_url("**/ui/documents/**#cited")
    assert page.locator("mark.cited#cited").text_content() == evidence_text
    page.go_back()
    watched.check_clean()


def test_ask_page_warns_when_nothing_scored_well(watched, ui_server) -> None:
    """A question about nothing in the store: the best evidence's cosine is under
    ``WEAK_DENSE_COSINE`` and the card says so."""
    from coinrag.inference.server.ui.views import WEAK_DENSE_COSINE

    page = watched.page
    watched.goto("/ui/ask")
    page.fill("#question", "What is a good recipe for banana bread?")
    for box in page.locator("input[name=method]").all():
        if box.get_attribute("value") != "coinrag":
            box.uncheck()
    page.click("#ask-button")
    page.locator("section.method[data-method=coinrag][data-state=done]").wait_for(timeout=120_000)
    warning = page.locator("section.method[data-method=coinrag] .weak")
    assert warning.is_visible()
    assert f"(under {WEAK_DENSE_COSINE})" in warning.text_content()
    watched.check_clean()


def test_no_ui_serves_the_api_only(ui_server) -> None:
    """``--no-ui`` (the ``ui`` setting off): the app has no ``/ui`` route; the API's stay."""
    import dataclasses

    from coinrag.inference.server.app import create_app

    _, server = ui_server
    saved = server.settings
    server.settings = dataclasses.replace(saved, ui=False)
    try:
        paths = {getattr(route, "path", "") for route in create_app(server).routes}
    finally:
        server.settings = saved
    assert {"/query", "/query/stream", "/health"} <= paths
    assert not [p for p in paths if p.startswith("/ui")]
    usage = CliRunner().invoke(app, ["api", "--help"], terminal_width=200).output
    assert "--no-ui" in usage and "--eval-dir" in usage


def test_evaluations_page_shows_an_eval_out_folder(watched, ui_store: Path) -> None:
    """``eval_dir``: the folder ``coinrag eval --out`` writes, read on each visit: Table 3, the
    plots (served from the folder, behind the key) and each question's answer."""
    watched.goto("/ui/evals")
    assert "not a folder" in watched.page.locator("main").inner_text()
    questions = ui_store.parent / "questions.jsonl"
    rows = [
        {"question": QUESTION, "answers": ["Stanley Kubrick"]},
        {"question": "Who was Marie Curie?", "answers": ["a physicist"]},
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = [
        "eval",
        str(questions),
        "--store",
        str(ui_store),
        "--out",
        str(ui_store.parent / "eval"),
    ]
    args += ["--methods", "coinrag", "--kc", "1", "--k", "3", "--max-new-tokens", "3"]
    result = CliRunner().invoke(app, [*args, "--threads", "1"])
    assert result.exit_code == 0, result.output
    watched.goto("/ui/evals")
    main = watched.page.locator("main")
    assert "Who was Marie Curie?" in main.inner_text()
    assert main.locator("table").first.locator("td", has_text="coinrag").count() >= 1
    images = main.locator("figure img")
    assert images.count() >= 3
    for i in range(images.count()):
        assert images.nth(i).evaluate("img => img.complete && img.naturalWidth > 0")
    plot = images.first.get_attribute("src")
    assert httpx.get(watched.base + plot, follow_redirects=False).status_code == 303  # no key
    watched.check_clean()
