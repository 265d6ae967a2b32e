"""What counts as a secret, defined once: text that must never reach a table, a log or lineage.

:func:`scrub` replaces the values of :data:`SECRET_ENV_VARS` found in the environment, any
given secrets, the secrets this process registered (:func:`register_secrets`: the query
server's API keys, every key it has read, rotated-out ones included), anything shaped like an
API key, bearer tokens, URL credentials and URL key parameters (``?api_key=``, ``&token=``)
with ``***``. The LLM clients
(``inference.llm.client``) and the ``runs`` table's error column (``storage.runs.failing_run``)
scrub through it; :class:`ScrubSecrets` scrubs log records (the query server puts it on its
loggers and uvicorn's: a key sent in a URL never reaches the access log).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable

# The query server's API key (`coinrag api --api-key`): read from this variable when not given.
API_KEY_ENV = "COINRAG_API_KEY"
# Environment variables whose values are credentials (the OpenAI client's, the object store's,
# the query server's).
SECRET_ENV_VARS = ("OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", API_KEY_ENV)

_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\",}]+")
_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")
_URL_KEY_PARAM = re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access_token)=)[^&#\s'\"]+")
_MIN_SECRET_CHARS = 4  # shorter "secrets" would scrub ordinary words

_registered: set[str] = set()
_registered_lock = threading.Lock()


def env_secrets() -> tuple[str, ...]:
    """The values of :data:`SECRET_ENV_VARS` set in this process's environment."""
    return tuple(v for v in (os.environ.get(name) for name in SECRET_ENV_VARS) if v)


def register_secrets(values: Iterable[str]) -> None:
    """Make every later :func:`scrub` in this process replace ``values`` (kept for the life
    of the process: a rotated-out key stays a secret)."""
    with _registered_lock:
        _registered.update(v for v in values if v and len(v) >= _MIN_SECRET_CHARS)


def known_secrets() -> tuple[str, ...]:
    """The registered secrets and the secret environment variables' values."""
    with _registered_lock:
        registered = tuple(_registered)
    return registered + env_secrets()


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the given and the registered secrets, anything shaped like an API key,
    bearer tokens, URL credentials and URL key parameters replaced by ``***``."""
    with _registered_lock:
        every = {*secrets, *_registered}
    for secret in sorted(every, key=len, reverse=True):  # a secret inside another: longest first
        if secret and len(secret) >= _MIN_SECRET_CHARS:
            text = text.replace(secret, "***")
    text = _KEY_LIKE.sub("sk-***", text)
    text = _BEARER.sub(r"\1***", text)
    text = _URL_KEY_PARAM.sub(r"\1***", text)
    return _URL_USERINFO.sub(r"\1***@", text)


class ScrubSecrets(logging.Filter):
    """A log filter that scrubs a record's message, its arguments (one by one: a formatter
    may unpack them, as uvicorn's access log does) and its traceback with :func:`scrub` and
    :func:`known_secrets`. On a logger it sees the records logged through that logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets()
        if isinstance(record.msg, str):
            record.msg = scrub(record.msg, secrets)
        if isinstance(record.args, tuple):
            record.args = tuple(_scrub_arg(a, secrets) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _scrub_arg(v, secrets) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, secrets)
        return True


def _scrub_arg(value: object, secrets: tuple[str, ...]) -> object:
    if isinstance(value, (int, float)) or value is None:
        return value  # numbers stay numbers (a "%d" formats them)
    text = str(value)
    clean = scrub(text, secrets)
    return value if clean == text else clean


def scrub_logs(*names: str) -> None:
    """Put one :class:`ScrubSecrets` on each named logger (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ScrubSecrets) for f in logger.filters):
            logger.addFilter(ScrubSecrets())
