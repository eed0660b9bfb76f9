"""Wrapper prefixes on a draft's keys: what a training wrapper puts in front of the draft's own names.

A draft saved from a wrapped module carries the wrapper's attribute path on every key:
``module.`` (DistributedDataParallel, FSDP1), ``_orig_mod.`` (``torch.compile``), a trainer's
``draft_model.`` (the draft inside its training module), nested as they were wrapped
(``module._orig_mod.``). Format tables add the ones their trainer writes (``strip_prefixes:``,
e.g. AngelSpec's DCP ``model_state.model.``).

Stripping is a rename of keys only: the bytes are never touched. A prefix is stripped when every
key carries it and the remainder matches the draft format better than the keys as stored; the
verb reports which one. A wrapper only some keys carry, whose stripping would make those keys
match, is refused (``prefix-partial``): it would mix two namings (and may make two keys one). A
prefix no table knows is not guessed: the draft stays refused, the message naming ``--strip-prefix P``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ..errors import InputError
from ..io.checkpoint import Checkpoint

# module.: DistributedDataParallel / FSDP1 wrappers; _orig_mod.: torch.compile's OptimizedModule;
# draft_model.: trainers that hold the draft as an attribute of their training module (AngelSpec's MTPModel)
WRAPPERS: tuple[str, ...] = ("module.", "_orig_mod.", "draft_model.")
SHOWN = 3  # keys named in a message


@dataclass(frozen=True)
class Unwrapped:
    """A draft with its keys as the format names them, and the prefix that was stripped ("" for none)."""

    ckpt: Checkpoint
    prefix: str = ""
    how: str = ""  # "known wrapper", "format <name>" or "--strip-prefix"

    def to_json(self) -> dict | None:
        return {"prefix": self.prefix, "how": self.how} if self.prefix else None


def peel(keys: Sequence[str], wrappers: Sequence[str]) -> list[str]:
    """Every prefix made of ``wrappers`` that all ``keys`` carry, shortest first (nested wrappers in turn)."""
    out: list[str] = []
    prefix = ""
    while keys:
        w = next((w for w in wrappers if all(k.startswith(prefix + w) for k in keys)), None)
        if w is None:
            return out
        prefix += w
        out.append(prefix)
    return out


def fit(keys: Iterable[str], prefix: str, known: Collection[str]) -> int:
    """How many of ``keys``, with ``prefix`` stripped, the format knows."""
    n = len(prefix)
    return sum(1 for k in keys if k[n:] in known)


def choose(keys: Sequence[str], known: Collection[str], wrappers: Sequence[str]) -> str:
    """The wrapper prefix whose stripping matches ``known`` best ("" when the keys fit best as stored)."""
    best, best_fit = "", fit(keys, "", known)
    for prefix in peel(keys, wrappers):
        f = fit(keys, prefix, known)
        if f > best_fit:
            best, best_fit = prefix, f
    return best


def unwrap(ckpt: Checkpoint, known: Collection[str], *, wrappers: Sequence[str] = WRAPPERS,
           explicit: str | None = None, origin: dict[str, str] | None = None) -> Unwrapped:
    """``ckpt`` with the wrapper prefix of its keys stripped (see the module docstring).

    ``known``: the keys the draft format expects. ``explicit``: ``--strip-prefix P``, stripped from
    every key whatever it is. ``origin``: wrapper -> how it is known (for the report).
    """
    keys = list(ckpt.tensors)
    if explicit is not None:
        _require_all(ckpt, keys, explicit)
        return Unwrapped(rename(ckpt, explicit), explicit, "--strip-prefix")
    prefix = choose(keys, known, wrappers)
    _refuse_partial(ckpt, keys, prefix, known, wrappers)
    if not prefix:
        _refuse_unknown(ckpt, keys, known)
        return Unwrapped(ckpt)
    hows = dict.fromkeys((origin or {}).get(w, "known wrapper") for w in _split(prefix, wrappers))
    return Unwrapped(rename(ckpt, prefix), prefix, ", ".join(hows))


def rename(ckpt: Checkpoint, prefix: str) -> Checkpoint:
    """``ckpt`` with ``prefix`` stripped from every key: references renamed, bytes untouched.

    Every key carries ``prefix`` (callers check), so no two keys become one. Headers and index
    still describe the files as stored.
    """
    n = len(prefix)
    tensors = {k[n:]: ref._replace(key=k[n:]) for k, ref in ckpt.tensors.items()}
    shard_keys = {name: [k[n:] for k in keys] for name, keys in ckpt.shard_keys.items()}
    return dataclasses.replace(ckpt, tensors=tensors, shard_keys=shard_keys)


def _split(prefix: str, wrappers: Sequence[str]) -> list[str]:
    """The wrappers ``prefix`` was peeled from, outermost first."""
    out = []
    while prefix:
        w = next(w for w in wrappers if prefix.startswith(w))
        out.append(w)
        prefix = prefix[len(w):]
    return out


def _require_all(ckpt: Checkpoint, keys: Sequence[str], prefix: str) -> None:
    """``--strip-prefix P``: every key must carry P."""
    without = [k for k in keys if not k.startswith(prefix)]
    if len(without) == len(keys):
        raise InputError(f"--strip-prefix {prefix!r}: no key of the draft starts with it (e.g. "
                         f"{', '.join(keys[:SHOWN])})", rule="draft-mismatch", path=ckpt.root)
    if without:
        raise _partial(ckpt, keys, "", prefix, without, "prefix")


def _refuse_partial(ckpt: Checkpoint, keys: Sequence[str], prefix: str, known: Collection[str],
                    wrappers: Sequence[str]) -> None:
    """A wrapper some keys carry after ``prefix`` and others do not, when stripping it would make those fit."""
    n = len(prefix)
    for w in wrappers:
        carriers = [k for k in keys if k[n:].startswith(w)]
        if carriers and len(carriers) < len(keys) and fit(carriers, prefix + w, known) > fit(carriers, prefix, known):
            raise _partial(ckpt, keys, prefix, w, [k for k in keys if not k[n:].startswith(w)], "wrapper prefix")


def _partial(ckpt: Checkpoint, keys: Sequence[str], outer: str, inner: str, without: list[str], what: str
             ) -> InputError:
    """``inner`` is carried (after the ``outer`` prefix every key carries) by some keys and not by ``without``."""
    prefix = outer + inner
    carriers = [k for k in keys if k.startswith(prefix)]
    names = {k[len(outer):]: k for k in keys}  # each key as it would be named without the inner prefix
    clash = [(k, names[k[len(prefix):]]) for k in carriers if k[len(prefix):] in names]
    collide = f"; stripping it would also make {clash[0][0]} and {clash[0][1]} one key" if clash else ""
    return InputError(f"{len(carriers)} of the draft's {len(keys)} keys carry the {what} {prefix!r} "
                      f"(e.g. {', '.join(carriers[:SHOWN]) or '-'}) and {len(without)} do not (e.g. "
                      f"{', '.join(without[:SHOWN])}){collide}; a prefix only some keys carry is not stripped: "
                      "save the draft from one module", rule="prefix-partial", path=ckpt.root)


def _refuse_unknown(ckpt: Checkpoint, keys: Sequence[str], known: Collection[str]) -> None:
    """Every key carries a prefix no table knows, and the remainder matches the format: name --strip-prefix."""
    prefix = suggest(keys, known)
    if prefix:
        raise InputError(f"every key of the draft starts with {prefix!r} (e.g. {keys[0]}), which is not a known "
                         f"wrapper prefix; after it the keys match the format. `--strip-prefix {prefix}` strips it "
                         "(a rename only, the bytes stay as they are)", rule="draft-mismatch", path=ckpt.root)


def suggest(keys: Sequence[str], known: Collection[str]) -> str | None:
    """The prefix, cut at a dot, that every key carries and whose stripping matches ``known`` best (None if none)."""
    if not keys:
        return None
    best, best_fit = None, fit(keys, "", known)
    first = keys[0]
    for i, ch in enumerate(first):
        if ch != ".":
            continue
        prefix = first[:i + 1]
        if not all(k.startswith(prefix) for k in keys):
            break
        f = fit(keys, prefix, known)
        if f > best_fit:
            best, best_fit = prefix, f
    return best
