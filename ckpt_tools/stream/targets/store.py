"""An output prefix in an object store, through fsspec: names, listings, and errors as OutputErrors.

Credentials come from the backend's standard chain only (for S3: the environment, profiles,
the instance's role, as botocore finds them); nothing here reads, prints or records them.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import CkptError, OutputError


@dataclass
class Store:
    """``url`` (``s3://bucket/prefix``) opened: its filesystem and ``root`` (``bucket/prefix``)."""

    url: str
    fs: Any
    root: str

    @classmethod
    def open(cls, url: str) -> Store:
        from ...io.sources.backends import filesystem, protocol_of

        # no listing cache: the writer lists to decide what exists, and must see the store as it is now
        options: dict = {"use_listings_cache": False}
        if protocol_of(url) in ("s3", "s3a"):
            options["fixed_upload_size"] = True  # every part but the last exactly the part size: memory bounded
        fs, root = filesystem(url, **options)  # a missing backend: one error naming its extra (exit 2)
        return cls(url, fs, root.rstrip("/"))

    @property
    def protocols(self) -> tuple[str, ...]:
        p = self.fs.protocol
        return (p,) if isinstance(p, str) else tuple(p)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def in_store(self, url: str) -> str | None:
        """``url``'s path in this store (same protocol), or None for a local path or another store."""
        if "://" not in url:
            return None
        protocol, rest = url.split("://", 1)
        return rest.rstrip("/") if protocol.lower() in self.protocols else None

    def listing(self) -> dict[str, dict]:
        """Every object under the prefix: name relative to it -> info (size, ETag, ...)."""
        with self.errors(self.url, "list"):
            found = self.fs.find(self.root, detail=True)
        start = len(self.root) + 1
        return {p[start:]: info for p, info in found.items() if p.startswith(self.root + "/")}

    def cat(self, name: str) -> bytes | None:
        with self.errors(self.url_of(name), "read"):
            try:
                return self.fs.cat_file(self.path(name))
            except FileNotFoundError:
                return None

    def remove(self, names: list[str]) -> None:
        """Delete objects under the prefix; a missing one is fine (a delete of it succeeds on S3 too)."""
        for n in names:
            with self.errors(self.url_of(n), "delete"), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(n))

    @contextlib.contextmanager
    def errors(self, where: str, what: str = "write") -> Iterator[None]:
        """A store's failure as an OutputError naming the object (exit 4); our own errors pass through."""
        try:
            yield
        except CkptError:
            raise
        except Exception as e:  # noqa: BLE001 - s3fs, botocore and aiohttp each raise their own
            raise OutputError(f"{what} failed: {describe(e)}", rule="object-store", path=where) from e


def describe(e: BaseException) -> str:
    """One line for a backend's error: what happened, never a credential (none is in these messages)."""
    if isinstance(e, PermissionError):
        return (f"access denied ({e}); credentials come from the standard chain (environment, profile, "
                "instance role): check that they may write here")
    if isinstance(e, FileNotFoundError):
        return f"not found ({e}): does the bucket exist?"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "no space left"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
