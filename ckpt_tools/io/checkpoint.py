"""A checkpoint opened lazily: config, index, tensor references and the other files.

Opening reads config.json, the index and every shard header - a few MB even for a
700 GB checkpoint. Shard names from the index are confined to the checkpoint
directory: absolute paths, ``..`` and symlinks that resolve elsewhere are refused
(except the Hugging Face cache layout, whose snapshot files link into the same
repository's ``blobs/``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import InputError
from ..gcpause import gc_paused
from .artefacts import LOCK_NAME, MANIFEST_NAME, RESUME_NAME
from .config import ConfigView
from .readers import Reader, for_file, for_object, read_weights
from .readers import detect as detect_reader
from .safetensors_io import Header, LocalFile, TensorRef, read_header, refs_from_header
from .sources import is_url, open_store

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Weight files in other formats are never carried into outputs.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_SKIP_NAMES = {INDEX_NAME, MANIFEST_NAME, "stitch-report.json", "graft-report.json", LOCK_NAME}


@dataclass
class Checkpoint:
    root: str  # display name: a directory, hf://org/repo@rev, or an fsspec URL (s3://bucket/prefix)
    config: ConfigView
    tensors: dict[str, TensorRef]  # key -> reference (through the index when there is one)
    headers: dict[str, Header]  # shard name -> header
    index: dict | None  # parsed index, None for a single file
    files: list[str]  # non-weight files (relative paths) that outputs may carry
    sources: dict[str, object] = field(default_factory=dict)  # shard name -> ByteSource
    local_dir: Path | None = None
    shard_keys: dict[str, list[str]] = field(default_factory=dict)  # shard -> keys it holds (header order)
    manifest: dict | None = None
    config_present: bool = True
    reader: str = "safetensors"  # what the weights were read from: safetensors, torch (state dict) or dcp
    reader_notes: list[str] = field(default_factory=list)  # what a draft reader unwrapped or ignored
    # sha256 of config.json, the index and the manifest as they were read (part of the input's fingerprint)
    digests: dict[str, str] = field(default_factory=dict)

    # -- opening ------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike | Mapping) -> Checkpoint:
        """A directory, a file, a URL, or an object a reader takes: a ``{name: torch.Tensor}`` mapping (a draft
        in memory, see ``open_object``). The readers registry decides which reader opens what."""
        reader = for_object(path)
        if reader is not None:
            return open_object(path, reader)
        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"no reader takes a {type(path).__name__}", rule="no-weights", path=repr(path)[:80])
        text = str(path)
        if is_url(text):
            return open_remote(text)
        p = Path(path)
        if p.is_file() and p.name == "config.json":
            return cls._config_only(p)
        reader = for_file(p) if p.is_file() else None
        if reader is not None:
            return cls._open_dir(p.parent, single=p.name) if reader.native else open_draft_source(p, reader.name)
        if not p.is_dir():
            raise InputError("no such checkpoint directory", path=text)
        return cls._open_dir(p)

    @classmethod
    def _config_only(cls, config_path: Path) -> Checkpoint:
        data = read_small(config_path, "config-json")
        cfg = ConfigView.from_bytes(data, str(config_path))
        return cls(str(config_path), cfg, {}, {}, None, [], local_dir=config_path.parent,
                   digests={"config.json": sha256_of(data)})

    @classmethod
    @gc_paused()  # ~92,000 references and header entries at release scale: no cycles to look for
    def _open_dir(cls, d: Path, single: str | None = None, *, problems: _Problems | None = None,
                  index: dict | None = None, renamed: dict[str, Path] | None = None,
                  manifest: dict | None = None) -> Checkpoint:
        """Directory ``d`` (only its file ``single`` when given): config, index, shard headers, manifest.

        ``problems`` decides what a problem does: raise it (the default), or note it and open
        what can be opened (``open_lenient``). ``index``, ``renamed`` and ``manifest`` describe an output
        the writer has not marked complete yet (see ``open_lenient``).
        """
        problems = problems or _Problems(strict=True)
        renamed = renamed or {}
        root = confinement_root(d)
        blocked = _escaping_links(d, root)
        for err in blocked.values():
            problems.add(err)
        digests: dict[str, str] = {}
        config, config_present = _read_config(d, digests, problems, skip="config.json" in blocked)
        # the index and header bytes are hashed (fingerprints) on a second thread while they are parsed
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as hasher:
            found = _shard_names(d, single, index, INDEX_NAME in blocked, renamed, digests, problems, hasher)
            if found is None:
                return open_draft_source(d)
            index, shard_names = found
            sources, headers = _open_shards(d, root, shard_names, renamed, problems, hasher)
        try:
            tensors, shard_keys = references(headers, sources, index, str(d / INDEX_NAME), strict=problems.strict)
            if manifest is None:
                manifest = _read_manifest_in(d, digests, problems, skip=MANIFEST_NAME in blocked)
        except BaseException:
            _close_all(sources)  # a refused checkpoint leaves no open file behind
            raise
        return cls(str(d), config, tensors, headers, index, _other_files(d, root), sources, d, shard_keys,
                   manifest, config_present, digests=digests)

    # -- closing ------------------------------------------------------------------

    def close(self) -> None:
        """Close every shard file this checkpoint opened (idempotent)."""
        _close_all(self.sources)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries --------------------------------------------------------------------

    @property
    def shard_names(self) -> list[str]:
        return list(self.headers)

    def shard_of(self, key: str) -> str:
        ref = self.tensors[key]
        for name, src in self.sources.items():
            if src is ref.source:
                return name
        raise KeyError(key)

    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    def header_bytes(self) -> int:
        return sum(8 + h.header_len for h in self.headers.values())

    def file_path(self, name: str) -> Path:
        assert self.local_dir is not None
        return self.local_dir / name


@dataclass
class RemoteCheckpoint(Checkpoint):
    """A Checkpoint whose files live behind a URL (``local_dir`` is None): the Hub or any fsspec store."""

    store: object = None  # sources.FsStore / sources.hf.HfStore

    @property
    def fs(self):
        """The fsspec filesystem of the source."""
        return self.store.fs

    @property
    def file_sizes(self) -> dict[str, int]:
        return self.store.sizes

    @property
    def lfs_sha256(self) -> dict[str, str]:
        return self.store.lfs_sha256  # the Hub's sha256 of each LFS file; empty for object stores

    @property
    def ref(self):
        return getattr(self.store, "ref", None)

    @property
    def commit(self) -> str:
        return getattr(self.store, "commit", "")

    @property
    def repo_id(self) -> str:
        return self.store.ref.repo_id

    def url_of(self, name: str) -> str:
        return self.store.url_of(name)

    def open_file(self, name: str):
        """A ByteSource for one file of the source."""
        self._size_of(name)
        return self.store.open_file(name)

    def read_file(self, name: str) -> bytes:
        """The bytes of a small file of the source (counted in the download stats)."""
        size = self._size_of(name)
        if size > SMALL_FILE_LIMIT:
            raise InputError(f"{name} is {size} bytes; refusing to read it into memory", path=self.root)
        src = self.store.open_file(name)
        buf = bytearray(size)
        src.readinto(0, memoryview(buf))
        return bytes(buf)

    def file_path(self, name: str) -> Path:
        """A local path for one file, returned at once and downloaded the first time it is used."""
        self._size_of(name)
        return self.store.fetch(name)

    fetch_file = file_path  # the name ops use to carry a remote file into an output

    def _size_of(self, name: str) -> int:
        if name not in self.store.sizes:
            raise InputError(f"{name} is not a file of this repository or prefix", rule="missing-file", path=self.root)
        return self.store.sizes[name]


HEADER_WORKERS = 16  # shard headers are read in parallel: hundreds of shards, two small ranged reads each


def open_remote(url: str) -> RemoteCheckpoint:
    """Open a URL from its headers: config, index, tensor references, the other files' names."""
    store = open_store(url)
    root, sizes = store.root, store.sizes
    digests: dict[str, str] = {}
    ckpt = RemoteCheckpoint(root, ConfigView({}), {}, {}, None, [], store=store)

    def small(name: str) -> bytes:
        data = ckpt.read_file(name)
        digests[name] = sha256_of(data)  # the fingerprint of the input as read
        return data

    config_present = "config.json" in sizes
    config = ConfigView.from_bytes(small("config.json"), f"{root}/config.json") if config_present else ConfigView({})
    index = None
    if INDEX_NAME in sizes:
        index = parse_index(small(INDEX_NAME), f"{root}/{INDEX_NAME}")
        shard_names = sorted(set(index["weight_map"].values()))
    elif SINGLE_NAME in sizes:
        shard_names = [SINGLE_NAME]
    else:
        raise InputError(f"neither {INDEX_NAME} nor {SINGLE_NAME} found; is this a safetensors checkpoint?",
                         rule="no-weights", path=root)
    sources = {}
    for name in shard_names:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or "\\" in name or not name:
            raise InputError(f"shard name {name!r} escapes the checkpoint", rule="shard-path", path=root)
        if name not in sizes:
            raise InputError(f"index names shard {name!r}, which does not exist", rule="missing-shard", path=root)
        sources[name] = store.open_file(name)
    with ThreadPoolExecutor(max_workers=min(HEADER_WORKERS, max(len(sources), 1))) as pool:
        headers: dict[str, Header] = dict(zip(sources, pool.map(read_header, sources.values()), strict=True))
    tensors, shard_keys = references(headers, sources, index, f"{root}/{INDEX_NAME}")
    manifest = parse_manifest(small(MANIFEST_NAME), f"{root}/{MANIFEST_NAME}") if MANIFEST_NAME in sizes else None
    return RemoteCheckpoint(root, config, tensors, headers, index, _remote_other_files(sizes), sources, None,
                            shard_keys, manifest, config_present, digests=digests, store=store)


def _remote_other_files(sizes: dict[str, int]) -> list[str]:
    """Non-weight files of a remote source, by the same rules as a local directory."""
    out = []
    for name in sorted(sizes):
        parts = PurePosixPath(name).parts
        if any(p.startswith(".") for p in parts) or ".." in parts:
            continue
        if parts[-1] in _SKIP_NAMES or parts[-1].endswith(_WEIGHT_SUFFIXES) or name == "config.json":
            continue
        out.append(name)
    return out


class _Problems:
    """What opening a directory finds wrong. Strict (``Checkpoint.open``) raises the first problem;
    lenient (``open_lenient``, for validate) collects them all and opens what it can."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.errors: list[InputError] = []
        self.unreadable: list[str] = []  # shards that could not be opened

    def add(self, err: InputError) -> None:
        if self.strict:
            raise err
        self.errors.append(err)


def _with_rule(e: InputError, rule: str, path: str) -> InputError:
    """``e``, given ``rule`` when it has none: every problem is reported by its rule."""
    return e if e.rule else InputError(str(e).removeprefix(f"{path}: "), rule=rule, path=path)


def _read_config(d: Path, digests: dict[str, str], problems: _Problems,
                 skip: bool = False) -> tuple[ConfigView, bool]:
    """config.json of ``d`` (an empty view when there is none, or it is ``skip``ped or unreadable) and
    whether it was read; its sha256 goes to ``digests``."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file() or skip:
        return ConfigView({}), False
    try:
        data = read_small(cfg_path, "config-json")
        digests["config.json"] = sha256_of(data)
        return ConfigView.from_bytes(data, str(cfg_path)), True
    except InputError as e:
        problems.add(_with_rule(e, "config-json", str(cfg_path)))
        return ConfigView({}), False


def _shard_names(d: Path, single: str | None, index: dict | None, index_blocked: bool, renamed: dict[str, Path],
                 digests: dict[str, str], problems: _Problems, hasher: Executor | None = None
                 ) -> tuple[dict | None, list[str]] | None:
    """The index (None without one) and the shards to open; None when ``d`` holds weights another
    reader reads instead (``open_draft_source``). ``index``: one given by the caller, not read from ``d``."""
    if single is not None:
        return None, [single]
    if index is not None:
        return index, sorted(set(index["weight_map"].values()))
    if (d / INDEX_NAME).is_file() and not index_blocked:
        try:
            data = read_small(d / INDEX_NAME, "index-json")
            digest = hasher.submit(sha256_of, data) if hasher is not None else None
            try:
                index = parse_index(data, str(d / INDEX_NAME))
            finally:  # recorded whether or not the index is valid JSON
                digests[INDEX_NAME] = digest.result() if digest is not None else sha256_of(data)
            return index, sorted(set(index["weight_map"].values()))
        except InputError as e:
            problems.add(e)
            return None, sorted(q.name for q in d.glob("*.safetensors"))  # still check what is there
    if (d / SINGLE_NAME).is_file() or SINGLE_NAME in renamed:
        return None, [SINGLE_NAME]
    reader = detect_reader(d)  # safetensors files win over any other weights beside them
    if reader is not None and not reader.native:
        return None
    return None, _unindexed_shards(d, problems)


def _unindexed_shards(d: Path, problems: _Problems) -> list[str]:
    """.safetensors files no index names: no checkpoint to loaders (strict refuses), what there is to check
    for validate (the missing index a problem of its own)."""
    unfinished = _unfinished_write(d)
    names = sorted(q.name for q in d.glob("*.safetensors"))
    if problems.strict or not names:
        wanted = SINGLE_NAME if problems.strict else "any .safetensors file"
        raise InputError(f"neither {INDEX_NAME} nor {wanted} found; " + (unfinished or
                                                                          "is this a safetensors checkpoint?"),
                         rule="no-weights", path=str(d))
    if unfinished:
        problems.add(InputError(f"no {INDEX_NAME} or {SINGLE_NAME} yet: {unfinished}", rule="unfinished-write",
                                path=str(d)))
    elif len(names) > 1:
        problems.add(InputError(f"{len(names)} .safetensors files but no {INDEX_NAME}; loaders will not find them",
                                rule="no-index", path=str(d)))
    return names


def _open_shards(d: Path, root: Path, names: list[str], renamed: dict[str, Path], problems: _Problems,
                 hasher: Executor | None = None) -> tuple[dict[str, LocalFile], dict[str, Header]]:
    """Each shard's file and header; one that cannot be read is a problem (and ``problems.unreadable``)."""
    sources: dict[str, LocalFile] = {}
    headers: dict[str, Header] = {}
    try:
        for name in names:
            try:
                fpath = renamed.get(name) or _confined(d, root, name)
                if callable(fpath):  # a file not in place yet, read from what it is made of (writer.PendingOutput)
                    src = sources[name] = fpath()
                elif not fpath.is_file():
                    raise InputError(f"index names shard {name!r}, which does not exist", rule="missing-shard",
                                     path=str(d / name))
                else:
                    src = sources[name] = LocalFile(fpath)
                src.name = str(d / name)
                headers[name] = read_header(src, hasher)
            except InputError as e:
                if name in sources:
                    sources.pop(name).close()
                problems.unreadable.append(name)
                problems.add(_with_rule(e, "unreadable-shard", str(d / name)))
    except BaseException:
        _close_all(sources)  # a refused checkpoint leaves no open file behind
        raise
    return sources, headers


def _read_manifest_in(d: Path, digests: dict[str, str], problems: _Problems, skip: bool = False) -> dict | None:
    """``d``'s ckpt_manifest.json, checked (None when there is none); its sha256 goes to ``digests``."""
    path = d / MANIFEST_NAME
    if not path.is_file() or skip:
        return None
    try:
        data = _read_side_file(path)
        digests[MANIFEST_NAME] = sha256_of(data)
        return parse_manifest(data, str(path))
    except InputError as e:
        problems.add(e)
        return None


def open_draft_source(path: str | os.PathLike, kind: str | None = None) -> Checkpoint:
    """A draft saved in a format a registered reader reads (a torch state dict, a torch DCP checkpoint, ...;
    see ``readers``), as a Checkpoint.

    ``path`` is a directory (detected by content; ``kind``, a reader's name, overrides) or a weight file.
    ``headers`` stay empty and ``index`` None: those describe safetensors files only.
    """
    p = Path(path)
    d, only = (p.parent, p.name) if p.is_file() else (p, None)
    root = confinement_root(d)
    for err in _escaping_links(d, root).values():
        raise err
    ws = read_weights(d, lambda name: _confined(d, root, name), _read_index, only=only, kind=kind)
    digests: dict[str, str] = {}
    strict = _Problems(strict=True)
    config, config_present = _read_config(d, digests, strict)
    files = [f for f in _other_files(d, root) if f not in ws.consumed] if ws.carries_files else []
    manifest = _read_manifest_in(d, digests, strict)
    return Checkpoint(str(d), config, ws.tensors, {}, None, files, dict(ws.files), d, ws.keys, manifest,
                      config_present, reader=ws.reader, reader_notes=ws.notes, digests=digests)


def open_object(obj: object, reader: Reader) -> Checkpoint:
    """An object ``reader`` takes (readers.memory: a ``{name: torch.Tensor}`` mapping, CPU or GPU) as a
    Checkpoint, its tensors read on demand.

    Like a trainer's output directory without config.json: no headers, no index, no manifest, no files to
    carry; ``local_dir`` None and ``root`` the reader's display name.
    """
    assert reader.read_object is not None
    ws = reader.read_object(obj)
    return Checkpoint(reader.display, ConfigView({}), ws.tensors, {}, None, [], dict(ws.files), None, ws.keys,
                      config_present=False, reader=ws.reader, reader_notes=ws.notes)


def references(headers: dict[str, Header], sources: dict, index: dict | None, index_path: str, *,
               strict: bool = True) -> tuple[dict[str, TensorRef], dict[str, list[str]]]:
    """Tensor references (through the index when there is one) and each shard's keys in file order.

    ``strict``: a key the index maps to a shard that does not hold it is an error; otherwise
    it is left out (``validate`` reports it as a problem of its own).
    """
    tensors: dict[str, TensorRef] = {}
    shard_keys: dict[str, list[str]] = {}
    for name, h in headers.items():
        shard_keys[name] = h.in_offset_order()
        if index is None:
            for k, r in refs_from_header(sources[name], h).items():
                tensors.setdefault(k, r)
    if index is not None:
        # the headers' own references (read_header makes them), else made here from their entries
        refs = {name: h.refs if h.refs is not None else refs_from_header(sources[name], h)
                for name, h in headers.items()}
        # the weight map again, keyed by the headers' own key strings and naming each file with one string (json
        # made one per entry): the index's copies of a release's 92,000 names and file names (~14 MB) are freed
        weight_map: dict[str, str] = {}
        names = {name: name for name in headers}
        last = in_shard = name = None
        for key, shard in index["weight_map"].items():  # 92,000 times for a release: nothing but lookups
            if shard != last:  # keys come in runs of one shard: its references and name looked up once a run
                last, in_shard, name = shard, refs.get(shard), names.get(shard, shard)
            ref = in_shard.get(key) if in_shard is not None else None
            if ref is not None:
                key = ref.key
                tensors[key] = ref
            elif strict and in_shard is not None:
                raise InputError(f"index maps {key!r} to {shard}, which does not hold it", rule="index-key-missing",
                                 path=index_path)
            weight_map[key] = name
        index["weight_map"] = weight_map
    return tensors, shard_keys


SMALL_FILE_LIMIT = 256 << 20  # config, index, manifest: read whole; real ones are KBs to a few MB


def read_small(path: Path, rule: str) -> bytes:
    """A JSON side file, read whole - unless it is absurdly large (a hostile file must not exhaust memory)."""
    size = path.stat().st_size if isinstance(path, Path) else 0  # hub bytes come size-checked already
    if size > SMALL_FILE_LIMIT:
        raise InputError(f"{size:,} bytes; refusing to read more than {SMALL_FILE_LIMIT >> 20} MB", rule=rule,
                         path=str(path))
    return path.read_bytes()


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _close_all(sources: dict) -> None:
    for src in sources.values():
        close = getattr(src, "close", None)  # remote sources hold no file descriptor
        if close is not None:
            close()


def _read_index(path: Path) -> dict:
    return parse_index(read_small(path, "index-json"), str(path))


def parse_index(data: bytes, where: str) -> dict:
    """The checks of an index file, on bytes already read (a local file, or one from the Hub)."""
    try:
        index = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise InputError(f"index is not valid JSON: {e}", rule="index-json", path=where) from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise InputError("index must be an object with a 'weight_map' object", rule="index-json", path=where)
    wm = index["weight_map"]
    if not set(map(type, wm.values())) <= {str}:
        for k, v in wm.items():
            if not isinstance(v, str):
                raise InputError(f"weight_map[{k!r}] is not a file name", rule="index-json", path=where)
    meta = index.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise InputError("index metadata must be an object", rule="index-json", path=where)
    return index


def confinement_root(d: Path) -> Path:
    """The directory every file of ``d`` must resolve into.

    A Hugging Face cache snapshot (``models--org--name/snapshots/<rev>``) links its
    files to ``../../blobs/<hash>``: those stay inside the repository's cache folder.
    """
    real = d.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def _confined(d: Path, root: Path, name: str) -> Path:
    pure = PurePosixPath(name)
    if (pure.is_absolute() or name.startswith(("/", "\\")) or ".." in pure.parts or "\\" in name or not name
            or "\0" in name):
        raise InputError(f"shard name {name!r} escapes the checkpoint directory", rule="shard-path",
                         path=str(d))
    p = d / name
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:
        raise InputError(f"cannot resolve shard {name!r}: {e}", rule="shard-path", path=str(d)) from None
    if p.exists() and not real.is_relative_to(root):
        raise InputError(f"shard {name!r} is a link that resolves outside the checkpoint ({real})",
                         rule="shard-path", path=str(d))
    return p


# Manifest fields the tool reads back (stitch, validate, experts, push), with the JSON types it writes.
_MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "kind": (str,), "format": (str,), "family": (str,), "command": (str,), "version": (str,),
    "tool_version": (str,), "quantized_to": (str, type(None)), "layers": (list,), "tensors": (dict,),
    "remote_files": (dict,), "files": (dict,), "inputs": (dict,), "plan": (dict,),
}


def _read_side_file(path: Path) -> bytes:
    try:
        return read_small(path, "manifest-json")
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", rule="manifest-json", path=str(path)) from None


def parse_manifest(data: bytes, where: str) -> dict:
    """ckpt_manifest.json's bytes (a local file, or one from the Hub), checked where other modules trust its
    shape (a draft's manifest steers stitch: from a stranger it is input like any other); InputError if not."""
    def bad(msg: str) -> InputError:
        return InputError(msg, rule="manifest-json", path=where)

    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise bad("the manifest must be a JSON object")
    for name, types in _MANIFEST_FIELDS.items():
        if name in manifest and not isinstance(manifest[name], types):
            raise bad(f"field {name!r} is {type(manifest[name]).__name__}, expected "
                      f"{' or '.join(t.__name__ for t in types)}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in manifest.get("layers", [])):
        raise bad("field 'layers' must be a list of integers")
    for key, entry in manifest.get("tensors", {}).items():
        if not isinstance(entry, dict):
            raise bad(f"tensors[{key!r}] is {type(entry).__name__}, expected an object")
    return manifest


def _unfinished_write(d: Path) -> str | None:
    """A hint when ``d`` holds what an interrupted (or running) ckpt command leaves: its lock, temporary files."""
    leftovers = sorted(p.name for p in d.glob(".*")
                       if p.name in (LOCK_NAME, RESUME_NAME) or p.name.endswith(".partial"))
    if not leftovers:
        return None
    return (f"a ckpt command stopped (or is still running) before finishing this directory ({', '.join(leftovers[:3])}"
            f"{' ...' if len(leftovers) > 3 else ''} left); rerun it with --resume, or delete the directory")


def _escaping_links(d: Path, root: Path) -> dict[str, InputError]:
    """config.json, the index and the manifest must not be links to files outside the checkpoint."""
    out: dict[str, InputError] = {}
    for name in ("config.json", INDEX_NAME, MANIFEST_NAME):
        p = d / name
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            out[name] = InputError(f"{name} is a link that resolves outside the checkpoint ({p.resolve()})",
                                   rule="shard-path", path=str(d))
    return out


def _other_files(d: Path, root: Path) -> list[str]:
    """Non-weight files (tokenizer, generation config, chat template, code, README...)."""
    out: list[str] = []
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if not p.is_file() or p.name in _SKIP_NAMES or p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if p.name == "config.json" and len(rel.parts) == 1:
            continue  # the config is rewritten by each op, never copied blindly
        if not p.resolve().is_relative_to(root):
            continue  # a link pointing outside the checkpoint is never followed
        out.append(str(rel))
    return out


# -- lenient opening (validate) -------------------------------------------------------


@dataclass
class LenientOpen:
    """A checkpoint opened as far as possible, and the file-level errors met on the way.

    ``ckpt`` holds every shard that could be read; ``errors`` name the rule and file of
    each one that could not (unreadable index or config, shard path escaping the
    directory, missing shard, broken header). ``unreadable`` lists those shard names.
    """

    ckpt: Checkpoint
    errors: list[InputError]
    unreadable: list[str]


def open_lenient(path: str | os.PathLike, *, index: dict | None = None,
                 renamed: dict[str, Path] | None = None, manifest: dict | None = None) -> LenientOpen:
    """Like ``Checkpoint.open`` for local paths, but collects file-level errors instead of raising.

    ``ckpt validate`` uses it to report every problem at once. Raises ``InputError``
    (rule ``no-weights``) only when ``path`` is not a checkpoint at all. Key-level
    checks (index vs shard contents) are left to the caller, which sees ``index``,
    ``headers`` and ``shard_keys``.

    An output the writer has not marked complete yet is opened as it will be: ``index``
    is the index about to be written, ``renamed`` maps final file names to the temporary
    files that hold them (the lone ``model.safetensors`` before its rename) or open what stands in for
    them, ``manifest`` the manifest about to be written.
    """
    p = Path(path)
    single: str | None = None
    reader = for_file(p) if p.is_file() else None
    if p.is_file() and p.name == "config.json":
        p = p.parent
    elif reader is not None and reader.native:
        single, p = p.name, p.parent
    elif reader is not None:
        return LenientOpen(open_draft_source(p, reader.name), [], [])
    if not p.is_dir():
        raise InputError("no such checkpoint directory or .safetensors file", rule="no-weights", path=str(path))
    problems = _Problems(strict=False)
    ckpt = Checkpoint._open_dir(p, single, problems=problems, index=index, renamed=renamed, manifest=manifest)
    return LenientOpen(ckpt, problems.errors, problems.unreadable)


def raw_header(ckpt: Checkpoint, shard: str) -> bytes:
    """The header JSON bytes of ``shard`` exactly as stored (to rewrite a shard byte-identically)."""
    from .safetensors_io import read_bytes

    h = ckpt.headers[shard]
    return bytes(read_bytes(ckpt.sources[shard], 8, h.header_len))


def source_name(ckpt: Checkpoint) -> str:
    """How outputs name their source: ``org/repo`` for hub sources, the URL or an absolute path otherwise."""
    if ckpt.root.startswith("hf://"):
        return ckpt.root[len("hf://"):].split("@", 1)[0]
    if is_url(ckpt.root) or ckpt.local_dir is None:  # a URL, or a mapping in memory (no path to resolve)
        return ckpt.root
    return str(Path(ckpt.root).resolve())


def revision_of(ckpt: Checkpoint) -> str | None:
    """The commit a hub source was read at (``hf://org/repo@sha``); None for local directories."""
    if ckpt.root.startswith("hf://") and "@" in ckpt.root:
        return ckpt.root.rsplit("@", 1)[1]
    return None
