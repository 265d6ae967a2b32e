"""What counts as a secret, defined once: text that must never reach a table, a log or lineage.

:func:`scrub` replaces the values of :data:`SECRET_ENV_VARS` found in the environment, any
given secrets, anything shaped like an API key, bearer tokens and URL credentials with ``***``.
The LLM clients (``inference.llm_client``) and the ``runs`` table's error column
(``storage.runs.failing_run``) scrub through it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

# Environment variables whose values are credentials (the OpenAI client's, the object store's).
SECRET_ENV_VARS = ("OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\",}]+")
_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")


def env_secrets() -> tuple[str, ...]:
    """The values of :data:`SECRET_ENV_VARS` set in this process's environment."""
    return tuple(v for v in (os.environ.get(name) for name in SECRET_ENV_VARS) if v)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the given secrets, anything shaped like an API key, bearer tokens and URL
    credentials replaced by ``***``."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _KEY_LIKE.sub("sk-***", text)
    text = _BEARER.sub(r"\1***", text)
    return _URL_USERINFO.sub(r"\1***@", text)
