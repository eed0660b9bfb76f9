"""``hf://ORG/REPO[@REV]`` sources: a remote checkpoint opened from headers and byte ranges only.

Opening costs the repository info, one tree listing, ``config.json``, the index and two range
requests per shard (the 8-byte header length, then the header). Tensor bytes are fetched later,
range by range, only when a plan copies or computes them; small non-weight files are fetched
(through huggingface_hub's cache) only when an output carries them. The revision is pinned to a
commit when the checkpoint is opened, so every later read sees the same files.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from .checkpoint import (
    _SKIP_NAMES,
    _WEIGHT_SUFFIXES,
    INDEX_NAME,
    MANIFEST_NAME,
    SINGLE_NAME,
    Checkpoint,
    _read_index,
    parse_manifest,
    references,
    sha256_of,
)
from .config import ConfigView
from .errors import CkptError, InputError
from .hub import (
    HUB_STATS,
    HubReadError,
    HubRef,
    call,
    endpoint,
    get_api,
    hub_error,
    is_transient,
    parse_hf_url,
    retry_settings,
)
from .safetensors_io import IO_STATS, Header, read_header

HEADER_WORKERS = 8  # shard headers are fetched in parallel: hundreds of shards, two small requests each
SMALL_FILE_LIMIT = 256 << 20  # config / index / manifest read into memory; anything larger is refused


def _cache_dir() -> str | None:
    """huggingface_hub's cache, honouring HF_HUB_CACHE / HF_HOME set after it was imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _download_timeout() -> float:
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


class RemoteFile:
    """A file of a Hub repository, read with HTTP ``Range`` requests (a ByteSource).

    Requests go through huggingface_hub's shared session and ``http_stream_backoff`` (retries on
    connection errors, 429 and 5xx). A transfer that breaks part-way resumes from the last byte
    received, with backoff, before giving up with a HubReadError.
    """

    def __init__(self, ref: HubRef, commit: str, path: str, size: int) -> None:
        self.ref = ref
        self.path = path
        self._size = size
        self.name = f"hf://{ref.repo_id}@{commit}/{path}"
        # hf_hub_url's template is fixed when huggingface_hub is imported; build it from the endpoint now.
        self.url = f"{endpoint()}/{ref.repo_id}/resolve/{quote(commit, safe='')}/{quote(path)}"

    @property
    def size(self) -> int:
        return self._size

    def local_fd(self) -> int | None:
        return None

    def readinto(self, offset: int, buf: memoryview) -> None:
        n = len(buf)
        if n == 0:
            return
        if offset < 0 or offset + n > self._size:
            raise InputError(f"read of bytes {offset}-{offset + n - 1} past the end ({self._size} bytes)",
                             rule="short-read", path=self.name)
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        retries, wait = retry_settings()
        done = 0
        failures = 0
        while done < n:
            start, end = offset + done, offset + n - 1
            headers = build_hf_headers(headers={"Range": f"bytes={start}-{end}", "Accept-Encoding": "identity"})
            got = 0
            try:
                # Exceptions are retried here, not inside http_stream_backoff, so that a transfer
                # broken part-way resumes from its last byte (as huggingface_hub's own http_get does).
                with http_stream_backoff("GET", self.url, headers=headers, max_retries=retries,
                                         base_wait_time=wait, retry_on_exceptions=(),
                                         timeout=_download_timeout()) as r:
                    if r.status_code >= 400:
                        r.read()
                        hf_raise_for_status(r)
                    self._check_range(r, start, end)
                    for chunk in r.iter_bytes():
                        k = len(chunk)
                        if done + k > n:
                            raise HubReadError(f"the server sent more than the {end - start + 1} bytes asked for",
                                               rule="hub-range", path=self.name)
                        buf[done:done + k] = chunk
                        done += k
                        got += k
            except CkptError:
                raise
            except Exception as e:
                HUB_STATS.add(got)
                if got:
                    failures = 0  # progress was made: the retry budget starts again
                if is_transient(e) and failures < retries:
                    time.sleep(min(wait * 2**failures, 8.0))
                    failures += 1
                    continue
                raise hub_error(e, ref=self.ref, what=f"reading bytes {start}-{end} of {self.path}") from e
            HUB_STATS.add(got)
            if done < n:  # the body ended early without an error: resume like a broken transfer
                if failures >= retries:
                    raise HubReadError(f"transfer of bytes {start}-{end} stopped early after {retries} retries",
                                       rule="hub-network", path=self.name)
                time.sleep(min(wait * 2**failures, 8.0))
                failures += 1
        IO_STATS.add_read(n)

    def _check_range(self, r, start: int, end: int) -> None:
        if r.status_code == 206:
            got = r.headers.get("Content-Range", "")
            try:
                unit, _, rest = got.partition(" ")
                span = rest.split("/")[0]
                a, b = (int(x) for x in span.split("-"))
            except ValueError:
                raise HubReadError(f"malformed Content-Range {got!r} in a range answer", rule="hub-range",
                                   path=self.name) from None
            if unit != "bytes" or a != start or b != end:
                raise HubReadError(f"asked for bytes {start}-{end}, the server sent {got!r}", rule="hub-range",
                                   path=self.name)
            return
        if r.status_code == 200 and start == 0 and end == self._size - 1:
            return  # a whole-file answer to a whole-file request
        raise HubReadError(f"the server answered {r.status_code} to a Range request for bytes {start}-{end}; "
                           "refusing to download the whole file", rule="hub-range", path=self.name)

    def read_all(self) -> bytes:
        buf = bytearray(self._size)
        self.readinto(0, memoryview(buf))
        return bytes(buf)


class _HubCachedPath(type(Path())):
    """A path in huggingface_hub's cache whose file is downloaded when the path is first used.

    ``os.fspath`` (what ``open``, ``os.link``, ``os.stat`` and pathlib's I/O methods call) runs
    the download once; ``str`` and path arithmetic do not.
    """

    def __init__(self, *args, fetch=None) -> None:
        if sys.version_info >= (3, 12):
            super().__init__(*args)
        self._fetch = fetch
        self._fetched: str | None = None
        self._lock = threading.Lock()

    def __new__(cls, *args, fetch=None):
        return super().__new__(cls, *args) if sys.version_info < (3, 12) else object.__new__(cls)

    def __fspath__(self) -> str:
        fetch = getattr(self, "_fetch", None)
        if fetch is None:
            return str(self)
        with self._lock:
            if self._fetched is None:
                self._fetched = fetch()
        return self._fetched


class _Blob:
    """Bytes that look like a Path to ``checkpoint._read_index`` (reused for identical validation)."""

    def __init__(self, data: bytes, name: str) -> None:
        self._data = data
        self._name = name

    def read_bytes(self) -> bytes:
        return self._data

    def __str__(self) -> str:
        return self._name


@dataclass
class RemoteCheckpoint(Checkpoint):
    """A Checkpoint whose files live in a Hub repository (``local_dir`` is None)."""

    ref: HubRef | None = None
    commit: str = ""
    file_sizes: dict[str, int] = field(default_factory=dict)  # every file of the repository
    lfs_sha256: dict[str, str] = field(default_factory=dict)  # the Hub's sha256 of each LFS file (whole file)

    @property
    def repo_id(self) -> str:
        assert self.ref is not None
        return self.ref.repo_id

    def read_file(self, name: str) -> bytes:
        """The bytes of a small file of the repository (counted in HUB_STATS)."""
        size = self._size_of(name)
        if size > SMALL_FILE_LIMIT:
            raise InputError(f"{name} is {size} bytes; refusing to read it into memory", path=self.root)
        assert self.ref is not None
        return RemoteFile(self.ref, self.commit, name, size).read_all()

    def file_path(self, name: str) -> Path:
        """Where one file of the repository is in huggingface_hub's cache; fetched on first use.

        The path is returned at once (planning and ``--dry-run`` download nothing); the file is
        downloaded with ``hf_hub_download`` the first time the path is opened, linked or stat'ed.
        """
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        self._size_of(name)
        cache = _cache_dir() or constants.HF_HUB_CACHE
        where = Path(cache) / repo_folder_name(repo_id=self.repo_id, repo_type="model") / "snapshots" / \
            self.commit / name
        return _HubCachedPath(where, fetch=lambda: self._download(name))

    def _download(self, name: str) -> str:
        from huggingface_hub import hf_hub_download

        assert self.ref is not None
        path = call(lambda: hf_hub_download(self.repo_id, name, revision=self.commit, endpoint=endpoint(),
                                            cache_dir=_cache_dir()),
                    ref=self.ref, what=f"downloading {name}")
        HUB_STATS.add(self.file_sizes[name], whole_file=True)
        return path

    fetch_file = file_path  # the name ops use to carry a remote file into an output

    def _size_of(self, name: str) -> int:
        if name not in self.file_sizes:
            raise InputError(f"{name} is not a file of this repository", rule="missing-file", path=self.root)
        return self.file_sizes[name]


def open_remote(url: str) -> RemoteCheckpoint:
    """Open ``hf://ORG/REPO[@REV]`` from its headers: config, index, tensor references, other files."""
    from huggingface_hub.hf_api import RepoFile

    ref = parse_hf_url(url)
    api = get_api()
    info = call(lambda: api.model_info(ref.repo_id, revision=ref.revision), ref=ref, what=f"opening {ref}")
    commit = info.sha or ref.rev
    entries = call(lambda: list(api.list_repo_tree(ref.repo_id, revision=commit, recursive=True)),
                   ref=ref, what=f"listing the files of {ref}")
    sizes = {e.path: int(e.size) for e in entries if isinstance(e, RepoFile)}
    lfs = {e.path: e.lfs.sha256 for e in entries if isinstance(e, RepoFile) and e.lfs is not None}
    root = f"hf://{ref.repo_id}@{commit}"
    digests: dict[str, str] = {}

    def small(name: str) -> bytes:
        if sizes[name] > SMALL_FILE_LIMIT:
            raise InputError(f"{name} is {sizes[name]} bytes; refusing to read it into memory", path=root)
        data = RemoteFile(ref, commit, name, sizes[name]).read_all()
        digests[name] = sha256_of(data)  # the fingerprint of the input as read
        return data

    config_present = "config.json" in sizes
    config = ConfigView.from_bytes(small("config.json"), f"{root}/config.json") if config_present else ConfigView({})
    index = None
    if INDEX_NAME in sizes:
        index = _read_index(_Blob(small(INDEX_NAME), f"{root}/{INDEX_NAME}"))
        shard_names = sorted(set(index["weight_map"].values()))
    elif SINGLE_NAME in sizes:
        shard_names = [SINGLE_NAME]
    else:
        raise InputError(f"neither {INDEX_NAME} nor {SINGLE_NAME} found in the repository; is this a safetensors "
                         "checkpoint?", rule="no-weights", path=root)
    sources: dict[str, RemoteFile] = {}
    for name in shard_names:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or "\\" in name or not name:
            raise InputError(f"shard name {name!r} escapes the repository", rule="shard-path", path=root)
        if name not in sizes:
            raise InputError(f"index names shard {name!r}, which does not exist", rule="missing-shard", path=root)
        sources[name] = RemoteFile(ref, commit, name, sizes[name])
    with ThreadPoolExecutor(max_workers=min(HEADER_WORKERS, max(len(sources), 1))) as pool:
        headers: dict[str, Header] = dict(zip(sources, pool.map(read_header, sources.values()), strict=True))
    tensors, shard_keys = references(headers, sources, index, f"{root}/{INDEX_NAME}")
    manifest = None
    if MANIFEST_NAME in sizes:
        manifest = parse_manifest(small(MANIFEST_NAME), f"{root}/{MANIFEST_NAME}")
    return RemoteCheckpoint(root, config, tensors, headers, index, _other_files(sizes), sources, None, shard_keys,
                            manifest, config_present, digests, ref=ref, commit=commit, file_sizes=sizes,
                            lfs_sha256=lfs)


def _other_files(sizes: dict[str, int]) -> list[str]:
    """Non-weight files of the repository, by the same rules as a local directory."""
    out = []
    for name in sorted(sizes):
        parts = PurePosixPath(name).parts
        if any(p.startswith(".") for p in parts) or ".." in parts:
            continue
        base = parts[-1]
        if base in _SKIP_NAMES or base.endswith(_WEIGHT_SUFFIXES) or name == "config.json":
            continue
        out.append(name)
    return out


__all__ = ["RemoteCheckpoint", "RemoteFile", "open_remote", "hub_error"]
