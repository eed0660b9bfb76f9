"""Run a producer one worker thread ahead of its consumer.

numpy, torch, ``os.write`` and sha256 all release the GIL, so computing the next chunk
overlaps writing and hashing the previous one.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

DEPTH = 2  # chunks computed ahead (0: run inline)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


class Started:
    """``make()`` iterated by a worker thread started at once, ``depth`` items ahead of whoever iterates
    this later (``started``). ``close()`` stops the worker, whether or not iteration began."""

    def __init__(self, make: Callable[[], Iterable[Any]], depth: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        # the worker runs in the caller's context: settings made there (decoding threads) hold in it too
        self._worker = threading.Thread(target=contextvars.copy_context().run, args=(self._work, make),
                                        name="ckpt-prefetch", daemon=True)
        self._worker.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, make: Callable[[], Iterable[Any]]) -> None:
        try:
            for item in make():
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(_Failed(e))

    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                item = self._q.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._worker.join()


def started(make: Callable[[], Iterable[Any]], depth: int | None = None) -> Started:
    """``prefetched``, but the worker starts now rather than at the first ``next``: work on a tensor begins
    while the one before it is still being written. The caller must iterate it to the end or ``close()`` it."""
    return Started(make, DEPTH if depth is None else depth)


def prefetched(make: Callable[[], Iterable[Any]], depth: int | None = None) -> Iterator[Any]:
    """Iterate ``make()`` in a worker thread, ``depth`` items ahead of the consumer.

    Items must be fresh objects (the worker does not wait for the consumer to finish with
    one). Errors surface in the consumer; closing the generator early stops the worker.
    """
    depth = DEPTH if depth is None else depth
    if depth <= 0:
        yield from make()
        return
    yield from Started(make, depth)
