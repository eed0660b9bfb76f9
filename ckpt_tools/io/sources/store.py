"""A remote checkpoint's files: an fsspec URL as a listing of (name, size), ranged reads and fetches.

``open_store(url)`` is the one entry point: ``hf://`` gives an ``HfStore`` (commit-pinned), any
other URL an ``FsStore`` over the fsspec filesystem that knows its protocol.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from ...errors import InputError
from .backends import filesystem, protocol_of, read_error
from .ranges import FsFile
from .stats import DOWNLOADS


def is_url(text: str) -> bool:
    """Whether ``text`` names a remote source (``proto://...``) rather than a local path."""
    proto, sep, _ = text.partition("://")
    return bool(sep) and proto.isidentifier() and proto.lower() != "file"


def cache_root() -> Path:
    """Where whole small files of object-store sources land (tokenizer, chat template, ...).

    The tool's cache (``CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpt-tools``); with the cache off, a
    per-user temporary directory: these files are the output's inputs, never kept as a cache entry.
    """
    configured = (os.environ.get("CKPT_CACHE_DIR") or "").strip()
    if configured.lower() in ("off", "0", "no"):
        import tempfile

        return Path(tempfile.gettempdir()) / f"ckpt-tools-{os.getuid()}" / "remote"
    base = configured or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                      "ckpt-tools")
    return Path(base) / "remote"


class FsStore:
    """The files under one fsspec URL (an S3/GCS/Azure prefix, or anything fsspec knows)."""

    def __init__(self, url: str) -> None:
        self.fs, self.path = filesystem(url)
        self.path = self.path.rstrip("/")
        proto = protocol_of(url)
        self.root = f"{proto}://{self.path}"
        self.origin = f"{proto}://{self.path.split('/', 1)[0]}"
        try:
            self.fs.invalidate_cache(self.path)  # a listing cached earlier in the process may be stale
            found = self.fs.find(self.path, detail=True)
        except Exception as e:
            raise read_error(e, self.root, "listing the checkpoint's files") from e
        base = self.path + "/"
        self.sizes: dict[str, int] = {p[len(base):]: int(info.get("size") or 0) for p, info in found.items()
                                      if p.startswith(base) and info.get("type", "file") != "directory"}
        if not self.sizes:
            raise InputError("no files found at this URL (no such bucket, container or prefix, or it is empty)",
                             rule="remote-not-found", path=self.root)
        self.lfs_sha256: dict[str, str] = {}

    def url_of(self, name: str) -> str:
        return f"{self.root}/{name}"

    def open_file(self, name: str) -> FsFile:
        return FsFile(self.fs, f"{self.path}/{name}", self.url_of(name), self.sizes[name], self.origin)

    def fetch(self, name: str) -> Path:
        """A local copy of one (small) file, downloaded the first time the path is used."""
        from .hf import LazyPath

        key = hashlib.sha256(self.url_of(name).encode()).hexdigest()[:24]
        where = cache_root() / key / Path(name).name
        return LazyPath(where, fetch=lambda: self._download(name, where), url=self.url_of(name),
                        size=self.sizes.get(name))

    def _download(self, name: str, where: Path) -> str:
        size = self.sizes[name]  # fetched every time: an object may change under the same name and size
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_name(f".{where.name}.{os.getpid()}.{threading.get_ident()}.partial")
        src = self.open_file(name)
        try:
            with open(tmp, "wb") as f:
                for chunk in src.stream(0, size) if size else ():
                    f.write(chunk)
            os.replace(tmp, where)
        finally:
            tmp.unlink(missing_ok=True)
        DOWNLOADS.count_file()
        return str(where)


def open_store(url: str):
    """The store behind ``url``: an HfStore for ``hf://``, else an FsStore."""
    if url.startswith("hf://"):
        from .hf import HfStore

        return HfStore(url)
    return FsStore(url)
