"""The state of an output directory: may this run write there, who holds it, what a previous run left.

- The lock (``.ckpt.lock``, an flock): a second writer refuses instead of interleaving.
- The checks before a byte is written: the output overlaps no input; a non-empty directory needs
  ``--overwrite`` or ``--resume``.
- The resume record (``.ckpt-resume.json``: the plan's digest and its input fingerprints), and the
  rule that ``--resume`` continues only a run whose record equals the new plan's.
- Clearing what an earlier run of ours left (``--overwrite``): every file its record or manifest lists as
  written (``written``: side files included), never a file no run of ours wrote; and temporary files.

The local target (``targets.local``) calls these; the object-store target shares the names and the resume rule.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import OutputError, UsageError
from ..io.artefacts import LOCK_NAME, MANIFEST_NAME, RESUME_NAME
from ..options import dangling_link
from .plan import Plan, fingerprint_change

# Files a previous run of ours may have left; --overwrite clears them before writing (with what its record lists).
OUR_ARTEFACTS = ("*.safetensors", "*.safetensors.index.json", MANIFEST_NAME, "stitch-report.json", "graft-report.json",
                 RESUME_NAME, ".ckpt-resume-journal.jsonl")  # journal.JOURNAL_NAME


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


# -- may this run write here ---------------------------------------------------------------


def check_not_an_input(out: Path, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse an -o that is, is inside, or contains an input: an input must never change.

    Real paths (links resolved; a missing -o by its nearest existing parent). An input
    directory is the whole directory; an input file is that file.
    """
    real_out = _real(out)
    for src in inputs:
        real = Path(src).resolve()
        if real_out == real:
            where = "is an input of this command"
        elif real.is_dir() and real_out.is_relative_to(real):
            where = f"is inside the input {real}"
        elif real.is_relative_to(real_out):
            where = f"contains the input {real}"
        else:
            continue
        raise UsageError(f"output directory {out} {where}; choose an -o outside every input",
                         rule="output-overlaps-input")


def check_output_dir(out: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse a non-empty directory unless --overwrite / --resume, and an -o through a dangling link.

    Called before creating the directory and again under the lock: a concurrent writer may
    have filled it in between. Only a plain lock file is not counted (a link or anything
    else named like the lock is someone else's).
    """
    link = dangling_link(out)
    if link is not None:  # mkdir would say only "File exists"; creating the link's target is not ours to guess
        raise OutputError(f"{link} is a dangling symbolic link (to {os.readlink(link)}, which does not exist); "
                          "create its target, remove the link, or give -o another path",
                          rule="output-dangling-link", path=str(out))
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", path=str(out))
    if out.exists():
        leftovers = [p.name for p in out.iterdir()
                     if p.name != LOCK_NAME or not _plain_file(p.lstat())]
        if leftovers and not (overwrite or resume):
            raise OutputError(
                f"output directory is not empty ({len(leftovers)} entries, e.g. {sorted(leftovers)[0]}); "
                "pass --overwrite to replace it or --resume to finish an interrupted run",
                path=str(out),
            )


# -- the lock --------------------------------------------------------------------------------


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


class DirLock:
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
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)


# -- what a previous run left ------------------------------------------------------------------


def written_names(plan: Plan, shards: Iterable[str]) -> list[str]:
    """Every file a run of ``plan`` puts into its output (``shards``: its shard names; side files, reports,
    index, manifest): what its record and manifest list as ``written``, so that a later ``--overwrite``
    removes exactly these."""
    shards = list(shards)
    names = set(shards) | {f.name for f in plan.files if f.link != "remote"} | {MANIFEST_NAME}
    return sorted(names if lone_file(plan, shards) else names | {plan.index_name})


def lone_file(plan: Plan, shards: Iterable[str]) -> bool:
    """The writer's rule: one lone shard and no whole .safetensors file is its own completion marker (no index)."""
    return list(shards) == [plan.single_file_name] and not any(f.name.endswith(".safetensors") for f in plan.files)


def previous_written(read: Callable[[str], bytes | None]) -> list[str]:
    """What earlier runs of ours wrote into this output: the ``written`` lists of its resume record (a run stopped
    before its manifest has only that) and of its manifest. A record is input like any other: names that could
    leave the output (absolute, ``..``) and the lock this run holds are not ours to remove and are dropped."""
    names: set[str] = set()
    for record in _records(read):
        listed = record.get("written")
        if isinstance(listed, list):
            names.update(n for n in listed if isinstance(n, str) and _inside(n) and n != LOCK_NAME)
    return sorted(names)


def _inside(name: str) -> bool:
    """A relative name that stays inside the output (no root, no ``..``, no empty part)."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def read_file(out: Path, name: str) -> bytes | None:
    """The bytes of ``out/name`` when it is a plain file (never read through a link); None otherwise."""
    p = out / name
    try:
        return p.read_bytes() if p.is_file() and not p.is_symlink() else None
    except OSError:
        return None


def clear_previous_output(out: Path, markers: Iterable[str]) -> None:
    """--overwrite: remove what a run of ours wrote; ``markers`` (completion markers, manifest) first.

    What a run of ours wrote: every file the previous record or manifest lists as ``written`` (side files
    included: a stale ``hf_quant_config.json`` would describe the new tensors wrongly), and our artefacts'
    names. A file no run of ours wrote (a note of the user's) is not ours to delete and stays.
    """
    listed = previous_written(lambda name: read_file(out, name))  # read before the markers (the manifest) go
    # The completion markers go first, so the directory reads as incomplete from here on.
    for name in markers:
        p = out / name
        if p.exists() or p.is_symlink():
            p.unlink()
    for pattern in OUR_ARTEFACTS:
        for p in out.glob(pattern):
            p.unlink()
    for name in listed:
        _remove_listed(out, name)


def _remove_listed(out: Path, name: str) -> None:
    """Unlink ``out/name`` (a link is removed, never followed) when every directory on the way is a real one of
    the output; then its parents inside the output, when that left them empty."""
    parts = name.split("/")
    d = out
    for part in parts[:-1]:
        d = d / part
        if d.is_symlink() or not d.is_dir():
            return
    p = out / name
    if p.is_symlink() or p.is_file():
        p.unlink()
    for _ in parts[:-1]:
        p = p.parent
        try:
            p.rmdir()  # only an empty directory
        except OSError:
            return


def read_record(read: Callable[[str], bytes | None]) -> dict | None:
    """What an interrupted run was doing: its resume record, else the manifest of a finished run; ``read(name)``
    gives an output file's bytes (None: not there). A file that is not a record is no record."""
    return next((r for r in _records(read) if isinstance(r.get("plan"), dict)), None)


def _records(read: Callable[[str], bytes | None]) -> Iterator[dict]:
    """The resume record, then the manifest, each that is there and a JSON object."""
    for name in (RESUME_NAME, MANIFEST_NAME):
        raw = read(name)
        try:
            record = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            yield record


# -- resume -------------------------------------------------------------------------------------


def resume_record(plan_digest: dict[str, str], fingerprints: dict, command: str,
                  written: list[str] | None = None) -> bytes:
    """The record written before the first shard: what ``--resume`` compares the next plan with, and the files
    this run will write (``written``: what an ``--overwrite`` of an interrupted run removes)."""
    record = {"plan": plan_digest, "inputs": fingerprints, "command": command,
              **({"written": written} if written is not None else {})}
    return (json.dumps(record, indent=1) + "\n").encode()


def check_resume(record: dict | None, finished: Callable[[], list[str]], plan_digest: dict[str, str],
                 fingerprints: dict, out: str) -> None:
    """--resume continues only the same job: same plan, same inputs (names what differs).

    ``record`` is what the interrupted run was doing (``read_record``); ``finished`` lists
    what it left in place, asked only when there is no record.
    """
    def refuse(msg: str, path: str) -> OutputError:
        return OutputError(f"--resume refused: {msg}; finished shards would not be this job's. Pass --overwrite "
                           "to start again", rule="resume-mismatch", path=path)

    if record is None and not finished():
        return  # nothing written yet (killed before the first file): nothing to reuse, nothing to prove
    if record is None:
        raise refuse(f"{out} holds no resume record ({RESUME_NAME}) or manifest of a run of this plan", out)
    old = record["plan"]
    if old.get("plan") == plan_digest["plan"]:
        return
    inputs = record.get("inputs")
    change = fingerprint_change(inputs, fingerprints) if isinstance(inputs, dict) else None
    if change is not None:
        raise refuse(f"{change[1]} since the interrupted run", change[0])
    parts = [k for k in sorted(plan_digest) if k != "plan" and old.get(k) != plan_digest[k]]
    raise refuse(f"the plan differs from the interrupted run's ({', '.join(parts) or 'plan'}: other options, "
                 "tables or tool version)", out)
