"""torch state dicts: ``pytorch_model.bin``, ``*.pt``, ``*.pth``, and ``pytorch_model-*.bin`` shards with their index.

``torch.save`` writes a zip archive: the pickled structure in ``<archive>/data.pkl`` and each storage as
an uncompressed record ``<archive>/data/<n>``. ``torch.load(weights_only=True, map_location="meta")``
runs torch's restricted unpickler (tensors, containers and plain values only; no code is run) and gives
each tensor's dtype, shape, strides and the offset of its storage record - the offsets torch's own
``mmap=True`` uses - without reading tensor data. A contiguous tensor is then a byte range of the file;
a non-contiguous one is loaded with ``torch.load(weights_only=True, mmap=True)`` and made contiguous when
first read. Legacy (torch < 1.6, non-zip) files are refused: they cannot be read without loading them whole.
"""

from __future__ import annotations

import pickle
import re
import struct
import threading
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import InputError
from ..safetensors_io import LocalFile, Segment, read_bytes
from .base import (
    TORCH_SUFFIXES,
    Confine,
    FileSpans,
    LoadedTensor,
    RangeReader,
    ReadIndex,
    Tensor,
    TensorCache,
    WeightSet,
    build_weight_set,
    torch_dtype_name,
)

BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# Where training scripts put the model's state dict inside a larger checkpoint dict (Lightning and timm:
# state_dict, torchtune and many scripts: model, DeepSpeed: module, the PyTorch tutorials: model_state_dict).
WRAPPERS = ("state_dict", "model", "module", "model_state_dict")
# Files trainers keep beside the weights, with the same suffixes: never the draft.
_SIDE_FILES = re.compile(r"training_args\.bin|(optimizer|scheduler|lr_scheduler|scaler|rng)[\w.-]*\.(pt|pth|bin)")
_ZIP_MAGIC = b"PK\x03\x04"


def find_torch_files(d: Path) -> list[str]:
    """The torch weight files of ``d``: its bin index, its ``pytorch_model.bin``, or every other candidate."""
    if (d / BIN_INDEX).is_file():
        return [BIN_INDEX]
    if (d / BIN_SINGLE).is_file():
        return [BIN_SINGLE]
    return sorted(p.name for p in d.iterdir() if p.suffix in TORCH_SUFFIXES and p.is_file()
                  and not _SIDE_FILES.fullmatch(p.name))


def detect(d: Path) -> str | None:
    names = find_torch_files(d)
    return f"torch files ({', '.join(names[:3])})" if names else None


def read_torch(d: Path, confine: Confine, read_index: ReadIndex, *, only: str | None = None) -> WeightSet:
    """Every tensor of the state dict(s) in ``d`` (or of its file ``only``)."""
    consumed: set[str] = set()
    wanted: dict[str, set[str] | None] = {}  # file -> the keys the index assigns to it (None: all)
    names = [only] if only is not None else find_torch_files(d)
    if names == [BIN_INDEX]:
        consumed.add(BIN_INDEX)
        for key, shard in read_index(confine(BIN_INDEX))["weight_map"].items():
            keys = wanted.setdefault(shard, set())
            keys.add(key)
    elif len(names) == 1:
        wanted[names[0]] = None
    elif not names:
        raise InputError("no torch weight files (.bin, .pt, .pth)", rule="no-weights", path=str(d))
    else:
        raise InputError(f"several torch files and no {BIN_INDEX}: {', '.join(names)}; pass the file to read",
                         rule="ambiguous-weights", path=str(d))
    cache = TensorCache()
    notes: list[str] = []
    found: dict[str, list[Tensor]] = {}
    opened: dict[str, list[LocalFile]] = {}
    for name in sorted(wanted):
        path = confine(name)
        if not path.is_file():
            raise InputError(f"{BIN_INDEX} names {name!r}, which does not exist", rule="missing-shard", path=str(d))
        src, tensors = _read_file(path, cache, notes)
        opened[name] = [src]
        found[name] = _indexed(tensors, wanted[name], name, str(d / BIN_INDEX), notes)
    return build_weight_set("torch", found, opened, cache, notes, consumed)




def _indexed(tensors: list[Tensor], keys: set[str] | None, name: str, index_path: str,
             notes: list[str]) -> list[Tensor]:
    """The tensors of one shard the index assigns to it (as for safetensors, the index decides)."""
    if keys is None:
        return tensors
    held = {t.key for t in tensors}
    missing = sorted(keys - held)
    if missing:
        raise InputError(f"index maps {missing[0]!r} to {name}, which does not hold it"
                         + (f" ({len(missing) - 1} more)" if len(missing) > 1 else ""), rule="index-key-missing",
                         path=index_path)
    if len(held) > len(keys):
        notes.append(f"{name}: {len(held) - len(keys)} tensors not in {BIN_INDEX} were ignored")
    return [t for t in tensors if t.key in keys]


def _read_file(path: Path, cache: TensorCache, notes: list[str]) -> tuple[LocalFile, list[Tensor]]:
    """One torch file: its tensors in file order (byte ranges where possible), and the open file they read."""
    src = LocalFile(path)
    where = src.name
    if bytes(_head(src)) != _ZIP_MAGIC:
        raise InputError("not a zip-format torch file (a legacy torch < 1.6 save, or not torch at all): it cannot "
                         "be read without loading it whole; re-save it with a current torch", rule="legacy-torch-file",
                         path=where)
    state, wrapper = flat_state_dict(load_torch(str(path), where, map_location="meta"), where)
    if wrapper is not None:
        notes.append(f"{path.name}: took the state dict under {wrapper!r}, ignored the rest")
    records = stored_records(src, 0, src.size)
    mapped = _MmapState(path, where, wrapper)
    placed: list[tuple[int, Tensor]] = []
    for key, t in state.items():
        dtype = check_tensor(t, key, where)
        shape = tuple(t.shape)
        span = records.span(t)
        part = FileSpans([Segment(src, *span)]) if span is not None else \
            LoadedTensor(lambda k=key: mapped.tensor(k), dtype, shape, cache, f"{where}: {key}")
        placed.append((span[0] if span is not None else src.size, Tensor(key, dtype, shape, part)))
    placed.sort(key=lambda p: p[0])  # file order: byte copies of neighbours coalesce
    return src, [t for _, t in placed]


def _head(src: LocalFile) -> bytearray:
    buf = bytearray(min(4, src.size))
    src.readinto(0, memoryview(buf))
    return buf


# ---------------------------------------------------------------------------
# torch.load, always with weights_only


def load_torch(f, where: str, **kwargs):
    """``torch.load(f, weights_only=True, **kwargs)``; InputError naming the file when torch refuses or fails."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice to turn weights_only off is not ours to give
            return torch.load(f, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise InputError(f"torch.load(weights_only=True) refuses it: {_reason(e)}", rule="unsafe-pickle",
                         path=where) from None
    except Exception as e:  # a corrupt or hostile archive can fail anywhere inside torch
        raise InputError(f"torch cannot read it: {_reason(e)}", rule="torch-file", path=where) from None


def _reason(e: Exception) -> str:
    """The specific part of torch's message (not its generic advice)."""
    paras = [p.strip() for p in str(e).split("\n\n") if p.strip()]
    specific = [p for p in paras if not p.startswith(("Weights only load failed", "Check the documentation"))]
    return " ".join(specific or paras[-1:] or [type(e).__name__]).replace("\n", " ")


def flat_state_dict(obj: object, where: str) -> tuple[dict, str | None]:
    """``obj`` as a flat ``{name: tensor}`` dict, unwrapped from one of ``WRAPPERS``; InputError otherwise."""
    if _is_flat(obj):
        return obj, None
    if isinstance(obj, dict):
        held = [k for k in WRAPPERS if _is_flat(obj.get(k))]
        if len(held) == 1:
            return obj[held[0]], held[0]
    raise InputError(f"not a flat dict of tensors: {_describe(obj)} (a state dict is also taken from a dict's "
                     f"{' / '.join(WRAPPERS)} entry)", rule="not-a-state-dict", path=where)


def _is_flat(obj: object) -> bool:
    import torch

    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _describe(obj: object) -> str:
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    if not obj:
        return "an empty dict"
    items = [f"{k!r:.60}: {type(v).__name__}" for k, v in list(obj.items())[:5]]
    return "a dict {" + ", ".join(items) + (", ..." if len(obj) > 5 else "") + "}"


def check_tensor(t, key: str, where: str) -> str:
    """The safetensors dtype of a dense tensor; InputError for what safetensors cannot hold."""
    import torch

    kind = ("quantized" if t.is_quantized else "nested" if t.is_nested else
            f"{t.layout}".removeprefix("torch.") if t.layout != torch.strided else None)
    if kind is not None:
        raise InputError(f"tensor {key!r} is a {kind} tensor; only dense tensors can be stored",
                         rule="unsupported-tensor", path=where, key=key)
    return torch_dtype_name(t.dtype, where, key)


class _MmapState:
    """The file through ``torch.load(weights_only=True, mmap=True)``, opened on first need.

    Mapped, not read: a tensor's pages are touched only when it is made contiguous.
    """

    def __init__(self, path: Path, where: str, wrapper: str | None) -> None:
        self.path, self.where, self.wrapper = path, where, wrapper
        self._state: dict | None = None
        self._lock = threading.Lock()

    def tensor(self, key: str):
        with self._lock:
            if self._state is None:
                obj = load_torch(str(self.path), self.where, mmap=True, map_location="cpu")
                self._state = obj[self.wrapper] if self.wrapper else obj
        return self._state[key]


# ---------------------------------------------------------------------------
# Storage records of a torch.save archive


@dataclass
class StoredRecords:
    """The uncompressed storage records of a torch.save archive: data offset (in the archive) -> size."""

    sizes: dict[int, int]
    little_endian: bool
    base: int = 0  # where the archive starts in its file

    def storage(self, t) -> tuple[int, int] | None:
        """(file offset, length) of meta tensor ``t``'s whole storage, when it is a plain little-endian record."""
        storage = t.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)  # set by torch.load for meta tensors
        if not self.little_endian or offset is None or self.sizes.get(offset) != storage.nbytes():
            return None  # not a record we could check: let torch load it
        return self.base + offset, storage.nbytes()

    def span(self, t) -> tuple[int, int] | None:
        """(file offset, length) of meta tensor ``t``'s bytes when they lie as safetensors stores them."""
        whole = self.storage(t) if t.is_contiguous() else None
        start, length = t.storage_offset() * t.element_size(), t.numel() * t.element_size()
        if whole is None or start + length > whole[1]:
            return None
        return whole[0] + start, length


def read_stored(src, t, records: StoredRecords):
    """Meta tensor ``t`` with its storage read from ``src`` (one copy of it); None when not a plain record.

    What ``torch.load`` does, without the second copy it makes of each record read from a file object.
    """
    import torch

    whole = records.storage(t)
    if whole is None:
        return None
    data = torch.empty(whole[1], dtype=torch.uint8)
    src.readinto(whole[0], memoryview(data.numpy()))
    try:
        return data.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    except RuntimeError:  # strides reaching past the storage: torch.load refuses those too
        return None


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


def stored_records(src, base: int, length: int) -> StoredRecords:
    """Read the zip directory of the archive at ``src[base:base + length]`` (never its data)."""
    try:
        sizes: dict[int, int] = {}
        little = True  # torch's default for archives without a byteorder record
        for info in zipfile.ZipFile(RangeReader(src, base, length)).infolist():
            parts = info.filename.split("/")
            stored = info.compress_type == zipfile.ZIP_STORED
            if stored and parts[-1] == "byteorder" and info.file_size <= 16:
                little = bytes(read_bytes(src, base + _data_offset(src, base, info), info.file_size)) == b"little"
            elif stored and len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit():
                sizes[_data_offset(src, base, info)] = info.file_size
        return StoredRecords(sizes, little, base)
    except (zipfile.BadZipFile, InputError, OSError, ValueError, EOFError, struct.error):
        return StoredRecords({}, False, base)  # torch read it; its bytes will come through torch too


def _data_offset(src, base: int, info: zipfile.ZipInfo) -> int:
    """Where a record's data starts in the archive: after its local header (CRCs are not needed for that)."""
    magic, name_len, extra_len = _LOCAL_HEADER.unpack(read_bytes(src, base + info.header_offset, _LOCAL_HEADER.size))
    if magic != _ZIP_MAGIC:
        raise ValueError(f"no local header for {info.filename}")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
