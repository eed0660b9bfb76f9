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


def prefetched(make: Callable[[], Iterable[Any]], depth: int | None = None) -> Iterator[Any]:
    """Iterate ``make()`` in a worker thread, ``depth`` items ahead of the consumer.

    Items must be fresh objects (the worker does not wait for the consumer to finish with
    one). Errors surface in the consumer; closing the generator early stops the worker.
    """
    depth = DEPTH if depth is None else depth
    if depth <= 0:
        yield from make()
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in make():
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(_Failed(e))

    # the worker runs in the caller's context: settings made there (decoding threads) hold in it too
    worker = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="ckpt-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        worker.join()
