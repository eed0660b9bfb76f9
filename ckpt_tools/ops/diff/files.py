"""`ckpt diff` beyond the tensors: config.json as a JSON diff, and every other non-weight file.

Side files (generation_config.json, tokenizer files, chat templates, hf_quant_config.json, code,
README...: ``Checkpoint.files``) are compared by sha256; a changed ``.json`` file also gets a JSON
diff (``json_diff``). A difference in config.json or a side file is a difference like a tensor's.

Not counted, listed only (``counted: false``): this tool's own records, ``ckpt_manifest.json``
and the ``*-report.json`` files, which hold commands, times and input fingerprints and so differ
between any two runs. The index is not compared as a file: which tensors it maps, and where,
is what the tensor comparison covers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import CkptError, InputError
from ...io.artefacts import MANIFEST_NAME
from ...io.checkpoint import Checkpoint
from .json_diff import json_diff

OWN_FILES = (MANIFEST_NAME, "stitch-report.json", "graft-report.json")
JSON_DIFF_LIMIT = 4 << 20  # a larger changed .json file (a tokenizer) is compared by digest only
CONFIG = "config.json"


@dataclass
class FileDiff:
    name: str
    status: str  # unchanged | changed | added | removed
    sha256_a: str | None = None
    sha256_b: str | None = None
    changes: list[dict] | None = None  # the JSON diff of a changed .json file
    counted: bool = True  # False: this tool's own records (listed, never a difference)
    note: str | None = None  # why a changed .json file has no JSON diff

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and not (k == "counted" and v)}


@dataclass
class ConfigDiff:
    status: str  # unchanged | changed | added | removed | absent (neither side has one) | not-compared
    changes: list[dict] = field(default_factory=list)
    note: str | None = None  # why not compared

    def to_json(self) -> dict:
        return {"status": self.status, "changes": self.changes, **({"note": self.note} if self.note else {})}


def weights_only(ckpt: Checkpoint) -> bool:
    """Weights and nothing else: no config.json and no other file (a state dict in memory, a trainer's
    bare weights file). Such a side is compared by its tensors only: a config or tokenizer it never had
    is not a difference."""
    return not ckpt.config_present and not ckpt.files and not any(_has(ckpt, n) for n in OWN_FILES)


def config_diff(a: Checkpoint, b: Checkpoint) -> ConfigDiff:
    """config.json of ``a`` vs ``b`` (as parsed: key order and whitespace are not differences)."""
    bare = [side for side, c in (("a", a), ("b", b)) if weights_only(c)]
    if bare:
        return ConfigDiff("not-compared", note=f"side {' and '.join(bare)} holds weights only (no config.json, no "
                                               "other file): compared by tensors")
    if not a.config_present and not b.config_present:
        return ConfigDiff("absent")
    if not b.config_present:
        return ConfigDiff("removed")
    if not a.config_present:
        return ConfigDiff("added")
    changes = json_diff(a.config.raw, b.config.raw)
    return ConfigDiff("changed" if changes else "unchanged", changes)


def file_diffs(a: Checkpoint, b: Checkpoint) -> list[FileDiff]:
    """Every non-weight file of either side (config.json and the index excepted), ours listed last; none
    when a side holds weights only."""
    if weights_only(a) or weights_only(b):
        return []
    return ([_one(a, b, name, counted=True) for name in sorted(set(a.files) | set(b.files))]
            + [_one(a, b, name, counted=False) for name in OWN_FILES if _has(a, name) or _has(b, name)])


def _one(a: Checkpoint, b: Checkpoint, name: str, *, counted: bool) -> FileDiff:
    da, db = _digest(a, name), _digest(b, name)
    status = ("added" if da is None else "removed" if db is None else "unchanged" if da == db else "changed")
    d = FileDiff(name, status, da, db, counted=counted)
    if status == "changed" and counted and name.lower().endswith(".json"):
        ja, jb = _json(a, name), _json(b, name)
        if isinstance(ja, str) or isinstance(jb, str):
            d.note = ja if isinstance(ja, str) else jb
        else:
            d.changes = json_diff(ja[0], jb[0])
            if not d.changes:
                d.note = "the same JSON, written differently (whitespace or key order)"
    return d


def _has(ckpt: Checkpoint, name: str) -> bool:
    if ckpt.local_dir is not None:
        return (ckpt.local_dir / name).is_file()
    return name in (getattr(ckpt, "file_sizes", None) or {})


def _digest(ckpt: Checkpoint, name: str) -> str | None:
    """sha256 of the file's bytes; None when the side has no such file."""
    if not _has(ckpt, name):
        return None
    if ckpt.local_dir is not None:
        try:
            h = hashlib.sha256()  # in pieces (hashlib.file_digest is 3.11+; we support 3.10)
            with open(ckpt.local_dir / name, "rb") as f:
                for piece in iter(lambda: f.read(1 << 20), b""):
                    h.update(piece)
            return h.hexdigest()
        except OSError as e:
            raise InputError(f"cannot read {name}: {e.strerror or e}", rule="read-error",
                             path=str(ckpt.local_dir / name)) from None
    lfs = getattr(ckpt, "lfs_sha256", None) or {}
    return lfs[name] if name in lfs else hashlib.sha256(ckpt.read_file(name)).hexdigest()


def _json(ckpt: Checkpoint, name: str) -> tuple[Any] | str:
    """The parsed document (in a 1-tuple), or why there is none."""
    try:
        if ckpt.local_dir is not None:
            path = ckpt.local_dir / name
            if path.stat().st_size > JSON_DIFF_LIMIT:
                return f"over {JSON_DIFF_LIMIT >> 20} MiB: compared by digest only"
            data = path.read_bytes()
        else:
            data = ckpt.read_file(name)
        return (json.loads(data),)
    except (OSError, CkptError) as e:
        return f"not read: {e}"
    except (ValueError, RecursionError):
        return f"{name} is not valid JSON on one side: compared by digest only"
