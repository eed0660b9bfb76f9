"""Computed tensors started before their turn: while one tensor is written, the next few decode.

A shard's tensors are written one after another; a checkpoint of many small quantized tensors would
otherwise decode each on its own (a tensor of two row bands keeps at most two cores busy). Recipes
marked ``Compute.ahead`` (they share no state with another recipe: decoding) are started early on
worker threads (``io.prefetch.started``), as many tensors ahead as there are decoding threads
(``--threads``; none with one thread, which then decodes one tensor at a time); memory stays at a
few chunks per started tensor. The bytes are the same: each tensor is still written whole, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..io.prefetch import Started, started
from ..parallel import decode_threads
from .plan import Compute, OutputTensor


class Lookahead:
    """``chunks(i)``: the chunks of ``tensors[i]``, started early when its recipe allows; ``close()`` stops
    whatever was started and not consumed (an error while writing)."""

    def __init__(self, tensors: list[OutputTensor], window: int | None = None) -> None:
        """``window``: tensors started ahead of the one being written (None: the decoding threads, 0 for one)."""
        self._tensors = tensors
        n = decode_threads()
        self._window = (n if n > 1 else 0) if window is None else window
        self._started: dict[int, Started] = {}
        self._next = 0  # first index not yet considered for starting

    def _fill(self, i: int) -> None:
        while self._next < len(self._tensors) and self._next <= i + self._window:
            r = self._tensors[self._next].recipe
            if isinstance(r, Compute) and r.ahead:
                self._started[self._next] = started(r.produce)
            self._next += 1

    def chunks(self, i: int) -> Iterable[Any] | None:
        """The started chunks of tensor ``i`` (None: run its recipe as usual)."""
        if not self._window:
            return None
        self._fill(i)
        return self._started.pop(i, None)

    def close(self) -> None:
        for s in self._started.values():
            s.close()
        self._started.clear()

    def __enter__(self) -> Lookahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookahead(tensors: list[OutputTensor], window: int | None = None) -> Lookahead:
    return Lookahead(tensors, window)


__all__ = ["Lookahead", "lookahead"]
