"""Progress of a long build stage, where the user waits: done/total, percent, rate and ETA.

One line at most every ``every_s`` seconds (the first as soon as something is done, the last
always), e.g.::

    extract: 12/50 chunk texts (24%), 1.52 s each, about 58 s left
    embed: 4096/10000 texts (41%), 210 per s, about 28 s left
    extract: 50/50 chunk texts (100%), 1.50 s each, done in 75 s

and, with ``artifact=``, a Prefect progress artifact (percent) updated with each line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class ProgressLog:
    """Rate-limited progress lines of one stage; the clock starts at construction."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        stage: str,
        unit: str,
        total: int,
        *,
        every_s: float = 5.0,
        artifact: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``artifact``: the description of a Prefect progress artifact to keep up to date."""
        self.logger, self.stage, self.unit, self.total = logger, stage, unit, total
        self.every_s = every_s
        self._clock = clock
        self._started = clock()
        self._last_line: float | None = None
        self._last_done = 0
        self._finished = False
        self._artifact_id: Any = None
        if artifact and total:
            from prefect.artifacts import create_progress_artifact

            self._artifact_id = create_progress_artifact(progress=0.0, description=artifact)

    def __call__(self, done: int, total: int | None = None) -> None:
        """The ``progress(done, total)`` callback form of :meth:`update`."""
        self.update(done, total)

    def update(self, done: int, total: int | None = None, *, what: str | None = None) -> None:
        """``done`` of ``total`` (default: the constructor's) are finished; log if it is time.
        ``what`` replaces the ``done/total unit`` part of the line (e.g. ``step 7/10, loss
        0.41``); the percentage, rate and ETA still count ``done`` of ``total``."""
        if total is not None:
            self.total = total
        if self.total <= 0 or self._finished or done <= self._last_done and done < self.total:
            return
        now = self._clock()
        final = done >= self.total
        due = self._last_line is None or now - self._last_line >= self.every_s
        if not (final or due):
            return
        self._last_line, self._last_done, self._finished = now, done, final
        self.logger.info(self.line(done, now - self._started, what))
        if self._artifact_id is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self._artifact_id, progress=100.0 * done / self.total)

    def line(self, done: int, elapsed: float, what: str | None = None) -> str:
        """The progress line for ``done`` after ``elapsed`` seconds."""
        total = self.total
        what = what or f"{done}/{total} {self.unit}"
        text = f"{self.stage}: {what} ({100 * done / total:.0f}%)"
        if done <= 0:
            return text
        each = elapsed / done
        rate = f"{each:.2f} s each" if each >= 0.1 else f"{done / max(elapsed, 1e-9):.0f} per s"
        if done >= total:
            return f"{text}, {rate}, done in {elapsed:.0f} s"
        return f"{text}, {rate}, about {each * (total - done):.0f} s left"


def result_with_ticks(future: Any, tick: Callable[[], None], every_s: float = 1.0) -> Any:
    """``future.result()`` of a Prefect future (any task runner's), calling ``tick()`` every
    ``every_s`` seconds while its task runs (e.g. to report the answers it has staged)."""
    finished = threading.Event()
    future.add_done_callback(lambda _future: finished.set())
    while not finished.wait(every_s):
        tick()
    return future.result()
