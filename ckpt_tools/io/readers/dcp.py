"""torch distributed checkpoints (DCP), read in one process, without a process group.

A DCP folder holds ``.metadata`` (a pickle of each key's dtype, shape and chunks), read through an
unpickler that resolves only DCP's metadata classes, torch dtypes, ``torch.Size`` and paths, and
``*.distcp`` files of ``torch.save`` archives. A tensor whose chunks split only its first axis is read
as byte ranges of those archives; any other is loaded on first read with
``torch.distributed.checkpoint.load`` (``no_dist=True``) for that one key, into the bounded cache.

Only model tensors are listed: non-tensor entries are never unpickled, optimizer and other training
state is ignored. A training step folder (AngelSpec's ``iter_0000100/``) is read through its
``model/`` sub-folder, a run's root through the step ``latest_checkpointed_iteration.txt`` names.
Keys are reported as stored; prefixes are the format layer's.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path

from ...dtypes import torch_dtype
from ...errors import InputError
from ..safetensors_io import LocalFile, Segment
from .base import (
    DCP_METADATA,
    Confine,
    Deferred,
    FileSpans,
    LoadedTensor,
    Part,
    RangeReader,
    Tensor,
    TensorCache,
    WeightSet,
    build_weight_set,
    check_dims,
    numel,
    tensor_nbytes,
    torch_dtype_name,
)
from .torch_state import load_torch, read_stored, stored_records

METADATA = DCP_METADATA
STEP_MODEL = "model"  # the model sub-folder of a training step
METADATA_LIMIT = 256 << 20  # .metadata is read whole; real ones are KBs to tens of MB
# First key components of training state saved beside the model in one DCP folder.
TRAINING_STATE = frozenset({"optim", "optimizer", "optim_state", "optimizer_state", "optimizers", "lr_scheduler",
                            "lr_scheduler_state", "lr_schedulers", "scheduler", "dataloader", "train_state", "rng"})
MAX_CHUNKS = 1 << 16  # chunks per tensor (one per rank and shard): far beyond any real run

_DCP = "torch.distributed.checkpoint"
_ALLOWED_GLOBALS = frozenset({
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                        "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.filesystem", "_StoragePrefix"),
    # torch < 2.2 kept TensorProperties here
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a lookup by name
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
})


LATEST = "latest_checkpointed_iteration.txt"  # a training run's root names its newest step (AngelSpec, Megatron)
STEP_FOLDER = "iter_{:07d}"


def latest_step(d: Path) -> Path | None:
    """The step folder a run root's ``latest_checkpointed_iteration.txt`` names, or None when ``d`` has none.

    The trainers that write it load the run from its root by that file, so a user passes the root too."""
    marker = d / LATEST
    if not marker.is_file():
        return None
    text = marker.read_bytes()[:64].decode("ascii", "replace").strip()
    if not text.isdigit():
        raise InputError(f"{LATEST} holds {text!r}, not a step number", rule="no-weights", path=str(marker))
    step = d / STEP_FOLDER.format(int(text))
    if not step.is_dir():
        raise InputError(f"{LATEST} names step {text}, but {step.name}/ is not here", rule="no-weights",
                         path=str(marker))
    return step


def find_dcp(d: Path) -> Path | None:
    """The DCP folder of ``d``: ``d`` itself, its ``model/`` sub-folder (a training step), or that of the step a
    run root's ``latest_checkpointed_iteration.txt`` names; None if none of them."""
    step = latest_step(d)
    for folder in (d, d / STEP_MODEL, *((step / STEP_MODEL,) if step is not None else ())):
        if (folder / METADATA).is_file():
            return folder
    return None


def detect(d: Path) -> str | None:
    folder = find_dcp(d)
    return None if folder is None else f"a DCP checkpoint ({folder.relative_to(d) if folder != d else METADATA})"


def read_dcp(d: Path, confine: Confine) -> WeightSet:
    """Every model tensor of the DCP checkpoint in ``d`` (a DCP folder or a training step folder)."""
    folder = find_dcp(d)
    if folder is None:
        raise InputError(f"no {METADATA} here or in {STEP_MODEL}/", rule="no-weights", path=str(d))
    prefix = "" if folder == d else folder.relative_to(d).as_posix() + "/"
    step = folder.parent if folder != d else d
    ignored = sorted(p.name + "/" * p.is_dir() for p in step.iterdir()
                     if p.name != STEP_MODEL and not p.name.startswith("."))
    notes = [] if folder == d else [f"read {prefix}; ignored " + ", ".join(ignored)]
    if step != d:
        notes.insert(0, f"{LATEST} names {step.name}/: the run's newest step")
    reader = _Folder(folder, prefix, confine, read_metadata(confine(prefix + METADATA)))
    tensors = reader.tensors(notes)
    name = prefix.rstrip("/") or d.name
    return build_weight_set("dcp", {name: tensors}, {name: list(reader.files.values())}, reader.cache, notes,
                            carries_files=False)




# ---------------------------------------------------------------------------
# .metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` pickle names; anything else is refused, never imported."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS or module == "torch" and name in _torch_dtypes():
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("a persistent id")


class _Refused(pickle.UnpicklingError):
    pass


@functools.cache
def _torch_dtypes() -> frozenset[str]:
    """Names of torch's dtypes (``torch.bfloat16``, ...), looked up without touching torch's lazy attributes."""
    import torch

    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


def read_metadata(path: Path):
    """DCP's ``Metadata`` from ``path``, through the restricted unpickler; InputError naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = str(path)
    size = path.stat().st_size
    if size > METADATA_LIMIT:
        raise InputError(f"{size:,} bytes; refusing to read more than {METADATA_LIMIT >> 20} MB", rule="dcp-metadata",
                         path=where)
    try:
        with path.open("rb") as f:
            md = _MetadataUnpickler(f).load()  # noqa: S301 - find_class admits DCP's metadata classes only
    except _Refused as e:
        raise InputError(f"the pickle names {e}, which DCP metadata never holds; not unpickled", rule="unsafe-pickle",
                         path=where) from None
    except Exception as e:  # a corrupt or hostile pickle can fail in any allowed constructor
        raise InputError(f"not a DCP metadata pickle: {type(e).__name__}: {e}", rule="dcp-metadata",
                         path=where) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or \
            not isinstance(md.storage_data, dict):
        raise InputError(f"holds a {type(md).__name__}, not DCP Metadata", rule="dcp-metadata", path=where)
    return md


# ---------------------------------------------------------------------------
# Tensors


class _Folder:
    """One DCP folder: its metadata, its open ``.distcp`` files and the loads it falls back to."""

    def __init__(self, folder: Path, prefix: str, confine: Confine, metadata) -> None:
        self.folder, self.prefix, self.confine, self.metadata = folder, prefix, confine, metadata
        self.where = str(folder / METADATA)
        self.files: dict[str, LocalFile] = {}
        self.cache = TensorCache()

    def tensors(self, notes: list[str]) -> list[Tensor]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        out: list[Tensor] = []
        skipped: dict[str, int] = {}
        for fqn, md in self.metadata.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise InputError(f"key {fqn!r:.60} is not a string", rule="dcp-metadata", path=self.where)
            head = fqn.split(".", 1)[0]
            if isinstance(md, BytesStorageMetadata) or head in TRAINING_STATE:
                what = "non-tensor entries" if isinstance(md, BytesStorageMetadata) else f"{head}.*"
                skipped[what] = skipped.get(what, 0) + 1
            elif isinstance(md, TensorStorageMetadata):
                out.append(self._tensor(fqn, md))
            else:
                raise InputError(f"entry {fqn!r} is a {type(md).__name__}", rule="dcp-metadata", path=self.where)
        if skipped:
            notes.append("ignored " + ", ".join(f"{n} {what}" for what, n in sorted(skipped.items())))
        return out

    def _tensor(self, fqn: str, md) -> Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        dtype = torch_dtype_name(getattr(md.properties, "dtype", None), self.where, fqn)
        shape = check_dims(md.size, f"{fqn}: size", self.where)
        if not isinstance(md.chunks, list) or not 0 < len(md.chunks) <= MAX_CHUNKS:
            raise InputError(f"{fqn}: {len(md.chunks) if isinstance(md.chunks, list) else 'no'} chunks",
                             rule="dcp-metadata", path=self.where)
        chunks: list[_Chunk] = []
        for c in md.chunks:
            offsets = check_dims(c.offsets, f"{fqn}: chunk offsets", self.where)
            sizes = check_dims(c.sizes, f"{fqn}: chunk sizes", self.where)
            info = self.metadata.storage_data.get(MetadataIndex(fqn, offsets))
            chunks.append(_Chunk(offsets, sizes, *self._storage(fqn, info)))
        _check_tiling(fqn, shape, chunks, self.where)
        nbytes = tensor_nbytes(dtype, shape)
        return Tensor(fqn, dtype, shape, Deferred(nbytes, functools.partial(self._resolve, fqn, dtype, shape, chunks)))

    def _storage(self, fqn: str, info) -> tuple[LocalFile, int, int, bool]:
        """(file, offset, length, plain) of a chunk's archive; plain: no transform between file and archive."""
        path, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(path, str) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in (offset, length)):
            raise InputError(f"{fqn}: no valid storage entry for a chunk", rule="dcp-metadata", path=self.where)
        src = self.files.get(path)
        if src is None:
            src = self.files[path] = LocalFile(self.confine(self.prefix + path))
        if offset + length > src.size:
            raise InputError(f"{fqn}: chunk bytes {offset}+{length} run past the end of {path} ({src.size} bytes)",
                             rule="dcp-metadata", path=self.where)
        return src, offset, length, not getattr(info, "transform_descriptors", None)

    def _resolve(self, fqn: str, dtype: str, shape: tuple[int, ...], chunks: list[_Chunk]) -> Part:
        spans = self._row_spans(fqn, dtype, chunks)
        if spans is not None:
            return FileSpans(spans)
        load = self._assemble if all(c.plain for c in chunks) else self._load
        return LoadedTensor(functools.partial(load, fqn, dtype, shape, chunks), dtype, shape, self.cache,
                            f"{self.where}: {fqn}")

    def _row_spans(self, fqn: str, dtype: str, chunks: list[_Chunk]) -> list[Segment] | None:
        """The tensor's bytes as storage-record ranges, when its chunks are whole rows stored plainly."""
        if not all(c.plain and not any(c.offsets[1:]) for c in chunks):
            return None
        spans: list[Segment] = []
        for c in sorted(chunks, key=lambda c: c.offsets[:1]):
            span = stored_records(c.src, c.offset, c.length).span(self._chunk(fqn, dtype, c, "meta"))
            if span is None:
                return None
            spans.append(Segment(c.src, *span))
        return spans

    def _assemble(self, fqn: str, dtype: str, shape: tuple[int, ...], chunks: list[_Chunk]):
        """The tensor from its chunks' archives: one chunk as stored (any strides), several copied into place.

        Memory: the tensor plus one chunk (DCP's own loader holds a second copy of each chunk).
        """
        import torch

        if len(chunks) == 1:
            return self._chunk_data(fqn, dtype, chunks[0])
        out = torch.empty(shape, dtype=torch_dtype(dtype))
        for c in chunks:
            piece = self._chunk_data(fqn, dtype, c)
            out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))].copy_(piece)
            del piece  # before the next chunk is read
        return out

    def _chunk_data(self, fqn: str, dtype: str, c: _Chunk):
        """One chunk's tensor in memory: its storage record read once, else torch.load of its archive."""
        t = self._chunk(fqn, dtype, c, "meta")
        loaded = read_stored(c.src, t, stored_records(c.src, c.offset, c.length))
        return loaded if loaded is not None else self._chunk(fqn, dtype, c, "cpu")

    def _chunk(self, fqn: str, dtype: str, c: _Chunk, map_location: str):
        """One chunk's tensor, checked against the metadata (``meta``: no data read)."""
        import torch

        where = f"{c.src.name} @ {c.offset}"
        t = load_torch(RangeReader(c.src, c.offset, c.length), where, map_location=map_location)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.sizes or torch_dtype_name(t.dtype, where) != dtype:
            raise InputError(f"chunk of {fqn!r} holds {getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))}, the metadata says {dtype} {list(c.sizes)}",
                             rule="tensor-mismatch", path=where)
        return t

    def _load(self, fqn: str, dtype: str, shape: tuple[int, ...], chunks: list[_Chunk]):
        """One key through DCP's own loader: chunks stored through a transform (e.g. compression extensions)."""
        import torch
        from torch.distributed.checkpoint import load

        target = torch.empty(shape, dtype=torch_dtype(dtype))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no_dist warns that it runs without a process group
                load({fqn: target}, storage_reader=_reader_class()(self.folder, self.metadata), no_dist=True)
        except Exception as e:  # DCP wraps reader failures in its own exception types
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise InputError(f"DCP cannot load {fqn!r}: {reason}",
                             rule="dcp-read", path=self.where) from None
        return target


class _Chunk:
    __slots__ = ("offsets", "sizes", "src", "offset", "length", "plain")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], src: LocalFile, offset: int, length: int,
                 plain: bool) -> None:
        self.offsets, self.sizes, self.src, self.offset, self.length, self.plain = \
            offsets, sizes, src, offset, length, plain


def _check_tiling(fqn: str, shape: tuple[int, ...], chunks: list[_Chunk], where: str) -> None:
    """The chunks cover the tensor exactly once: inside it, volumes adding up, no two overlapping."""
    def bad(msg: str) -> InputError:
        return InputError(f"{fqn}: {msg}", rule="dcp-metadata", path=where)

    total = 0
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or \
                any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)):
            raise bad(f"chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside {list(shape)}")
        total += numel(c.sizes)
    if total != numel(shape):
        raise bad(f"chunks hold {total} elements, the tensor {numel(shape)}")
    ordered = sorted(chunks, key=lambda c: c.offsets)
    for i, a in enumerate(ordered):  # sweep along the first axis: row shards compare with one neighbour
        for b in ordered[i + 1:]:
            if shape and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(bo < ao + az and ao < bo + bz
                   for ao, az, bo, bz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise bad(f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap")


@functools.cache
def _reader_class():
    """A FileSystemReader that serves the metadata read here instead of unpickling ``.metadata`` again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def __init__(self, path: Path, metadata) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self, *args, **kwargs):
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    return _Reader
