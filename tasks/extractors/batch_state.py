"""The resumable state of the Batch API extractor (``openai_batch.py``): each batch a run
uploaded and submitted (:class:`BatchJob`), recorded in a JSON file as soon as it exists
(written atomically), so that a killed build with the same extractor fingerprint polls those
batches again instead of uploading and paying a second time."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coinrag.tasks.extractors.openai_chat import MODE_JSON_SCHEMA

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class BatchJob:
    """One batch of one round: what was uploaded, what was submitted, what came back."""

    round: int
    custom_ids: dict[str, str]  # custom_id -> request key (everything in the input file)
    mode: str
    input_file_id: str | None = None
    batch_id: str | None = None
    submitted_at: float = field(default_factory=time.time)
    status: str = "unknown"
    error: str | None = None  # why the job could not be uploaded / created / polled
    batch: Any = None  # last openai.types.Batch seen
    poll_failures: int = 0
    serves: dict[str, str] = field(default_factory=dict)  # the custom_ids this run uses

    def to_state(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "input_file_id": self.input_file_id,
            "batch_id": self.batch_id,
            "mode": self.mode,
            "submitted_at": self.submitted_at,
            "custom_ids": self.custom_ids,
        }

    @classmethod
    def from_state(cls, row: dict[str, Any]) -> BatchJob:
        return cls(
            round=int(row["round"]),
            custom_ids={str(k): str(v) for k, v in dict(row["custom_ids"]).items()},
            mode=str(row.get("mode") or MODE_JSON_SCHEMA),
            input_file_id=row.get("input_file_id"),
            batch_id=row.get("batch_id"),
            submitted_at=float(row.get("submitted_at") or time.time()),
        )


def load_jobs(path: Path | None, fingerprint: str) -> list[BatchJob]:
    """The batches recorded in ``path`` by an extractor of ``fingerprint`` (none when the file
    is missing, unreadable or another extractor's: logged, never raised)."""
    if path is None or not path.exists():
        return []
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("batch state %s unreadable, ignored: %s", path, exc)
        return []
    if state.get("version") != STATE_VERSION or state.get("extractor") != fingerprint:
        log.warning("batch state %s is for another extractor; ignored", path)
        return []
    jobs = []
    for row in state.get("batches", []):
        try:
            jobs.append(BatchJob.from_state(row))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("batch state %s: bad entry ignored: %s", path, exc)
    log.info("batch state %s: %d recorded batch(es)", path, len(jobs))
    return jobs


def save_jobs(path: Path | None, fingerprint: str, model: str, jobs: list[BatchJob]) -> None:
    """Record ``jobs`` (those with an uploaded input file) in ``path``, atomically."""
    if path is None:
        return
    state = {
        "version": STATE_VERSION,
        "extractor": fingerprint,
        "model": model,
        "batches": [job.to_state() for job in jobs if job.input_file_id],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(state, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
