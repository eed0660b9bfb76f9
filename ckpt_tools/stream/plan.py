"""Plans: every output tensor with its recipe, decided before a byte is written.

A recipe is one of a small vocabulary:

* ``CopyBytes`` - bytes as they are: one range (copy), several ranges laid end to
  end (concatenation along the first axis) or part of a range (slicing);
* ``Compute`` - anything that needs arithmetic (transpose, cast, dequantize,
  initialise), produced in chunks so that memory stays bounded by one tensor or
  one expert.

Ops build plans; the writer executes them and knows nothing about MTP.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .. import __version__
from ..dtypes import DTYPES
from ..io.safetensors_io import Header, Segment, coalesce
from .known_digests import KnownDigest

Chunk = Any  # bytes-like, numpy array or torch tensor; see numeric.as_bytes


@dataclass(slots=True)  # slots: one per copied tensor of a plan (92,000 for a release's trunk)
class CopyBytes:
    segments: list[Segment]
    op: str = "copy"  # copy | concat | slice, for display only

    def __post_init__(self) -> None:
        self.segments = coalesce(self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    def describe(self) -> dict:
        return {
            "op": self.op,
            "ranges": [{"file": s.source.name, "offset": s.offset, "length": s.length} for s in self.segments],
        }


@dataclass
class Compute:
    produce: Callable[[], Iterable[Chunk]]
    op: str  # e.g. "transpose", "cast", "dequant", "init"
    inputs: list[str] = field(default_factory=list)  # source keys, for display and manifests
    detail: dict = field(default_factory=dict)
    read_bytes: int = 0  # bytes of input this recipe reads (for plan totals)
    ahead: bool = False  # shares no state with another recipe: the writer may start it early (lookahead)

    def describe(self) -> dict:
        return {"op": self.op, "inputs": list(self.inputs), **self.detail}


Recipe = CopyBytes | Compute


class TensorCheck(Protocol):
    """Judges a tensor's bytes as they are written (``update`` per chunk, in order); ``finish`` raises the
    error that names the file, the key and the rule."""

    def update(self, data: memoryview, /) -> None: ...

    def finish(self) -> None: ...


@dataclass(slots=True)  # slots: a plan may hold one per tensor of a release (92,000)
class OutputTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    recipe: Recipe
    shard: str | None = None  # explicit output file; None lets the planner assign one
    meta: dict = field(default_factory=dict)  # carried into the manifest (source, role, layout, ...)
    # a check of the values as the writer writes them (graft's rule nonfinite on the source's bytes): a new
    # TensorCheck per write, fed every chunk in order; its finish() raises before the shard goes into place
    check: Callable[[], TensorCheck] | None = None

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].nbytes(math.prod(self.shape))


def copy_of(ref: Any, key: str | None = None, meta: dict | None = None, shard: str | None = None) -> OutputTensor:
    """``ref``'s bytes as they are, under ``key`` (its own by default); ``meta`` defaults to its source."""
    return OutputTensor(key or ref.key, ref.dtype, tuple(ref.shape), CopyBytes([ref.segment()]), shard,
                        meta=dict(meta) if meta is not None else {"source": [ref.key]})


@dataclass
class OutputFile:
    """A non-tensor file of the output: inline content, or a copy/link of a source file."""

    name: str
    content: bytes | None = None
    source: Path | None = None
    link: str = "copy"  # copy | reflink | hardlink | remote
    tensors: dict[str, int] = field(default_factory=dict)  # a copied shard: its indexed keys and their byte sizes
    remote: str | None = None  # link "remote": the file stays in this hub repo (hf://org/repo@rev/path)
    # a copied shard's header as read from its source (dtypes and shapes for the manifest of a remote file;
    # a local copy is described from the bytes that landed in the output)
    header: Header | None = None
    sha256: str | None = None  # the source file's whole-file sha256 when its host vouches for it (Hub LFS)
    known: KnownDigest | None = None  # its digest in its input's own manifest (known_digests): not hashed again


@dataclass
class ShardLayout:
    """A shard that keeps a given tensor order (a rewrite of a source shard).

    With ``header_bytes`` the source header is reproduced verbatim, so a shard whose
    tensors are unchanged comes out byte-identical to the source file.
    """

    order: list[str]
    header_bytes: bytes | None = None


@dataclass
class Plan:
    command: str
    tensors: list[OutputTensor]
    files: list[OutputFile] = field(default_factory=list)
    inputs: list[Path] = field(default_factory=list)  # never written to
    max_shard_size: int = 5 * 10**9
    shard_pattern: str = "model{suffix}.safetensors"
    manifest: dict = field(default_factory=dict)  # op-level provenance; the writer adds per-tensor hashes
    shard_layouts: dict[str, ShardLayout] = field(default_factory=dict)
    single_file_name: str = "model.safetensors"
    index_name: str = "model.safetensors.index.json"
    # role ("source", "verifier", "draft", "target") -> what the input was when planned (see fingerprint.py)
    fingerprints: dict[str, dict] = field(default_factory=dict)
    # parts of ``fingerprints`` that read tensor bytes (fingerprint.TakenTensors), computed only when it is written
    pending_fingerprints: list[Any] = field(default_factory=list, repr=False, compare=False)
    # (output file, key, kind) of scales copied unchanged from an input whose gate read them and found them valid:
    # the output check does not read them again (scale_values.checked_copies)
    checked_values: frozenset[tuple[str, str, Any]] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        schedule_reads(self.tensors)

    def settle_fingerprints(self, written: dict[str, str] | None = None) -> dict[str, dict]:
        """``fingerprints`` complete; ``written``: output tensor -> digest of its bytes as written (an input's
        tensor the output copies whole is not read again for its digest)."""
        by_range = {t.recipe.segments[0]: written[t.key] for t in self._copies() if t.key in (written or {})}
        for taken in self.pending_fingerprints:
            taken.settle(by_range)
        return self.fingerprints

    def planned_fingerprints(self) -> dict[str, dict]:
        """``fingerprints`` as the plan digest and the resume record hold them, before anything is written: the
        digest of the tensors taken from an input leaves out those copied whole (fingerprint.TakenTensors)."""
        copied = {t.recipe.segments[0] for t in self._copies()}
        planned = {id(taken.fp): taken.planned(copied) for taken in self.pending_fingerprints}
        return {role: planned.get(id(fp), fp) for role, fp in self.fingerprints.items()}

    def copied_digests(self) -> dict[str, str]:
        """Output tensor -> the digest of the input bytes it copies whole, read now, for the tensors taken from an
        input (``--resume`` reuses a finished shard only when its copies still hold them)."""
        copied = {t.recipe.segments[0] for t in self._copies()}
        by_range = {seg: d for taken in self.pending_fingerprints for seg, d in taken.copies(copied).items()}
        return {t.key: by_range[t.recipe.segments[0]] for t in self._copies() if t.recipe.segments[0] in by_range}

    def _copies(self) -> list[OutputTensor]:
        if not self.pending_fingerprints:  # nothing taken from an input by digest (a whole release: 92,000 tensors)
            return []
        return [t for t in self.tensors if isinstance(t.recipe, CopyBytes) and len(t.recipe.segments) == 1]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def shards(self) -> dict[str, list[OutputTensor]]:
        """Assign tensors to output files (explicit ``shard`` first, the rest greedily).

        Greedy assignment follows huggingface_hub's splitter: plan order, a new shard
        when the next tensor would exceed the limit, oversized tensors alone.
        Everything in one shard is written as ``model.safetensors`` without an index.
        """
        fixed: dict[str, list[OutputTensor]] = {}
        free: dict[str, OutputTensor] = {}
        for t in self.tensors:
            if t.shard is not None:
                fixed.setdefault(t.shard, []).append(t)
            else:
                free[t.key] = t
        if not free:
            return fixed
        if not fixed and sum(t.nbytes for t in free.values()) <= self.max_shard_size:
            return {self.single_file_name: list(free.values())}  # one file; no splitter needed
        from huggingface_hub import split_state_dict_into_shards_factory

        split = split_state_dict_into_shards_factory(
            free,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern=self.shard_pattern,
            max_shard_size=self.max_shard_size,
        )
        out = dict(fixed)
        if not fixed and len(split.filename_to_tensors) == 1:
            return {self.single_file_name: list(free.values())}
        for fname, keys in split.filename_to_tensors.items():
            if fname in out:
                raise ValueError(f"shard name {fname} is used twice")
            out[fname] = [free[k] for k in keys]
        return out

    def to_json(self) -> dict:
        shards = self.shards()
        where = {t.key: name for name, ts in shards.items() for t in ts}
        return {
            "command": self.command,
            "total_bytes": self.total_bytes,
            "shards": {name: sum(t.nbytes for t in ts) for name, ts in shards.items()},
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "shard": where[t.key],
                    "recipe": t.recipe.describe(),
                    **({"meta": t.meta} if t.meta else {}),
                }
                for t in self.tensors
            ],
            "files": [
                {"name": f.name, "from": str(f.source) if f.source else "generated", "link": f.link}
                for f in self.files
            ],
        }

    def write_json(self, path: str | Path) -> None:
        from ..jsonutil import write_json_file

        write_json_file(path, self.to_json(), "--plan-json", self.inputs)

    def digest(self) -> dict[str, str]:
        """sha256 of what this plan writes, part by part, and of the whole (``plan``).

        Covers every tensor (name, dtype, shape, shard, recipe with its options and source
        ranges), every file (generated content by its sha256), the op's manifest, the input
        fingerprints (``planned_fingerprints``) and the tool version: equal digests mean the same output from
        the same inputs. The command line is left out (it names -o and --resume).
        """
        body = self.to_json()
        files = body.pop("files")
        for entry, f in zip(files, self.files, strict=True):
            if f.content is not None:
                entry["sha256"] = hashlib.sha256(f.content).hexdigest()
        parts = {
            "tensors": {"shards": body["shards"], "tensors": body["tensors"], "single": self.single_file_name,
                        "index": self.index_name},
            "files": files,
            "manifest": self.manifest,
            "inputs": self.planned_fingerprints(),
            "tool": __version__,
        }
        out = {name: _sha256_json(v) for name, v in parts.items()}
        out["plan"] = _sha256_json(out)
        return out


def _sha256_json(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint_change(old: dict[str, dict], new: dict[str, dict]) -> tuple[str, str] | None:
    """The first difference between two plans' input fingerprints: (file or root, what changed), or None."""
    for role in sorted(set(old) | set(new)):
        a, b = old.get(role), new.get(role)
        if a is None or b is None:
            return (str((a or b or {}).get("root")), f"the {role} input was {'added' if a is None else 'removed'}")
        if a.get("root") != b.get("root"):
            return str(b.get("root")), f"the {role} is another checkpoint (was {a.get('root')})"
        root = str(b.get("root"))
        for group, what in (("files", "shard"), ("side_files", "file"), ("other_files", "file")):
            fa, fb = a.get(group) or {}, b.get(group) or {}
            for name in sorted(set(fa) | set(fb)):
                if fa.get(name) != fb.get(name):
                    return f"{root}/{name}", f"the {role}'s {what} {name} {_how(fa.get(name), fb.get(name))}"
        if a.get("tensors") != b.get("tensors"):
            n = (b.get("tensors") or {}).get("count", 0)
            return root, f"the {role}'s tensors changed ({n} tensor(s) taken; their digest differs)"
    return None


_FIELD_NAMES = {"mtime_ns": "modification time", "header_sha256": "header bytes", "sha256": "content sha256"}


def _how(a: object, b: object) -> str:
    if a is None:
        return "appeared"
    if b is None:
        return "is gone"
    if isinstance(a, dict) and isinstance(b, dict):
        fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return f"changed ({', '.join(_FIELD_NAMES.get(f, f) for f in fields)})"
    return "changed (sha256)"


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGT]B)\Z", re.IGNORECASE)
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's SIZE_UNITS


def parse_size(text: str | int) -> int:
    """Parse ``500MB`` / ``5GB`` / plain bytes; refuse more than the Hub's 50 GB file limit.

    Sizes are read as huggingface_hub's ``parse_size_to_int`` reads them; the plain forms (digits, a unit) here,
    without importing it (every writing verb parses its default ``--max-shard-size``), the rest by it."""
    from ..errors import UsageError

    if isinstance(text, int):
        size = text
    else:
        s = text.strip()
        plain = _SIZE.match(s)
        try:
            if s.isdigit():
                size = int(s)
            elif plain is not None:
                size = int(float(plain.group(1)) * _SIZE_UNITS[plain.group(2).upper()])
            else:
                from huggingface_hub.serialization._base import parse_size_to_int

                size = parse_size_to_int(s)
        except (ValueError, OverflowError) as e:  # OverflowError: "infGB"
            raise UsageError(f"--max-shard-size {text!r}: {e}") from None
    if size <= 0:
        raise UsageError(f"--max-shard-size must be positive, got {text!r}")
    if size > 50 * 10**9:
        raise UsageError(f"--max-shard-size {text!r} exceeds the Hub's 50GB per-file limit")
    return size


def schedule_reads(tensors: list[OutputTensor]) -> None:
    """Tell remote sources which byte ranges this plan copies, so they can fetch them coalesced and ahead.

    Nothing is downloaded here: a source starts fetching when the writer first copies a scheduled range.
    """
    ranges: dict[int, tuple[object, list[tuple[int, int]]]] = {}
    for t in tensors:
        if isinstance(t.recipe, CopyBytes):
            for seg in t.recipe.segments:
                if hasattr(seg.source, "schedule"):
                    ranges.setdefault(id(seg.source), (seg.source, []))[1].append((seg.offset, seg.offset + seg.length))
    for src, rs in ranges.values():
        src.schedule(rs)
