"""A small, real HTTP server speaking just enough of the OpenAI REST API for the official client.

This is the only fake of the OpenAI tests, at the edge of the network: the extractors and the
real ``openai`` client run unchanged against ``http://127.0.0.1:<port>/v1``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/files`` (multipart), ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``POST /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``.

Answers are deterministic: a chat request "extracts" the first clauses (split at ``.`` and ``;``)
of the passage between ``<<<`` and ``>>>`` of the request's (first) user message, verbatim, as
``{"nuggets": [...]}``, with a ``usage`` block (word counts, or :attr:`FakeOpenAI.fixed_usage`).

Failure injection, per test:

- :meth:`FakeOpenAI.script_chat` queues :class:`Action` s (an HTTP error with headers such as
  ``Retry-After``, a delay longer than the client's timeout, a raw message content such as cut-off
  JSON) consumed by the next chat requests (optionally only those whose passage contains a
  string);
- :meth:`FakeOpenAI.answer_always` answers every chat request about a passage with the same
  content (a deterministic model's malformed reply), whatever the request;
- :attr:`FakeOpenAI.reject_formats`: ``response_format`` types answered with a 400;
- :attr:`FakeOpenAI.hold_after` ``= n``: every chat request after the first ``n`` waits, unanswered,
  until :meth:`FakeOpenAI.release` (or the server stops): a client killed while waiting got
  exactly ``n`` answers;
- :meth:`FakeOpenAI.plan_batch` queues a :class:`BatchPlan` per created batch: the statuses shown
  on successive polls, the final status (completed, failed, expired with partial output,
  cancelled), shuffled output order, malformed or failing lines.

Every request is recorded (:attr:`FakeOpenAI.requests`), and :attr:`FakeOpenAI.max_in_flight`
counts concurrent chat requests.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Recorded:
    """One request the server received."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    json: Any
    started: float
    finished: float = 0.0


@dataclass
class Action:
    """A scripted answer to one chat request."""

    kind: str  # error | delay | content
    status: int = 200
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    content: str = ""
    code: str | None = None
    param: str | None = None

    @classmethod
    def error(
        cls,
        status: int,
        message: str = "injected failure",
        headers: dict[str, str] | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> Action:
        """Answer with an HTTP error (e.g. 429 with ``{"Retry-After": "1"}``, 500)."""
        return cls("error", status, message, dict(headers or {}), code=code, param=param)

    @classmethod
    def delay(cls, seconds: float) -> Action:
        """Wait ``seconds`` before the normal answer (longer than the client timeout)."""
        return cls("delay", seconds=seconds)

    @classmethod
    def raw_content(cls, content: str) -> Action:
        """Answer 200 with this message content (malformed JSON, a bare list...)."""
        return cls("content", content=content)


@dataclass
class BatchPlan:
    """How the next created batch behaves."""

    progression: list[str] = field(
        default_factory=lambda: ["validating", "in_progress", "finalizing"]
    )
    final: str = "completed"  # completed | failed | expired | cancelled
    processed_fraction: float = 1.0  # expired/cancelled: share of the lines that were answered
    shuffle: bool = False
    malformed_match: str | None = None  # malformed content for passages containing this
    malformed_content: str = '{"nuggets": ["cut off'  # what they get
    error_match: str | None = None  # a 500 line in the error file for passages containing this
    failure_message: str = "injected batch failure"


def passage_of(user_text: str) -> str:
    """The passage between ``<<<`` and ``>>>`` of a user message."""
    match = re.search(r"<<<\n?(.*?)\n?>>>", user_text, re.DOTALL)
    return match.group(1) if match else user_text


def passage_in(messages: list[dict[str, Any]]) -> str:
    """The passage a chat request is about: of its first user message holding ``<<< >>>`` (a
    repair request repeats the conversation and ends with another user message), else of the
    last user message."""
    users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
    for text in users:
        if "<<<" in text:
            return passage_of(text)
    return passage_of(users[-1]) if users else ""


def nuggets_for(passage: str) -> list[str]:
    """The fake's extraction: up to three first clauses of the passage, verbatim."""
    pieces = [p.strip() for p in re.split(r"[.;]", passage)]
    return [p for p in pieces if p][:3]


def _words(text: str) -> int:
    return len(text.split())


def _error_body(message: str, status: int, code: str | None, param: str | None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class FakeOpenAI:
    """The fake OpenAI server; ``with FakeOpenAI() as fake: ... fake.base_url``."""

    def __init__(self, api_key: str | None = None) -> None:
        """``api_key``: when given, requests without ``Bearer <api_key>`` get a 401."""
        self.api_key = api_key
        self.requests: list[Recorded] = []
        self.reject_formats: set[str] = set()
        self.latency_s = 0.0
        self.fixed_usage: tuple[int, int] | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold_after: int | None = None  # chat requests after this many wait for release()
        self.always: list[tuple[str, str]] = []  # (match, content): see answer_always
        self._released = threading.Event()
        self._chat_seen = 0
        self.files: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self._chat_scripts: list[tuple[str | None, deque[Action]]] = []
        self._batch_plans: deque[BatchPlan] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------- lifecycle

    def start(self) -> FakeOpenAI:
        """Listen on 127.0.0.1, an ephemeral port, in a background thread."""
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (delayed handlers are woken up)."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """What to give ``openai.OpenAI(base_url=...)``."""
        return f"http://127.0.0.1:{self.port}/v1"

    # ----------------------------------------------------------------------- scripting

    def script_chat(self, *actions: Action, match: str | None = None) -> None:
        """Queue actions for the next chat requests (whose passage contains ``match``)."""
        with self._lock:
            self._chat_scripts.append((match, deque(actions)))

    def answer_always(self, match: str, content: str) -> None:
        """Answer every chat request whose passage contains ``match`` with this message content
        (e.g. the same malformed JSON), in this server's whole life, repair requests included:
        a model at temperature 0 that answers that passage this way."""
        with self._lock:
            self.always.append((match, content))

    def release(self) -> None:
        """Let the chat requests held by :attr:`hold_after` go on (and any later ones)."""
        self._released.set()

    def plan_batch(self, *plans: BatchPlan) -> None:
        """Queue the behaviour of the next created batches (default: a normal completion)."""
        with self._lock:
            self._batch_plans.extend(plans)

    # ----------------------------------------------------------------------- observations

    def received(self, method: str, path_prefix: str) -> list[Recorded]:
        """The recorded requests with this method whose path starts with ``path_prefix``."""
        with self._lock:
            return [
                r for r in self.requests if r.method == method and r.path.startswith(path_prefix)
            ]

    def chat_requests(self) -> list[Recorded]:
        """The chat completion requests, in arrival order."""
        return self.received("POST", "/v1/chat/completions")

    def uploaded_lines(self) -> list[list[dict[str, Any]]]:
        """The JSONL lines of every uploaded batch input file, in upload order."""
        with self._lock:
            files = [f for f in self.files.values() if f["purpose"] == "batch"]
        return [[json.loads(line) for line in f["data"].decode().splitlines()] for f in files]

    # ----------------------------------------------------------------------- chat logic

    def _next_action(self, passage: str) -> Action | None:
        with self._lock:
            for match, queue in self._chat_scripts:
                if queue and (match is None or match in passage):
                    return queue.popleft()
        return None

    def _format_rejection(self, body: dict[str, Any]) -> dict[str, Any] | None:
        fmt = body.get("response_format")
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind is not None and kind in self.reject_formats:
            return _error_body(
                f"Invalid parameter: 'response_format' of type '{kind}' is not supported "
                "with this model.",
                400,
                None,
                "response_format",
            )
        return None

    def _completion(self, body: dict[str, Any], content: str | None = None) -> dict[str, Any]:
        messages = body.get("messages") or []
        if content is None:
            passage = passage_in(messages)
            content = json.dumps({"nuggets": nuggets_for(passage)}, ensure_ascii=False)
        if self.fixed_usage is not None:
            tokens_in, tokens_out = self.fixed_usage
        else:
            tokens_in = sum(_words(str(m.get("content", ""))) for m in messages)
            tokens_out = _words(content)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:20],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "unknown"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": tokens_in,
                "completion_tokens": tokens_out,
                "total_tokens": tokens_in + tokens_out,
            },
        }

    def handle_chat(self, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        """(status, headers, JSON body) of one chat completion request."""
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._chat_seen += 1
            held = self.hold_after is not None and self._chat_seen > self.hold_after
        try:
            while held and not (self._released.is_set() or self._stop.is_set()):
                self._released.wait(0.05)
            if self.latency_s:
                self._stop.wait(self.latency_s)
            passage = passage_in(body.get("messages") or [])
            always = next((c for m, c in self.always if m in passage), None)
            if always is not None:  # a model at temperature 0: the same answer every time
                return 200, {}, self._completion(body, always)
            action = self._next_action(passage)
            if action is not None and action.kind == "error":
                err = _error_body(action.message, action.status, action.code, action.param)
                return action.status, action.headers, err
            if action is not None and action.kind == "delay":
                self._stop.wait(action.seconds)
            rejection = self._format_rejection(body)
            if rejection is not None:
                return 400, {}, rejection
            content = action.content if action is not None and action.kind == "content" else None
            return 200, {}, self._completion(body, content)
        finally:
            with self._lock:
                self.in_flight -= 1

    # ----------------------------------------------------------------------- files & batches

    def create_file(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store a file; its File object."""
        file_id = "file-" + uuid.uuid4().hex[:24]
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        with self._lock:
            self.files[file_id] = {**obj, "data": data}
        return obj

    def create_batch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A new batch in its first status."""
        file_id = body.get("input_file_id")
        with self._lock:
            known = file_id in self.files
            plan = self._batch_plans.popleft() if self._batch_plans else BatchPlan()
        if not known:
            return 404, _error_body(f"No such File object: {file_id}", 404, None, "input_file_id")
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body.get("endpoint"),
            "errors": None,
            "input_file_id": file_id,
            "completion_window": body.get("completion_window"),
            "status": plan.progression[0] if plan.progression else plan.final,
            "output_file_id": None,
            "error_file_id": None,
            "created_at": int(time.time()),
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        with self._lock:
            self.batches[batch_id] = {"obj": batch, "plan": plan, "polls": 0}
        if not plan.progression:
            self._finish_batch(batch_id)
        return 200, self._batch_view(batch_id)

    def _batch_view(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self.batches[batch_id]["obj"]))

    def poll_batch(self, batch_id: str) -> tuple[int, dict[str, Any]]:
        """Advance the batch by one status and return it."""
        with self._lock:
            entry = self.batches.get(batch_id)
        if entry is None:
            return 404, _error_body(f"No such batch: {batch_id}", 404, None, None)
        plan: BatchPlan = entry["plan"]
        obj = entry["obj"]
        if obj["status"] not in ("completed", "failed", "expired", "cancelled"):
            with self._lock:
                entry["polls"] += 1
                polls = entry["polls"]
            if polls < len(plan.progression):
                with self._lock:
                    obj["status"] = plan.progression[polls]
                    if obj["status"] == "in_progress":
                        obj["in_progress_at"] = int(time.time())
            else:
                self._finish_batch(batch_id)
        return 200, self._batch_view(batch_id)

    def _batch_line(self, line: dict[str, Any], plan: BatchPlan) -> tuple[bool, dict[str, Any]]:
        """(goes to the output file, the result line) for one input line."""
        cid = line.get("custom_id")
        body = line.get("body") or {}
        passage = passage_in(body.get("messages") or [])
        rid = "batch_req_" + uuid.uuid4().hex[:20]

        def error_line(status: int, err: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
            response = {"status_code": status, "request_id": rid, "body": err}
            return False, {"id": rid, "custom_id": cid, "response": response, "error": None}

        if line.get("method") != "POST" or line.get("url") != "/v1/chat/completions":
            return error_line(400, _error_body("bad method or url", 400, None, "url"))
        rejection = self._format_rejection(body)
        if rejection is not None:
            return error_line(400, rejection)
        if plan.error_match is not None and plan.error_match in passage:
            return error_line(500, _error_body("injected line failure", 500, None, None))
        content = None
        if plan.malformed_match is not None and plan.malformed_match in passage:
            content = plan.malformed_content
        completion = self._completion(body, content)
        response = {"status_code": 200, "request_id": rid, "body": completion}
        return True, {"id": rid, "custom_id": cid, "response": response, "error": None}

    def _finish_batch(self, batch_id: str) -> None:
        with self._lock:
            entry = self.batches[batch_id]
            plan: BatchPlan = entry["plan"]
            obj = entry["obj"]
            data = self.files[obj["input_file_id"]]["data"]
        lines = [json.loads(s) for s in data.decode().splitlines() if s.strip()]
        now = int(time.time())
        if plan.final == "failed":
            errors = [{"code": "invalid_request", "message": plan.failure_message, "line": None}]
            with self._lock:
                obj.update(status="failed", failed_at=now)
                obj["errors"] = {"object": "list", "data": errors}
                obj["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
            return
        processed = len(lines)
        if plan.final in ("expired", "cancelled"):
            processed = int(len(lines) * plan.processed_fraction)
        outputs: list[dict[str, Any]] = []
        errors_out: list[dict[str, Any]] = []
        for i, line in enumerate(lines):
            if i < processed:
                ok, row = self._batch_line(line, plan)
                (outputs if ok else errors_out).append(row)
            else:
                code = "batch_expired" if plan.final == "expired" else "batch_cancelled"
                errors_out.append(
                    {
                        "id": "batch_req_" + uuid.uuid4().hex[:20],
                        "custom_id": line.get("custom_id"),
                        "response": None,
                        "error": {"code": code, "message": "not executed in time"},
                    }
                )
        if plan.shuffle:
            random.Random(7).shuffle(outputs)
            outputs.reverse()
        out_id = err_id = None
        if outputs:
            blob = "".join(json.dumps(r) + "\n" for r in outputs).encode()
            out_id = self.create_file(f"{batch_id}_output.jsonl", "batch_output", blob)["id"]
        if errors_out:
            blob = "".join(json.dumps(r) + "\n" for r in errors_out).encode()
            err_id = self.create_file(f"{batch_id}_error.jsonl", "batch_output", blob)["id"]
        stamp = {
            "completed": "completed_at",
            "expired": "expired_at",
            "cancelled": "cancelled_at",
        }[plan.final]
        with self._lock:
            obj.update(status=plan.final, output_file_id=out_id, error_file_id=err_id)
            obj[stamp] = now
            obj["request_counts"] = {
                "total": len(lines),
                "completed": len(outputs),
                "failed": len(errors_out),
            }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # headers and body leave in one write (no delayed-ACK stalls)
    disable_nagle_algorithm = True
    fake: FakeOpenAI  # set on the subclass made by FakeOpenAI.start

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(
        self, status: int, payload: Any, headers: dict[str, str] | None = None, raw: bool = False
    ) -> None:
        data = payload if raw else json.dumps(payload).encode()
        try:
            self.send_response(status)
            ctype = "application/octet-stream" if raw else "application/json"
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-request-id", "req_" + uuid.uuid4().hex[:16])
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): nothing to answer

    def _handle(self, method: str) -> None:
        fake = self.fake
        body = self._read_body() if method == "POST" else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        parsed: Any = None
        if "json" in headers.get("content-type", "") and body:
            try:
                parsed = json.loads(body)
            except json.JSONDecodeError:
                parsed = None
        record = Recorded(method, self.path, headers, body, parsed, time.time())
        with fake._lock:
            fake.requests.append(record)
        try:
            if fake.api_key is not None and headers.get("authorization") != (
                f"Bearer {fake.api_key}"
            ):
                self._send(401, _error_body("missing or wrong API key", 401, None, None))
                return
            self._route(method, self.path.split("?")[0], body, parsed, headers)
        finally:
            record.finished = time.time()

    def _route(
        self, method: str, path: str, body: bytes, parsed: Any, headers: dict[str, str]
    ) -> None:
        fake = self.fake
        if method == "POST" and path == "/v1/chat/completions":
            status, extra, payload = fake.handle_chat(parsed or {})
            self._send(status, payload, extra)
            return
        if method == "POST" and path == "/v1/files":
            form = _parse_multipart(headers.get("content-type", ""), body)
            if "file" not in form:
                self._send(400, _error_body("no file", 400, None, "file"))
                return
            filename, data = form["file"]
            purpose = form.get("purpose", ("", b""))[1].decode()
            self._send(200, fake.create_file(filename or "upload.jsonl", purpose, data))
            return
        match = re.fullmatch(r"/v1/files/([^/]+)(/content)?", path)
        if method == "GET" and match:
            with fake._lock:
                stored = fake.files.get(match.group(1))
            if stored is None:
                self._send(404, _error_body("No such File object", 404, None, None))
            elif match.group(2):
                self._send(200, stored["data"], raw=True)
            else:
                self._send(200, {k: v for k, v in stored.items() if k != "data"})
            return
        if method == "POST" and path == "/v1/batches":
            status, payload = fake.create_batch(parsed or {})
            self._send(status, payload)
            return
        match = re.fullmatch(r"/v1/batches/([^/]+)(/cancel)?", path)
        if match and method == "GET" and not match.group(2):
            status, payload = fake.poll_batch(match.group(1))
            self._send(status, payload)
            return
        if match and method == "POST" and match.group(2):
            with fake._lock:
                entry = fake.batches.get(match.group(1))
                if entry is not None:
                    entry["plan"].final = "cancelled"
                    entry["plan"].progression = ["cancelling"]
                    entry["obj"]["status"] = "cancelling"
            if entry is None:
                self._send(404, _error_body("No such batch", 404, None, None))
            else:
                self._send(200, fake._batch_view(match.group(1)))
            return
        self._send(404, _error_body(f"no route {method} {path}", 404, None, None))

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        self._handle("POST")


def _parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """``{field: (filename, bytes)}`` of a multipart/form-data body."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    if not message.is_multipart():
        return fields
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        payload = part.get_payload(decode=True) or b""
        fields[str(name)] = (part.get_filename(), payload)
    return fields
