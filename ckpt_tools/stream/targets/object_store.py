"""The writer into an object store: ``writer.Writer`` with its storage steps replaced.

The plan, the order (shards, files, manifest, check, index last), the manifest and the resume proof are
the local writer's; what differs is how bytes land: a shard streams into a multipart upload in parts of
``PART_SIZE``, completed only when every byte is in; a whole file of a source in the same store is a
server-side copy; small files are single PUTs, the index last; the lock is a conditional put
(``lock.ObjectLock``); the resume record holds each finished object's size, ETag and digests, and
``--resume`` keeps an object whose size and ETag still match.

The check runs on a local mirror of the prefix (headers read back, true sizes, the small files), without
downloading tensor bytes. Tensors and uploaded files are hashed as they stream; server-side copies are
not downloaded to be hashed: the manifest records their size and source.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ...errors import OutputError, UsageError
from ...io import digest
from ...io.artefacts import LOCK_NAME, MANIFEST_NAME, RESUME_NAME
from ...io.safetensors_io import MAX_HEADER_BYTES, parse_header_bytes
from .. import manifest
from ..hashcopy import Feed
from ..output_dir import OUR_ARTEFACTS, previous_written, read_record
from ..plan import OutputFile, OutputTensor, Plan
from ..writer import FileDigest, PendingOutput, Writer, WriteResult, source_size
from .lock import ObjectLock
from .store import Store

PART_SIZE = 32 << 20  # multipart part size (S3: at least 5 MiB but for the last part)
MIRROR_WHOLE = 64 << 20  # the check's mirror holds a non-shard file's bytes up to this size (config, tokenizer)
SERVER_COPY = "server-copy"  # OutputFile.link of a file copied inside the store


class _Digests:
    """The writer's hasher for uploads: digests are computed inline, as the bytes stream out."""

    def __init__(self) -> None:
        self.tensors: dict[str, str] = {}
        self.files: dict[str, tuple] = {}

    def results(self) -> tuple[dict[str, str], dict[str, tuple]]:
        return self.tensors, self.files

    def __enter__(self) -> _Digests:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _server_copies(plan: Plan, store: Store) -> Plan:
    """The plan with every whole file that already lives in this store turned into a server-side copy.

    A file a source leaves in place (``link="remote"``), names by URL (``source="s3://..."``) or by a
    lazy path of a remote source (``LazyPath.source_url``) is copied inside the store; one in another
    store keeps its link (``remote``: listed, not written).
    """
    files = []
    for f in plan.files:
        # a remote source's file is named by URL, or by a lazy local path that knows its URL (never fetched here)
        url = f.remote if f.link == "remote" else f.source if isinstance(f.source, str) else \
            getattr(f.source, "source_url", None)
        if url is not None and store.in_store(url) is not None:
            f = replace(f, source=url, link=SERVER_COPY, remote=None)
        files.append(f)
    return replace(plan, files=files)


class ObjectStoreWriter(Writer):
    def __init__(self, plan: Plan, url: str, **kwargs: Any) -> None:
        store = Store.open(url)
        super().__init__(_server_copies(plan, store), url, **kwargs)
        self.out = url  # type: ignore[assignment]  # a URL: every path operation below goes through the store
        self.store = store
        self._uploads: list = []  # uploads begun and not completed: aborted on failure
        self._done: dict[str, dict] = {}  # finished objects (the resume record's "objects")
        self._copied: set[str] = set()  # files copied server-side (their manifest entry carries the ETag)
        self._record: dict | None = None
        self._written: dict[str, bytes] = {}  # small files PUT by this run: the check's mirror takes them as sent
        self._deferred: tuple[bytes, int] | None = None  # the lone file held back: its header bytes and size
        self._scanned = False

    # -- checks -------------------------------------------------------------------------

    def _check_not_an_input(self) -> None:
        """Refuse a prefix that is, is inside, or contains an input in the same store."""
        out = self.store.root
        for url in self._input_urls():
            src = self.store.in_store(url)
            if src is not None and (out == src or out.startswith(src + "/") or src.startswith(out + "/")):
                raise UsageError(f"output {self.out} overlaps the input {url}; choose an -o outside every input",
                                 rule="output-overlaps-input")

    def _input_urls(self) -> list[str]:
        urls = [str(p) for p in self.plan.inputs]
        urls += [str(fp["root"]) for fp in self.plan.fingerprints.values() if isinstance(fp, dict) and "root" in fp]
        for f in self.plan.files:
            for u in (f.source, f.remote):
                if isinstance(u, str):
                    urls.append(u.rsplit("/", 1)[0])  # the checkpoint the file belongs to
        return [u for u in urls if "://" in u]

    def _check_output_dir(self) -> None:
        listing = self.store.listing()
        leftovers = sorted(n for n in listing if n != LOCK_NAME)
        if leftovers and not (self.overwrite or self.resume):
            raise OutputError(f"output prefix is not empty ({len(leftovers)} objects, e.g. {leftovers[0]}); pass "
                              "--overwrite to replace it or --resume to finish an interrupted run",
                              rule="output-exists", path=self.out)

    def _lock(self) -> ObjectLock:
        return ObjectLock(self.store)

    def _clear_previous_output(self) -> None:
        listing = self.store.listing()
        listed = set(previous_written(self.store.cat))  # what earlier runs of ours wrote: read before the markers go
        markers = [n for n in (self.plan.index_name, MANIFEST_NAME, self.plan.single_file_name) if n in listing]
        self.store.remove(markers)  # the completion markers first: the prefix reads as incomplete from here on
        self.store.remove([n for n in listing if n not in markers and (n in listed or (
            "/" not in n and any(fnmatch(n, p) for p in OUR_ARTEFACTS)))])
        self._abort_stale_uploads()

    def _previous_record(self) -> dict | None:
        return read_record(self.store.cat)

    def _check_resume(self, plan_digest: dict[str, str]) -> None:
        super()._check_resume(plan_digest)  # the same job, or a refusal naming what differs
        record = self._previous_record()
        objects = record.get("objects") if record else None
        if isinstance(objects, dict) and record["plan"].get("plan") == plan_digest["plan"]:
            self._done = {k: v for k, v in objects.items() if isinstance(v, dict)}

    def _finished_files(self) -> list[str]:
        return [n for n in self.store.listing() if not n.startswith(".")]

    # -- storage steps ---------------------------------------------------------------------

    def _open_journal(self, manifest: dict | None = None) -> None:
        """No local journal: the resume record's objects carry size, ETag and digests (``_kept``); an object
        rewritten after the kill has another ETag and is written again."""

    def _previous_manifest(self) -> dict | None:
        return None

    def _remove(self, name: str) -> None:
        self.store.remove([name])

    def _remove_partials(self) -> None:
        for up in self._uploads:
            with contextlib.suppress(Exception):
                up.discard()  # aborts its multipart upload: no part stays billed
            up.closed = True  # discarded: closing it (when collected) must not try to send the rest
        self._uploads.clear()
        if self.resume:
            self._abort_stale_uploads()

    def _abort_stale_uploads(self) -> None:
        """A killed run's unfinished multipart uploads under the prefix (we hold the lock: none is live)."""
        call = getattr(self.store.fs, "call_s3", None)
        if call is None or self._scanned:
            return
        self._scanned = True
        bucket, _, key = self.store.root.partition("/")
        with self.store.errors(self.out, "list uploads"):
            found = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/").get("Uploads") or []
            for u in found:
                self.store.fs.abort_mpu(bucket, u["Key"], u["UploadId"])

    def _hasher(self) -> _Digests:  # type: ignore[override]
        return _Digests()

    def _fsync_dir(self) -> None:
        pass  # a completed upload is durable

    def _open_upload(self, name: str):
        with self.store.errors(self.store.url_of(name)):
            up = self.store.fs.open(self.store.path(name), "wb", block_size=PART_SIZE, autocommit=False)
        self._uploads.append(up)
        return up

    def _complete(self, up, name: str, size: int, about: dict) -> dict:
        """Complete ``up`` (the object appears whole, or not at all) and record it for --resume."""
        where = self.store.url_of(name)
        with self.store.errors(where):
            up.close()  # uploads the last part
            up.commit()  # CompleteMultipartUpload
            self._uploads.remove(up)
            info = self.store.fs.info(self.store.path(name))
        return self._landed(name, size, info, about)

    def _landed(self, name: str, size: int, info: dict, about: dict) -> dict:
        if info.get("size") != size:
            raise OutputError(f"the store holds {info.get('size')} bytes, {size} were written", rule="object-store",
                              path=self.store.url_of(name))
        entry = {"size": size, "etag": info.get("ETag") or info.get("etag"), **about}
        self._done[name] = entry
        self._save_record()
        return entry

    def _kept(self, name: str, size: int, about: dict) -> dict | None:
        """A finished object of the interrupted run that is still as recorded (size, ETag, what it holds)."""
        done = self._done.get(name)
        if not self.resume or done is None or done.get("size") != size or \
                any(done.get(k) != v for k, v in about.items()):
            return None
        with self.store.errors(self.store.url_of(name), "read"):
            try:
                info = self.store.fs.info(self.store.path(name))
            except FileNotFoundError:
                return None
        return done if info.get("size") == size and (info.get("ETag") or info.get("etag")) == done.get("etag") else None

    def _save_record(self) -> None:
        if self._record is not None:
            self._record["objects"] = self._done
            self._put(RESUME_NAME, (json.dumps(self._record, indent=1) + "\n").encode())

    def _put(self, name: str, content: bytes) -> None:
        with self.store.errors(self.store.url_of(name)):
            self.store.fs.pipe_file(self.store.path(name), content)
        self._written[name] = content

    # -- shards and files --------------------------------------------------------------------

    def _write_shard(self, name: str, tensors: list[OutputTensor], result: WriteResult, hasher: _Digests,
                     defer: bool):
        header, ordered = self._shard_header(name, tensors)
        head = struct.pack("<Q", len(header)) + header
        size = len(head) + sum(t.nbytes for t in ordered)
        about = {"header_sha256": hashlib.sha256(head).hexdigest()}
        done = self._kept(name, size, about)
        if done is not None and isinstance(done.get("tensors"), dict) and \
                set(done["tensors"]) == {t.key for t in ordered}:
            result.skipped_shards.append(name)
            for t in ordered:
                result.tensor_files[t.key] = name
                if done["tensors"][t.key]:
                    hasher.tensors[t.key] = done["tensors"][t.key]
                self.progress.advance(t.nbytes)
            result.files.append(name)
            return None, name
        up = self._open_upload(name)
        digests: dict[str, str | None] = {}
        where = self.store.url_of(name)

        def write(mv: memoryview, h=None) -> None:
            with self.store.errors(where):
                for i in range(0, len(mv), PART_SIZE):  # the upload buffers at most a part before sending it
                    up.write(mv[i : i + PART_SIZE])
            if h is not None:
                h.update(mv)

        write(memoryview(head))
        for t in ordered:
            h = digest.new() if self.hash_tensors else None
            check = t.check() if t.check is not None else None  # its values judged as they are uploaded
            sink = h if check is None else Feed(h, check)
            self._stream_tensor(t, lambda seg, s=sink: self._read_segment(seg, lambda mv: write(mv, s)),
                                lambda mv, s=sink: write(mv, s))
            if check is not None:
                check.finish()
            digests[t.key] = h.hexdigest() if h is not None else None
            result.tensor_files[t.key] = name
        hasher.tensors.update({k: v for k, v in digests.items() if v is not None})
        result.bytes_written += size
        result.files.append(name)
        if defer:
            with self.store.errors(where):
                up.close()  # every part is in; completed after the check (the lone file is its own marker)
            self._deferred = (head, size)
            return up, name
        self._complete(up, name, size, {**about, "tensors": digests})
        return None, name

    def _read_segment(self, seg, write) -> None:
        """A source's byte range into the upload, through the writer's buffer (a chunk at a time)."""
        done = 0
        while done < seg.length:
            n = min(len(self._buf), seg.length - done)
            seg.source.readinto(seg.offset + done, self._buf[:n])
            write(self._buf[:n])
            done += n

    def _commit_deferred(self, deferred) -> None:
        up, name = deferred
        head, size = self._deferred
        self._complete(up, name, size, {"header_sha256": hashlib.sha256(head).hexdigest()})

    def _write_file(self, f: OutputFile, hasher: _Digests | None = None) -> None:
        if f.link == "remote":
            return  # in another store or on the Hub: listed in the index and the manifest, as locally
        if f.content is not None:
            content = f.content
            if f.name == RESUME_NAME:  # the record carries what this run (and a resumed one) finished
                self._record = json.loads(content)
                self._record["objects"] = self._done
                content = (json.dumps(self._record, indent=1) + "\n").encode()
            self._put(f.name, content)
            return
        assert f.source is not None
        landed = self._server_copy(f) if f.link == SERVER_COPY else self._upload_file(f)
        if f.tensors and hasher is not None:
            hasher.files[f.name] = landed

    def _landed_facts(self, name: str) -> dict:
        """A server-side copy is never downloaded to be hashed: the manifest keeps the store's ETag of the
        copy, which verify-manifest checks against the object (any rewrite changes it)."""
        if name not in self._copied:
            return {}
        etag = (self._done.get(name) or {}).get("etag")
        return {"etag": etag} if etag else {}

    def _server_copy(self, f: OutputFile) -> tuple:
        self._copied.add(f.name)
        src = self.store.in_store(str(f.source))
        where = self.store.url_of(f.name)
        with self.store.errors(where, f"server-side copy from {f.source}"):
            size = self.store.fs.info(src)["size"]
            done = self._kept(f.name, size, {"from": str(f.source)})
            if done is None:
                # CopyObject (UploadPartCopy above 5 GB): no byte leaves the store
                self.store.fs.copy(src, self.store.path(f.name))
                self._landed(f.name, size, self.store.fs.info(self.store.path(f.name)), {"from": str(f.source)})
        header = f.header
        if header is None and f.tensors:
            header = parse_header_bytes(self._read_head(f.name, size)[8:], size, where)
        return None, size, header

    def _moved_bytes(self, f: OutputFile) -> int:
        """An upload's size (the progress total counts it); a server-side copy moves no byte through us."""
        if f.source is None or f.link in ("remote", SERVER_COPY):
            return 0
        if isinstance(f.source, str) and "://" in f.source:  # a file of another store
            import fsspec

            return fsspec.core.url_to_fs(f.source)[0].size(f.source)
        return source_size(f.source)

    def _upload_file(self, f: OutputFile) -> tuple:
        """A file from a local source (or another store), streamed into an upload and hashed on the way."""
        import fsspec

        # a path: os.fspath fetches a remote source's lazy path (an hf:// file into the Hub cache) first
        src = f.source if isinstance(f.source, str) else os.fspath(f.source)
        size = self._moved_bytes(f)
        done = self._kept(f.name, size, {"from": src})
        if done is not None and isinstance(done.get("landed"), list):
            self.progress.advance(size)
            value, _ = done["landed"]
            header = parse_header_bytes(self._read_head(f.name, size)[8:], size, src) if f.tensors else None
            return value, size, header
        d = FileDigest()
        with fsspec.open(src, "rb") as fh:
            if size < PART_SIZE:  # a small file (tokenizer, generation config): one PUT
                data = fh.read(size + 1)
                d.update(memoryview(data))
                self._put(f.name, data)
            else:
                up = self._open_upload(f.name)
                while n := fh.readinto(self._buf[:PART_SIZE]):
                    with self.store.errors(self.store.url_of(f.name)):
                        up.write(self._buf[:n])
                    d.update(self._buf[:n])
                    self.progress.advance(n)
        value, got, header = d.result(src)
        if got != size:
            from ...io.safetensors_io import short_read

            raise short_read(src, min(got, size))
        about = {"from": src, "landed": [value, size]}
        if size < PART_SIZE:
            with self.store.errors(self.store.url_of(f.name)):
                self._landed(f.name, size, self.store.fs.info(self.store.path(f.name)), about)
            self.progress.advance(size)
        else:
            self._complete(up, f.name, size, about)
        return value, size, header

    def _read_head(self, name: str, size: int) -> bytes:
        """The first 8 bytes and the header of an object in the output, by two ranged reads."""
        path = self.store.path(name)
        with self.store.errors(self.store.url_of(name), "read"):
            first = self.store.fs.cat_file(path, start=0, end=min(8, size))
            if len(first) < 8:
                return first
            n = struct.unpack("<Q", first)[0]
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return first  # the check names what is wrong with it
            return first + self.store.fs.cat_file(path, start=8, end=8 + n)

    # -- the check -----------------------------------------------------------------------------

    def _run_check(self, result: WriteResult, deferred) -> None:
        if self.check is None:
            return
        with tempfile.TemporaryDirectory(prefix="ckpt-check-") as tmp:
            root = Path(tmp)
            self._mirror(root, deferred)
            marker = deferred[1] if deferred is not None else self.plan.index_name
            pending = PendingOutput(manifest.index(self.plan, result.tensor_files) if deferred is None else None, {})
            try:
                self._checked(root, pending, marker)
            except OutputError as e:  # name the store's objects, not the mirror
                raise OutputError(e.message.replace(tmp, self.out), rule=e.rule,
                                  path=(e.path or self.out).replace(tmp, self.out)) from None

    def _mirror(self, root: Path, deferred) -> None:
        """The prefix as the check reads it: headers and true sizes of shards (sparse), small files whole."""
        entries = {n: info.get("size", 0) for n, info in self.store.listing().items() if n != LOCK_NAME}
        for name, size in entries.items():
            dst = root / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if name in self._written and len(self._written[name]) == size:
                dst.write_bytes(self._written[name])
            elif name.endswith(".safetensors"):
                _sparse(dst, self._read_head(name, size), size)
            elif size <= MIRROR_WHOLE:
                dst.write_bytes(self.store.cat(name) or b"")
            else:
                _sparse(dst, b"", size)
        if deferred is not None and self._deferred is not None:
            _sparse(root / deferred[1], *self._deferred)


def _sparse(path: Path, head: bytes, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
