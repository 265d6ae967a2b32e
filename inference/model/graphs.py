"""The ``graphs`` forward: the static step of each bucketed shape captured once as a CUDA graph
and replayed per question (``inference/model/forward.py`` states the step, its buffers and
buckets).

At 7B dims on an H200 a 25-token query prefill or a decode step spends most of its time
launching kernels (RESULTS.md, "GPU check": 1.5-2.7 % MFU, 11-22 ms where reading the weights
takes ~3 ms). A CUDA graph launches a whole step at once. What a graph needs is what
:class:`~coinrag.inference.model.forward.CompiledForward` already fixed: every tensor a step
touches lives at one address per shape. So a shape is ``(query bucket, capacity bucket)``
(``query_bucket``, ``capacity_bucket``), and each has one :class:`StepGraph`:

- its **static inputs**: one int64 tensor ``(2q + 1,)`` on the device, the padded ids
  ``[:q]``, their positions ``[q:2q]`` and the index of the last real one ``[2q]``, written by
  one host-to-device copy per step (:meth:`StepGraph.load`);
- the KV buffer of its capacity (one per capacity, ``KvBuffer``: the graph reads and writes it
  in place);
- the step, run over the whole buffer with a causal mask (as the compiled step: the same
  arithmetic for every position, so one graph serves every position of its shape).

E.g. a question with 2,080 context tokens, 25 query tokens and 16 answer tokens: capacity
``capacity_bucket(2080 + 32 + 16) = 4096``; the prefill replays the graph of ``(32, 4096)``
(ids padded 25 -> 32), each decode step the graph of ``(1, 4096)``; the next question of
the same buckets replays the same two graphs.

A shape is captured at its first use (``coinrag api`` and ``eval`` answer once untimed per
method before serving: the warm-up): the step is run once eagerly on a side stream with the
real inputs (cuBLAS and the allocator set themselves up; the KV it writes is the KV the replay
writes again, so nothing is lost), then captured into a graph sharing one memory pool with
the forward's other graphs (they never run at the same time), then replayed. A capture that
fails leaves that shape to the eager step (logged once); prefills longer than
``max_graph_query`` run the eager step (compute-bound there: a graph saves nothing).

Without CUDA (tests, ``--dry-run``) a :class:`StepGraph` runs the same step eagerly over the
same static inputs and buffers: the bucketing and the static inputs are what a CPU checks
(``tests/inference/test_forward.py``); the CUDA tests hold the replayed graphs to eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from coinrag.inference.model.forward import (
    KvBuffer,
    StaticForward,
    attention_of_static_step,
    query_bucket,
    static_step,
)

log = logging.getLogger(__name__)


class StepGraph:
    """One shape's step: static inputs ``(2q + 1,)`` int64 on ``device`` (ids, positions,
    last index), and ``step(ids (1, q), positions (q,), last (1,)) -> logits (vocab,)`` run
    over them: replayed as a captured CUDA graph once :meth:`capture` succeeded, else called
    (CPU, or a failed capture).

    E.g. ``q = 4``, :meth:`load` ``([7, 8], position=30)`` -> inputs ``[7, 8, 8, 8, 30, 31,
    32, 33, 1]``: ids padded with the last id, positions ``30..33``, last index 1."""

    def __init__(self, q: int, device: torch.device | str, step: Callable[..., torch.Tensor]):
        self.q = q
        self.inputs = torch.zeros(2 * q + 1, dtype=torch.long, device=device)
        self.step = step
        self.graph: Any | None = None  # torch.cuda.CUDAGraph once captured
        self.output: torch.Tensor | None = None  # the graph's static output (vocab,)
        self.failed = ""  # why capturing failed (the shape then runs eagerly)
        self.replays = 0  # graph replays (0 where the step is called)

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs[: self.q].view(1, self.q)

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs[self.q : 2 * self.q]

    @property
    def last(self) -> torch.Tensor:
        return self.inputs[2 * self.q :]

    def load(self, ids: Sequence[int], position: int) -> None:
        """Write ``ids`` (at most ``q``, right-padded with the last) at positions ``position..``
        into the static inputs: one host-to-device copy."""
        n = len(ids)
        if not 0 < n <= self.q:
            raise ValueError(f"{n} ids do not fit a step of {self.q} (1..{self.q})")
        padded = [*ids, *[int(ids[-1])] * (self.q - n)]
        host = [*padded, *range(position, position + self.q), n - 1]
        # non_blocking: the ids are staged at once, the copy queued before the step's kernels
        self.inputs.copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)

    def call(self) -> torch.Tensor:
        """The step over the static inputs, eagerly."""
        return self.step(self.ids, self.positions, self.last)

    def run(self) -> torch.Tensor:
        """The logits ``(vocab,)`` float32 of the loaded inputs (a copy: the graph's output is
        overwritten by its next replay)."""
        if self.graph is None:
            return self.call()
        self.graph.replay()
        self.replays += 1
        return self.output.clone()  # type: ignore[union-attr]

    def capture(self, pool: Any) -> None:
        """Capture the step as a CUDA graph (``pool``: the memory pool shared with the other
        shapes' graphs), after one eager run on a side stream; on failure keep calling the
        step eagerly (``failed`` says why). The loaded inputs must be the real ones: the warm
        run writes their keys and values into the KV buffer."""
        device = self.inputs.device
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.call()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (none should run) does not fail it
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                output = self.call()
        except RuntimeError as exc:
            self.failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("CUDA graph capture of a %d-token step failed, eager: %s", self.q, exc)
            return
        self.graph, self.output = graph, output


class GraphForward(StaticForward, name="graphs"):
    """:class:`StaticForward`'s step replayed as one CUDA graph per ``(query bucket, capacity
    bucket)`` (:class:`StepGraph`; eager over the same static inputs without CUDA)."""

    warms_served_shapes = True
    max_graph_query: ClassVar[int] = 256  # longer prefills run the eager step

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.graphs: dict[tuple[int, int], StepGraph] = {}  # (query bucket, capacity)
        self.cuda = torch.device(self.device).type == "cuda"
        self._pool: Any = None

    def capacity(self, context_len: int, query_len: int, max_new_tokens: int) -> int:
        """Room for the query padded to its bucket too."""
        return context_len + query_bucket(query_len) + max_new_tokens

    def graph_for(self, q: int, buffer: KvBuffer) -> StepGraph:
        """The :class:`StepGraph` of ``(q, buffer.capacity)`` (made once, not yet captured)."""
        key = (q, buffer.capacity)
        found = self.graphs.get(key)
        if found is None:
            lm, tensors, capacity = self.lm, buffer.tensors, buffer.capacity

            def step(ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor):
                with attention_of_static_step(lm):
                    return static_step(lm, ids, positions, tensors, last, capacity, True)

            found = self.graphs[key] = StepGraph(q, self.device, step)
        return found

    def run_step(self, buffer: KvBuffer, ids: Sequence[int], position: int) -> torch.Tensor:
        q = query_bucket(len(ids))
        if q > self.max_graph_query or position + q > buffer.capacity:
            return super().run_step(buffer, ids, position)
        graph = self.graph_for(q, buffer)
        graph.load(ids, position)
        if self.cuda and graph.graph is None and not graph.failed:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph.capture(self._pool)
        return graph.run()
