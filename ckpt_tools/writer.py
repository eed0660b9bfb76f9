"""The one streaming writer: executes any plan, shard by shard, atomically.

Per output shard: write the header, stream each recipe's bytes (kernel copies for
byte ranges, chunks for computed tensors), fsync, rename from a hidden temporary
name. Non-tensor files follow, then the manifest, and the completion marker last
(``model.safetensors.index.json``, or the lone ``model.safetensors``): a crash
leaves no marker, so an incomplete output is obviously incomplete.

Memory stays bounded by one computed chunk; copied bytes never enter Python.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .dtypes import DTYPES
from .errors import OutputError, UsageError
from .plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan
from .safetensors_io import COPY_CHUNK, _write_all, copy_segment

MANIFEST_NAME = "ckpt_manifest.json"
# sha256 of written tensors runs on one thread beside the copies (measured: a second thread
# did not help on 2 cores, where the kernel's copy and writeback need the other core)
HASH_THREADS = 1
LOCK_NAME = ".ckpt.lock"
# Files a previous run of ours may have left; --overwrite clears them before writing.
_OUR_ARTEFACTS = ("*.safetensors", "*.safetensors.index.json", MANIFEST_NAME, "stitch-report.json")


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
    out_dir: Path
    files: list[str] = field(default_factory=list)
    tensor_files: dict[str, str] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    seconds: float = 0.0
    skipped_shards: list[str] = field(default_factory=list)


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


class _Lock:
    """An advisory lock on the output directory: a second writer refuses instead of interleaving.

    An flock: the kernel releases it when its holder dies, so a lock file left by a killed
    run never blocks ``--resume``.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
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
                same = os.path.samestat(os.fstat(self.fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self.fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

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
    ) -> None:
        self.plan = plan
        self.out = Path(out_dir)
        self.overwrite = overwrite
        self.resume = resume
        self.progress = progress or Progress()
        self.hash_tensors = hash_tensors
        self._buf = memoryview(bytearray(COPY_CHUNK))

    # -- checks -----------------------------------------------------------------

    def _check_output_dir(self) -> None:
        """Refuse inputs as output, and a non-empty directory unless --overwrite / --resume.

        Called before creating the directory and again under the lock: a concurrent writer may
        have filled it in between.
        """
        for src in self.plan.inputs:
            src = Path(src)
            src_dir = src if src.is_dir() else src.parent
            if _same_path(self.out, src_dir) or (self.out.exists() and _same_path(self.out, src)):
                raise UsageError(f"output directory {self.out} is an input of this command; choose another -o")
        if self.out.exists() and not self.out.is_dir():
            raise OutputError("output path exists and is not a directory", path=str(self.out))
        if self.out.exists():
            leftovers = [p.name for p in self.out.iterdir() if p.name != LOCK_NAME]
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

    # -- execution ----------------------------------------------------------------

    def run(self) -> WriteResult:
        t0 = time.monotonic()
        self._check_output_dir()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory: {e.strerror}", path=str(self.out)) from e
        lock = _Lock(self.out)
        try:
            self._check_output_dir()
        except BaseException:
            lock.release()
            raise
        result = WriteResult(self.out)
        complete = False
        try:
            if self.overwrite and not self.resume:
                self._clear_previous_output()
            elif self.resume:
                # An index or manifest from the interrupted run would claim completeness early, and its
                # temporary files (we hold the lock: nobody is writing them) only take disk space.
                for name in (self.plan.index_name, MANIFEST_NAME):
                    (self.out / name).unlink(missing_ok=True)
                for p in self.out.glob(".*.partial"):
                    p.unlink(missing_ok=True)
                # Weights of an interrupted run planned differently (another --max-shard-size) would linger.
                planned = set(self.plan.shards()) | {f.name for f in self.plan.files}
                for p in self.out.glob("*.safetensors"):
                    if p.name not in planned:
                        p.unlink()
            shards = self.plan.shards()
            single = list(shards) == [self.plan.single_file_name] and not any(
                f.name.endswith(".safetensors") for f in self.plan.files
            )
            self.progress.start(self.plan.total_bytes, self.plan.command)
            deferred: tuple[Path, Path] | None = None
            with ThreadPoolExecutor(max_workers=HASH_THREADS) as hasher:
                for name, tensors in shards.items():
                    tmp, final = self._write_shard(name, tensors, result, hasher, defer=single)
                    if single:
                        deferred = (tmp, final)
            for f in self.plan.files:
                self._write_file(f)
                result.files.append(f.name)
            self._write_manifest(result)
            if deferred is not None:
                os.replace(*deferred)
            else:
                self._write_index(result)
            complete = True
            self._fsync_dir()
        except OSError as e:
            raise self._output_error(e) from e
        finally:
            self.progress.stop()
            for p in self.out.glob(".*.partial"):
                p.unlink(missing_ok=True)
            if not complete:  # a manifest without its completion marker would read as a finished run
                (self.out / MANIFEST_NAME).unlink(missing_ok=True)
            lock.release()
        result.seconds = time.monotonic() - t0
        return result

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

    def _write_shard(self, name, tensors, result: WriteResult, hasher: ThreadPoolExecutor, defer: bool):
        header, ordered = self._shard_header(name, tensors)
        final = self.out / name
        tmp = self.out / f".{name}.partial"
        if self.resume and self._shard_complete(final, header, ordered):
            result.skipped_shards.append(name)
            for t in ordered:
                result.tensor_files[t.key] = name
                if self.hash_tensors and t.hashed:
                    result.sha256[t.key] = _hash_file_range(final, *self._offset_of(header, ordered, t))
                self.progress.advance(t.nbytes)
            result.files.append(name)
            return final, final
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        written = 0
        pending: dict[str, Future] = {}
        try:
            _write_all(fd, memoryview(struct.pack("<Q", len(header)) + header))
            pos = 8 + len(header)
            for t in ordered:
                digest = self._write_tensor(fd, t, tmp, pos, hasher, pending)
                if digest is not None:
                    result.sha256[t.key] = digest
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
        for key, fut in pending.items():
            result.sha256[key] = fut.result()
        result.bytes_written += pos
        result.files.append(name)
        if not defer:
            os.replace(tmp, final)
        return tmp, final

    def _write_tensor(self, fd: int, t: OutputTensor, tmp: Path, pos: int, hasher, pending) -> str | None:
        recipe = t.recipe
        if isinstance(recipe, CopyBytes):
            if recipe.nbytes != t.nbytes:
                raise RuntimeError(f"plan error: {t.key} copies {recipe.nbytes} bytes, needs {t.nbytes}")
            for seg in recipe.segments:
                copy_segment(seg, fd, self._buf)
                self.progress.advance(seg.length)
            if self.hash_tensors and t.hashed:
                # Hash what landed in the output, off the main thread, while the next copy runs.
                pending[t.key] = hasher.submit(_hash_file_range, tmp, pos, t.nbytes)
            return None
        assert isinstance(recipe, Compute)
        from .numeric import as_bytes  # numpy is only needed for computed tensors

        n = 0
        for chunk in recipe.produce():
            mv = as_bytes(chunk)
            if n + len(mv) > t.nbytes:
                raise RuntimeError(f"plan error: {t.key} produced more than {t.nbytes} bytes")
            _write_all(fd, mv)
            n += len(mv)
            self.progress.advance(len(mv))
        if n != t.nbytes:
            raise RuntimeError(f"plan error: {t.key} produced {n} bytes, needs {t.nbytes}")
        if self.hash_tensors and t.hashed:  # like copies: hashed from the output, off the main thread
            pending[t.key] = hasher.submit(_hash_file_range, tmp, pos, t.nbytes)
        return None

    @staticmethod
    def _offset_of(header: bytes, ordered: list[OutputTensor], t: OutputTensor) -> tuple[int, int]:
        pos = 8 + len(header)
        for o in ordered:
            if o is t:
                return pos, t.nbytes
            pos += o.nbytes
        raise KeyError(t.key)

    @staticmethod
    def _shard_complete(final: Path, header: bytes, ordered: list[OutputTensor]) -> bool:
        if not final.exists():
            return False
        size = 8 + len(header) + sum(t.nbytes for t in ordered)
        if final.stat().st_size != size:
            return False
        with open(final, "rb") as f:
            return f.read(8 + len(header)) == struct.pack("<Q", len(header)) + header

    def _write_file(self, f: OutputFile) -> None:
        if f.link == "remote":
            return  # listed in the index and the manifest; `ckpt push --base` copies it server-side
        final = self.out / f.name
        final.parent.mkdir(parents=True, exist_ok=True)
        if f.content is not None:
            tmp = final.with_name(f".{final.name}.partial")
            with self._cleanup_on_error(tmp, final), open(tmp, "wb") as fh:
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
                _copy_whole_file(f.source, tmp, reflink=f.link == "reflink", progress=self.progress)
            os.replace(tmp, final)

    @contextlib.contextmanager
    def _cleanup_on_error(self, tmp: Path, final: Path):
        """A failed write removes its temporary file and names the file and the bytes that reached it."""
        try:
            yield
        except OSError as e:
            try:
                written = tmp.stat().st_size
            except OSError:
                written = None
            tmp.unlink(missing_ok=True)
            raise self._output_error(e, str(final), written) from e

    def _write_manifest(self, result: WriteResult) -> None:
        manifest = {
            "tool": "ckpt-tools",
            "version": __version__,
            "command": self.plan.command,
            **self.plan.manifest,
            "tensors": {},
        }
        for t in self.plan.tensors:
            entry = {
                "file": result.tensor_files[t.key],
                "dtype": t.dtype,
                "shape": list(t.shape),
            }
            if t.key in result.sha256:
                entry["sha256"] = result.sha256[t.key]
            entry.update(t.meta)
            manifest["tensors"][t.key] = entry
        remote = {f.name: f.remote for f in self.plan.files if f.link == "remote"}
        if remote:
            # shards deliberately not downloaded: the output is complete once pushed over its base
            manifest["remote_files"] = remote
        content = (json.dumps(manifest, indent=1, sort_keys=False) + "\n").encode()
        self._write_file(OutputFile(MANIFEST_NAME, content=content))

    def _write_index(self, result: WriteResult) -> None:
        weight_map = dict(result.tensor_files)
        total = sum(t.nbytes for t in self.plan.tensors)
        for f in self.plan.files:
            for key, nbytes in getattr(f, "tensors", {}).items():
                weight_map[key] = f.name
                total += nbytes
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        self._write_file(OutputFile(self.plan.index_name, content=(json.dumps(index, indent=2) + "\n").encode()))

    def _fsync_dir(self) -> None:
        fd = os.open(self.out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


HASH_CHUNK = 4 << 20  # small: the hasher runs beside the main thread's own buffers


def _hash_file_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(HASH_CHUNK, max(length, 1)))
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left:
            n = f.readinto(mv[: min(len(mv), left)])
            if not n:
                raise OSError(errno.EIO, f"{path} shorter than expected while hashing")
            h.update(mv[:n])
            left -= n
    return h.hexdigest()


_FICLONE = 0x40049409


def _copy_whole_file(src: Path, dst: Path, *, reflink: bool, progress: Progress) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        if reflink:
            try:
                fcntl.ioctl(fo.fileno(), _FICLONE, fi.fileno())
                progress.advance(os.fstat(fi.fileno()).st_size)
                return
            except OSError:
                pass  # filesystem without reflinks: copy_file_range below may still share extents
        size = os.fstat(fi.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), size - done)
                if n == 0:
                    break
                done += n
                progress.advance(n)
        except OSError:
            fi.seek(done)
            fo.seek(done)
            shutil.copyfileobj(fi, fo, COPY_CHUNK)
            progress.advance(size - done)
        fo.flush()
        os.fsync(fo.fileno())


def execute(plan: Plan, out_dir, **kwargs) -> WriteResult:
    return Writer(plan, out_dir, **kwargs).run()


ProgressFactory = Callable[[], Progress]
