"""Fuzzy stage of span matching (``tasks/recover/match.py``): the best whole-word windows of a chunk
for a canonical candidate, by Indel similarity, pruned with exact upper bounds.

The result is exactly what scoring every window would give (``tests/recover_reference.py`` does
that) but prunes with ``LCS(c, w) <= LCS(c, t)`` for any text ``t`` containing window ``w``:
blocks of window starts are bounded in one rapidfuzz call and scored best bound first, and when
no block stands out (typical of junk) the longest windows are scored first and bound the shorter
windows inside them. Nothing whose bound reaches the best similarity is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Indel, LCSseq

from coinrag.tasks.recover.canon import canonicalize

__all__ = ["ChunkIndex", "FuzzySearch"]


_BLOCK = 8  # window starts per block of the fuzzy search
_MAX_BLOCKS = 4  # more surviving blocks than this: score their whole range at once
_CLOSE = 0.05  # bounds this close to the top one: the block bounds do not discriminate
_EPS = 1e-12


class ChunkIndex:
    """Everything about one chunk that does not depend on the candidate (built lazily)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._canon: tuple[str, np.ndarray] | None = None
        self._words: tuple[list[int], list[int], np.ndarray, np.ndarray] | None = None
        self._windows: dict[int, list[str]] = {}
        self._blocks: dict[int, list[str]] = {}

    def _build(self) -> None:
        canon, orig, ws_a, we_a = canonicalize(self.text)
        self._canon = (canon, orig)
        self._words = (ws_a.tolist(), we_a.tolist(), ws_a, we_a)

    @property
    def canon(self) -> tuple[str, np.ndarray]:
        """Canonical text and the original index of each of its characters."""
        if self._canon is None:
            self._build()
        return self._canon

    @property
    def words(self) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """Canonical word starts and ends (lists and numpy arrays)."""
        if self._words is None:
            self._build()
        return self._words

    def windows(self, size: int) -> list[str]:
        """All windows of ``size`` consecutive words, by start word."""
        got = self._windows.get(size)
        if got is None:
            canon = self.canon[0]
            ws, we, _, _ = self.words
            got = [canon[a:b] for a, b in zip(ws, we[size - 1 :], strict=False)]
            self._windows[size] = got
        return got

    def blocks(self, hi: int) -> list[str]:
        """Block texts: block k covers every window of <= ``hi`` words starting in it."""
        got = self._blocks.get(hi)
        if got is None:
            canon = self.canon[0]
            _, _, ws_a, we_a = self.words
            first = ws_a[::_BLOCK]
            last = np.minimum(len(ws_a), np.arange(0, len(ws_a), _BLOCK) + (_BLOCK - 1 + hi)) - 1
            got = [canon[a:b] for a, b in zip(first.tolist(), we_a[last].tolist(), strict=True)]
            self._blocks[hi] = got
        return got


class FuzzySearch:
    """Best similarity over all windows of ``lo..hi`` words of a chunk for the canonical
    candidate ``c``, and every window ``(i, L)`` (start word, word count) reaching it.

    Exact (the same result as scoring every window), but prunes with two upper bounds on the
    LCS of a window ``w``: ``LCS(c, w) <= LCS(c, t)`` for any text ``t`` containing ``w``, and
    ``LCS <= min(len(c), len(w))``; with the Indel similarity ``2 LCS / (len(c) + len(w))``.
    One instance per search: ``FuzzySearch(chunk, c, lo, hi).run()``.
    """

    def __init__(self, chunk: ChunkIndex, c: str, lo: int, hi: int) -> None:
        self.chunk = chunk
        self.c = c
        self.la = len(c)
        self.canon = chunk.canon[0]
        self.ws, self.we, self.ws_a, self.we_a = chunk.words
        self.n_w = len(self.ws)
        self.lo = lo
        self.hi = min(hi, self.n_w)
        self.n_starts = self.n_w - lo + 1
        self.best = -1.0
        self.ties: set[tuple[int, int]] = set()

    def run(self) -> tuple[float, set[tuple[int, int]]]:
        """``(best similarity, windows reaching it)``: the most promising block of window
        starts first, then the others whose bound reaches the best; a full scan when the block
        bounds do not discriminate."""
        n_blocks = (self.n_starts + _BLOCK - 1) // _BLOCK
        if n_blocks <= 2:
            self._scan()
            return self.best, self.ties
        block_texts = self.chunk.blocks(self.hi)[:n_blocks]
        u = process.cdist(
            [self.c], block_texts, scorer=LCSseq.similarity, dtype=np.int32, workers=1
        )[0]
        m = np.minimum(u, self.la)
        bound = 2.0 * m / (self.la + m)
        order = np.argsort(-bound, kind="stable")
        bound_l = bound.tolist()
        top_bound = bound_l[order[0]]
        if bound_l[order[min(_MAX_BLOCKS, n_blocks - 1)]] >= top_bound - _CLOSE:
            # many blocks look alike (typical of junk): no block stands out, score everything
            self._scan()
            return self.best, self.ties
        self._score_block(int(order[0]))
        rest = [k for k in order[1:].tolist() if bound_l[k] >= self.best - _EPS]
        if len(rest) > _MAX_BLOCKS:
            self._scan()
        else:
            for k in rest:
                if bound_l[k] >= self.best - _EPS:
                    self._score_block(k)
        return self.best, self.ties

    def _take(self, sims: np.ndarray, starts: Sequence[int], sizes: Sequence[int] | int) -> None:
        """Merge windows ``(starts[j], sizes[j])`` with similarities ``sims`` into the best."""
        top = float(sims.max())
        if top < self.best:
            return
        if top > self.best:
            self.best = top
            self.ties = set()
        for j in np.flatnonzero(sims == top).tolist():
            self.ties.add((int(starts[j]), sizes if isinstance(sizes, int) else sizes[j]))

    def _distances(self, texts: list[str]) -> np.ndarray:
        """Indel distance of the candidate to each text, shape ``(len(texts),)``."""
        return process.cdist([self.c], texts, scorer=Indel.distance, dtype=np.int32, workers=1)[0]

    def _score(self, texts: list[str], starts: Sequence[int], sizes: Sequence[int] | int) -> None:
        lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        self._take(1.0 - self._distances(texts) / (self.la + lens), starts, sizes)

    def _score_block(self, k: int) -> None:
        """Score every window starting in block k, in one rapidfuzz call."""
        ws, we, n_w = self.ws, self.we, self.n_w
        a = k * _BLOCK
        b = min(a + _BLOCK, self.n_starts)
        texts: list[str] = []
        starts: list[int] = []
        sizes: list[int] = []
        for size in range(self.lo, self.hi + 1):
            e = min(b, n_w - size + 1)
            if e <= a:
                break
            texts += [self.canon[x:y] for x, y in zip(ws[a:e], we[a + size - 1 :], strict=False)]
            starts += range(a, e)
            sizes += [size] * (e - a)
        self._score(texts, starts, sizes)

    def _scan(self) -> None:
        """Score every window, pruning with containment bounds: the windows of ``hi`` words
        first, then the shorter ones their bounds let through."""
        hi = self.hi
        texts = self.chunk.windows(hi)
        n_hi = len(texts)
        d = self._distances(texts)
        total = self.la + (self.we_a[hi - 1 :] - self.ws_a[:n_hi])
        self._take(1.0 - d / total, range(n_hi), hi)
        if self.lo < hi:
            self._scan_shorter((total - d) // 2)

    def _scan_shorter(self, lcs_hi: np.ndarray) -> None:
        """Score the windows shorter than ``hi`` words that may reach the best.

        ``lcs_hi[s]`` is the LCS of window ``(s, hi)``; it bounds the LCS of every shorter
        window inside it, so window ``(i, L)`` has ``LCS <= min(lcs_hi[s] for s in
        [i - (hi - L), i])``; it is scored only when ``2 * min(that, len(w)) / (len(c) +
        len(w)) >= best``.
        """
        ws, we, ws_a, we_a, la = self.ws, self.we, self.ws_a, self.we_a, self.la
        n_hi = len(lcs_hi)
        pad = self.hi - self.lo
        padded = np.full(n_hi + 2 * pad, la, dtype=np.int64)
        padded[pad : pad + n_hi] = lcs_hi
        running = padded.copy()  # running[x] = min(padded[x - w .. x]) after step w
        texts: list[str] = []
        starts: list[int] = []
        sizes: list[int] = []
        floor = self.best - _EPS
        for w in range(1, pad + 1):
            np.minimum(running[w:], padded[:-w], out=running[w:])
            size = self.hi - w
            n_i = self.n_w - size + 1
            lens = we_a[size - 1 :] - ws_a[:n_i]
            m = np.minimum(running[pad : pad + n_i], lens)
            idx = np.flatnonzero(2.0 * m / (la + lens) >= floor).tolist()
            if idx:
                texts += [self.canon[ws[i] : we[i + size - 1]] for i in idx]
                starts += idx
                sizes += [size] * len(idx)
        if texts:
            self._score(texts, starts, sizes)
