"""The explorer's routes under ``/ui`` of ``coinrag api`` (:func:`mount_ui`), rendered on the
server with Jinja2 (``templates/``, every value escaped: ``autoescape``), styled by
``static/ui.css``; the Ask page streams its answers with ``static/ask.js`` (no library).

Routes (each page needs a key when the server has keys: ``gate.py``):

- ``/ui``: the store (published version, counts, KV bytes against raw bf16, runs, disk,
  stale assets); ``/ui/documents?q=&page=``: the live documents; ``/ui/documents/{doc_id}``
  (URL-encoded): its text with chunk boundaries and each nugget a ``<mark data-nugget=ID>``
  (``?cite=CHUNK_ID:START-END``: a piece of an answer's evidence highlighted, ``#cited``);
- ``/ui/lineage?id=``: the walk through a document, chunk or nugget id;
- ``/ui/ask``, and ``POST /ui/ask/stream``: the API's streaming query (the same handler and
  events as ``POST /query/stream``), signed in by the cookie;
- ``/ui/evals``: the ``eval_dir`` setting's evaluation (``evals.py``);
- ``/ui/login`` (GET, POST), ``POST /ui/logout``; ``/ui/static/...`` (CSS and the script,
  open: they hold no store data).

Every ``/ui`` answer carries ``gate.SECURITY_HEADERS`` and ``Server-Timing: app;dur=MS``, the
server's time to its headers (a page: all of its rendering; ``tests/benchmarks/bench_ui.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from coinrag.inference.server.ui import gate
from coinrag.inference.server.ui.evals import EvalFolder
from coinrag.inference.server.ui.views import UiState
from coinrag.storage.lineage import LineageError

HERE = Path(__file__).resolve().parent
log = logging.getLogger("coinrag.api")
Handler = Callable[..., Awaitable[Response]]


def human_bytes(n: int | float | None) -> str:
    """``1536 -> "1.5 KiB"``, ``10805760 -> "10.3 MiB"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["q"] = lambda s: quote(str(s), safe="")
    return env


class Pages:
    """Renders the pages of one server (its :class:`UiState`, its templates)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.state = UiState(server)
        self.env = templates()
        folder = server.settings.eval_dir
        self.evals = EvalFolder(Path(folder)) if folder else None
        # open the explorer now, in the background: the first page then does not wait for it.
        # Not a daemon, and the server's stop waits for it (close): its DuckDB queries call
        # into Python (an object store's files are read through s3fs), and a daemon thread
        # caught in one when the interpreter finalizes aborts the process ("PyGILState_Release:
        # thread state ... must be current", exit 134; tests/storage/test_object_store_exit.py).
        self._warming = threading.Thread(target=self._warm, name="ui-warm")
        self._warming.start()
        server.on_stop(self.close)

    def close(self, timeout: float = 120.0) -> None:
        """Wait up to ``timeout`` s for the explorer's warm-up (it reads the whole store's
        lineage once); past that the server stops without it, and the interpreter's exit
        still waits for the thread."""
        if self._warming.is_alive():
            log.info("waiting for the store explorer to finish opening")
            self._warming.join(timeout)
            if self._warming.is_alive():
                log.warning("the store explorer is still opening after %.0f s", timeout)

    def _warm(self) -> None:
        try:
            self.state.explorer()
        except Exception:  # the first page opens it again, and shows the error
            log.exception("opening the store explorer failed")

    def render(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        keys = self.server.keys.enabled
        html = self.env.get_template(name).render(signed_in=keys, **context)
        return HTMLResponse(html, status_code=status)

    def not_found(self, what: str) -> HTMLResponse:
        return self.render("missing.html", 404, what=what)


def _gated(pages: Pages, request: Request) -> Response | None:
    """None when ``request`` may see a page, else the redirect to the sign-in page."""
    if gate.ui_client(pages.server, request) is None:
        return RedirectResponse(gate.login_url(request), status_code=303)
    return None


def mount_ui(app: FastAPI, server: Any, handle: Handler) -> None:
    """Add the explorer's routes, its static files and its security headers to ``app``;
    ``handle``: the API's query handler (``create_app``'s), reused for the Ask page."""
    pages = Pages(server)

    app.add_middleware(gate.UiHeaders)

    app.mount(f"{gate.HOME}/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    _mount_gate(app, pages)
    _mount_pages(app, pages)
    _mount_ask(app, pages, handle)


def _mount_gate(app: FastAPI, pages: Pages) -> None:
    @app.get(f"{gate.HOME}/login")
    def login_form(request: Request, next: str = gate.HOME) -> Response:
        if not pages.server.keys.enabled:  # a server without keys: nothing to sign in to
            return RedirectResponse(gate.safe_next(next), status_code=303)
        return pages.render("login.html", next=gate.safe_next(next), error=None)

    @app.post(f"{gate.HOME}/login")
    async def login(request: Request) -> Response:
        try:
            form = await gate.read_form(request)
        except ValueError as exc:
            return pages.render("login.html", 413, next=gate.HOME, error=str(exc))
        target = gate.safe_next(form.get("next"))
        key = form.get("key", "").strip()
        if not gate.same_origin(request) or pages.server.keys.client(f"Bearer {key}") is None:
            error = "That key is not valid here: check it and sign in again."
            return pages.render("login.html", 401, next=target, error=error)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(value=key, **gate.cookie_options(request))
        return response

    @app.post(f"{gate.HOME}/logout")
    def logout(request: Request) -> Response:
        response = RedirectResponse(f"{gate.HOME}/login", status_code=303)
        response.delete_cookie(gate.COOKIE, path=gate.COOKIE_PATH)
        return response


def _mount_pages(app: FastAPI, pages: Pages) -> None:
    @app.get(gate.HOME)
    def store_page(request: Request) -> Response:
        return _gated(pages, request) or pages.render("store.html", **pages.state.store_page())

    @app.get(f"{gate.HOME}/documents")
    def documents(request: Request, q: str = "", page: int = 1) -> Response:
        return _gated(pages, request) or pages.render(
            "documents.html", **pages.state.documents_page(q, page)
        )

    @app.get(f"{gate.HOME}/documents/{{doc_id:path}}")
    def document(request: Request, doc_id: str, cite: str = "") -> Response:
        refused = _gated(pages, request)
        if refused is not None:
            return refused
        context = pages.state.document_page(doc_id, cite)
        if context is None:
            return pages.not_found(f"document {doc_id!r} (no live version in this store)")
        return pages.render("document.html", **context)

    @app.get(f"{gate.HOME}/lineage")
    def lineage(request: Request, id: str = "") -> Response:
        refused = _gated(pages, request)
        if refused is not None:
            return refused
        try:
            context = pages.state.lineage_page(id.strip())
        except LineageError as exc:
            return pages.render("lineage.html", 404, ident=id, kind=None, sections={}, error=exc)
        status = 404 if id and context["kind"] is None else 200
        return pages.render("lineage.html", status, error=None, **context)

    @app.get(f"{gate.HOME}/evals")
    def evals(request: Request) -> Response:
        refused = _gated(pages, request)
        if refused is not None:
            return refused
        context = pages.evals.page() if pages.evals else None
        return pages.render("evals.html", evals=context)

    @app.get(f"{gate.HOME}/evals/plots/{{name}}")
    def eval_plot(request: Request, name: str) -> Response:
        refused = _gated(pages, request)
        if refused is not None:
            return refused
        path = pages.evals.plot(name) if pages.evals else None
        return FileResponse(path) if path else pages.not_found(f"plot {name!r}")


def _mount_ask(app: FastAPI, pages: Pages, handle: Handler) -> None:
    @app.get(f"{gate.HOME}/ask")
    def ask(request: Request) -> Response:
        return _gated(pages, request) or pages.render("ask.html", **pages.state.ask_page())

    @app.post(f"{gate.HOME}/ask/stream")
    async def ask_stream(request: Request) -> Response:
        if not gate.same_origin(request):
            return Response("cross-origin request refused", status_code=403)
        return await handle(request, "ui", True, lambda r: gate.ui_client(pages.server, r))
