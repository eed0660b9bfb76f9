"""`ckpt diff`: per-key comparison of two checkpoints, streaming and memory-bounded, and of their files.

Read-only: it never refuses a checkpoint it can read. Tensors are compared whatever the family
(unknown, MTP missing on one side...); config.json and the side files too (``files``). The
index rules of the consistency gate run on both sides and what they find is reported as a
problem, a difference like any other (exit 1): a shard left out of an index would otherwise
make its tensors "removed" without a word, or two broken sides "identical".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...io.checkpoint import Checkpoint
from ...model.formats import all_wrappers
from ...model.gate import check
from ...model.prefixes import choose, rename
from ...model.quant.codec import checkpoint_codec
from ...options import regex
from ...stream.progress import Progress

if TYPE_CHECKING:  # compare loads numpy: imported when a comparison runs, not with the report class
    from ..shared.compare import TensorDiff
    from .files import ConfigDiff, FileDiff


SAME_CONFIG = ("unchanged", "absent", "not-compared")  # config states that are no difference


@dataclass
class DiffReport:
    a: str
    b: str
    diffs: list[TensorDiff] = field(default_factory=list)
    allowed_invalid: list[dict] = field(default_factory=list)  # input problems let through by --allow-invalid
    readers: dict[str, dict] = field(default_factory=dict)  # side -> {reader, reader_notes}: how its weights were read
    config: ConfigDiff | None = None  # config.json: a JSON diff
    files: list[FileDiff] = field(default_factory=list)  # every other non-weight file, ours last (not counted)
    problems: list[dict] = field(default_factory=list)  # the index rules' findings, each with its side (a / b)

    @property
    def identical(self) -> bool:
        return (all(d.status == "unchanged" for d in self.diffs) and not self.problems
                and (self.config is None or self.config.status in SAME_CONFIG)
                and not self.changed_files())

    def totals(self) -> dict[str, int]:
        return dict(Counter(d.status for d in self.diffs))

    def changed_files(self) -> list[FileDiff]:
        """Side files that differ (our own records never count)."""
        return [f for f in self.files if f.counted and f.status != "unchanged"]

    def summary(self) -> str:
        """What differs, in one phrase: tensors by status, then config, files and problems."""
        parts = [f"{n} {status}" for status, n in sorted(self.totals().items()) if status != "unchanged"]
        if self.config is not None and self.config.status not in SAME_CONFIG:
            n = len(self.config.changes)
            parts.append(f"config.json {self.config.status}" + (f" ({n} key(s))" if n else ""))
        if self.changed_files():
            parts.append(f"{len(self.changed_files())} file(s) differ")
        if self.problems:
            parts.append(f"{len(self.problems)} input problem(s)")
        return ", ".join(parts) or "identical"

    def to_json(self, all_keys: bool = False) -> dict:
        """Stable keys: a, b, identical, totals (tensors by status), readers, tensors[]; then config
        {status, changes[]}, files[] (name, status, sha256_a/b, changes[] for .json, counted: false for
        this tool's own records), problems[] (rule, path, key, message, side)."""
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "totals": self.totals(),
            "readers": self.readers,
            "tensors": [d.to_json() for d in self.diffs if all_keys or d.status != "unchanged"],
            **({"allowed_invalid": self.allowed_invalid} if self.allowed_invalid else {}),
            "config": self.config.to_json() if self.config is not None else None,
            "files": [f.to_json() for f in self.files if all_keys or f.status != "unchanged"],
            "problems": self.problems,
        }


def diff(a: Checkpoint, b: Checkpoint, *, keys: str | None = None, stats: bool = False,
         dequant: bool = False, allow: frozenset[str] = frozenset(), progress: Progress | None = None) -> DiffReport:
    """Compare every tensor of ``a`` and ``b`` (optionally only keys matching ``keys``), their config.json
    and side files.

    Both sides go through the index rules of the consistency gate first; what they find is reported
    (``problems``), not refused, unless ``allow`` lets the rule through (``allowed_invalid``).
    ``progress``: the "comparing" phase, advanced by the bytes of each pair of tensors read.
    """
    from ..shared.compare import TensorDiff, compare, recipe_of
    from .files import config_diff, file_diffs

    pattern = regex("--keys", keys) if keys else None
    report = DiffReport(a.root, b.root)
    for side, c in (("a", a), ("b", b)):
        found, _ = check(c, scope="files")
        for p in found:
            (report.allowed_invalid if p.rule in allow else report.problems).append({**p.to_json(), "side": side})
    report.config = config_diff(a, b)
    report.files = file_diffs(a, b)
    a, b = _aligned(a, b, report)
    names = [k for k in sorted(set(a.tensors) | set(b.tensors)) if pattern is None or pattern.search(k)]
    both = [k for k in names if k in a.tensors and k in b.tensors]
    values = (_values(a), _values(b)) if dequant else None
    progress = progress or Progress()
    progress.phase("comparing", sum(a.tensors[k].nbytes + b.tensors[k].nbytes for k in both))
    for key in names:
        ra, rb = a.tensors.get(key), b.tensors.get(key)
        if ra is None:
            report.diffs.append(TensorDiff(key, "added", None, rb.dtype, None, list(rb.shape)))
            continue
        if rb is None:
            report.diffs.append(TensorDiff(key, "removed", ra.dtype, None, list(ra.shape), None))
            continue
        va, vb = (values[0](key), values[1](key)) if values else (None, None)
        # a quantized weight by the values its codec decodes (float32, no output rounding); stored alike on both
        # sides, equal values are unchanged (compared as float32 bytes)
        alike = va is not None and vb is not None and ra.dtype == rb.dtype
        sides = [(t.dtype, t.shape, t.recipe, None if alike else _f32) if t is not None else (
            r.dtype, r.shape, recipe_of(r), None) for t, r in ((va, ra), (vb, rb))]
        d = compare(key, *sides[0][:3], *sides[1][:3], stats=stats, finite=stats, decode_a=sides[0][3],
                    decode_b=sides[1][3])
        if va is not None or vb is not None:
            d.dtype_a, d.dtype_b, d.shape_a, d.shape_b = ra.dtype, rb.dtype, list(ra.shape), list(rb.shape)
            if ra.dtype != rb.dtype and d.status != "shape-changed":
                d.status = "dtype-changed"
        report.diffs.append(d)
        progress.advance(ra.nbytes + rb.nbytes)
    return report


def _aligned(a: Checkpoint, b: Checkpoint, report: DiffReport) -> tuple[Checkpoint, Checkpoint]:
    """Each side with a wrapper prefix stripped when every key carries it and the other side then matches
    better (a draft saved from a wrapped module vs the same draft unwrapped); the report says so."""
    wrappers = all_wrappers()
    out = []
    for side, this, other in (("a", a, b), ("b", b, a)):
        prefix = choose(list(this.tensors), other.tensors, wrappers)
        report.readers[side] = {"reader": this.reader, "reader_notes": list(this.reader_notes),
                                "prefix_stripped": prefix or None}
        out.append(rename(this, prefix) if prefix else this)
    return out[0], out[1]


def _values(ckpt: Checkpoint):
    """``key`` -> the float32 values of a quantized weight of ``ckpt`` (its codec's decoder), else None."""
    from ...model.quant.dequant import checkpoint_lookup, values_of

    codec, lookup = checkpoint_codec(ckpt), checkpoint_lookup(ckpt)
    return lambda key: values_of(ckpt, key, codec, lookup)


def _f32(buf, start: int, n: int):
    import numpy as np

    return np.frombuffer(buf, dtype=np.float32, count=n)
