"""Scales are values: every scale, global scale and zero point of every quantized module, read and checked.

A quantized weight decodes as ``(code - zero_point) * scale`` (``decode``): a NaN, Inf, zero or negative
scale gives weights no shape or dtype check sees, and a zero point outside the code range is no code.
Rule ``quant-scale-value`` (the one rule set, so validate, the gate and every verb): every companion a
scheme table gives the role ``scale``, ``global_scale`` or ``input_scale``, of a module whose weight the
same table stores, is finite and positive; every ``zero_point`` lies within the codes' range. A sparse
replica (zero bytes) has zero scales and is invalid like any other.

Cost: scales are a small part of the bytes (FP8 blocks 1/16384 of the weight, NVFP4 1/8). They are read
in one pass, per shard in offset order, in batches of at most ``BATCH_BYTES``, each checked with two
vectorised reductions on the raw bits (positive finite floats are a range of unsigned bit patterns); in a
failing batch one ``reduceat`` finds the tensors with a bad value, and only the first ``MAX_DETAILED``
are looked at one by one to name the tensor and the first bad index (the rest are counted).
"""

from __future__ import annotations

import os
import sys
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import add, attrgetter, ne
from typing import TYPE_CHECKING, Any

from ...errors import InputError
from ...io.safetensors_io import IO_STATS
from ..problem import Problem

if TYPE_CHECKING:
    from .schema import FormatDef, SchemeTable, TensorDef

RULE = "quant-scale-value"
DESCRIPTION = "a scale, global scale or zero point of a quantized module is NaN, Inf, zero, negative or out of range"
BATCH_BYTES = 32 << 20  # bytes read and checked at once (memory bound of the pass)
MAX_DETAILED = 100  # problems named one by one; the rest are counted in one more

# Positive finite values of each float format are exactly one range of unsigned bit patterns
# (sign clear, not zero, exponent not all ones): (unsigned view, lowest, highest) inclusive.
# (numpy dtypes as strings: a checkpoint without quantized modules never imports numpy)
_POSITIVE_FINITE: dict[str, tuple[str, int, int]] = {
    "F64": ("<u8", 1, 0x7FEFFFFFFFFFFFFF),
    "F32": ("<u4", 1, 0x7F7FFFFF),
    "BF16": ("<u2", 1, 0x7F7F),
    "F16": ("<u2", 1, 0x7BFF),
    "F8_E4M3": ("u1", 1, 0x7E),  # 0x7F is NaN (no Inf)
    "F8_E5M2": ("u1", 1, 0x7B),
    "F8_E8M0": ("u1", 0, 0xFE),  # 2**(e - 127): never zero nor negative; 0xFF is NaN
}
_E8M0 = ("u1", 0, 0xFE)  # a U8 scale the table reads as E8M0 (OCP MX); 0xFF is NaN or Inf
_INTS = {"I8": "i1", "U8": "u1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
_ROLES = ("scale", "global_scale", "input_scale", "zero_point")
_WHAT = {"scale": "scale", "global_scale": "global scale", "input_scale": "activation scale",
         "zero_point": "zero point", "kv_scale": "KV-cache scale"}
# what a bad value does, per role (a zero point's is said apart)
_EFFECT = {"input_scale": "activations would be divided by it",
           "kv_scale": "vLLM refuses a zero or NaN k_scale at load and silently replaces other bad values (a "
                       "negative pair by 1.0, a bad v_scale by k_scale)"}


@dataclass(frozen=True)
class _Kind:
    """How one companion's raw bits are judged."""

    role: str
    view: str  # numpy dtype the bytes are read as
    low: int  # inclusive range of the valid raw values
    high: int
    dtype: str  # safetensors dtype (for the value shown)
    encoding: str = "float"

    @property
    def itemsize(self) -> int:
        return int(self.view[-1])


# one piece read and checked: (TensorRef, byte offset inside the tensor, length, kind); tuples, not objects: a
# release has tens of thousands of scale tensors
_Piece = tuple


def _candidates(tables: list[SchemeTable]) -> dict[str, list[tuple[FormatDef, TensorDef]]]:
    """Last name component -> (format, companion) of every format that has a companion of that suffix."""
    out: dict[str, list[tuple[FormatDef, TensorDef]]] = {}
    for table in tables:
        for fmt in table.storage:
            for t in fmt.tensors:
                if t.role in _ROLES and "." not in t.suffix:
                    out.setdefault(t.suffix, []).append((fmt, t))
    return out


def _zero_range(fmt: FormatDef) -> tuple[int, int] | None:
    """The codes' range a zero point must lie in (integer codes of ``bits``), None when not integer codes."""
    d = fmt.decoder
    if d.codes != "int":
        return None
    if d.offset == 0:  # signed codes
        return -(1 << (d.bits - 1)), (1 << (d.bits - 1)) - 1
    return -d.offset, (1 << d.bits) - 1 - d.offset


def _kind(fmt: FormatDef, t: TensorDef, dtype: str) -> _Kind | None:
    if t.role == "zero_point":
        zr = _zero_range(fmt)
        packed = fmt.decoder.zero_point is not None and fmt.decoder.zero_point.packed != "none"
        if zr is None or dtype not in _INTS or packed:
            return None  # packed zero points decode into the range whatever the bits (zero_point_values)
        return _Kind("zero_point", _INTS[dtype], zr[0], zr[1], dtype, "int")
    if t.role == "scale" and t.suffix == fmt.decoder.scale.tensor and fmt.decoder.scale.encoding == "e8m0" \
            and dtype == "U8":
        return _Kind(t.role, *_E8M0, dtype, "e8m0")
    return positive_kind(t.role, dtype)  # None: a dtype read another way (a U8 activation scale), no value rule known


def positive_kind(role: str, dtype: str) -> _Kind | None:
    """How a value that must be finite and positive is judged from its raw bits in ``dtype`` (None: no float)."""
    return _Kind(role, *_POSITIVE_FINITE[dtype], dtype) if dtype in _POSITIVE_FINITE else None


def _declared_first(ckpt: Any) -> list[SchemeTable]:
    from .detect import detect_scheme
    from .tables import all_schemes

    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # quant-unknown: reported by its own rule
        scheme = None
    own = list(scheme.tables) if scheme is not None else []
    names = {t.scheme for t in own}
    return own + [t for t in all_schemes().values() if t.scheme not in names]


def companions(ckpt: Any, unknown: set[str] | frozenset[str] = frozenset()) -> list[tuple[Any, _Kind]]:
    """Every scale / global scale / activation scale / zero point tensor of a quantized module, with its rule."""
    tensors: Mapping[str, Any] = ckpt.tensors
    get = tensors.get
    # per companion suffix, each (format, companion) that has it, with what is asked of every key made once: the
    # weight's name, the dtypes allowed, and the kind per scale dtype (a few distinct ones)
    cands = {suffix: [(f".{fmt.weight.suffix}", fmt.weight.dtypes, t.dtypes, fmt, t, {}) for fmt, t in options]
             for suffix, options in _candidates(_declared_first(ckpt)).items()}
    out = []
    for key, ref in tensors.items():
        module, _, suffix = key.rpartition(".")
        options = cands.get(suffix)
        if options is None or key in unknown:
            continue
        dtype = ref.dtype
        for weight, weight_dtypes, dtypes, fmt, t, kinds in options:
            w = get(module + weight)
            if w is not None and w.dtype in weight_dtypes and dtype in dtypes:
                kind = kinds[dtype] if dtype in kinds else kinds.setdefault(dtype, _kind(fmt, t, dtype))
                if kind is not None:
                    out.append((ref, kind))
                break
    return out


# a batch: its kind, its tensors (one source, offset order), where each piece starts inside its tensor (None: at
# 0, whole tensors) and each piece's length; lists, not an object per piece: a release has 45,000 scale tensors
_Batch = tuple


def _pieces(refs: list[tuple[Any, _Kind]]) -> Iterator[_Batch]:
    """Batches of at most BATCH_BYTES of one kind (one piece may be a part of a large tensor), per local source in
    offset order (a remote one is left to the decoders' finite check)."""
    groups: dict[tuple[int, int], tuple[_Kind, list[Any]]] = {}
    for ref, kind in refs:  # kinds are shared objects (companions): grouped by identity, no hashing of fields
        at = (id(ref.source), id(kind))
        (groups.get(at) or groups.setdefault(at, (kind, [])))[1].append(ref)
    for kind, group in groups.values():
        if group[0].source.local_fd() is None:
            continue
        group.sort(key=_OFFSET)
        step = max(kind.itemsize, BATCH_BYTES // kind.itemsize * kind.itemsize)
        sizes = list(map(_NBYTES, group))
        starts = None  # whole tensors; a tensor larger than a batch is read in pieces of ``step``
        if max(sizes) > step:
            pieces = [(ref, at, min(step, n - at)) for ref, n in zip(group, sizes, strict=True)
                      for at in range(0, max(n, 1), step)]
            group, starts, sizes = (list(column) for column in zip(*pieces, strict=True))
        ends = list(accumulate(sizes))
        first = 0
        while first < len(group):  # each batch the longest run that fits (one piece at least)
            last = max(first + 1, bisect_right(ends, (ends[first - 1] if first else 0) + BATCH_BYTES, first))
            yield kind, group[first:last], starts and starts[first:last], sizes[first:last]
            first = last


_OFFSET = attrgetter("offset")
_NBYTES = attrgetter("nbytes")


def _read(refs: list[Any], starts: list[int] | None, lengths: list[int], into: bytearray
          ) -> tuple[memoryview, list[int]]:
    """The batch's bytes, one piece after another, read into the start of ``into`` (at least as long; one buffer
    for every batch: no fresh pages to zero and fault in per batch), and where each piece starts (and the end).

    Pieces lying end to end in the file lie end to end in ``into`` too: each such run is one read. The safetensors
    writer stores tensors by dtype, then name, so a shard's scales are a few runs (a release's 45,808 scales: a
    few hundred reads, not 45,808). A read-only mapping instead costs a page fault per scale, twice the CPU."""
    at = list(accumulate(lengths, initial=0))
    view = memoryview(into)[:at[-1]]
    source = refs[0].source
    fd = source.local_fd()
    offsets = list(map(_OFFSET, refs) if starts is None else map(add, map(_OFFSET, refs), starts))
    # where a run starts: the first piece, and each piece not starting where the one before it ends
    firsts = [0, *compress(range(1, len(offsets)), map(ne, offsets[1:], map(add, offsets, lengths)))]
    for first, last in zip(firsts, firsts[1:] + [len(offsets)], strict=True):
        part = view[at[first]:at[last]]
        if os.preadv(fd, [part], offsets[first]) != len(part):
            source.readinto(offsets[first], part)  # a short read: the source's own path and errors
    IO_STATS.add_read(at[-1])
    return view, at


# a small batch is judged without numpy (a small quantized checkpoint's read-only verbs then need none): its raw
# values through a memoryview of the native unsigned / signed type of the same size, where that is little-endian
_NATIVE = {"u1": "B", "<u2": "H", "<u4": "I", "<u8": "Q", "i1": "b", "<i2": "h", "<i4": "i", "<i8": "q"}
SMALL_VALUES = 1 << 16  # values judged one by one at most (a few ms)


def _fine_small(buf: bytearray | memoryview, kind: _Kind) -> bool:
    """True when ``buf`` is small and every value of it is in range; False when numpy must judge (or name) it."""
    code = _NATIVE.get(kind.view)
    if code is None or len(buf) > SMALL_VALUES * kind.itemsize or (kind.itemsize > 1 and sys.byteorder != "little"):
        return False
    values = memoryview(buf).cast(code)
    if values.itemsize != kind.itemsize:
        return False
    return not len(values) or (kind.low <= min(values) and max(values) <= kind.high)


def _bad(raw: Any, kind: _Kind) -> bool:
    return bool(raw.size) and (int(raw.min()) < kind.low or int(raw.max()) > kind.high)


def _failing(raw: Any, at: list[int], kind: _Kind) -> list[int]:
    """Indices of the pieces (starting at byte offsets ``at`` in ``raw``'s buffer) holding a value out of range."""
    import numpy as np

    bad = raw < kind.low
    bad |= raw > kind.high  # two masks of the batch at most (a quarter of its bytes each for F32 scales)
    starts = np.asarray(at, dtype=np.int64) // kind.itemsize
    pieces = np.flatnonzero(np.diff(starts, append=raw.size) > 0)  # empty pieces hold nothing to judge
    return pieces[np.logical_or.reduceat(bad, starts[pieces])].tolist() if pieces.size else []


def _value(raw: int, kind: _Kind) -> str:
    import numpy as np

    if kind.encoding == "int":
        return str(raw)
    from ...errors import PlanError
    from .decode import scale_values

    arr = np.array([raw], dtype=kind.view)
    try:
        v = float(scale_values(arr, kind.dtype if kind.encoding == "float" else "U8", kind.encoding)[0])
    except PlanError:  # a dtype the decoders do not read (F64 of a registered table): its bits
        return f"0x{raw:0{2 * kind.itemsize}x}"
    return repr(v) if np.isfinite(v) else ("NaN" if np.isnan(v) else ("-inf" if v < 0 else "inf"))


def _problem(p: _Piece, raw: Any, rule: str = RULE) -> Problem:
    import numpy as np

    ref, start, _, kind = p
    bad = np.flatnonzero((raw < kind.low) | (raw > kind.high))
    local = int(bad[0])
    flat = start // kind.itemsize + local
    index = list(np.unravel_index(flat, ref.shape)) if ref.shape else []
    value = _value(int(raw[local]), kind)
    what = _WHAT[kind.role]
    count = int(bad.size)
    more = f" ({count} such values in this part of it)" if count > 1 else ""
    if kind.role == "zero_point":
        why = f"outside the codes' range [{kind.low}, {kind.high}]"
        effect = "no code has that offset"
    else:
        why = "not finite and positive"
        effect = _EFFECT.get(kind.role, "the weights it scales decode to NaN, Inf or zero")
    return Problem(rule, ref.file, ref.key, f"{what} value {value} at index {[int(i) for i in index]} is {why}"
                                             f"{more}: {effect}")


def scale_value_problems(ckpt: Any, unknown: set[str] | frozenset[str] = frozenset(),
                         checked: frozenset[tuple[str, str, Any]] = frozenset()) -> list[Problem]:
    """``quant-scale-value`` for every quantized module of ``ckpt`` (trunk and MTP alike) stored in local files.

    A remote checkpoint (hf://, s3://) is read header-only by inspect, validate and the gate (a verb downloads
    the shards it needs, no more), so its scales are not read here: they are checked where they are decoded
    (``finite``: a NaN / Inf value is refused, naming the tensor and index). ``checked``: (file name, key, kind)
    already judged in the input they were copied from unchanged (``checked_copies``), not read again."""
    refs = companions(ckpt, unknown)
    if checked:
        refs = [(r, k) for r, k in refs if (os.path.basename(r.file), r.key, k) not in checked]
    return judge(refs)


def checked_copies(ckpt: Any, copies: Mapping[str, str]) -> frozenset[tuple[str, str, Any]]:
    """The scales of ``ckpt``, an input the gate judged and found valid (``scale_value_problems``), held by files
    copied or linked whole into an output (``copies``: input file path -> output file name), as (output file name,
    key, kind): the output's check skips exactly these (same bytes, same key, judged as the same kind). A remote
    input's scales are not read by its gate (``judge``): none of them is returned."""
    return frozenset((copies[r.file], r.key, k) for r, k in companions(ckpt)
                     if r.file in copies and r.source.local_fd() is not None)


def judge(refs: list[tuple[Any, _Kind]], rule: str = RULE) -> list[Problem]:
    """The problems of every (tensor, kind) in ``refs`` whose values are out of their kind's range, under ``rule``:
    one batched read of the local ones (a remote tensor is left to the decoders' finite check)."""
    out: list[Problem] = []
    seen: set[str] = set()
    extra = 0
    into = bytearray()
    for kind, batch, starts, lengths in _pieces(refs):
        if len(into) < sum(lengths):
            into = bytearray(sum(lengths))
        buf, at = _read(batch, starts, lengths, into)
        if _fine_small(buf, kind):
            continue
        import numpy as np

        whole = np.frombuffer(buf, dtype=kind.view)
        if not _bad(whole, kind):
            continue
        # the pieces holding a bad value, found in one pass over the batch (a replica's scales are all zero: every
        # piece fails, and only the first MAX_DETAILED are looked at one by one)
        for i in _failing(whole, at[:-1], kind):
            key = batch[i].key
            if key in seen:  # another piece of a tensor larger than a batch
                continue
            seen.add(key)
            if len(out) < MAX_DETAILED:
                p = (batch[i], 0 if starts is None else starts[i], lengths[i], kind)
                out.append(_problem(p, np.frombuffer(buf, dtype=kind.view, count=p[2] // kind.itemsize,
                                                     offset=at[i]), rule))
            else:
                extra += 1
    if extra:
        out.append(Problem(rule, None, None, f"{extra} more scale / zero point tensor(s) with values that are not "
                                             "finite and positive (or out of range)"))
    return out


def require_finite_scales(ckpt: Any, where: str | None = None) -> None:
    """Refuse (InputError) a checkpoint whose scales ``scale_value_problems`` finds wrong: for callers that do not
    run the rule set (probe loads through transformers)."""
    problems = scale_value_problems(ckpt)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{first.key}: {first.message}{more}", rule=RULE, path=first.path or where)
