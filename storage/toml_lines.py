"""TOML text of nested tables, as ``STORE/coinrag.toml`` is written (``storage/store.py``):
scalars as JSON values (strings, numbers, booleans, lists of them), sub-tables after them."""

from __future__ import annotations

import json
import re
from typing import Any


def toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """TOML lines of one table: scalars first, then its sub-tables (``[name.sub]``)."""
    lines = [f"[{name}]"]
    subs = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict):
            subs.append((key, value))
        else:
            lines.append(f"{toml_key(key)} = {json.dumps(value)}")
    for key, value in subs:
        lines += toml_table(f"{name}.{toml_key(key)}", value)
    return lines


def toml_key(key: Any) -> str:
    """A bare TOML key where allowed (letters, digits, ``_``, ``-``), else a quoted one."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)
