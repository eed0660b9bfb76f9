"""``hf://ORG/REPO[@REV]``: a Hub repository as a store of files read by HTTP ranges.

The revision is pinned to a commit when the store is opened, so every later read sees the same
files. Ranges go through huggingface_hub's session and backoff; this reader is kept (rather than
``HfFileSystem``'s ``_fetch_range``) because it resumes a transfer broken part-way from its last
byte and refuses an answer whose ``Content-Range`` is not the range asked for. ``fs`` is
``HfFileSystem`` on the same endpoint, for callers that want fsspec.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

from ...errors import CkptError
from ..hub import HubReadError, HubRef, call, endpoint, get_api, hub_error, is_transient, parse_hf_url, retry_settings
from .ranges import RangedFile
from .stats import DOWNLOADS


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


class RemoteFile(RangedFile):
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

    def fetch(self, start: int, end: int) -> bytearray:
        buf = bytearray(end - start)
        self._read_range(start, memoryview(buf))
        return buf  # a bytearray is bytes enough for every reader, and saves a copy

    def _read_range(self, offset: int, buf: memoryview) -> None:
        n = len(buf)
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
                DOWNLOADS.add(got, origin=endpoint())
                if got:
                    failures = 0  # progress was made: the retry budget starts again
                if is_transient(e) and failures < retries:
                    time.sleep(min(wait * 2**failures, 8.0))
                    failures += 1
                    continue
                raise hub_error(e, ref=self.ref, what=f"reading bytes {start}-{end} of {self.path}") from e
            DOWNLOADS.add(got, origin=endpoint())
            if done < n:  # the body ended early without an error: resume like a broken transfer
                if failures >= retries:
                    raise HubReadError(f"transfer of bytes {start}-{end} stopped early after {retries} retries",
                                       rule="hub-network", path=self.name)
                time.sleep(min(wait * 2**failures, 8.0))
                failures += 1

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


class LazyPath(type(Path())):
    """A path in huggingface_hub's cache whose file is downloaded when the path is first used.

    ``os.fspath`` (what ``open``, ``os.link``, ``os.stat`` and pathlib's I/O methods call) runs
    the download once; ``str`` and path arithmetic do not.
    """

    def __init__(self, *args, fetch=None, url: str | None = None, size: int | None = None) -> None:
        if sys.version_info >= (3, 12):
            super().__init__(*args)
        self._fetch = fetch
        self._fetched: str | None = None
        self._lock = threading.Lock()
        self.source_url = url  # where the file lives: an output in the same store copies it server-side
        self.size = size  # as listed by its store: a progress total counts it without downloading it

    def __new__(cls, *args, fetch=None, url: str | None = None, size: int | None = None):
        return super().__new__(cls, *args) if sys.version_info < (3, 12) else object.__new__(cls)

    def __fspath__(self) -> str:
        fetch = getattr(self, "_fetch", None)
        if fetch is None:
            return str(self)
        with self._lock:
            if self._fetched is None:
                self._fetched = fetch()
        return self._fetched


class HfStore:
    """The files of one Hub repository at one commit."""

    def __init__(self, url: str) -> None:
        from huggingface_hub.hf_api import RepoFile

        ref = parse_hf_url(url)
        api = get_api()
        info = call(lambda: api.model_info(ref.repo_id, revision=ref.revision), ref=ref, what=f"opening {ref}")
        self.ref = ref
        self.commit = info.sha or ref.rev
        entries = call(lambda: list(api.list_repo_tree(ref.repo_id, revision=self.commit, recursive=True)),
                       ref=ref, what=f"listing the files of {ref}")
        self.sizes = {e.path: int(e.size) for e in entries if isinstance(e, RepoFile)}
        self.lfs_sha256 = {e.path: e.lfs.sha256 for e in entries if isinstance(e, RepoFile) and e.lfs is not None}
        self.root = f"hf://{ref.repo_id}@{self.commit}"
        self._fs = None

    @property
    def fs(self):
        if self._fs is None:
            from huggingface_hub import HfFileSystem

            self._fs = HfFileSystem(endpoint=endpoint())
        return self._fs

    def url_of(self, name: str) -> str:
        return f"{self.root}/{name}"

    def open_file(self, name: str) -> RemoteFile:
        return RemoteFile(self.ref, self.commit, name, self.sizes[name])

    def fetch(self, name: str) -> Path:
        """Where the file is in huggingface_hub's cache; downloaded the first time the path is used."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        cache = _cache_dir() or constants.HF_HUB_CACHE
        where = Path(cache) / repo_folder_name(repo_id=self.ref.repo_id, repo_type="model") / "snapshots" / \
            self.commit / name
        return LazyPath(where, fetch=lambda: self._download(name), size=self.sizes.get(name))

    def _download(self, name: str) -> str:
        from huggingface_hub import hf_hub_download

        path = call(lambda: hf_hub_download(self.ref.repo_id, name, revision=self.commit, endpoint=endpoint(),
                                            cache_dir=_cache_dir()),
                    ref=self.ref, what=f"downloading {name}")
        DOWNLOADS.add(self.sizes[name], whole_file=True, origin=endpoint())
        return path
