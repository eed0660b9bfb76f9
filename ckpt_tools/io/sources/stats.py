"""Bytes downloaded from remote sources by this process, reported per command and asserted by tests.

One counter for every remote source (the Hub, object stores, any fsspec filesystem): commands
print one line ("downloaded N bytes from ORIGIN in K requests") when anything was fetched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class DownloadStats:
    bytes_downloaded: int = 0
    requests: int = 0
    files_downloaded: int = 0  # whole small files fetched (config, tokenizer, ...)
    origins: set[str] = field(default_factory=set)  # where from: an endpoint or "s3://bucket"
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, *, whole_file: bool = False, origin: str | None = None) -> None:
        with self._lock:
            self.bytes_downloaded += nbytes
            self.requests += 1
            self.files_downloaded += int(whole_file)
            if origin:
                self.origins.add(origin)

    def count_file(self) -> None:
        """A whole file was fetched (its bytes and requests were counted as they came)."""
        with self._lock:
            self.files_downloaded += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes_downloaded = self.requests = self.files_downloaded = 0
            self.origins.clear()

    def to_json(self) -> dict:
        return {"bytes_downloaded": self.bytes_downloaded, "requests": self.requests,
                "files_downloaded": self.files_downloaded}


DOWNLOADS = DownloadStats()


def transfer_summary() -> str | None:
    """One line for a command's report, or None when nothing was downloaded."""
    if not DOWNLOADS.requests:
        return None
    where = ", ".join(sorted(DOWNLOADS.origins)) or "remote sources"
    return f"downloaded {DOWNLOADS.bytes_downloaded:,} bytes from {where} in {DOWNLOADS.requests} requests"
