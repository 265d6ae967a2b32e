"""The query server: one warm :class:`~inference.methods.RagEngine` per published version of
the store, behind FastAPI on uvicorn (``coinrag api``, ``flows/cli/api.py``).

Endpoints:

- ``POST /query``: ``{"question", "method", "kc", "k", "max_new_tokens", "oracle_doc",
  "stream"}`` (the options of ``coinrag query``, same defaults); answers the JSON ``coinrag query
  --json`` prints (:meth:`~inference.methods.base.Answer.to_json_text`), with the published
  run it was answered from in the header ``X-Coinrag-Run-Id``. ``"stream": true`` (or ``POST
  /query/stream``) answers server-sent events instead: ``event: token`` per answer token as it
  is decoded (``{"index", "token_id", "text"}``: ``text`` is what the token adds to the
  decoded answer; the first one is sent at TTFT), then one ``event: answer`` with the full
  answer JSON (or ``event: error`` with ``{"error", "status"}``).
- ``GET /health``: the run served, its ``[published]`` record and fingerprints, the queue.
- ``GET /metrics``: Prometheus text (``inference/server/metrics.py``).
- ``/ui``: the store explorer (``inference/server/ui/``), unless the ``ui`` setting is off
  (``--no-ui``).

With API keys (``inference/server/auth.py``) every route needs ``Authorization: Bearer KEY``,
but ``/health``, which answers a request without a valid key with ``{"status": "ok"}`` only
(liveness: no store path, run ids or fingerprints), and ``/metrics`` with ``metrics_open``.
Without keys (``coinrag api`` allows that on a loopback address, or with ``--insecure``)
every route is open.

Errors are JSON ``{"error": "..."}``: 400 (not a JSON object), 401 + ``WWW-Authenticate`` (no
valid key), 413 (body over ``max_body_bytes``), 422 (blank or over-long question, method not
served, kc/k/max_new_tokens out of range, unknown field), 429 + ``Retry-After`` (the client is
over its share: ``inference/server/limits.py``), 503 + ``Retry-After`` (queue full:
``inference/server/queue.py``), 500 (an answer that failed, e.g. a corrupt KV entry: the
message names it). A client that disconnects stops its generation at the next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from coinrag.inference.methods import RagEngine
from coinrag.inference.methods.base import Answer
from coinrag.inference.server.auth import ApiKeys
from coinrag.inference.server.limits import ClientLimits, Limited
from coinrag.inference.server.metrics import MULTIPROC_ENV, ServerMetrics
from coinrag.inference.server.queue import Cancel, ModelQueue, QueueFull
from coinrag.inference.server.requests import BadRequest, QueryRequest, parse_query
from coinrag.inference.server.versions import PublishWatcher, ServedVersion, VersionHolder
from coinrag.schemas.secrets import API_KEY_ENV, scrub_logs
from coinrag.schemas.settings import DEFAULT_QUERY, DEFAULT_RAG_METHODS, ApiSettings
from coinrag.storage.readers import ReaderLeaseHolder
from coinrag.storage.store import Store

log = logging.getLogger("coinrag.api")
CONFIG_ENV = "COINRAG_API_CONFIG"  # the ServerConfig of `coinrag api`, as JSON, for workers
RUN_HEADER = "X-Coinrag-Run-Id"
WARM_QUESTION = "What is this about?"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SCRUBBED_LOGGERS = ("coinrag.api", "uvicorn", "uvicorn.error", "uvicorn.access")
BAD_KEY_HEADERS = {"WWW-Authenticate": 'Bearer realm="coinrag"'}


@dataclass(frozen=True)
class ServerConfig:
    """What ``coinrag api`` serves: the store, the model (None: the store's), the methods
    opened at start, the default ``max_new_tokens`` of a request, the API settings, and the
    ``--api-key`` (never in :meth:`to_json`: workers read it from ``$COINRAG_API_KEY``)."""

    store: str
    model: str | None = None
    methods: tuple[str, ...] = DEFAULT_RAG_METHODS
    max_new_tokens: int = DEFAULT_QUERY.max_new_tokens
    settings: dict[str, Any] | None = None
    api_key: str | None = field(default=None, repr=False)

    def api_settings(self) -> ApiSettings:
        return ApiSettings(**(self.settings or {})).validate()

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "api_key": None})

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        data = json.loads(text)
        data["methods"] = tuple(data["methods"])
        return cls(**data)


class ApiServer:
    """What one server process holds: the served versions, the model thread and its queue,
    the metrics, the publish watcher."""

    def __init__(
        self, config: ServerConfig, engine: RagEngine, lease: ReaderLeaseHolder | None = None
    ) -> None:
        self.config = config
        self.settings = config.api_settings()
        self.methods: tuple[str, ...] = tuple(engine.methods)
        self.metrics = ServerMetrics()
        self.keys = ApiKeys(config.api_key, self.settings.api_key_file)
        s = self.settings
        self.limits = ClientLimits(
            s.client_queue_limit, s.client_rate, s.client_burst, s.retry_after_s
        )
        self.queue = ModelQueue(self.settings.queue_limit)
        self.warm(engine)
        self.holder = VersionHolder(
            ServedVersion(engine), lambda v: self.metrics.serve_run(v.run_id), self._held_changed
        )
        self.lease = lease or ReaderLeaseHolder(engine.store, self.holder.held)
        self.lease.versions = self.holder.held
        self.watcher = PublishWatcher(
            self.holder,
            self.settings.poll_interval,
            self.warm,
            self._refused,
            before_open=lambda record: self.lease.renew(extra=[record]),
        )
        self._on_stop: list[Callable[[], None]] = []

    @classmethod
    def open(cls, config: ServerConfig) -> ApiServer:
        """Set the process's threads, load the model, embedder and store views of the methods,
        and warm them (one throwaway query per method): the first request pays no cold start."""
        from coinrag.inference.model.forward import set_default_forward
        from coinrag.inference.model.kv_transfer import set_resident_kv_bytes
        from coinrag.inference.model.threads import set_process_threads

        settings = config.api_settings()
        threads = set_process_threads(settings.threads)
        set_default_forward(settings.forward, serving=True)
        set_resident_kv_bytes(settings.kv_resident_bytes)
        started = time.perf_counter()
        store = Store.at(config.store)
        lease = ReaderLeaseHolder(store, list)  # leased before it is read (gc keeps it)
        published = store.published() if store.exists() else None
        if published:
            lease.renew(extra=[published])
        try:
            engine = RagEngine.open(
                config.store,
                model=config.model,
                max_new_tokens=config.max_new_tokens,
                methods=config.methods,
            )
        except BaseException:
            lease.release()
            raise
        server = cls(config, engine, lease)
        log.info(
            "loaded and warmed %s (run %s, %s) in %.1f s, %d thread(s)",
            config.store,
            server.holder.current.run_id or "-",
            ", ".join(server.methods),
            time.perf_counter() - started,
            threads,
        )
        return server

    def _held_changed(self) -> None:
        """Rewrite the reader lease now (a swap or a closed version), not at the next beat."""
        try:
            self.lease.renew()
        except Exception:
            log.exception("renewing the reader lease failed (retried at the next beat)")

    def _refused(self, message: str) -> None:
        self.metrics.refusals.inc()

    def warm(self, engine: RagEngine) -> None:
        """One throwaway query per method, on the model thread (the indexes' first search, the
        KV manifest and readers, the model's first forwards; a compiled or graphs forward
        compiles or captures the shapes of a served answer: the default ``max_new_tokens``, so
        the same KV buffer)."""
        from coinrag.inference.model.forward import forward_for

        served_shapes = forward_for(engine.model).warms_served_shapes

        def run() -> None:
            saved = engine.max_new_tokens
            engine.max_new_tokens = saved if served_shapes else 2
            try:
                for method in engine.methods:
                    engine.answer(WARM_QUESTION, method)
            finally:
                engine.max_new_tokens = saved

        self.queue.submit(run, force=True).result()

    def health(self) -> dict[str, Any]:
        version = self.holder.current
        return {
            "status": "ok",
            "store": self.config.store,
            "run_id": version.run_id,
            "published": version.published,
            "fingerprints": version.engine.fingerprints(),
            "methods": list(self.methods),
            "queue": {"admitted": self.queue.admitted, "limit": self.queue.limit},
            "versions_held": 1 + len(self.holder.retired_open),
            "pid": os.getpid(),
        }

    def answer_job(
        self, version: ServedVersion, req: QueryRequest, cancel: Cancel, emit: Callable | None
    ) -> Answer:
        """Runs on the model thread: answer ``req`` on ``version`` (released at the end)."""
        try:
            cancel.check()  # the client left while the request waited
            engine = version.engine  # only the model thread calls engines
            tokenizer = engine.tokenizer
            ids: list[int] = []
            said = [""]

            def on_token(token_id: int) -> None:
                cancel.check()
                if emit is not None:
                    ids.append(token_id)
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    delta, said[0] = text[len(said[0]) :], text
                    emit({"index": len(ids) - 1, "token_id": token_id, "text": delta})

            return engine.ask(req.question, req, on_token)
        finally:
            self.holder.release(version)

    def client(self, request: Request, cookie: str | None = None) -> str | None:
        """Who sends ``request``: its API key's client (None: no valid key), or its address
        when the server has no keys. ``cookie``: a key the explorer's sign-in cookie holds,
        tried when the ``Authorization`` header carries no valid key (``/ui`` only)."""
        if self.keys.enabled:
            found = self.keys.client(request.headers.get("authorization"))
            if found is None and cookie:
                found = self.keys.client(f"Bearer {cookie}")
            return found
        return "address:" + (request.client.host if request.client else "unknown")

    def admit(
        self,
        req: QueryRequest,
        cancel: Cancel,
        emit: Callable | None = None,
        client: str = "-",
    ) -> tuple[ServedVersion, Any]:
        """Take the current version and queue the answer, counted in ``client``'s share until
        it ends; :class:`Limited` past the client's share, :class:`QueueFull` past the
        queue's limit."""
        release = self.limits.enter(client)
        version = self.holder.acquire()
        try:
            future = self.queue.submit(self.answer_job, version, req, cancel, emit)
        except BaseException:
            self.holder.release(version)
            release()
            raise
        future.add_done_callback(lambda _: release())
        return version, future

    def refused(self, endpoint: str, method: str, exc: BaseException) -> JSONResponse:
        """A request refused before its answer started (counted, then answered)."""
        status, message, headers = refusal(exc, self.settings.retry_after_s)
        if isinstance(exc, Limited):
            self.metrics.limited.labels(exc.reason).inc()
        self.metrics.requests.labels(endpoint, method, str(status)).inc()
        return _error(status, message, headers)

    def unauthorized(self, endpoint: str) -> JSONResponse:
        """401 for a request without a valid key (counted)."""
        self.metrics.unauthorized.labels(endpoint).inc()
        return _error(
            401,
            "missing or wrong API key: send the header Authorization: Bearer KEY",
            BAD_KEY_HEADERS,
        )

    def start(self) -> None:
        """Hold the reader lease (renewed in the background) and start following the store."""
        self.lease.hold()
        self.watcher.start()

    def on_stop(self, step: Callable[[], None]) -> None:
        """Run ``step`` first when the server stops (the explorer's: wait for its warm-up)."""
        self._on_stop.append(step)

    def stop(self) -> None:
        try:
            for step in self._on_stop:
                step()
        finally:
            self.watcher.stop()
            self.queue.shutdown()
            self.lease.release()
            self.metrics.close()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def http_status_of(exc: BaseException) -> int:
    """The HTTP status of an error, the server's ONE mapping: the status it declares
    (``http_status``: ``BadRequest``, ``Limited`` 429, ``QueueFull`` 503, ``Cancelled`` 499,
    ``MissingAssets`` 500, ``BlankQuestion`` and ``SettingsError`` 422), else 422 for a value the
    request named wrong (``ValueError``, ``LookupError``: e.g. an unknown ``oracle_doc``), else
    500."""
    status = getattr(exc, "http_status", None)
    if isinstance(status, int):
        return status
    return 422 if isinstance(exc, ValueError | LookupError) else 500


def refusal(exc: BaseException, retry_after_s: int) -> tuple[int, str, dict[str, str]]:
    """Status, message and headers of the answer to a request that raised ``exc``: 429/503
    say when to retry (``Retry-After``); an undeclared 500 is logged with its traceback."""
    status = http_status_of(exc)
    message, headers = str(exc), {}
    if status in (429, 503):
        headers["Retry-After"] = str(getattr(exc, "retry_after", retry_after_s))
    if isinstance(exc, QueueFull):
        message = f"server busy: {exc}; retry later"
    if status == 500 and getattr(exc, "http_status", None) is None:
        log.error("answer failed", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    return status, message, headers


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit + 1`` bytes read (enough to refuse an oversized one)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body over {limit} bytes")
    return b"".join(chunks)


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


class InFlight:
    """One admitted request: its answer job on the model thread, the tokens it streams, and
    its outcome, counted in the metrics once when the job ends (whether or not a client is
    still there to read it)."""

    def __init__(self, server: ApiServer, req: QueryRequest, endpoint: str, stream: bool) -> None:
        self.server, self.req, self.endpoint, self.stream = server, req, endpoint, stream
        self.started = time.perf_counter()
        self.cancel = Cancel()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.outcome: tuple[int, Answer | str] | None = None
        self.headers: dict[str, str] = {}

    def emit(self, data: dict[str, Any]) -> None:
        """A decoded token (called on the model thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("token", data))

    def admit(self, client: str) -> None:
        """Queue the answer (:class:`Limited` or :class:`QueueFull` when refused)."""
        emit = self.emit if self.stream else None
        version, future = self.server.admit(self.req, self.cancel, emit, client)
        self.headers = {RUN_HEADER: version.run_id}
        self.done = asyncio.wrap_future(future)
        self.done.add_done_callback(self.finished)
        if self.stream:
            self.done.add_done_callback(lambda _: self.events.put_nowait(("done", None)))

    def finished(self, _: Any = None) -> tuple[int, Answer | str]:
        """The status and the answer (or the error message), counted once."""
        if self.outcome is None:
            metrics, exc = self.server.metrics, self.done.exception()
            if exc is None:
                answer = self.done.result()
                elapsed = time.perf_counter() - self.started
                metrics.answered(self.req.method, answer.timings, elapsed)
                self.outcome = (200, answer)
            else:
                self.outcome = refusal(exc, self.server.settings.retry_after_s)[:2]
                if self.outcome[0] == 499:
                    metrics.cancelled.inc()
            metrics.requests.labels(self.endpoint, self.req.method, str(self.outcome[0])).inc()
        return self.outcome

    async def response(self, request: Request) -> Response:
        """The whole answer as JSON (a client that leaves stops the job at its next token)."""
        while not self.done.done():
            await asyncio.wait({self.done}, timeout=0.2)
            if not self.done.done() and await request.is_disconnected():
                self.cancel.set()
        status, result = self.finished()
        if isinstance(result, Answer):
            return Response(
                result.to_json_text(), media_type="application/json", headers=self.headers
            )
        return _error(status, result, self.headers)

    def events_response(self) -> StreamingResponse:
        """Server-sent events: ``token`` per decoded token, then ``answer`` (or ``error``)."""

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    kind, data = await self.events.get()
                    if kind == "token":
                        yield _sse("token", json.dumps(data, ensure_ascii=False))
                        continue
                    status, result = self.finished()
                    if isinstance(result, Answer):
                        yield _sse("answer", result.to_json_text())
                    else:
                        payload = {"error": result, "status": status}
                        yield _sse("error", json.dumps(payload, ensure_ascii=False))
                    return
            finally:
                self.cancel.set()  # a client gone mid-stream: stop at the next token

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={**self.headers, "Cache-Control": "no-cache"},
        )


def create_app(server: ApiServer) -> FastAPI:
    """The FastAPI app of ``server`` (its watcher runs while the app does)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scrub_logs(*SCRUBBED_LOGGERS)  # a key sent in a URL never reaches the access log
        server.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="coinrag", lifespan=lifespan)
    metrics = server.metrics

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # the boundary
        status, message, headers = refusal(exc, server.settings.retry_after_s)
        return _error(status, message, headers)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if server.client(request) is None:
            return JSONResponse({"status": "ok"})  # liveness only, without a key
        return JSONResponse(server.health())

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        if not server.settings.metrics_open and server.client(request) is None:
            return server.unauthorized("metrics")
        metrics.queue_depth.set(server.queue.admitted)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def handle(
        request: Request,
        endpoint: str,
        force_stream: bool,
        authorize: Callable[[Request], str | None] = server.client,
    ) -> Response:
        """Answer one query request (``authorize``: who sent it, None for no valid key)."""
        client = authorize(request)
        if client is None:
            metrics.requests.labels(endpoint, "-", "401").inc()
            return server.unauthorized(endpoint)
        try:
            server.limits.take(client)  # before the body is read
        except Limited as exc:
            return server.refused(endpoint, "-", exc)
        try:
            body = await _read_body(request, server.settings.max_body_bytes)
            req = parse_query(body, server.settings, server.methods, server.config.max_new_tokens)
        except ValueError as exc:  # BadRequest, BlankQuestion: the request's own fault
            return server.refused(endpoint, "-", exc)
        stream = force_stream or req.stream
        flight = InFlight(server, req, "stream" if stream else endpoint, stream)
        try:
            flight.admit(client)
        except (Limited, QueueFull) as exc:
            return server.refused(flight.endpoint, req.method, exc)
        return flight.events_response() if stream else await flight.response(request)

    @app.post("/query")
    async def query(request: Request) -> Response:
        return await handle(request, "query", False)

    @app.post("/query/stream")
    async def query_stream(request: Request) -> Response:
        return await handle(request, "stream", True)

    if server.settings.ui:
        from coinrag.inference.server.ui.pages import mount_ui

        mount_ui(app, server, handle)
    return app


def app_from_env() -> FastAPI:
    """The app of the :class:`ServerConfig` in ``$COINRAG_API_CONFIG`` (uvicorn's factory in
    each worker process of ``coinrag api``)."""
    if not logging.getLogger().handlers:  # a worker process: log as `coinrag api` does
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    config = ServerConfig.from_json(os.environ[CONFIG_ENV])
    config = replace(config, api_key=os.environ.get(API_KEY_ENV) or None)
    return create_app(ApiServer.open(config))


def serve(config: ServerConfig, host: str, port: int, workers: int) -> None:
    """Run uvicorn: ``workers`` processes, each loading and warming before it listens."""
    import uvicorn

    options: dict[str, Any] = dict(host=host, port=port, timeout_graceful_shutdown=30)
    if workers == 1:  # load here: a store that cannot be served fails before the port opens
        uvicorn.run(create_app(ApiServer.open(config)), **options)
        return
    os.environ[CONFIG_ENV] = config.to_json()
    if config.api_key:  # the workers' --api-key (kept out of the JSON above)
        os.environ[API_KEY_ENV] = config.api_key
    import shutil
    import tempfile

    shared = tempfile.mkdtemp(prefix="coinrag-metrics-")  # the workers' metrics, summed
    os.environ[MULTIPROC_ENV] = shared
    try:
        uvicorn.run(f"{__name__}:app_from_env", factory=True, workers=workers, **options)
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(shared, ignore_errors=True)
