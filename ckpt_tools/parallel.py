"""Decoding on every core: row bands handed to a thread pool, results kept in order.

numpy's table lookups, multiplies and casts release the GIL, so N threads decode N bands at once.
Each band's bytes are read in order by the one thread that iterates (reads are sequential), decoded
on a pool thread, and yielded in band order: the output is the same bytes whatever the thread count.

``decode_threads()`` is the count in force: ``--threads N`` (``use_threads``), else every core this
process may run on (``os.sched_getaffinity``). One pool serves the process; each stream keeps at most
``threads`` bands in flight, so memory stays at a few bands per stream.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

from .arrays import keep_freed_memory
from .errors import UsageError

T = TypeVar("T")
R = TypeVar("R")

_THREADS: ContextVar[int | None] = ContextVar("ckpt_tools_decode_threads", default=None)
_IN_TASK: ContextVar[bool] = ContextVar("ckpt_tools_in_pool_task", default=False)  # threads a task starts inherit it
_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
_PREFIX = "ckpt-decode"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def check_threads(n: int | None) -> int | None:
    """``--threads``: None (every core) or a positive count, capped at the cores this process may use (more
    threads only contend; ``capped_threads`` says so on the command line)."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"--threads {n!r}: use a positive number of threads (default: every core)")
    return min(n, available_cores())


def capped_threads(n: int | None) -> tuple[int | None, str | None]:
    """``check_threads(n)`` and the message to show when it capped ``n`` (None when it did not)."""
    used = check_threads(n)
    if n is not None and used != n:
        return used, f"--threads {n}: capped at {used}, the CPUs this process may use"
    return used, None


def decode_threads() -> int:
    """Threads decoding bands now: the ``use_threads`` count, else every available core."""
    n = _THREADS.get()
    return n if n is not None else available_cores()


@contextlib.contextmanager
def use_threads(n: int | None) -> Iterator[None]:
    """Decode with ``n`` threads inside (None: every core)."""
    token = _THREADS.set(check_threads(n))
    try:
        yield
    finally:
        _THREADS.reset(token)


def _pool(n: int) -> ThreadPoolExecutor:
    """The process's decoding pool, with room for at least ``n`` threads (grown, never shrunk)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            keep_freed_memory()  # band-sized arrays on every thread from now on
        if _POOL is None or _POOL[0] < n:
            old = _POOL
            _POOL = (n, ThreadPoolExecutor(max_workers=n, thread_name_prefix=_PREFIX))
            if old is not None:
                old[1].shutdown(wait=False)
        return _POOL[1]


def in_pool() -> bool:
    """True on a pool thread, or a thread a pool task started in its context: work there runs inline (nothing
    a task runs waits on the pool, so tasks filling every worker cannot wait on each other)."""
    return _IN_TASK.get() or threading.current_thread().name.startswith(_PREFIX)


def _as_task(fn: Callable[..., R], *args: Any) -> R:
    _IN_TASK.set(True)  # in the task's own copy of the caller's context
    return fn(*args)


def submit(fn: Callable[..., R], *args: Any, threads: int | None = None) -> Future[R]:
    """``fn(*args)`` on the pool (``threads`` workers, default ``decode_threads()``), in the caller's context.
    Inside, ``ordered_map`` and the band decoders run inline: a task never waits on another task."""
    n = decode_threads() if threads is None else threads
    return _pool(max(1, n)).submit(contextvars.copy_context().run, _as_task, fn, *args)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> Iterator[R]:
    """``fn(item)`` for every item, computed on ``threads`` pool threads (default ``decode_threads()``),
    yielded in the items' order. ``items`` is iterated by the caller's thread only (sequential reads);
    at most ``threads`` results are pending at a time. One thread: computed inline, no pool."""
    n = decode_threads() if threads is None else threads
    if n <= 1 or in_pool():  # a pool thread never waits on the pool
        for item in items:
            yield fn(item)
        return
    pool = _pool(n)
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            if len(pending) >= n:
                yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:  # stopped early (an error, a closed consumer): nothing left running on our buffers
            f.cancel()
        for f in pending:
            with contextlib.suppress(BaseException):
                f.result()


def run_all(fn: Callable[[T], Any], items: Iterable[T], threads: int | None = None) -> None:
    """``fn(item)`` for every item on the pool (results written in place by ``fn``); errors re-raised."""
    for _ in ordered_map(fn, items, threads):
        pass


__all__ = ["available_cores", "check_threads", "decode_threads", "in_pool", "ordered_map", "run_all", "submit",
           "use_threads"]
