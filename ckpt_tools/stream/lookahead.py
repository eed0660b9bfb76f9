"""Computed tensors decoded before their turn, on the decoding pool: while one tensor is written, the next few decode.

A shard's tensors are written one after another. A checkpoint of many small quantized tensors (a
tensor of two row bands keeps at most two cores busy, and its fixed costs are paid one tensor at a
time) is decoded across tensors instead: recipes marked ``Compute.ahead`` (they share no state with
another recipe: decoding) of at most ``SMALL`` bytes are handed whole to the pool of ``--threads``
decoding threads (``parallel.submit``), up to ``window`` tensors ahead of the one being written (the
decoding threads: one with ``--threads 1``, which then decodes the next tensor while this one is
written) and no more than ``BUDGET`` bytes of finished tensors held at once. A task decodes its tensor
inline, start to end, into memory; the writer takes the finished chunks in order. Larger tensors stream
as their recipe does (their bands are decoded on the pool). The bytes are the same: each tensor is still
written whole, in order, from its own recipe's chunks.

Memory: at most ``window`` finished small tensors and ``BUDGET`` bytes beside the one being written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from ..parallel import decode_threads, submit
from .plan import Compute, OutputTensor

SMALL = 16 << 20  # tensors up to this many bytes are decoded whole on a pool thread
BUDGET = 64 << 20  # bytes of tensors decoded ahead and not yet written, at most


def _whole(r: Compute) -> list[Any]:
    """Every chunk of a recipe, computed on this (pool) thread."""
    return list(r.produce())


class Lookahead:
    """``chunks(i)``: the chunks of ``tensors[i]``, decoded early when its recipe allows; ``close()`` cancels
    whatever was submitted and not consumed (an error while writing) and waits for the running ones."""

    def __init__(self, tensors: list[OutputTensor], window: int | None = None, budget: int = BUDGET,
                 small: int = SMALL) -> None:
        """``window``: tensors decoded ahead of the one being written (None: the decoding threads; 0: none)."""
        self._tensors = tensors
        self._threads = decode_threads()
        self._window = self._threads if window is None else window
        self._budget, self._small = budget, min(small, budget)
        self._pending: dict[int, Future[list[Any]]] = {}
        self._held = 0  # bytes of the pending tensors
        self._next = 0  # first index not yet considered

    def _eligible(self, t: OutputTensor) -> bool:
        r = t.recipe
        return isinstance(r, Compute) and r.ahead and t.nbytes <= self._small

    def _fill(self, i: int) -> None:
        self._next = max(self._next, i)
        while self._next < len(self._tensors) and len(self._pending) < self._window:
            t = self._tensors[self._next]
            if self._eligible(t):
                if self._pending and self._held + t.nbytes > self._budget:
                    return  # over budget: submitted once the writer has taken earlier ones
                assert isinstance(t.recipe, Compute)
                self._pending[self._next] = submit(_whole, t.recipe, threads=self._threads)
                self._held += t.nbytes
            self._next += 1

    def chunks(self, i: int) -> Iterable[Any] | None:
        """The chunks of tensor ``i`` decoded ahead (None: run its recipe as usual). Tensors are asked for
        in order; a decoding error is raised here, when the writer reaches the tensor."""
        if not self._window:
            return None
        self._fill(i)
        f = self._pending.pop(i, None)
        if f is None:
            return None
        self._held -= self._tensors[i].nbytes
        self._fill(i + 1)  # a slot is free: keep the pool busy while this one is waited for and written
        return f.result()

    def close(self) -> None:
        for f in self._pending.values():
            f.cancel()
        for f in self._pending.values():
            with contextlib.suppress(BaseException):
                f.result()
        self._pending.clear()
        self._held = 0

    def __enter__(self) -> Lookahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookahead(tensors: list[OutputTensor], window: int | None = None) -> Lookahead:
    return Lookahead(tensors, window)


__all__ = ["BUDGET", "SMALL", "Lookahead", "lookahead"]
