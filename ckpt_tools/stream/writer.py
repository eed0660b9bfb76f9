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
one chunk. Where files land is a ``Target`` (``targets``: a local directory, an object store).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..dtypes import DTYPES
from ..errors import CkptError, OutputError
from ..io import digest
from ..io.artefacts import MANIFEST_NAME, RESUME_NAME
from ..io.safetensors_io import (
    IO_STATS,
    MAX_HEADER_BYTES,
    Header,
    Segment,
    parse_header_bytes,
)
from . import manifest, output_dir
from .early_check import EarlyCheck
from .hashcopy import Feed, HashingCopier, Split, feed_mapped
from .journal import JOURNAL_NAME
from .known_digests import KnownDigest
from .lookahead import lookahead
from .plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan
from .progress import Progress


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
    reused: dict[str, str] = field(default_factory=dict)  # whole file -> the input manifest its digest came from


@dataclass
class PendingOutput:
    """An output with every file in place but its completion marker: what a check sees first.

    ``index`` is the index about to be written (None for a lone file); ``renamed`` maps final
    file names to the temporary files still holding them (the lone ``model.safetensors``).
    """

    index: dict | None
    renamed: dict[str, Path | Callable[[], Any]]  # or a file still being copied: its input, read in its place
    checked: frozenset[tuple[str, str, Any]] = frozenset()  # Plan.checked_values: not read again
    manifest: dict | None = None  # the manifest about to be written (None: the one in place)


Check = Callable[[Path, PendingOutput], None]


class Target(Protocol):
    """Where a writer's files land (``targets``: a local directory, an object store), in the spirit of fsspec's
    AbstractFileSystem: what may be written, the lock, small files, shards opened under a temporary name and
    committed, whole files copied, what a previous run left and proves (``--resume``)."""

    name: Path | str  # the directory, or the store's URL (named by errors and the result)
    stats: dict[str, dict[str, int]]  # landed shard -> its file_stats entry (manifest; local files only)
    reused: dict[str, str]  # whole file -> the input manifest whose digest was taken over

    def prepare(self, plan: Plan) -> Plan: ...  # the plan as this target moves it (server-side copies)
    def check(self, plan: Plan, *, overwrite: bool, resume: bool) -> None: ...  # may this run write here
    def lock(self) -> None: ...
    def release(self, complete: bool) -> None: ...
    def read(self, name: str) -> bytes | None: ...  # a small file (a record), None if absent
    def listing(self) -> list[str]: ...  # files a run left in place (hidden ones aside)
    def remove(self, name: str) -> None: ...
    def remove_partials(self) -> None: ...  # temporary files, uploads never completed
    def clear(self, markers: tuple[str, ...]) -> None: ...  # --overwrite: what a run of ours wrote, markers first
    def start(self, resume: bool) -> None: ...  # the journal of finished files (--resume: the previous run's)
    def journal(self, name: str, entry: dict) -> None: ...  # a finished file's size and digests
    def settle(self) -> None: ...  # every file written so far durable and in place (fsync'd beside the copies)
    def finish(self) -> None: ...  # durable, and nothing left to resume
    def put(self, name: str, content: bytes) -> None: ...  # a small file, atomically
    def open(self, name: str, head: bytes) -> Any: ...  # a shard: write, copy, close, commit (a context manager)
    def proven_shard(self, name: str, head: bytes, ordered: list[OutputTensor]) -> dict[str, str] | None: ...
    def copy_file(self, f: OutputFile, hasher: _Hasher, progress: Progress) -> None: ...
    def moved_bytes(self, f: OutputFile) -> int: ...
    def landed_facts(self, name: str) -> dict: ...  # what the storage vouches for (an object store's ETag)
    def view(self, lone: Any) -> contextlib.AbstractContextManager[tuple[Path, dict[str, Path]]]: ...
    def barrier(self) -> Future | None: ...  # done once the files handed over are in place (None: no early check)


class Writer:
    def __init__(self, plan: Plan, target: Target, *, overwrite: bool = False, resume: bool = False,
                 progress: Progress | None = None, hash_tensors: bool = True, check: Check | None = None) -> None:
        self.plan = target.prepare(plan)
        self.target = target
        self.overwrite = overwrite
        self.resume = resume
        self.progress = progress or Progress()
        self.hash_tensors = hash_tensors
        self.check = check
        self._written_names: list[str] = []  # every file this run writes (output_dir.written_names)
        self._copied: dict[str, str] = {}  # --resume: Plan.copied_digests
        self._early: EarlyCheck | None = None  # the output's check, started beside the whole-file copies

    def run(self) -> WriteResult:
        t0, plan, target = time.monotonic(), self.plan, self.target
        plan_digest = self._claim()
        result, complete = WriteResult(target.name), False
        try:
            shards = plan.shards()
            self._begin(plan_digest, shards)
            self.progress.phase("writing", plan.total_bytes + sum(map(target.moved_bytes, plan.files)))
            lone = output_dir.lone_file(plan, shards)
            with self._hasher() as hasher:
                held = self._write_all(shards, result, hasher, lone, plan_digest)
                target.settle()  # every file durable and in place before the manifest vouches for it
                self.progress.phase("hashing")  # what the hasher threads have left
                result.digests, result.landed = hasher.results()
            result.reused = dict(target.reused)
            written = self._write_manifest(result, plan_digest)
            result.bytes_read = IO_STATS.total
            self.progress.phase("validating")
            self._run_check(result, lone, held, written)
            if not lone:
                target.put(plan.index_name, manifest.index_bytes(plan, result.tensor_files))
            elif held is not None:
                held.commit()  # the lone file is its own completion marker
            complete = True
            target.finish()
        except OSError as e:
            raise output_error(e, str(target.name)) from e
        except ValueRefused as e:
            if not self.resume:  # the input is refused: nothing to resume, and nothing of this run is left behind
                for name in (*result.files, RESUME_NAME, JOURNAL_NAME):
                    with contextlib.suppress(OSError):  # the refusal is the error to report, not a cleanup's
                        target.remove(name)
            raise e.error from None
        finally:
            if self._early is not None:
                self._early.wait()  # nothing of this run reads the output after it
            self.progress.stop()
            target.remove_partials()
            if not complete:  # a manifest without its completion marker would read as a finished run
                target.remove(MANIFEST_NAME)
            target.release(complete)
        result.seconds = time.monotonic() - t0
        return result

    def _claim(self) -> dict[str, str]:
        """Checks, then the lock, then the checks again under it (a concurrent writer may have filled the output);
        ``--resume`` is refused before anything is touched. The plan's digest."""
        target = self.target
        target.check(self.plan, overwrite=self.overwrite, resume=self.resume)
        target.lock()
        try:
            plan_digest = self.plan.digest()
            target.check(self.plan, overwrite=self.overwrite, resume=self.resume)
            if self.resume:
                output_dir.check_resume(output_dir.read_record(target.read), target.listing, plan_digest,
                                        self.plan.planned_fingerprints(), str(target.name))
                self._copied = self.plan.copied_digests()  # what finished shards' copies must still hold
        except BaseException:
            target.release(False)
            raise
        return plan_digest

    def _begin(self, plan_digest: dict[str, str], shards: dict[str, list[OutputTensor]]) -> None:
        """Clear what an earlier run left (--overwrite) or keep what it proves (--resume); the resume record."""
        plan, target = self.plan, self.target
        if self.overwrite and not self.resume:
            target.clear((plan.index_name, MANIFEST_NAME, plan.single_file_name))
        target.start(self.resume)  # with --resume: the interrupted run's journal (and manifest) read first
        if self.resume:
            # An index or manifest from the interrupted run would claim completeness early, and its
            # temporary files (we hold the lock: nobody is writing them) only take disk space.
            for name in (plan.index_name, MANIFEST_NAME):
                target.remove(name)
            target.remove_partials()
        self._written_names = output_dir.written_names(plan, shards)
        target.put(RESUME_NAME, output_dir.resume_record(plan_digest, plan.planned_fingerprints(), plan.command,
                                                         self._written_names))

    def _write_all(self, shards: dict[str, list[OutputTensor]], result: WriteResult, hasher: _Hasher,
                   lone: bool, plan_digest: dict[str, str]) -> Any:
        """Shards whose values are checked first (a refused value stops the run before the rest is written), then
        files linked whole (hashing them overlaps the shards written next), the other shards, the other files,
        and the files copied whole: the output's check starts before them, on a thread (``early_check``). The lone
        output file (no index) is returned uncommitted (None: proven in place)."""
        checked = [n for n, ts in shards.items() if any(t.check is not None for t in ts)]
        rest = [n for n in shards if n not in checked]
        copies = self._copied_whole(lone)
        files = sorted((f for f in self.plan.files if f.name not in copies), key=lambda f: not f.tensors)
        try:
            uploads = [self._write_shard(n, shards[n], result, hasher, lone) for n in checked]
        except CkptError as e:
            if e.rule in VALUE_RULES:
                raise ValueRefused(e) from None
            raise
        for f in files[: sum(bool(f.tensors) for f in files)]:
            self._write_file(f, hasher)
        uploads += [self._write_shard(n, shards[n], result, hasher, lone) for n in rest]
        for f in files[sum(bool(f.tensors) for f in files):]:
            self._write_file(f, hasher)
        if copies:
            self._early = self._start_check(result, plan_digest, copies)
        for f in self.plan.files:
            if f.name in copies:
                self._write_file(f, hasher)
        result.files += [f.name for f in self.plan.files]
        return uploads[0] if lone else None

    def _copied_whole(self, lone: bool) -> dict[str, Path]:
        """Files copied whole from a local input, which the output's check reads in their copies' place while they
        are copied (``early_check``): none without a check, for a lone file, where the target cannot tell when
        files are in place, or where a whole file's header is not known before it lands (the planned manifest lists
        its tensors from it)."""
        whole = [f for f in self.plan.files if f.tensors and f.link != "remote"]
        if self.check is None or lone or self.target.barrier() is None or any(f.header is None for f in whole):
            return {}
        return {f.name: f.source for f in self.plan.files if f.tensors and f.link == "copy" and f.content is None
                and type(f.source) is type(Path())}  # not a lazy remote path (fetched when opened)

    def _start_check(self, result: WriteResult, plan_digest: dict[str, str], copies: dict[str, Path]) -> EarlyCheck:
        """The output's check, on a thread once every file handed over so far is in place, the files copied whole
        read from their inputs and the manifest as planned."""
        plan, target, check = self.plan, self.target, self.check
        assert check is not None
        index = manifest.index(plan, result.tensor_files)
        tensor_files = dict(result.tensor_files)

        def run(stand_ins: dict[str, Callable[[], Any]]) -> dict:
            landed = {f.name: ("", 0, f.header) for f in plan.files if f.tensors and f.link != "remote"}
            planned = manifest.manifest_dict(plan, plan_digest, tensor_files, {}, landed, target.landed_facts,
                                             written=self._written_names, settle=False)
            with target.view(None) as (root, renamed):
                check(root, PendingOutput(index, {**renamed, **stand_ins}, plan.checked_values, planned))
            return planned

        return EarlyCheck(run, copies, target.barrier())

    def _write_file(self, f: OutputFile, hasher: _Hasher) -> None:
        if f.link == "remote":
            return  # listed in the index and the manifest; `ckpt push --base` copies it server-side
        if f.content is not None:
            self.target.put(f.name, f.content)
        else:
            self.target.copy_file(f, hasher, self.progress)

    def _write_manifest(self, result: WriteResult, plan_digest: dict[str, str]) -> dict:
        target = self.target
        content = manifest.manifest_dict(self.plan, plan_digest, result.tensor_files, result.digests, result.landed,
                                         target.landed_facts, file_stats=target.stats, reused=target.reused,
                                         written=self._written_names)
        target.put(MANIFEST_NAME, manifest.manifest_bytes(content))
        return content

    def _hasher(self) -> _Hasher:
        return _Hasher(digest.hash_threads() if self.hash_tensors else None)  # threads beside the copies (digest)

    def _run_check(self, result: WriteResult, lone: bool, held: Any, written: dict) -> None:
        """The caller's check of the output as it will be (``held``: the lone file, not yet committed): the one run
        beside the copies when what landed is proven to be what it read, else run now; a failure leaves the output
        without its completion marker."""
        if self.check is None:
            return
        where = str(self.target.name)
        marker = self.plan.single_file_name if lone else self.plan.index_name
        with self.target.view(held) as (root, renamed):
            try:
                if self._early is not None and self._early.passed() and self._early.proven(root, written):
                    return  # else (refused, or unproven) judged again below, on what landed
                self.check(root, PendingOutput(None if lone else manifest.index(self.plan, result.tensor_files),
                                               renamed, self.plan.checked_values))
            except CkptError as e:  # named by the output's own names (not a local mirror's)
                raise OutputError(f"{e.message}; the output was left incomplete (no {marker}, no {MANIFEST_NAME})"
                                  .replace(str(root), where), rule=e.rule or "output-invalid",
                                  path=(e.path or where).replace(str(root), where)) from None

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
                     lone: bool) -> Any:
        """One shard: its header, then each tensor's bytes (hashed and checked as written); committed unless it is
        the lone output file. A finished shard the interrupted run proves (``--resume``) is kept."""
        header, ordered = self._shard_header(name, tensors)
        head = struct.pack("<Q", len(header)) + header
        result.files.append(name)
        result.tensor_files.update({t.key: name for t in ordered})
        proven = self.target.proven_shard(name, head, ordered) if self.resume else None
        if proven is not None and any(proven[t.key] != self._copied.get(t.key, proven[t.key]) for t in ordered):
            proven = None  # it copies an input's tensor whose bytes changed since (Plan.copied_digests): again
        if proven is not None:
            result.skipped_shards.append(name)  # its digests are the ones just proven: not hashed again
            for key, d in proven.items():
                hasher.done_tensor(key, d)
            self.progress.advance(sum(t.nbytes for t in ordered))
            return None
        with self.target.open(name, head) as up, lookahead(ordered) as ahead:
            i, checks = 0, []
            for run in _runs(ordered):
                if len(run) > 1:
                    checks += self._write_run(up, run, hasher)
                else:  # the next computed tensors decode while this one is written
                    checks += self._write_tensor(up, run[0], ahead.chunks(i), hasher)
                i += len(run)
            if checks:  # judged once every byte is fed (hashed beside the copies, up to the last): the first refused
                hasher.copier.drain()  # value in the shard's order is the error, and the shard is not committed
                for check in checks:
                    check.finish()
            up.close()
        if not lone:
            up.commit()
        hasher.when_done([t.key for t in ordered],
                         lambda digests: self.target.journal(name, {"size": up.size, "tensors": digests}))
        result.bytes_written += up.size
        return up

    def _write_tensor(self, up: Any, t: OutputTensor, chunks: Iterable[Any], hasher: _Hasher) -> list[Any]:
        """``t``'s bytes appended to ``up``: kernel copies and plain writes, or (``copier``) each chunk read once
        and fed to its digest and its value check as it is written; the check, to be finished (``_write_shard``)."""
        copier = hasher.copier if hasher.hashing or t.check else None
        h = digest.new(hasher.algo) if copier is not None and hasher.hashing else None
        check = t.check() if t.check is not None else None
        sink = Feed(h, check) if copier is not None else None
        write = up.write if copier is None else lambda mv: copier.chunk(sink, mv, up.write)
        self._stream_tensor(t, lambda seg: up.copy(seg, copier, sink), write, chunks)
        if h is not None:
            hasher.done_tensor(t.key, copier.later(h.hexdigest))
        return [check] if check is not None else []

    def _write_run(self, up: Any, run: list[OutputTensor], hasher: _Hasher) -> list[Any]:
        """Tensors whose bytes lie end to end in one source, in this order (``_runs``): one copy - a kernel copy
        when large, hashed from the page cache - each tensor's bytes fed to its own digest and check (``Split``);
        the checks, to be finished (``_write_shard``)."""
        checks = [t.check() if t.check is not None else None for t in run]
        hashes = [digest.new(hasher.algo) if hasher.hashing else None for _ in run]
        first = run[0].recipe.segments[0]
        seg = Segment(first.source, first.offset, sum(t.nbytes for t in run))
        feeds = [Feed(h, c) for h, c in zip(hashes, checks, strict=True)]
        copier = hasher.copier if hasher.hashing or any(checks) else None
        up.copy(seg, copier, None if copier is None else Split([(t.nbytes, f) for t, f in zip(run, feeds,
                                                                                               strict=True)]))
        self.progress.advance(seg.length)
        for t, h in zip(run, hashes, strict=True):
            if h is not None:
                hasher.done_tensor(t.key, copier.later(h.hexdigest))
        return [c for c in checks if c is not None]

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


def _runs(ordered: list[OutputTensor]) -> list[list[OutputTensor]]:
    """``ordered`` in runs: tensors each copied whole from one byte range that continues the previous one's in the
    same source (a draft's or a release's MTP layer, laid out as it is written) share a run; others are alone."""
    runs: list[list[OutputTensor]] = []
    end = None
    for t in ordered:
        r = t.recipe
        seg = r.segments[0] if isinstance(r, CopyBytes) and len(r.segments) == 1 else None
        if seg is None or seg.length != t.nbytes or not t.nbytes:
            runs.append([t])
            end = None
            continue
        if end is not None and end[0] is seg.source and end[1] == seg.offset:
            runs[-1].append(t)
        else:
            runs.append([t])
        end = (seg.source, seg.offset + seg.length)
    return runs


def output_error(e: OSError, where: str, written: int | None = None) -> OutputError:
    what = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    if e.errno == errno.EFBIG:
        what = "file size limit exceeded"
    elif e.errno == errno.EDQUOT:
        what = "disk quota exceeded"
    suffix = f" after {written} bytes" if written is not None else ""
    return OutputError(f"write failed ({what}){suffix}", path=where)


VALUE_RULES = frozenset({"nonfinite"})  # what a tensor's check (OutputTensor.check) refuses


class ValueRefused(Exception):
    """A tensor's check refused the values being written (carries the error the command reports)."""

    def __init__(self, error: CkptError) -> None:
        super().__init__(str(error))
        self.error = error


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
        self.copier = HashingCopier(threads=threads or 0)  # also feeds value checks when nothing is hashed
        # key -> its digest, or the Future that brings it (replaced by its digest once done: a Future with its
        # Condition is ~1 KB, and a shard rewritten whole has one per tensor)
        self._tensors: dict[str, str | Future] = {}
        self._files: dict[str, Future] = {}
        self._known: dict[str, tuple] = {}  # whole files: name -> (digest or None, size, header), from a manifest
        self._known_tensors: dict[str, str] = {}  # their tensors' digests, when the manifest has them per tensor

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
        pending = [f for f in futures.values() if isinstance(f, Future)]
        left = [len(pending)]
        lock = threading.Lock()

        def one(_f: Future | None) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            with contextlib.suppress(Exception):  # a failed hash is reported by results(); no entry: rewritten
                callback({k: _value(f) for k, f in futures.items()})

        if not pending:
            one(None)
        for f in pending:
            f.add_done_callback(one)

    def when_file_done(self, name: str, callback: Callable[[tuple], None]) -> None:
        fut = self._files.get(name)
        if fut is not None:
            fut.add_done_callback(lambda f: f.exception() is None and callback(f.result()))

    def done_tensor(self, key: str, digest: str | Future) -> None:
        """A tensor's digest: computed (a resumed shard's proof), or on its way (the copier's)."""
        self._tensors[key] = digest
        if isinstance(digest, Future):
            digest.add_done_callback(lambda f: self._settle(key, f))

    def _settle(self, key: str, f: Future) -> None:
        if f.exception() is None and self._tensors.get(key) is f:
            self._tensors[key] = f.result()

    def done_file(self, name: str, landed: tuple | Future) -> None:
        self._files[name] = _done(landed)

    def known(self, name: str, known: KnownDigest, header: Header | None) -> None:
        """A whole file whose digest its input's manifest vouches for: taken as it is, nothing read."""
        self._known[name] = (known.whole, known.stat["size"], header)
        self._known_tensors.update(known.tensors or {})

    def results(self) -> tuple[dict[str, str], dict[str, tuple]]:
        return ({**{k: _value(f) for k, f in self._tensors.items()}, **self._known_tensors},
                {**{k: f.result() for k, f in self._files.items()}, **self._known})

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # nothing reads a file after this
        self.copier.close()


def _value(digest: str | Future) -> str:
    return digest.result() if isinstance(digest, Future) else digest


def _done(value: Any) -> Future:
    if isinstance(value, Future):
        return value
    fut: Future = Future()
    fut.set_result(value)
    return fut


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


MAP_STEP = 8 << 20  # a linked file is hashed from read-only mappings of this size, one at a time (RSS stays flat)


def _hash_shard_file(path: Path) -> tuple[str, int, Header | None]:
    """(digest, size, header) of a safetensors file as it landed in the output, in one pass: hashed from read-only
    mappings (the page cache, no copy into a buffer: a third less CPU than reading it, BLAKE3 on 2 cores)."""
    d = FileDigest()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        for at in range(0, size, MAP_STEP):
            feed_mapped(d, f.fileno(), str(path), at, min(MAP_STEP, size - at))
    return d.result(str(path))


def source_size(path) -> int:
    """A source file's size; a remote source's lazy path knows it without being downloaded."""
    known = getattr(path, "size", None)
    return known if isinstance(known, int) else os.stat(path).st_size

