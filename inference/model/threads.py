"""How many threads the process computes with: torch's intra-op pool and the BLAS/OpenMP pools,
set once per process (``coinrag build``, ``query``, ``eval`` and ``api`` call
:func:`set_process_threads` first thing).

Why a setting with a low default: PyTorch's default pool is one thread per logical CPU, and
OpenMP threads spin-wait on each other. On a CPU shared with other jobs a pool as wide as the
machine collapses: on the 2-core development VM at load ~6, an in-process ``coinrag eval`` of
49 questions gave coinrag a TTFT of median 1,421 ms and max 14.7 s with the default pool, and
120-310 ms with one thread (issue 16). Small models (SmolLM2-135M, MiniLM) gain little from a
second thread even on an idle machine, so the default (``threads = 0``, "auto") is **1 thread
on machines with at most 2 usable CPUs, else min(physical cores, 4)**: below the number of
cores, so a neighbour's job does not stall every step, and capped at 4 because the matrices of
a single query rarely keep more busy.
"""

from __future__ import annotations

import os
from typing import Any

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_APPLIED: dict[str, int] = {}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def physical_cores() -> int:
    """Physical cores (psutil), else the usable CPUs."""
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or usable_cpus())
    except ImportError:
        return usable_cpus()


def resolve_threads(threads: int) -> int:
    """``threads`` if > 0; 0 (auto): 1 on at most 2 usable CPUs, else min(physical cores, 4)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: auto), got {threads}")
    if threads > 0:
        return threads
    cpus = usable_cpus()
    return 1 if cpus <= 2 else max(1, min(physical_cores(), cpus, 4))


def worker_threads(threads: int, local_workers: int | None) -> int:
    """Threads of one worker process of a scale-out build (Dask or Ray; ``flows/scaleout.py``):
    ``threads`` if > 0; auto (0) on a local cluster of ``local_workers`` processes: the usable
    CPUs shared among them (at least 1, at most 4), so N workers do not each start a pool as
    wide as the machine; auto on a remote cluster (``local_workers`` None): 0, resolved on the
    worker's own machine by :func:`set_process_threads`."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: auto), got {threads}")
    if threads > 0 or local_workers is None:
        return threads
    return max(1, min(usable_cpus() // max(1, local_workers), 4))


def set_process_threads(threads: int) -> int:
    """Set torch's intra-op (and, once, inter-op) threads, the OMP/MKL/OpenBLAS variables (read
    by pools started later, child processes included) and the pools already loaded (numpy's
    OpenBLAS, through threadpoolctl) to ``resolve_threads(threads)``; returns that number.
    Calling it again with the same number does nothing.

    Why the loaded pools too: numpy starts OpenBLAS when it is imported, before any command
    reads its settings, with one thread per CPU; after each threaded product (the dense
    search's ``vectors @ q``) its workers spin for a while before they sleep, on the core the
    KV decode would have had."""
    n = resolve_threads(threads)
    if _APPLIED.get("threads") == n:
        return n
    for name in ENV_VARS:
        os.environ[name] = str(n)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n)
    import torch

    torch.set_num_threads(n)
    if "interop" not in _APPLIED:
        try:  # allowed once per process, before any inter-op work started
            torch.set_num_interop_threads(n)
            _APPLIED["interop"] = n
        except RuntimeError:
            pass
    _APPLIED["threads"] = n
    return n


def apply_runtime(settings: Any, *, serving: bool) -> int:
    """A reading process's runtime settings (``schemas.settings.RuntimeSettings``): its
    threads (:func:`set_process_threads`, returned), its model forward
    (``inference.model.forward.set_default_forward``; ``serving``: ``eval``, not a one-shot
    ``query``), the device bytes its KV readers keep resident (``kv_resident_bytes``) and
    whether its index readers hold large tables in memory (serving only:
    ``storage.index.ann.keep_large_tables_in_memory``)."""
    from coinrag.inference.model.forward import set_default_forward
    from coinrag.inference.model.kv_transfer import set_resident_kv_bytes
    from coinrag.storage.index.ann import keep_large_tables_in_memory

    threads = set_process_threads(settings.threads)
    set_default_forward(settings.forward, serving=serving)
    set_resident_kv_bytes(settings.kv_resident_bytes)
    keep_large_tables_in_memory(serving)
    return threads
