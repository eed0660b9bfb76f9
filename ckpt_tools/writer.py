"""The one streaming writer: executes any plan, shard by shard, atomically.

Per output shard: write the header, stream each recipe's bytes (kernel copies for
byte ranges, chunks for computed tensors), fsync, rename from a hidden temporary
name. Non-tensor files follow, then the manifest, then the caller's check (``ckpt
validate`` on the output as it will be), and the completion marker last
(``model.safetensors.index.json``, or the lone ``model.safetensors``): a crash or a
failed check leaves no marker, so an incomplete output is obviously incomplete.

Before the first shard a resume record (``.ckpt-resume.json``: the plan's digest and
its input fingerprints) is written; ``--resume`` continues only a run whose record
equals the new plan's, so a finished shard of another job is never reused.

The manifest accounts for every tensor of the output: a digest (BLAKE3, see ``digest``) per
tensor written, and the whole-file digest of each shard copied or linked as it is - all hashed from the
bytes that landed in the output, on hasher threads beside the copies.

Memory stays bounded by one computed chunk; copied bytes never enter Python.

An object-store output (``-o s3://bucket/prefix``) runs this same writer with its storage steps
(lock, uploads, copies, removals, the check's view of the output) replaced: ``targets.object_store``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, digest
from .dtypes import DTYPES
from .errors import CkptError, OutputError, UsageError
from .jsonutil import dumps_strict
from .plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan, fingerprint_change
from .safetensors_io import (
    COPY_CHUNK,
    IO_STATS,
    MAX_HEADER_BYTES,
    Header,
    LocalFile,
    Segment,
    _write_all,
    copy_segment,
    parse_header_bytes,
)

MANIFEST_NAME = "ckpt_manifest.json"
LOCK_NAME = ".ckpt.lock"
RESUME_NAME = ".ckpt-resume.json"
# Files a previous run of ours may have left; --overwrite clears them before writing.
_OUR_ARTEFACTS = ("*.safetensors", "*.safetensors.index.json", MANIFEST_NAME, "stitch-report.json", "graft-report.json",
                  RESUME_NAME)


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict | None) -> bytes:
    """Serialise a header the way safetensors does: compact JSON, padded with spaces to 8 bytes.

    ``tensors`` are (key, dtype, shape, nbytes) in file order.
    """
    obj: dict = {}
    if metadata is not None:
        obj["__metadata__"] = metadata
    pos = 0
    for key, dtype, shape, nbytes in tensors:
        obj[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def safetensors_order(tensors: list[OutputTensor]) -> list[OutputTensor]:
    """Descending dtype (safetensors' enum order), then name: aligned, and identical to save_file."""
    return sorted(tensors, key=lambda t: (-DTYPES[t.dtype].rank, t.key))


class Progress:
    """Sink for bytes written; the CLI plugs a rich progress bar in."""

    def start(self, total: int, description: str) -> None: ...

    def advance(self, n: int) -> None: ...

    def stop(self) -> None: ...


@dataclass
class WriteResult:
    out_dir: Path | str  # a directory, or an object store's URL
    files: list[str] = field(default_factory=list)
    tensor_files: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # tensor key -> digest.MANIFEST_ALGO of its bytes
    bytes_written: int = 0
    seconds: float = 0.0
    skipped_shards: list[str] = field(default_factory=list)
    bytes_read: int = 0  # IO_STATS.total before the output's check (which reads the output, not the inputs)
    # files copied or linked whole: name -> (digest, size, header) of what landed in the output
    landed: dict[str, tuple[str, int, object]] = field(default_factory=dict)


@dataclass
class PendingOutput:
    """An output with every file in place but its completion marker: what a check sees first.

    ``index`` is the index about to be written (None for a lone file); ``renamed`` maps final
    file names to the temporary files still holding them (the lone ``model.safetensors``).
    """

    index: dict | None
    renamed: dict[str, Path]


Check = Callable[[Path, PendingOutput], None]


def _real(path: Path) -> Path:
    """The real path of ``path``, which may not exist yet: its nearest existing ancestor, resolved."""
    p = Path(os.path.abspath(path))
    rest: list[str] = []
    while not p.exists() and p != p.parent:
        rest.append(p.name)
        p = p.parent
    return p.resolve().joinpath(*reversed(rest))


def _plain_file(st: os.stat_result) -> bool:
    """A regular file with one name: writing it changes nothing outside the output."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _open_lock(path: Path) -> int:
    """Open (creating) the lock file without following a link; only a plain file of ours is used.

    O_NOFOLLOW refuses a symlink, O_NONBLOCK keeps a FIFO from blocking the open, and the
    fstat refuses devices, FIFOs and hard links to other files before a byte is written.
    (Not O_EXCL: a killed run's lock file must not block ``--resume``; flock decides.)
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else f"not usable ({e.strerror})"
        raise OutputError(f"{LOCK_NAME} is {what}; the lock is never written through a link or into another "
                          "file: remove it", rule="lock-file", path=str(path)) from None
    st = os.fstat(fd)
    if not _plain_file(st):
        os.close(fd)
        what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise OutputError(f"{LOCK_NAME} is {what}; the lock is never written into another file: remove it",
                          rule="lock-file", path=str(path))
    return fd


class _Lock:
    """An advisory lock on the output directory: a second writer refuses instead of interleaving.

    An flock: the kernel releases it when its holder dies, so a lock file left by a killed
    run never blocks ``--resume``.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        while True:
            self.fd = _open_lock(self.path)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip()
                os.close(self.fd)
                raise OutputError(
                    f"another ckpt command{f' (pid {holder})' if holder else ''} is writing this directory "
                    f"(lock {LOCK_NAME} held); wait for it or pick another -o",
                    path=str(out_dir),
                ) from None
            # The holder we waited on may have unlinked the file between our open and flock: then we
            # locked an orphan inode while a third writer may lock a new file. Retry on the live path.
            try:
                same = os.path.samestat(os.fstat(self.fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self.fd)
        try:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
        except OSError:
            self.release()
            raise

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


class Writer:
    def __init__(
        self,
        plan: Plan,
        out_dir: str | os.PathLike,
        *,
        overwrite: bool = False,
        resume: bool = False,
        progress: Progress | None = None,
        hash_tensors: bool = True,
        check: Check | None = None,
    ) -> None:
        self.plan = plan
        self.out = Path(out_dir)
        self.overwrite = overwrite
        self.resume = resume
        self.progress = progress or Progress()
        self.hash_tensors = hash_tensors
        self.check = check
        self._buf = memoryview(bytearray(COPY_CHUNK))

    # -- checks -----------------------------------------------------------------

    def _check_not_an_input(self) -> None:
        """Refuse an -o that is, is inside, or contains an input: an input must never change.

        Real paths (links resolved; a missing -o by its nearest existing parent). An input
        directory is the whole directory; an input file is that file.
        """
        out = _real(self.out)
        for src in self.plan.inputs:
            real = Path(src).resolve()
            if out == real:
                where = "is an input of this command"
            elif real.is_dir() and out.is_relative_to(real):
                where = f"is inside the input {real}"
            elif real.is_relative_to(out):
                where = f"contains the input {real}"
            else:
                continue
            raise UsageError(f"output directory {self.out} {where}; choose an -o outside every input",
                             rule="output-overlaps-input")

    def _check_output_dir(self) -> None:
        """Refuse a non-empty directory unless --overwrite / --resume.

        Called before creating the directory and again under the lock: a concurrent writer may
        have filled it in between. Only a plain lock file is not counted (a link or anything
        else named like the lock is someone else's).
        """
        if self.out.exists() and not self.out.is_dir():
            raise OutputError("output path exists and is not a directory", path=str(self.out))
        if self.out.exists():
            leftovers = [p.name for p in self.out.iterdir()
                         if p.name != LOCK_NAME or not _plain_file(p.lstat())]
            if leftovers and not (self.overwrite or self.resume):
                raise OutputError(
                    f"output directory is not empty ({len(leftovers)} entries, e.g. {sorted(leftovers)[0]}); "
                    "pass --overwrite to replace it or --resume to finish an interrupted run",
                    path=str(self.out),
                )

    def _clear_previous_output(self) -> None:
        # The completion markers go first, so the directory reads as incomplete from here on.
        for name in (self.plan.index_name, MANIFEST_NAME, self.plan.single_file_name):
            p = self.out / name
            if p.exists() or p.is_symlink():
                p.unlink()
        for pattern in _OUR_ARTEFACTS:
            for p in self.out.glob(pattern):
                p.unlink()

    def _previous_record(self) -> dict | None:
        """What the interrupted run was doing: its resume record, else the manifest of a finished run."""
        for name in (RESUME_NAME, MANIFEST_NAME):
            p = self.out / name
            if not p.is_file() or p.is_symlink():
                continue
            try:
                record = json.loads(p.read_bytes())
            except (OSError, ValueError, RecursionError):
                continue
            if isinstance(record, dict) and isinstance(record.get("plan"), dict):
                return record
        return None

    def _check_resume(self, plan_digest: dict[str, str]) -> None:
        """--resume continues only the same job: same plan, same inputs (names what differs)."""
        def refuse(msg: str, path: str) -> OutputError:
            return OutputError(f"--resume refused: {msg}; finished shards would not be this job's. Pass --overwrite "
                               "to start again", rule="resume-mismatch", path=path)

        record = self._previous_record()
        if record is None and not self._finished_files():
            return  # nothing written yet (killed before the first file): nothing to reuse, nothing to prove
        if record is None:
            raise refuse(f"{self.out} holds no resume record ({RESUME_NAME}) or manifest of a run of this plan",
                         str(self.out))
        old = record["plan"]
        if old.get("plan") == plan_digest["plan"]:
            return
        inputs = record.get("inputs")
        change = fingerprint_change(inputs, self.plan.fingerprints) if isinstance(inputs, dict) else None
        if change is not None:
            raise refuse(f"{change[1]} since the interrupted run", change[0])
        parts = [k for k in sorted(plan_digest) if k != "plan" and old.get(k) != plan_digest[k]]
        raise refuse(f"the plan differs from the interrupted run's ({', '.join(parts) or 'plan'}: other options, "
                     "tables or tool version)", str(self.out))

    def _finished_files(self) -> list[str]:
        """What a run left in place (hidden lock, record and temporary files aside)."""
        return [p.name for p in self.out.iterdir() if not p.name.startswith(".")]

    # -- execution ----------------------------------------------------------------

    def run(self) -> WriteResult:
        t0 = time.monotonic()
        self._check_not_an_input()
        self._check_output_dir()
        lock = self._lock()
        try:
            plan_digest = self.plan.digest()
            self._check_output_dir()
            if self.resume:
                self._check_resume(plan_digest)  # before anything is touched: a refusal leaves the directory as it was
        except BaseException:
            lock.release()
            raise
        result = WriteResult(self.out)
        complete = False
        try:
            if self.resume:
                # An index or manifest from the interrupted run would claim completeness early, and its
                # temporary files (we hold the lock: nobody is writing them) only take disk space.
                for name in (self.plan.index_name, MANIFEST_NAME):
                    self._remove(name)
                self._remove_partials()
            elif self.overwrite:
                self._clear_previous_output()
            record = {"plan": plan_digest, "inputs": self.plan.fingerprints, "command": self.plan.command}
            self._write_file(OutputFile(RESUME_NAME, content=(json.dumps(record, indent=1) + "\n").encode()))
            shards = self.plan.shards()
            single = list(shards) == [self.plan.single_file_name] and not any(
                f.name.endswith(".safetensors") for f in self.plan.files
            )
            self.progress.start(self.plan.total_bytes, self.plan.command)
            deferred: tuple[Path, Path] | None = None
            with self._hasher() as hasher:
                # shards copied or linked whole first: their hashing then overlaps the shards being written
                whole = [f for f in self.plan.files if f.tensors]
                for f in whole:
                    self._write_file(f, hasher)
                for name, tensors in shards.items():
                    tmp, final = self._write_shard(name, tensors, result, hasher, defer=single)
                    if single:
                        deferred = (tmp, final)
                for f in self.plan.files:
                    if not f.tensors:
                        self._write_file(f, hasher)
                    result.files.append(f.name)
                result.digests, result.landed = hasher.results()
            self._write_manifest(result, plan_digest)
            result.bytes_read = IO_STATS.total
            self._run_check(result, deferred)
            if deferred is not None:
                self._commit_deferred(deferred)
            else:
                self._write_index(result)
            complete = True
            self._fsync_dir()
            self._remove(RESUME_NAME)  # done: nothing left to resume
        except OSError as e:
            raise self._output_error(e) from e
        finally:
            self.progress.stop()
            self._remove_partials()
            if not complete:  # a manifest without its completion marker would read as a finished run
                self._remove(MANIFEST_NAME)
            lock.release()
        result.seconds = time.monotonic() - t0
        return result

    # -- what a target other than a local directory replaces (targets/) ----------------

    def _lock(self) -> _Lock:
        """Create the output directory and take its lock."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory: {e.strerror}", path=str(self.out)) from e
        try:
            return _Lock(self.out)
        except OSError as e:
            raise self._output_error(e, str(self.out / LOCK_NAME)) from e

    def _remove(self, name: str) -> None:
        (self.out / name).unlink(missing_ok=True)

    def _remove_partials(self) -> None:
        """Temporary files of unfinished writes (ours, or a killed run's: we hold the lock)."""
        for p in self.out.glob(".*.partial"):
            p.unlink(missing_ok=True)

    def _hasher(self) -> _Hasher:
        return _Hasher(digest.hash_threads() if self.hash_tensors else None)  # threads beside the copies (digest)

    def _commit_deferred(self, deferred: tuple[Path, Path]) -> None:
        os.replace(*deferred)

    def _run_check(self, result: WriteResult, deferred: tuple[Path, Path] | None) -> None:
        """The caller's check of the output as it will be; a failure leaves it without its marker."""
        if self.check is None:
            return
        if deferred is not None:
            pending = PendingOutput(None, {deferred[1].name: deferred[0]})
            marker = deferred[1].name
        else:
            pending = PendingOutput(self._index(result), {})
            marker = self.plan.index_name
        self._checked(self.out, pending, marker)

    def _checked(self, root: Path, pending: PendingOutput, marker: str) -> None:
        assert self.check is not None
        try:
            self.check(root, pending)
        except CkptError as e:
            raise OutputError(f"{e.message}; the output was left incomplete (no {marker}, no {MANIFEST_NAME})",
                              rule=e.rule or "output-invalid", path=e.path or str(self.out)) from None

    def _output_error(self, e: OSError, where: str | None = None, written: int | None = None) -> OutputError:
        what = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        if e.errno == errno.EFBIG:
            what = "file size limit exceeded"
        elif e.errno == errno.EDQUOT:
            what = "disk quota exceeded"
        suffix = f" after {written} bytes" if written is not None else ""
        return OutputError(f"write failed ({what}){suffix}", path=where or str(self.out))

    def _shard_header(self, name: str, tensors: list[OutputTensor]) -> tuple[bytes, list[OutputTensor]]:
        layout = self.plan.shard_layouts.get(name)
        meta = {"format": "pt"}
        if layout is not None:
            by_key = {t.key: t for t in tensors}
            if sorted(layout.order) != sorted(by_key):
                raise RuntimeError(f"layout of {name} does not match its planned tensors")
            ordered = [by_key[k] for k in layout.order]
            generated = header_bytes([(t.key, t.dtype, t.shape, t.nbytes) for t in ordered], meta)
            if layout.header_bytes is not None and _same_entries(layout.header_bytes, generated):
                return layout.header_bytes, ordered
            return generated, ordered
        ordered = safetensors_order(tensors)
        return header_bytes([(t.key, t.dtype, t.shape, t.nbytes) for t in ordered], meta), ordered

    def _write_shard(self, name: str, tensors: list[OutputTensor], result: WriteResult, hasher: _Hasher,
                     defer: bool) -> tuple[Path, Path]:
        header, ordered = self._shard_header(name, tensors)
        final = self.out / name
        tmp = self.out / f".{name}.partial"
        if self.resume and self._shard_complete(final, header, ordered):
            result.skipped_shards.append(name)
            reader = hasher.open(final)
            pos = 8 + len(header)
            for t in ordered:
                result.tensor_files[t.key] = name
                hasher.tensor(t.key, reader, pos, t.nbytes)
                pos += t.nbytes
                self.progress.advance(t.nbytes)
            result.files.append(name)
            return final, final
        fd = _create(tmp)
        written = 0
        try:
            reader = hasher.open(tmp)
            _write_all(fd, memoryview(struct.pack("<Q", len(header)) + header))
            pos = 8 + len(header)
            for t in ordered:
                self._write_tensor(fd, t)
                hasher.tensor(t.key, reader, pos, t.nbytes)  # what landed, hashed while the next copy runs
                pos += t.nbytes
                written += t.nbytes
                result.tensor_files[t.key] = name
            os.fsync(fd)
        except OSError as e:
            written = _size_of(fd, written)
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise self._output_error(e, str(final), written) from e
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        result.bytes_written += pos
        result.files.append(name)
        if not defer:
            os.replace(tmp, final)  # the hashes read through their own descriptor: no need to wait for them
        return tmp, final

    def _write_tensor(self, fd: int, t: OutputTensor) -> None:
        self._stream_tensor(t, lambda seg: copy_segment(seg, fd, self._buf), lambda mv: _write_all(fd, mv))

    def _stream_tensor(self, t: OutputTensor, copy: Callable[[Segment], None],
                       write: Callable[[memoryview], None]) -> None:
        """A tensor's bytes in order: its byte ranges through ``copy``, computed chunks through ``write``."""
        recipe = t.recipe
        if isinstance(recipe, CopyBytes):
            if recipe.nbytes != t.nbytes:
                raise RuntimeError(f"plan error: {t.key} copies {recipe.nbytes} bytes, needs {t.nbytes}")
            for seg in recipe.segments:
                copy(seg)
                self.progress.advance(seg.length)
            return
        assert isinstance(recipe, Compute)
        from .numeric import as_bytes  # numpy is only needed for computed tensors

        n = 0
        for chunk in recipe.produce():
            mv = as_bytes(chunk)
            if n + len(mv) > t.nbytes:
                raise RuntimeError(f"plan error: {t.key} produced more than {t.nbytes} bytes")
            write(mv)
            n += len(mv)
            self.progress.advance(len(mv))
        if n != t.nbytes:
            raise RuntimeError(f"plan error: {t.key} produced {n} bytes, needs {t.nbytes}")

    @staticmethod
    def _shard_complete(final: Path, header: bytes, ordered: list[OutputTensor]) -> bool:
        if not final.is_file() or final.is_symlink():
            return False
        size = 8 + len(header) + sum(t.nbytes for t in ordered)
        if final.stat().st_size != size:
            return False
        with open(final, "rb") as f:
            return f.read(8 + len(header)) == struct.pack("<Q", len(header)) + header

    def _write_file(self, f: OutputFile, hasher: _Hasher | None = None) -> None:
        """Write, copy or link one file; a copied shard is then hashed as it landed."""
        if f.link == "remote":
            return  # listed in the index and the manifest; `ckpt push --base` copies it server-side
        final = self.out / f.name
        final.parent.mkdir(parents=True, exist_ok=True)
        if not final.parent.resolve().is_relative_to(self.out.resolve()):
            raise OutputError(f"{final.parent.relative_to(self.out)} is a link out of the output directory; the "
                              "output is never written through a link: remove it", rule="output-link",
                              path=str(final.parent))
        if f.content is not None:
            tmp = final.with_name(f".{final.name}.partial")
            with self._cleanup_on_error(tmp, final), open(tmp, "wb", opener=_exclusive) as fh:
                fh.write(f.content)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            return
        assert f.source is not None
        if final.exists() or final.is_symlink():
            if f.link == "hardlink" or not self.resume or final.is_symlink():
                final.unlink()
            else:
                self._hash_landed(f, final, hasher)
                return  # resumed: a finished copy (renamed into place) is complete
        if f.link == "hardlink":
            try:
                os.link(f.source, final)
            except OSError as e:
                raise OutputError(
                    f"cannot hardlink {f.source} ({e.strerror}); use --link copy or put the output on the same "
                    "filesystem", path=str(final)
                ) from e
        else:
            tmp = final.with_name(f".{final.name}.partial")
            with self._cleanup_on_error(tmp, final):
                copy_whole_file(f.source, tmp, reflink=f.link == "reflink", progress=self.progress, buf=self._buf)
            os.replace(tmp, final)
        self._hash_landed(f, final, hasher)

    @staticmethod
    def _hash_landed(f: OutputFile, final: Path, hasher: _Hasher | None) -> None:
        if f.tensors and hasher is not None:
            hasher.file(f.name, final)

    @contextlib.contextmanager
    def _cleanup_on_error(self, tmp: Path, final: Path):
        """A failed write removes its temporary file and names the file and the bytes that reached it.

        Only the output's own errors become output errors; an input that cannot be read stays
        the InputError it is - its temporary file is removed all the same.
        """
        try:
            yield
        except OSError as e:
            try:
                written = tmp.stat().st_size
            except OSError:
                written = None
            tmp.unlink(missing_ok=True)
            raise self._output_error(e, str(final), written) from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _landed_facts(self, name: str) -> dict:
        """What the storage itself vouches for about a landed file (an object store's ETag); none locally."""
        return {}

    def _write_manifest(self, result: WriteResult, plan_digest: dict[str, str]) -> None:
        """Every tensor of the output: written ones with their digest, those in copied shards by their file's."""
        manifest = {
            "tool": "ckpt-tools",
            "version": __version__,
            "command": self.plan.command,
            **self.plan.manifest,
            "inputs": self.plan.fingerprints,
            "plan": plan_digest,
            "files": {},
            "tensors": {},
        }
        for t in self.plan.tensors:
            entry = {
                "file": result.tensor_files[t.key],
                "dtype": t.dtype,
                "shape": list(t.shape),
            }
            if t.key in result.digests:
                entry[digest.MANIFEST_ALGO] = result.digests[t.key]
            entry.update(t.meta)
            manifest["tensors"][t.key] = entry
        for f in self.plan.files:
            if not f.tensors:
                continue
            header = f.header
            if f.link == "remote":
                about = {"remote": f.remote, **({"sha256": f.sha256} if f.sha256 else {})}  # the Hub's LFS oid
            elif f.name in result.landed:
                value, size, header = result.landed[f.name]
                # no digest: copied server-side in an object store, never downloaded to be hashed
                about = {**({digest.MANIFEST_ALGO: value} if value else {}), "size": size,
                         "copied_from": str(f.source), "link": f.link, **self._landed_facts(f.name)}
            else:
                continue  # hashing off (benchmark fixtures)
            manifest["files"][f.name] = about
            keys = header.tensors if header is not None else dict.fromkeys(f.tensors)
            for key, info in keys.items():
                entry = {"file": f.name}
                if info is not None:
                    entry.update(dtype=info.dtype, shape=list(info.shape))
                manifest["tensors"][key] = entry
        remote = {f.name: f.remote for f in self.plan.files if f.link == "remote"}
        if remote:
            # shards deliberately not downloaded: the output is complete once pushed over its base
            manifest["remote_files"] = remote
        content = (dumps_strict(manifest, indent=1) + "\n").encode()  # strict: no bare NaN/Infinity
        self._write_file(OutputFile(MANIFEST_NAME, content=content))

    def _index(self, result: WriteResult) -> dict:
        weight_map = dict(result.tensor_files)
        total = sum(t.nbytes for t in self.plan.tensors)
        for f in self.plan.files:
            for key, nbytes in f.tensors.items():
                weight_map[key] = f.name
                total += nbytes
        return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}

    def _write_index(self, result: WriteResult) -> None:
        content = (json.dumps(self._index(result), indent=2) + "\n").encode()
        self._write_file(OutputFile(self.plan.index_name, content=content))

    def _fsync_dir(self) -> None:
        fd = os.open(self.out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exclusive(path: str, flags: int) -> int:
    """An ``open`` opener for temporary files: a new file, never through a link or into another file.

    Whatever an earlier run (or anyone) left under the name is unlinked first - a link is
    removed, its target untouched.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)


def _create(path: Path) -> int:
    return _exclusive(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)


def write_file_atomically(path: Path, content: bytes) -> None:
    """``content`` into ``path`` by a new temporary file, fsync and rename (never through a link)."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb", opener=_exclusive) as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _size_of(fd: int, default: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return default


def _same_entries(a: bytes, b: bytes) -> bool:
    """Two headers describe the same tensors at the same offsets (formatting aside)."""
    try:
        ja, jb = json.loads(a), json.loads(b)
    except ValueError:
        return False
    ja.pop("__metadata__", None)
    jb.pop("__metadata__", None)
    return ja == jb


HASH_CHUNK = 4 << 20  # small: the hashers run beside the main thread's own buffers


class _Hasher:
    """Digests of what landed in the output, on threads beside the copies (the hash releases the GIL).

    Tensor ranges are read through a descriptor opened on the shard's temporary file: it
    survives the rename, so a shard goes into place without waiting for its hashes. With
    0 threads each hash runs inline; with None nothing is hashed (synthetic benchmark inputs).
    """

    def __init__(self, threads: int | None) -> None:
        self.pool = digest.executor(threads) if threads is not None else None
        self._tensors: dict[str, Future] = {}
        self._files: dict[str, Future] = {}
        self._readers: dict[int, list[Future]] = {}  # open descriptor -> its pending hashes

    def open(self, path: Path) -> int:
        self._close_readers(only_done=True)
        if self.pool is None:
            return -1
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._readers[fd] = []
        return fd

    def tensor(self, key: str, reader: int, offset: int, length: int) -> None:
        if self.pool is not None:
            self._tensors[key] = fut = self.pool.submit(_hash_fd_range, reader, offset, length)
            self._readers[reader].append(fut)

    def file(self, name: str, path: Path) -> None:
        if self.pool is not None:
            self._files[name] = self.pool.submit(_hash_shard_file, path)

    def results(self) -> tuple[dict[str, str], dict[str, tuple]]:
        return ({k: f.result() for k, f in self._tensors.items()}, {k: f.result() for k, f in self._files.items()})

    def _close_readers(self, only_done: bool) -> None:
        for fd, futures in list(self._readers.items()):
            if not only_done or all(f.done() for f in futures):
                os.close(fd)
                del self._readers[fd]

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # nothing reads a descriptor after this
        self._close_readers(only_done=False)


def _hash_fd_range(fd: int, offset: int, length: int) -> str:
    h = digest.new()
    mv = memoryview(bytearray(min(HASH_CHUNK, max(length, 1))))
    done = 0
    while done < length:
        n = os.preadv(fd, [mv[: min(len(mv), length - done)]], offset + done)
        if not n:
            raise OSError(errno.EIO, f"output ended {length - done} bytes early while hashing")
        h.update(mv[:n])
        done += n
    return h.hexdigest()


class FileDigest:
    """(digest, size, header) of a safetensors file from its bytes in order, in one pass.

    Fed by the local writer reading a landed file back, and by an object-store target with the
    bytes it uploads.
    """

    def __init__(self) -> None:
        self.h = digest.new()
        self.head = bytearray()  # the file's first bytes, up to the end of its header
        self.need = 8
        self.size = 0

    def update(self, mv: memoryview) -> None:
        n = len(mv)
        self.h.update(mv)
        if len(self.head) < self.need:  # the header rides along with the first chunk(s)
            self.head += mv[len(self.head) - self.size : min(n, self.need - self.size)]
            if self.need == 8 and len(self.head) == 8:
                self.need = 8 + min(struct.unpack("<Q", self.head)[0], MAX_HEADER_BYTES)
                self.head += mv[8 - self.size : min(n, self.need - self.size)]  # size < 8: this chunk holds byte 8
        self.size += n

    def result(self, name: str) -> tuple[str, int, Header | None]:
        complete = len(self.head) == self.need > 8
        header = parse_header_bytes(bytes(self.head[8:]), self.size, name) if complete else None
        return self.h.hexdigest(), self.size, header


def _hash_shard_file(path: Path) -> tuple[str, int, Header | None]:
    """(digest, size, header) of a safetensors file as it landed in the output, in one pass."""
    d = FileDigest()
    mv = memoryview(bytearray(HASH_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(mv):
            d.update(mv[:n])
    return d.result(str(path))


_FICLONE = 0x40049409
WHOLE_FILE_STEP = 256 << 20  # progress granularity of a whole-file copy


def _reflink(source: LocalFile, dst_fd: int) -> bool:
    """Share the source's extents (FICLONE); False on a filesystem without reflinks."""
    try:
        fcntl.ioctl(dst_fd, _FICLONE, source.local_fd())
        return True
    except OSError:
        return False  # copy_file_range may still share extents


def copy_whole_file(src: Path, dst: Path, *, reflink: bool, progress: Progress, buf: memoryview) -> None:
    """Copy ``src`` to a new ``dst``: a reflink when asked and possible, else ranges of ``copy_segment``.

    Exactly the size ``src`` had when opened, or an error: a source that shrinks is a ``short-read``
    (exit 3, the input named), a write that fails an OSError of the output.
    """
    source = LocalFile(src)
    try:
        with open(dst, "wb", opener=_exclusive) as fo:
            if not (reflink and _reflink(source, fo.fileno())):
                for offset in range(0, source.size, WHOLE_FILE_STEP):
                    seg = Segment(source, offset, min(WHOLE_FILE_STEP, source.size - offset))
                    copy_segment(seg, fo.fileno(), buf)
                    progress.advance(seg.length)
            else:
                progress.advance(source.size)
            fo.flush()
            os.fsync(fo.fileno())
    finally:
        source.close()


def execute(plan: Plan, out_dir, **kwargs) -> WriteResult:
    """Run ``plan`` into ``out_dir``: a local directory, or an object store's URL (see ``targets``)."""
    from .targets import writer_for

    return writer_for(plan, out_dir, **kwargs).run()


ProgressFactory = Callable[[], Progress]
