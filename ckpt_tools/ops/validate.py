"""`ckpt validate`: every problem a checkpoint has, each with its rule, file and key.

Three groups of checks run, and none stops at the first problem:

1. **Format** - every shard obeys the safetensors rules enforced by the strict reader
   (``safetensors_io``): ``header-length``, ``header-too-large``, ``header-json``,
   ``header-not-object``, ``duplicate-key``, ``metadata-not-string``, ``tensor-entry``,
   ``unknown-dtype``, ``bad-shape``, ``bad-offsets``, ``misaligned``, ``size-mismatch``,
   ``overlap``, ``offsets-not-contiguous``, ``past-end``, ``trailing-bytes``; a shard that
   cannot be opened is ``unreadable-shard``. ``metadata-format``: a ``__metadata__`` whose
   ``format`` is not pt/tf/flax/mlx (transformers 4.x ``load_state_dict`` refuses such a
   file; 5.x no longer looks); a file without ``__metadata__`` is fine.
2. **Index and files** - ``index-json`` (unparsable index), ``index-metadata`` (no
   ``metadata`` object: transformers reads ``index["metadata"]``), ``total-size``
   (``metadata.total_size`` differs from the sum of tensor bytes), ``shard-path`` (a shard
   name that is absolute, has ``..`` or links outside the checkpoint; the Hugging Face
   cache layout is allowed), ``missing-shard``, ``index-key-missing`` (the index maps a
   key to a shard that does not hold it), ``unindexed-key`` (a shard holds a key the index
   does not map to it), ``duplicate-tensor`` (a key held by two files - two indexed
   shards, or an indexed shard and a stale ``.safetensors`` file beside it),
   ``no-index`` (several ``.safetensors`` files and no index), ``single-file-shadows-index``
   (``model.safetensors`` next to an index that references other files: transformers
   loads the lone file and ignores the index).
3. **Config vs tensors** (needs config.json and a table): ``config-json``, ``no-config``,
   ``unknown-family``, ``ambiguous-family``, ``config-field`` - reported once, when the
   config cannot be read or matched; then ``mtp-missing`` and ``mtp-misshaped`` (the config
   declares MTP layers: every tensor of every depth, every expert, must be present with
   its shape), ``mtp-beyond`` (MTP tensors past the declared count, e.g. count 0 with MTP
   weights present), ``mtp-extra`` (unexpected tensors inside the MTP namespace),
   ``fp8-scale-missing`` / ``fp8-scale-shape`` (every F8 weight needs its
   ``weight_scale_inv`` of shape ``[.., ceil(rows/b0), ceil(cols/b1)]``, the block from
   ``quantization_config.weight_block_size``, else the table, else 128x128),
   ``quant-config`` (FP8 tensors present <=> ``quantization_config.quant_method: fp8``;
   other FP8-capable methods such as compressed-tensors use their own scale names and are
   accepted as they are), ``tied-head`` (``tie_word_embeddings`` ties the head while the
   checkpoint ships the head tensor the table drops when tied).

Public API: ``validate(path_or_checkpoint, arch=None) -> ValidationReport``. ``validate``
raises ``InputError`` (exit 3) only when the path is not a checkpoint at all.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, open_lenient
from ..dtypes import FP8_DTYPES
from ..errors import CkptError, InputError
from ..expert_layouts import scale_key, scale_shape
from ..expr import ExprError, render
from ..mtp import choose_table, open_mtp
from ..safetensors_io import LocalFile, read_header
from ..writer import PendingOutput

VALID_FORMATS = ("pt", "tf", "flax", "mlx")  # transformers load_state_dict's accepted __metadata__ formats
# Rules that come from opening files (used to recognise them on a strict, remote open).
FILE_RULES = frozenset({
    "header-length", "header-too-large", "header-json", "header-not-object", "duplicate-key",
    "metadata-not-string", "tensor-entry", "unknown-dtype", "bad-shape", "bad-offsets", "misaligned",
    "size-mismatch", "overlap", "offsets-not-contiguous", "past-end", "trailing-bytes", "unreadable-shard",
    "index-json", "shard-path", "missing-shard", "index-key-missing", "config-json",
})
MAX_LISTED = 20  # keys named in one message before "..."


@dataclass(frozen=True)
class Problem:
    rule: str
    path: str | None  # the file the problem is in
    key: str | None  # the tensor key, when the problem concerns one
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        key = f"{self.key}: " if self.key else ""
        return f"{where}[{self.rule}] {key}{self.message}"

    def to_json(self) -> dict:
        return {"rule": self.rule, "path": self.path, "key": self.key, "message": self.message}


@dataclass
class ValidationReport:
    root: str
    problems: list[Problem] = field(default_factory=list)
    family: str | None = None
    mtp_layers: int | None = None
    files_checked: int = 0
    tensors_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def rules(self) -> set[str]:
        return {p.rule for p in self.problems}

    def add(self, rule: str, path: str | os.PathLike | None, key: str | None, message: str) -> None:
        self.problems.append(Problem(rule, str(path) if path is not None else None, key, message))

    def to_json(self) -> dict:
        """Stable keys: path, ok, family, mtp_layers, checked{files,tensors}, counts{rule: n}, problems[]."""
        return {
            "path": self.root,
            "ok": self.ok,
            "family": self.family,
            "mtp_layers": self.mtp_layers,
            "checked": {"files": self.files_checked, "tensors": self.tensors_checked},
            "counts": dict(sorted(Counter(p.rule for p in self.problems).items())),
            "problems": [p.to_json() for p in self.problems],
        }


def bare_message(e: CkptError) -> str:
    """The message of ``e`` without the ``path: [rule]`` prefix CkptError adds."""
    s = str(e)
    if e.path:
        s = s.removeprefix(f"{e.path}: ")
        if e.rule:
            s = s.removeprefix(f"[{e.rule}]: ")
    elif e.rule:
        s = s.removeprefix(f"[{e.rule}] ")
    return s


def validate(path_or_checkpoint: str | os.PathLike | Checkpoint, arch: str | None = None, *,
             pending: PendingOutput | None = None) -> ValidationReport:
    """Check a checkpoint (a local path, an ``hf://`` URL or an opened ``Checkpoint``).

    ``pending``: an output the writer has not marked complete yet, checked as it will be.
    """
    unreadable: list[str] = []
    if isinstance(path_or_checkpoint, Checkpoint):
        ckpt = path_or_checkpoint
        report = ValidationReport(ckpt.root)
    elif "://" in str(path_or_checkpoint):
        report = ValidationReport(str(path_or_checkpoint))
        try:
            ckpt = Checkpoint.open(path_or_checkpoint)  # remote: strict, so the first file problem is all we get
        except InputError as e:
            if e.rule not in FILE_RULES:
                raise
            report.add(e.rule, e.path, None, bare_message(e))
            return report
    else:
        opened = open_lenient(path_or_checkpoint, index=pending.index if pending else None,
                              renamed=pending.renamed if pending else None)
        ckpt, unreadable = opened.ckpt, opened.unreadable
        report = ValidationReport(ckpt.root)
        remote = set((ckpt.manifest or {}).get("remote_files") or {})
        for e in opened.errors:
            if e.rule == "missing-shard" and e.path and os.path.basename(e.path) in remote:
                continue  # left on the Hub on purpose (stitch --link remote); push --base copies it
            report.add(e.rule or "unreadable", e.path, None, bare_message(e))
    try:
        report.files_checked = len(ckpt.headers) + len(unreadable)
        report.tensors_checked = sum(len(h.tensors) for h in ckpt.headers.values())
        _metadata_checks(ckpt, report)
        unknown = _index_checks(ckpt, unreadable, report)
        config_broken = "config-json" in report.rules()
        _config_checks(ckpt, arch, unknown, config_broken, report)
    finally:
        if ckpt is not path_or_checkpoint:
            ckpt.close()
    return report


# -- format -----------------------------------------------------------------------------


def _shard_path(ckpt: Checkpoint, name: str) -> str:
    src = ckpt.sources.get(name)
    if src is not None:
        return src.name
    return str(ckpt.local_dir / name) if ckpt.local_dir else f"{ckpt.root}/{name}"


def _metadata_checks(ckpt: Checkpoint, report: ValidationReport) -> None:
    for name, h in ckpt.headers.items():
        if h.metadata is not None and h.metadata.get("format") not in VALID_FORMATS:
            fmt = h.metadata.get("format")
            what = "has no 'format'" if fmt is None else f"has format {fmt!r}"
            report.add("metadata-format", _shard_path(ckpt, name), None,
                       f"__metadata__ {what}; transformers' load_state_dict (v4) refuses a format that is not one of "
                       f"{', '.join(VALID_FORMATS)} (write {{\"format\": \"pt\"}})")


# -- index and files ------------------------------------------------------------------------


def _index_checks(ckpt: Checkpoint, unreadable: list[str], report: ValidationReport) -> set[str]:
    """Index vs shards. Returns the keys whose presence cannot be known (their shard is unreadable)."""
    index_path = str(ckpt.local_dir / INDEX_NAME) if ckpt.local_dir else f"{ckpt.root}/{INDEX_NAME}"
    holders: dict[str, list[str]] = {}
    for name, keys in ckpt.shard_keys.items():
        for k in keys:
            holders.setdefault(k, []).append(name)
    for key, names in holders.items():
        if len(names) > 1:
            report.add("duplicate-tensor", _shard_path(ckpt, names[1]), key,
                       f"held by {len(names)} files: {', '.join(names)}; loaders that read every indexed file "
                       "(vLLM) load both copies")
    unknown: set[str] = set()
    index = ckpt.index
    if index is not None:
        wmap: dict[str, str] = index["weight_map"]
        unknown = {k for k, s in wmap.items() if s in unreadable}
        for key, shard in wmap.items():
            if shard in ckpt.headers and key not in ckpt.headers[shard].tensors:
                report.add("index-key-missing", index_path, key, f"index maps it to {shard}, which does not hold it")
        for name, keys in ckpt.shard_keys.items():
            for k in keys:
                mapped = wmap.get(k)
                if mapped is None:
                    report.add("unindexed-key", _shard_path(ckpt, name), k,
                               f"{name} holds it but the index does not list it; index-driven loaders never see it")
                elif mapped != name and mapped in ckpt.headers and k not in ckpt.headers[mapped].tensors:
                    report.add("unindexed-key", _shard_path(ckpt, name), k,
                               f"{name} holds it but the index maps it to {mapped}")
                # mapped elsewhere and held there too: a duplicate, reported above; mapped to a missing or
                # unreadable shard: reported with that shard
        meta = index.get("metadata")
        if not isinstance(meta, dict):
            report.add("index-metadata", index_path, None,
                       "index has no 'metadata' object (transformers reads index['metadata']); "
                       "write {\"metadata\": {\"total_size\": N}}")
        elif "total_size" in meta and not unreadable:
            total = sum(info.nbytes for h in ckpt.headers.values() for info in h.tensors.values())
            ts = meta["total_size"]
            if not isinstance(ts, int) or isinstance(ts, bool) or ts != total:
                report.add("total-size", index_path, None,
                           f"metadata.total_size is {ts!r} but the shards hold {total} tensor bytes")
    _stray_files(ckpt, holders, report)
    return unknown


def _stray_files(ckpt: Checkpoint, holders: dict[str, list[str]], report: ValidationReport) -> None:
    d = ckpt.local_dir
    if d is None or not Path(d).is_dir():
        return
    referenced = set(ckpt.headers) | (set(ckpt.index["weight_map"].values()) if ckpt.index else set())
    if ckpt.index is not None and (d / SINGLE_NAME).is_file() and referenced != {SINGLE_NAME}:
        report.add("single-file-shadows-index", d / SINGLE_NAME, None,
                   f"{SINGLE_NAME} sits next to {INDEX_NAME}, which references other files; transformers loads "
                   f"{SINGLE_NAME} alone and ignores the index")
    for p in sorted(Path(d).glob("*.safetensors")):
        if p.name in referenced:
            continue
        try:
            src = LocalFile(p)
            try:
                keys = read_header(src).tensors
            finally:
                src.close()
        except InputError:
            continue  # not part of the checkpoint; only stale copies of its tensors matter
        dups = sorted(k for k in keys if k in holders)
        for k in dups[:MAX_LISTED]:
            report.add("duplicate-tensor", p, k,
                       f"stale copy: also held by {holders[k][0]}; {p.name} is not in the index, but tools that "
                       "glob *.safetensors load both")


# -- config vs tensors --------------------------------------------------------------------


def _config_path(ckpt: Checkpoint) -> str:
    return str(ckpt.local_dir / "config.json") if ckpt.local_dir else f"{ckpt.root}/config.json"


def _count_field(view) -> str:
    """The config key that declares the MTP count (for messages)."""
    table = view.table
    var = table.config.get(table.mtp.count_field or "")
    if var is None:
        return "the MTP count"
    for k in var.keys:
        if view.ckpt.config.has(k):
            return k
    return var.keys[0]


def _draft_format(ckpt: Checkpoint) -> str | None:
    """The draft format of ``ckpt`` when it is a renamed draft (speculators, angelspec, ...), else None."""
    from ..formats import detect_format

    fmt = detect_format(ckpt.config.raw, ckpt.manifest)
    return None if fmt.rename == "native" else fmt.name


def _manifest_checks(ckpt: Checkpoint, unknown: set[str], report: ValidationReport) -> None:
    """Every tensor our manifest lists is present with the dtype and shape it was written with."""
    entries = (ckpt.manifest or {}).get("tensors")
    if not isinstance(entries, dict) or not ckpt.local_dir:
        return
    where = str(ckpt.local_dir / "ckpt_manifest.json")
    for key, entry in entries.items():
        if key in unknown or not isinstance(entry, dict):
            continue
        ref = ckpt.tensors.get(key)
        if ref is None:
            report.add("manifest-missing", where, key, "listed in ckpt_manifest.json but not in the checkpoint")
        elif entry.get("dtype") != ref.dtype or list(entry.get("shape", [])) != list(ref.shape):
            report.add("manifest-mismatch", ref.file, key,
                       f"is {ref.dtype} {list(ref.shape)}, the manifest says {entry.get('dtype')} {entry.get('shape')}")
    if (ckpt.manifest or {}).get("kind") == "mtp-draft":
        for key in sorted(set(ckpt.tensors) - set(entries)):
            report.add("manifest-extra", ckpt.tensors[key].file, key, "not listed in the draft's ckpt_manifest.json")


def _config_checks(ckpt: Checkpoint, arch: str | None, unknown: set[str], config_broken: bool,
                   report: ValidationReport) -> None:
    cfg = _config_path(ckpt)
    view = None
    table = None
    _manifest_checks(ckpt, unknown, report)
    draft_format = None if config_broken or arch else _draft_format(ckpt)
    if draft_format is not None:
        # a renamed draft has no architecture table of its own: its manifest is the reference
        report.family = (ckpt.manifest or {}).get("family")
        layers = (ckpt.manifest or {}).get("layers")
        report.mtp_layers = len(layers) if isinstance(layers, list) else None
        return
    if not config_broken:
        try:
            table = choose_table(ckpt, arch)
            view = open_mtp(ckpt, table)
        except CkptError as e:
            report.add(e.rule or "config", e.path if e.path and e.path != ckpt.root else cfg, None, bare_message(e))
    if view is not None:
        report.family, report.mtp_layers = view.table.family, view.count
        _mtp_checks(view, unknown, report)
        _tied_head(view, report)
    _fp8_checks(ckpt, table, view, unknown, None if config_broken or not ckpt.config_present else cfg, report)


def _mtp_checks(view, unknown: set[str], report: ValidationReport) -> None:
    ckpt = view.ckpt
    cfg = _config_path(ckpt)
    field_name = _count_field(view)
    declared = f"config declares {view.count} MTP layer(s) ({field_name}, {view.table.family})"
    for s in view.missing:
        if s.key in unknown:
            continue
        where = f"depth {s.depth}" if s.depth is not None else "shared by every depth"
        report.add("mtp-missing", cfg, s.key, f"{declared} but this {s.role} tensor {list(s.shape)} "
                                                    f"({where}) is missing")
    for s, actual in view.misshaped:
        if s.role == "scale":
            continue  # FP8 scales are checked for every weight below, with the config's block size
        report.add("mtp-misshaped", _file_of(ckpt, s.key), s.key,
                   f"shape {list(actual)}, but the {view.table.family} table expects {list(s.shape)}")
    for k in view.beyond:
        report.add("mtp-beyond", _file_of(ckpt, k), k,
                   f"{declared} but this tensor belongs to an MTP layer past that count; set {field_name} to "
                   "match the weights, or drop the tensors")
    for k in view.extra:
        report.add("mtp-extra", _file_of(ckpt, k), k,
                   f"inside the MTP namespace but not a tensor of the {view.table.family} table")


def _file_of(ckpt: Checkpoint, key: str) -> str | None:
    try:
        return ckpt.tensors[key].file
    except KeyError:
        return None


def _tied_head(view, report: ValidationReport) -> None:
    res = view.resolved
    head = res.table.shared.get("head")
    if head is None or head.when is None or "head" in res.shared:
        return
    try:
        key = render(head.key, res.env)
    except ExprError:
        return
    if key in view.ckpt.tensors:
        report.add("tied-head", _file_of(view.ckpt, key), key,
                   f"the config ties the head to the embedding (tie_word_embeddings), so loaders ignore this "
                   f"tensor; set tie_word_embeddings: false or drop {key}")


def _block_size(ckpt: Checkpoint, qc, view) -> tuple[int, int] | None:
    """Scale block (rows, cols); None means one per-tensor scale."""
    if isinstance(qc, dict) and "weight_block_size" in qc:
        b = qc["weight_block_size"]
        if b is None:
            return None
        if isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b):
            return (b[0], b[1])
    if view is not None:
        return view.resolved.block_size
    return (128, 128)


def _fp8_checks(ckpt: Checkpoint, table, view, unknown: set[str], cfg: str | None,
                report: ValidationReport) -> None:
    fp8 = sorted(k for k, r in ckpt.tensors.items() if r.dtype in FP8_DTYPES)
    qc = ckpt.config.get("quantization_config") if cfg else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if cfg is not None:
        if fp8 and method is None:
            report.add("quant-config", cfg, fp8[0],
                       f"{len(fp8)} FP8 tensor(s) (e.g. this one) but config.json has no quantization_config "
                       "with quant_method 'fp8'; loaders would read the FP8 bytes as the model dtype")
        elif method == "fp8" and not fp8 and not unknown:
            report.add("quant-config", cfg, None,
                       "quantization_config says quant_method 'fp8' but no tensor is FP8; remove quantization_config")
        if method not in (None, "fp8"):
            return  # another method (compressed-tensors, fbgemm_fp8, ...) names its scales its own way
    suffix = table.quantization.scale_suffix if table is not None and table.quantization else "weight_scale_inv"
    block = _block_size(ckpt, qc, view)
    for k in fp8:
        skey = scale_key(k, suffix)
        ref = ckpt.tensors[k]
        sref = ckpt.tensors.get(skey)
        if sref is None:
            if skey not in unknown:
                report.add("fp8-scale-missing", ref.file, k, f"{ref.dtype} weight without its {skey}")
            continue
        if block is None:
            ok = tuple(sref.shape) in ((), (1,))
            want = "[] (one per-tensor scale)"
        elif len(ref.shape) < 2:
            continue  # block scales are defined for matrices (and stacks of them) only
        else:
            want_shape = scale_shape(tuple(ref.shape), block)
            ok = tuple(sref.shape) == want_shape
            want = f"{list(want_shape)} (block {block[0]}x{block[1]} over {list(ref.shape)})"
        if not ok:
            report.add("fp8-scale-shape", sref.file, skey, f"shape {list(sref.shape)}, expected {want}")


def validate_output(path: str | os.PathLike, *, arch: str | None = None, pending: PendingOutput | None = None
                    ) -> dict:
    """Validate an output this tool is writing (the writer's check, before its completion marker).

    An invalid output is an output error (exit 4) with the first problem's rule.
    """
    from ..errors import OutputError

    report = validate(path, arch, pending=pending)
    if not report.ok:
        shown = "; ".join(str(p) for p in report.problems[:5])
        raise OutputError(f"the output failed validation ({len(report.problems)} problem(s)): {shown}",
                          rule=report.problems[0].rule, path=str(path))
    return {"ok": True, "problems": 0, "family": report.family}
