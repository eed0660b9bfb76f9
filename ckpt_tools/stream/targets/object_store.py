"""An object store as the writer's target: multipart uploads, server-side copies, a lock object.

The writer (``writer.Writer``) is the local one: the plan, the order (shards, files, manifest, check, index
last), the manifest and the resume proof. Here bytes land differently: a shard streams into a multipart upload
in parts of ``PART_SIZE``, completed only when every byte is in; a whole file of a source in the same store is
a server-side copy; small files are single PUTs; the lock is a conditional put (``lock.ObjectLock``); the
resume record holds each finished object's size, ETag and digests, and ``--resume`` keeps an object whose size
and ETag still match.

The check runs on a local mirror of the prefix (headers read back, true sizes, the small files), without
downloading tensor bytes. Server-side copies are not downloaded to be hashed: the manifest records their size
and source.
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

from ...errors import OutputError, UsageError
from ...io.artefacts import LOCK_NAME, RESUME_NAME
from ...io.safetensors_io import COPY_CHUNK, MAX_HEADER_BYTES, Segment, parse_header_bytes
from ..hashcopy import Feed, HashingCopier
from ..output_dir import OUR_ARTEFACTS, previous_written, read_record
from ..plan import OutputFile, OutputTensor, Plan
from ..progress import Progress
from ..writer import FileDigest, _Hasher, source_size
from .lock import ObjectLock
from .store import Store

PART_SIZE = 32 << 20  # multipart part size (S3: at least 5 MiB but for the last part)
MIRROR_WHOLE = 64 << 20  # the check's mirror holds a non-shard file's bytes up to this size (config, tokenizer)
SERVER_COPY = "server-copy"  # OutputFile.link of a file copied inside the store


class ObjectStoreTarget:
    def __init__(self, url: str) -> None:
        self.store = Store.open(url)
        self.name = url
        self.stats: dict[str, dict] = {}  # no local file stats
        self.reused: dict[str, str] = {}
        self._uploads: list = []  # uploads begun and not completed: aborted on failure
        self._done: dict[str, dict] = {}  # finished objects (the resume record's "objects")
        self._copied: set[str] = set()  # files copied server-side (their manifest entry carries the ETag)
        self._record: dict | None = None
        self._written: dict[str, bytes] = {}  # small files PUT by this run: the check's mirror takes them as sent
        self._lock: ObjectLock | None = None
        self._resume = False
        self._scanned = False
        self.copier = HashingCopier()  # a byte range's way into an upload: through its buffer

    def prepare(self, plan: Plan) -> Plan:
        """The plan with every whole file that already lives in this store turned into a server-side copy.

        A file a source leaves in place (``link="remote"``), names by URL (``source="s3://..."``) or by a
        lazy path of a remote source (``LazyPath.source_url``) is copied inside the store; one in another
        store keeps its link (``remote``: listed, not written).
        """
        files = []
        for f in plan.files:
            # a remote source's file is named by URL, or by a lazy local path that knows its URL (never fetched)
            url = f.remote if f.link == "remote" else f.source if isinstance(f.source, str) else \
                getattr(f.source, "source_url", None)
            if url is not None and self.store.in_store(url) is not None:
                f = replace(f, source=url, link=SERVER_COPY, remote=None)
            files.append(f)
        return replace(plan, files=files)

    # -- may this run write here, the lock, what a previous run left -------------------------

    def check(self, plan: Plan, *, overwrite: bool, resume: bool) -> None:
        """Refuse a prefix that overlaps an input in the same store, and a non-empty one unless asked."""
        out = self.store.root
        for url in _input_urls(plan):
            src = self.store.in_store(url)
            if src is not None and (out == src or out.startswith(src + "/") or src.startswith(out + "/")):
                raise UsageError(f"output {self.name} overlaps the input {url}; choose an -o outside every input",
                                 rule="output-overlaps-input")
        leftovers = sorted(n for n in self.store.listing() if n != LOCK_NAME)
        if leftovers and not (overwrite or resume):
            raise OutputError(f"output prefix is not empty ({len(leftovers)} objects, e.g. {leftovers[0]}); pass "
                              "--overwrite to replace it or --resume to finish an interrupted run",
                              rule="output-exists", path=self.name)

    def lock(self) -> None:
        self._lock = ObjectLock(self.store)

    def release(self, complete: bool) -> None:
        if self._lock is not None:
            self._lock.release()

    def read(self, name: str) -> bytes | None:
        return self.store.cat(name)

    def listing(self) -> list[str]:
        return [n for n in self.store.listing() if not n.startswith(".")]

    def remove(self, name: str) -> None:
        self.store.remove([name])

    def clear(self, markers: tuple[str, ...]) -> None:
        listing = self.store.listing()
        listed = set(previous_written(self.store.cat))  # what earlier runs of ours wrote: read before the markers go
        markers = tuple(n for n in markers if n in listing)
        self.store.remove(list(markers))  # the completion markers first: the prefix reads as incomplete from here on
        self.store.remove([n for n in listing if n not in markers and (n in listed or (
            "/" not in n and any(fnmatch(n, p) for p in OUR_ARTEFACTS)))])
        self._abort_stale_uploads()

    def start(self, resume: bool) -> None:
        """No local journal: the resume record's objects carry size, ETag and digests (``_kept``); an object
        rewritten after the kill has another ETag and is written again."""
        self._resume = resume
        record = read_record(self.store.cat) if resume else None
        objects = record.get("objects") if record else None
        if isinstance(objects, dict):  # the record is this plan's: check_resume refused any other
            self._done = {k: v for k, v in objects.items() if isinstance(v, dict)}

    def journal(self, name: str, entry: dict) -> None:
        self._done[name] = {**self._done.get(name, {}), **entry}
        self._save_record()

    def settle(self) -> None:
        pass  # an upload is complete (and durable) when its last part is in

    def finish(self) -> None:
        self.remove(RESUME_NAME)  # a completed upload is durable: nothing to fsync

    def remove_partials(self) -> None:
        for up in self._uploads:
            with contextlib.suppress(Exception):
                up.discard()  # aborts its multipart upload: no part stays billed
            up.closed = True  # discarded: closing it (when collected) must not try to send the rest
        self._uploads.clear()
        if self._resume:
            self._abort_stale_uploads()

    def _abort_stale_uploads(self) -> None:
        """A killed run's unfinished multipart uploads under the prefix (we hold the lock: none is live)."""
        call = getattr(self.store.fs, "call_s3", None)
        if call is None or self._scanned:
            return
        self._scanned = True
        bucket, _, key = self.store.root.partition("/")
        with self.store.errors(self.name, "list uploads"):
            found = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/").get("Uploads") or []
            for u in found:
                self.store.fs.abort_mpu(bucket, u["Key"], u["UploadId"])

    # -- objects ---------------------------------------------------------------------------------

    def _open_upload(self, name: str):
        with self.store.errors(self.store.url_of(name)):
            up = self.store.fs.open(self.store.path(name), "wb", block_size=PART_SIZE, autocommit=False)
        self._uploads.append(up)
        return up

    def _complete(self, up, name: str, size: int, about: dict) -> dict:
        """Complete ``up`` (the object appears whole, or not at all) and record it for --resume."""
        with self.store.errors(self.store.url_of(name)):
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
        if not self._resume or done is None or done.get("size") != size or \
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

    def put(self, name: str, content: bytes) -> None:
        if name == RESUME_NAME:  # the record carries what this run (and a resumed one) finished
            self._record = json.loads(content)
            self._record["objects"] = self._done
            content = (json.dumps(self._record, indent=1) + "\n").encode()
        self._put(name, content)

    def open(self, name: str, head: bytes) -> _Upload:
        self._done.pop(name, None)  # rewritten: the interrupted run's entry no longer describes it
        return _Upload(self, name, head)

    def proven_shard(self, name: str, head: bytes, ordered: list[OutputTensor]) -> dict[str, str] | None:
        size = len(head) + sum(t.nbytes for t in ordered)
        done = self._kept(name, size, {"header_sha256": hashlib.sha256(head).hexdigest()})
        tensors = done.get("tensors") if done is not None else None
        if not isinstance(tensors, dict) or set(tensors) != {t.key for t in ordered}:
            return None
        return {k: v for k, v in tensors.items() if v}

    def copy_file(self, f: OutputFile, hasher: _Hasher, progress: Progress) -> None:
        landed = self._server_copy(f) if f.link == SERVER_COPY else self._upload_file(f, progress)
        if f.tensors:
            hasher.done_file(f.name, landed)

    def landed_facts(self, name: str) -> dict:
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

    @staticmethod
    def moved_bytes(f: OutputFile) -> int:
        """An upload's size (the progress total counts it); a server-side copy moves no byte through us."""
        if f.source is None or f.link in ("remote", SERVER_COPY):
            return 0
        if isinstance(f.source, str) and "://" in f.source:  # a file of another store
            import fsspec

            return fsspec.core.url_to_fs(f.source)[0].size(f.source)
        return source_size(f.source)

    def _upload_file(self, f: OutputFile, progress: Progress) -> tuple:
        """A file from a local source (or another store), streamed into an upload and hashed on the way."""
        import fsspec

        # a path: os.fspath fetches a remote source's lazy path (an hf:// file into the Hub cache) first
        src = f.source if isinstance(f.source, str) else os.fspath(f.source)
        size = self.moved_bytes(f)
        done = self._kept(f.name, size, {"from": src})
        if done is not None and isinstance(done.get("landed"), list):
            progress.advance(size)
            value, _ = done["landed"]
            header = parse_header_bytes(self._read_head(f.name, size)[8:], size, src) if f.tensors else None
            return value, size, header
        d, buf = FileDigest(), memoryview(bytearray(min(COPY_CHUNK, PART_SIZE)))
        with fsspec.open(src, "rb") as fh:
            if size < PART_SIZE:  # a small file (tokenizer, generation config): one PUT
                data = fh.read(size + 1)
                d.update(memoryview(data))
                self._put(f.name, data)
            else:
                up = self._open_upload(f.name)
                while n := fh.readinto(buf):
                    with self.store.errors(self.store.url_of(f.name)):
                        up.write(buf[:n])
                    d.update(buf[:n])
                    progress.advance(n)
        value, got, header = d.result(src)
        if got != size:
            from ...io.safetensors_io import short_read

            raise short_read(src, min(got, size))
        about = {"from": src, "landed": [value, size]}
        if size < PART_SIZE:
            with self.store.errors(self.store.url_of(f.name)):
                self._landed(f.name, size, self.store.fs.info(self.store.path(f.name)), about)
            progress.advance(size)
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

    def barrier(self) -> None:
        return None  # the check reads a local mirror of what was uploaded: run after everything landed

    @contextlib.contextmanager
    def view(self, lone: _Upload | None):
        """The prefix as the check reads it, mirrored locally: headers and true sizes of shards (sparse), small
        files whole; the lone file held back as streamed."""
        with tempfile.TemporaryDirectory(prefix="ckpt-check-") as tmp:
            root = Path(tmp)
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
            if lone is not None:
                _sparse(root / lone.name, lone.head, lone.size)
            yield root, {}


class _Upload:
    """One shard streamed into a multipart upload: every part sent on ``close``, the object completed on
    ``commit`` (before that it does not exist); an upload never completed is aborted (``remove_partials``)."""

    def __init__(self, target: ObjectStoreTarget, name: str, head: bytes) -> None:
        self.target, self.name, self.head, self.size = target, name, head, 0
        self.where = target.store.url_of(name)
        self.up = target._open_upload(name)
        self.write(memoryview(head))

    def write(self, mv: memoryview) -> None:
        with self.target.store.errors(self.where):
            for i in range(0, len(mv), PART_SIZE):  # the upload buffers at most a part before sending it
                self.up.write(mv[i : i + PART_SIZE])
        self.size += len(mv)

    def copy(self, seg: Segment, copier: HashingCopier | None, sink: Feed | None) -> None:
        """A source's byte range through a buffer (a chunk at a time), fed to ``sink`` on the way."""
        (copier or self.target.copier).segment(seg, sink or Feed(), self.write)

    def __enter__(self) -> _Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # a failed upload is aborted with the others (remove_partials)

    def close(self) -> None:
        with self.target.store.errors(self.where):
            self.up.close()  # every part is in; completed by commit (the lone file: after the check)

    def commit(self) -> None:
        self.target._complete(self.up, self.name, self.size,
                              {"header_sha256": hashlib.sha256(self.head).hexdigest()})


def _input_urls(plan: Plan) -> list[str]:
    urls = [str(p) for p in plan.inputs]
    urls += [str(fp["root"]) for fp in plan.fingerprints.values() if isinstance(fp, dict) and "root" in fp]
    for f in plan.files:
        for u in (f.source, f.remote):
            if isinstance(u, str):
                urls.append(u.rsplit("/", 1)[0])  # the checkpoint the file belongs to
    return [u for u in urls if "://" in u]


def _sparse(path: Path, head: bytes, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
