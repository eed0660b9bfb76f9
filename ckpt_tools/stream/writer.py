"""The one streaming writer: executes any plan, shard by shard, atomically.

Per output shard: write the header, stream each recipe's bytes (kernel copies for byte ranges, chunks
for computed tensors), fsync, rename from a hidden temporary name. Non-tensor files follow, then the
manifest, then the caller's check, and the completion marker last (``model.safetensors.index.json``,
or the lone ``model.safetensors``): a crash or a failed check leaves no marker.

A resume record (the plan's digest and its input fingerprints) is written before the first shard;
``--resume`` continues only a run whose record equals the new plan's (``output_dir``). The manifest holds
a BLAKE3 digest per tensor written and the whole-file digest of each shard copied or linked: hashed from the
buffer each byte is written from, read once (``hashcopy``); a file linked whole is read and hashed on threads
(or taken over from an input's manifest that provably describes it, ``known_digests``). Memory stays bounded by
one chunk. An object-store output replaces the storage steps (``targets.object_store``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import DTYPES
from ..errors import CkptError, OutputError
from ..io import digest
from ..io.artefacts import LOCK_NAME, MANIFEST_NAME, RESUME_NAME
from ..io.safetensors_io import (
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
from . import manifest, output_dir
from .hashcopy import Feed, HashingCopier
from .journal import JOURNAL_NAME, Journal
from .known_digests import KnownDigest, file_stat, same_file
from .lookahead import lookahead
from .output_dir import DirLock
from .plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan
from .progress import Progress

_Lock = DirLock  # its name here before output_dir held it


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
        self._stats: dict[str, dict[str, int]] = {}  # local shard -> its file_stats entry, taken as it landed
        self._reused: dict[str, str] = {}  # shard copied or linked whole -> the input manifest its digest came from
        self._journal: Journal | None = None  # what each finished file holds (journal.py; local outputs)
        self._previous: dict[str, dict] = {}  # the interrupted run's journal entries (--resume)
        self._created = False  # this run created the output directory (a refused input then removes it)
        self._checked_single: tuple[Path, Path] | None = None  # a lone checked file, renamed at the end
        self._written_names: list[str] = []  # every file this run writes (output_dir.written_names)

    # -- the output directory's state (output_dir; a target other than a local directory replaces these) ----

    def _check_not_an_input(self) -> None:
        output_dir.check_not_an_input(self.out, self.plan.inputs)

    def _check_output_dir(self) -> None:
        output_dir.check_output_dir(self.out, overwrite=self.overwrite, resume=self.resume)

    def _clear_previous_output(self) -> None:
        output_dir.clear_previous_output(self.out, (self.plan.index_name, MANIFEST_NAME, self.plan.single_file_name))

    def _previous_record(self) -> dict | None:
        return output_dir.previous_record(self.out)

    def _check_resume(self, plan_digest: dict[str, str]) -> None:
        output_dir.check_resume(self._previous_record(), self._finished_files, plan_digest, self.plan.fingerprints,
                                str(self.out))

    def _finished_files(self) -> list[str]:
        return output_dir.finished_files(self.out)

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
                previous_manifest = self._previous_manifest()  # its digests prove finished shards (journal.py)
                # An index or manifest from the interrupted run would claim completeness early, and its
                # temporary files (we hold the lock: nobody is writing them) only take disk space.
                for name in (self.plan.index_name, MANIFEST_NAME):
                    self._remove(name)
                self._remove_partials()
            elif self.overwrite:
                self._clear_previous_output()
            shards = self.plan.shards()
            self._written_names = output_dir.written_names(self.plan, shards)
            record = output_dir.resume_record(plan_digest, self.plan.settle_fingerprints(), self.plan.command,
                                              self._written_names)
            self._write_file(OutputFile(RESUME_NAME, content=record))
            self._open_journal(previous_manifest if self.resume else None)
            single = list(shards) == [self.plan.single_file_name] and not any(
                f.name.endswith(".safetensors") for f in self.plan.files
            )
            self.progress.phase("writing", self.plan.total_bytes + sum(map(self._moved_bytes, self.plan.files)))
            deferred: tuple[Path, Path] | None = None
            with self._hasher() as hasher:
                # shards whose values are checked first (a refused value stops the run before the rest is written),
                # then shards copied or linked whole: the hashing of linked ones overlaps the shards being written
                checked = [n for n, ts in shards.items() if any(t.check is not None for t in ts)]
                for name in checked:
                    self._write_checked_shard(name, shards[name], result, hasher, single)
                for f in self.plan.files:
                    if f.tensors:
                        self._write_file(f, hasher)
                for name, tensors in shards.items():
                    if name in checked:
                        continue
                    tmp, final = self._write_shard(name, tensors, result, hasher, defer=single)
                    if single:
                        deferred = (tmp, final)
                if single and checked:
                    deferred = self._checked_single
                for f in self.plan.files:
                    if not f.tensors:
                        self._write_file(f, hasher)
                    result.files.append(f.name)
                self.progress.phase("hashing")  # what the hasher threads have left
                result.digests, result.landed = hasher.results()
            self._write_manifest(result, plan_digest)
            result.bytes_read = IO_STATS.total
            self.progress.phase("validating")
            self._run_check(result, deferred)
            if deferred is not None:
                self._commit_deferred(deferred)
            else:
                self._write_index(result)
            complete = True
            self._fsync_dir()
            self._remove(RESUME_NAME)  # done: nothing left to resume
            if self._journal is not None:
                self._journal.close()
            self._remove(JOURNAL_NAME)
        except OSError as e:
            raise self._output_error(e) from e
        except ValueRefused as e:
            if not self.resume:  # the input is refused: nothing to resume, and nothing of this run is left behind
                for name in (*result.files, RESUME_NAME, JOURNAL_NAME):
                    with contextlib.suppress(OSError):  # the refusal is the error to report, not a cleanup's
                        self._remove(name)
            raise e.error from None
        finally:
            self.progress.stop()
            self._remove_partials()
            if not complete:  # a manifest without its completion marker would read as a finished run
                self._remove(MANIFEST_NAME)
            lock.release()
            if not complete and self._created:
                with contextlib.suppress(OSError):
                    self.out.rmdir()  # only when empty: a refused input left nothing in it
        result.seconds = time.monotonic() - t0
        return result

    # -- what a target other than a local directory replaces (targets/) ----------------

    def _lock(self) -> DirLock:
        """Create the output directory and take its lock."""
        self._created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory: {e.strerror}", path=str(self.out)) from e
        try:
            return DirLock(self.out)
        except OSError as e:
            raise self._output_error(e, str(self.out / LOCK_NAME)) from e

    def _remove(self, name: str) -> None:
        (self.out / name).unlink(missing_ok=True)

    def _previous_manifest(self) -> dict | None:
        p = self.out / MANIFEST_NAME
        if not p.is_file() or p.is_symlink():
            return None
        try:
            return json.loads(p.read_bytes())
        except (OSError, ValueError, RecursionError):
            return None

    def _open_journal(self, manifest: dict | None = None) -> None:
        """The journal of finished files (journal.py); with --resume, the interrupted run's entries first."""
        self._journal = Journal(self.out)
        self._previous = self._journal.start(keep=self.resume, manifest=manifest)

    def _journal_tensors(self, name: str, size: int, keys: list[str], hasher: _Hasher) -> None:
        """Journal shard ``name`` once the digests of what landed are in (a kill before that: it is rewritten)."""
        journal = self._journal
        if journal is not None:
            hasher.when_done(keys, lambda digests: journal.add(name, {"size": size, "tensors": digests}))

    def _proven_shard(self, name: str, final: Path, header: bytes, ordered: list[OutputTensor],
                      hasher: _Hasher) -> bool:
        """A finished shard of the interrupted run still holds what it wrote: the journal's size and tensor digests
        match its bytes hashed again (the header check first: cheap)."""
        entry = self._previous.get(name)
        size = 8 + len(header) + sum(t.nbytes for t in ordered)
        if entry is None or entry.get("size", size) != size or not isinstance(entry.get("tensors"), dict) \
                or not self._shard_complete(final, header, ordered):
            return False
        digests: dict[str, str] = {}
        fd = os.open(final, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            pos = 8 + len(header)
            for t in ordered:
                digests[t.key] = _hash_fd_range(fd, pos, t.nbytes)
                if digests[t.key] != entry["tensors"].get(t.key):
                    return False
                pos += t.nbytes
        finally:
            os.close(fd)
        for key, d in digests.items():
            hasher.done_tensor(key, d)
        return True  # its journal line was carried over (Journal.start)

    def _proven_file(self, f: OutputFile, final: Path, hasher: _Hasher | None) -> bool:
        """A whole file of the interrupted run still holds what it copied (journal: size and whole-file digest)."""
        entry = self._previous.get(f.name)
        if entry is None or not f.tensors or "whole" not in entry:
            return False
        try:
            if final.stat().st_size != entry.get("size"):
                return False
            landed = _hash_shard_file(final)
        except OSError:
            return False
        if landed[0] != entry["whole"]:
            return False
        self._stats[f.name] = file_stat(os.stat(final))
        if hasher is not None:
            hasher.done_file(f.name, landed)
        return True

    def _remove_partials(self) -> None:
        output_dir.remove_partials(self.out)

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
            pending = PendingOutput(manifest.index(self.plan, result.tensor_files), {})
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
        if self.resume and self._proven_shard(name, final, header, ordered, hasher):
            result.skipped_shards.append(name)  # its digests are the ones just proven: not hashed again
            for t in ordered:
                result.tensor_files[t.key] = name
                self.progress.advance(t.nbytes)
            result.files.append(name)
            self._stats[name] = file_stat(os.stat(final))
            return final, final
        fd = _create(tmp)
        written = 0
        try:
            _write_all(fd, memoryview(struct.pack("<Q", len(header)) + header))
            pos = 8 + len(header)
            with lookahead(ordered) as ahead:  # the next computed tensors decode while this one is written
                for i, t in enumerate(ordered):
                    copier = hasher.copier if hasher.hashing else hasher.checker() if t.check else None
                    if copier is None:
                        self._write_tensor(fd, t, ahead.chunks(i))
                    else:  # hashed (and checked) from the bytes as they are written: each byte read once
                        h = digest.new(hasher.algo) if hasher.hashing else None
                        check = t.check() if t.check is not None else None
                        self._write_tensor(fd, t, ahead.chunks(i), copier, Feed(h, check))
                        if check is not None:
                            check.finish()  # a refused value: the shard is not renamed into place
                        if h is not None:
                            hasher.done_tensor(t.key, h.hexdigest())
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
        self._journal_tensors(name, pos, [t.key for t in ordered], hasher)
        result.bytes_written += pos
        result.files.append(name)
        self._stats[name] = file_stat(os.stat(tmp))  # a rename keeps inode and mtime
        if not defer:
            os.replace(tmp, final)  # hashed as written: nothing left to wait for
        return tmp, final

    def _write_checked_shard(self, name: str, tensors: list[OutputTensor], result: WriteResult, hasher: _Hasher,
                             single: bool) -> None:
        """A shard holding tensors whose values are checked as they are written: a refused value is a
        ``ValueRefused`` (the run then removes what it wrote); a lone output file waits for the end as always."""
        try:
            tmp, final = self._write_shard(name, tensors, result, hasher, defer=single)
        except CkptError as e:
            if e.rule in VALUE_RULES:
                raise ValueRefused(e) from None
            raise
        if single:
            self._checked_single = (tmp, final)

    def _write_tensor(self, fd: int, t: OutputTensor, chunks: Iterable[Any] | None = None,
                      copier: HashingCopier | None = None, sink: Feed | None = None) -> None:
        """``t``'s bytes appended to ``fd``: kernel copies and plain writes, or (``copier``) each chunk read once
        and fed to ``sink`` (its digest, its value check) as it is written."""
        if copier is None or sink is None:
            self._stream_tensor(t, lambda seg: copy_range(seg, fd, self._buf), lambda mv: _write_all(fd, mv), chunks)
            return
        self._stream_tensor(t, lambda seg: copy_range(seg, fd, self._buf, copier, sink),
                            lambda mv: copier.chunk(sink, mv, lambda data: _write_all(fd, data)), chunks)

    def _stream_tensor(self, t: OutputTensor, copy: Callable[[Segment], None],
                       write: Callable[[memoryview], None], chunks: Iterable[Any] | None = None) -> None:
        """A tensor's bytes in order: its byte ranges through ``copy``, computed chunks through ``write``
        (``chunks``: its recipe's, already started)."""
        recipe = t.recipe
        if isinstance(recipe, CopyBytes):
            if recipe.nbytes != t.nbytes:
                raise RuntimeError(f"plan error: {t.key} copies {recipe.nbytes} bytes, needs {t.nbytes}")
            for seg in recipe.segments:
                copy(seg)
                self.progress.advance(seg.length)
            return
        assert isinstance(recipe, Compute)
        from ..arrays import as_bytes  # numpy is only needed for computed tensors

        n = 0
        for chunk in recipe.produce() if chunks is None else chunks:
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
            if f.link != "hardlink" and self.resume and not final.is_symlink() and self._proven_file(f, final, hasher):
                self.progress.advance(self._moved_bytes(f))
                return  # resumed: a finished copy the journal proves unchanged
            final.unlink()
        before = self._still_described(f, hasher)
        landed: tuple | None = None
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
            # hashed as it is copied (one read), unless its input's manifest vouches for it or a reflink moves
            # no bytes (then it is hashed as it landed, below)
            copier = hasher.copier if hasher is not None and before is None and f.link != "reflink" else None
            with self._cleanup_on_error(tmp, final):
                landed = copy_whole_file(f.source, tmp, reflink=f.link == "reflink", progress=self.progress,
                                         buf=self._buf, copier=copier, name=str(final))
            os.replace(tmp, final)
        self._hash_landed(f, final, hasher, self._landed_as_described(f, final, before), landed)

    @staticmethod
    def _still_described(f: OutputFile, hasher: _Hasher | None) -> os.stat_result | None:
        """The source's stat when its input's manifest describes it as it is (known_digests), before it is
        copied or linked; None when there is no such digest to take over."""
        if f.known is None or f.source is None or not f.tensors or hasher is None or not hasher.hashing:
            return None
        st = os.stat(f.source)
        return st if same_file(st, f.known.stat) else None

    @staticmethod
    def _landed_as_described(f: OutputFile, final: Path, before: os.stat_result | None) -> KnownDigest | None:
        """The input manifest's digest of ``f``, when what landed is provably the file it describes."""
        if before is None or f.known is None or f.source is None:
            return None
        landed = os.stat(final)
        if f.link == "hardlink":  # the output's file is the input's: the same inode, unchanged
            proven = (landed.st_ino, landed.st_dev) == (before.st_ino, before.st_dev) and same_file(landed,
                                                                                                  f.known.stat)
        else:  # a copy of the input, which did not change while it was read
            proven = same_file(os.stat(f.source), f.known.stat) and landed.st_size == before.st_size
        return f.known if proven else None

    @staticmethod
    def _moved_bytes(f: OutputFile) -> int:
        """The bytes writing ``f`` moves (its share of the progress total): a whole-file copy's size; nothing for
        inline content, a hardlink or a file left remote."""
        if f.source is None or f.link in ("hardlink", "remote"):
            return 0
        return source_size(f.source)

    def _hash_landed(self, f: OutputFile, final: Path, hasher: _Hasher | None, known: KnownDigest | None,
                     landed: tuple | None = None) -> None:
        """Account for a file copied or linked whole: its input manifest's digest, ``landed`` (hashed as it was
        copied), or hashed now from what landed (a hardlink, a reflink)."""
        if not f.tensors:
            return
        self._stats[f.name] = file_stat(os.stat(final))
        if hasher is None:
            return
        journal, name = self._journal, f.name
        if known is not None:
            hasher.known(f.name, known, f.header)
            self._reused[f.name] = known.manifest
            if journal is not None and known.whole:
                journal.add(name, {"size": known.stat["size"], "whole": known.whole})
        else:
            if landed is not None:
                hasher.done_file(f.name, landed)
            else:
                hasher.file(f.name, final)
            if journal is not None:
                hasher.when_file_done(name, lambda landed: journal.add(name, {"size": landed[1], "whole": landed[0]}))

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
        content = manifest.manifest_bytes(self.plan, plan_digest, result.tensor_files, result.digests, result.landed,
                                          self._landed_facts, file_stats=self._stats, reused=self._reused,
                                          written=self._written_names)
        self._write_file(OutputFile(MANIFEST_NAME, content=content))

    def _write_index(self, result: WriteResult) -> None:
        self._write_file(OutputFile(self.plan.index_name, content=manifest.index_bytes(self.plan, result.tensor_files)))

    def _fsync_dir(self) -> None:
        fd = os.open(self.out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


VALUE_RULES = frozenset({"nonfinite"})  # what a tensor's check (OutputTensor.check) refuses


class ValueRefused(Exception):
    """A tensor's check refused the values being written (carries the error the command reports)."""

    def __init__(self, error: CkptError) -> None:
        super().__init__(str(error))
        self.error = error


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
    """Digests of what the output holds: tensors and copied files hashed as they are written (``copier``, one read
    of each byte), files linked whole (a hardlink, a reflink) read and hashed on threads beside the copies (the
    hash releases the GIL). With 0 threads each hash runs inline; with None nothing is hashed (synthetic
    benchmark inputs).
    """

    def __init__(self, threads: int | None) -> None:
        self.pool = digest.executor(threads) if threads is not None else None
        self.algo = digest.manifest_algo() if threads is not None else None  # read once, not per tensor
        # the copier hashes on the writing thread: measured on 2 cores, a hash thread fed 512 KiB chunks cost more
        # CPU (a thread switch per chunk) than it overlapped (graft 1 GB: 0.93 s CPU threaded, 0.80 s inline)
        self.copier = HashingCopier() if threads is not None else None
        self._checker: HashingCopier | None = None
        self._tensors: dict[str, Future] = {}
        self._files: dict[str, Future] = {}
        self._known: dict[str, tuple] = {}  # whole files: name -> (digest or None, size, header), from a manifest
        self._known_tensors: dict[str, str] = {}  # their tensors' digests, when the manifest has them per tensor

    def checker(self) -> HashingCopier:
        """A copier for a tensor whose values are checked as they are copied, when nothing is hashed."""
        if self._checker is None:
            self._checker = HashingCopier()
        return self._checker

    @property
    def hashing(self) -> bool:
        return self.pool is not None

    def file(self, name: str, path: Path) -> None:
        if self.pool is not None:
            self._files[name] = self.pool.submit(_hash_shard_file, path)

    def when_done(self, keys: list[str], callback: Callable[[dict[str, str]], None]) -> None:
        """``callback({key: digest})`` once every tensor of ``keys`` is hashed (on the last hashing thread)."""
        futures = {k: self._tensors[k] for k in keys if k in self._tensors}
        if self.pool is None or len(futures) != len(keys):
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one(_f: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            with contextlib.suppress(Exception):  # a failed hash is reported by results(); no entry: rewritten
                callback({k: f.result() for k, f in futures.items()})

        if not futures:
            callback({})
        for f in futures.values():
            f.add_done_callback(one)

    def when_file_done(self, name: str, callback: Callable[[tuple], None]) -> None:
        fut = self._files.get(name)
        if fut is not None:
            fut.add_done_callback(lambda f: f.exception() is None and callback(f.result()))

    def done_tensor(self, key: str, digest: str) -> None:
        """A tensor digest already computed (a resumed shard's proof)."""
        fut: Future = Future()
        fut.set_result(digest)
        self._tensors[key] = fut

    def done_file(self, name: str, landed: tuple) -> None:
        fut: Future = Future()
        fut.set_result(landed)
        self._files[name] = fut

    def known(self, name: str, known: KnownDigest, header: Header | None) -> None:
        """A whole file whose digest its input's manifest vouches for: taken as it is, nothing read."""
        self._known[name] = (known.whole, known.stat["size"], header)
        self._known_tensors.update(known.tensors or {})

    def results(self) -> tuple[dict[str, str], dict[str, tuple]]:
        return ({**{k: f.result() for k, f in self._tensors.items()}, **self._known_tensors},
                {**{k: f.result() for k, f in self._files.items()}, **self._known})

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # nothing reads a file after this


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


def copy_range(seg: Segment, fd: int, buf: memoryview, copier: HashingCopier | None = None,
               sink: Feed | None = None) -> None:
    """One byte range appended to the output: a kernel copy, or (``copier``) read once, fed to ``sink`` and written."""
    if copier is None or sink is None:
        copy_segment(seg, fd, buf)
    else:
        copier.segment(seg, sink, lambda mv: _write_all(fd, mv))


_FICLONE = 0x40049409
WHOLE_FILE_STEP = 256 << 20  # progress granularity of a whole-file copy


def _reflink(source: LocalFile, dst_fd: int, dst: Path) -> None:
    """Share the source's extents (FICLONE), or refuse: ``--link reflink`` never turns into a copy unsaid."""
    try:
        fcntl.ioctl(dst_fd, _FICLONE, source.local_fd())
    except OSError as e:
        raise OutputError(f"cannot reflink {source.name} ({e.strerror or e}): this filesystem (or this pair of "
                          "filesystems) has no reflinks; use --link copy, or --link hardlink on the same filesystem",
                          rule="reflink-unsupported", path=str(dst.with_name(dst.name.removeprefix(".")
                                                                  .removesuffix(".partial")))) from None


def source_size(path) -> int:
    """A source file's size; a remote source's lazy path knows it without being downloaded."""
    known = getattr(path, "size", None)
    return known if isinstance(known, int) else os.stat(path).st_size


def copy_whole_file(src: Path, dst: Path, *, reflink: bool, progress: Progress, buf: memoryview,
                    copier: HashingCopier | None = None,
                    name: str | None = None) -> tuple[str, int, Header | None] | None:
    """Copy ``src`` to a new ``dst``: a reflink when asked (refused where the filesystem has none: OutputError
    ``reflink-unsupported``), else ranges of ``copy_segment``, or with ``copier`` read once, hashed and written:
    then (digest, size, header) of the bytes written is returned (``name``: the file named by a header error).

    Exactly the size ``src`` had when opened, or an error: a source that shrinks is a ``short-read``
    (exit 3, the input named), a write that fails an OSError of the output.
    """
    source = LocalFile(src)
    landed = None
    try:
        with open(dst, "wb", opener=_exclusive) as fo:
            if reflink:
                _reflink(source, fo.fileno(), dst)
                progress.advance(source.size)
            elif copier is not None:
                d, fd = FileDigest(), fo.fileno()
                for offset in range(0, source.size, WHOLE_FILE_STEP):
                    seg = Segment(source, offset, min(WHOLE_FILE_STEP, source.size - offset))
                    copier.segment(seg, d, lambda mv: _write_all(fd, mv))
                    progress.advance(seg.length)
                landed = d.result(name or str(dst))
            else:
                for offset in range(0, source.size, WHOLE_FILE_STEP):
                    seg = Segment(source, offset, min(WHOLE_FILE_STEP, source.size - offset))
                    copy_segment(seg, fo.fileno(), buf)
                    progress.advance(seg.length)
            fo.flush()
            os.fsync(fo.fileno())
    finally:
        source.close()
    return landed


ProgressFactory = Callable[[], Progress]
