"""Who may see the explorer, and the headers every ``/ui`` answer carries.

The explorer sits behind the API's keys (``inference/server/auth.py``). A browser signs in once
on ``/ui/login``: the key it types is checked, then kept in the cookie :data:`COOKIE`
(``HttpOnly``: no script reads it; ``SameSite=Strict``: no other site's page sends it;
``Path=/ui``; ``Secure`` over https), and every later page sends it back. Scripts and tests may
send ``Authorization: Bearer KEY`` instead, as to the JSON API. A server without keys (loopback,
or ``--insecure``) lets every request in, as its API does.

Every ``/ui`` answer carries :data:`SECURITY_HEADERS`: a Content-Security-Policy that allows
scripts, styles, images and requests from the server's own origin only (no inline script or
style, no frame, no other origin), no MIME sniffing, no referrer sent to another origin.

Example::

    client = ui_client(server, request)   # "key:3fa9..." | "address:127.0.0.1" | None
    if client is None: -> 303 to /ui/login?next=/ui/documents
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "coinrag_ui_key"
COOKIE_PATH = "/ui"
HOME = "/ui"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make a form post's Origin "null"
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
MAX_FORM_BYTES = 8192


def ui_client(server: Any, request: Request) -> str | None:
    """The client of a ``/ui`` request (``server.client`` of its Bearer header, else of its
    cookie), or None when keys are on and it carries no valid one."""
    return server.client(request, cookie=request.cookies.get(COOKIE))


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path under ``/ui`` of this server, else ``/ui`` (never
    another origin: ``//evil.example``, ``https://...`` and ``/ui\\..`` all give ``/ui``)."""
    if not target or not target.startswith(HOME) or "\\" in target or "//" in target:
        return HOME
    rest = target[len(HOME) :]
    return target if rest == "" or rest[0] in "/?" else HOME


def login_url(request: Request) -> str:
    """``/ui/login?next=<the page asked for>``."""
    wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return f"{HOME}/login?next={quote(wanted, safe='')}"


async def read_form(request: Request) -> dict[str, str]:
    """A small ``application/x-www-form-urlencoded`` body as ``{name: first value}`` (at most
    :data:`MAX_FORM_BYTES`; ValueError past that)."""
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_FORM_BYTES:
            raise ValueError(f"form body over {MAX_FORM_BYTES} bytes")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def same_origin(request: Request) -> bool:
    """Whether a state-changing request comes from this server's own pages: its ``Origin``
    header (sent by browsers on POST) is absent or names this host."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


def cookie_options(request: Request) -> dict[str, Any]:
    """The sign-in cookie's attributes (``Secure`` when the page came over https)."""
    return {
        "key": COOKIE,
        "httponly": True,
        "samesite": "strict",
        "path": COOKIE_PATH,
        "secure": request.url.scheme == "https",
    }


def is_ui_path(path: str) -> bool:
    return path == HOME or path.startswith(HOME + "/")


class UiHeaders:
    """ASGI middleware: :data:`SECURITY_HEADERS` and ``Server-Timing: app;dur=MS`` (the time to
    the answer's headers: a page's whole rendering) on every ``/ui`` answer; every other
    request (``/query``, its streams) passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_ui_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.update(SECURITY_HEADERS)
                elapsed_ms = (time.perf_counter() - started) * 1000
                headers["Server-Timing"] = f"app;dur={elapsed_ms:.2f}"
            await send(message)

        await self.app(scope, receive, send_with_headers)
