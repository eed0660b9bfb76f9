"""The verbs that read: ``inspect``, ``validate`` (and its one writing mode, ``fix_quant_config=True``) and ``diff``.

Each returns a report whose ``to_json()`` is what ``ckpt VERB --json`` prints. A check that finds
something (validate's problems, diff's differences: exit 1 on the command line) raises
``CheckFailed`` with the report attached, so a script cannot mistake a failed check for a pass.
The reports are the ops' own report classes with ``Report`` as a second base (ops sit below api and
cannot import it): every field and method of the ops' report is there.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from ..errors import CheckFailed, UsageError
from ..ops import diff as _diff
from ..ops import fix_quant as _fix
from ..ops import inspect as _inspect
from ..ops import validate as _validate
from .report import Report, progress_sink

if TYPE_CHECKING:
    from ..ops.discover import Discovery

PathLike = str | os.PathLike[str]
StateDict = Mapping[str, Any]  # name -> torch.Tensor: a draft still in memory (diff reads it like a directory)
_R = TypeVar("_R", bound=Report)


@dataclass
class InspectReport(_inspect.InspectReport, Report):
    """``ckpt inspect --json``: family, MTP layers, roles, experts, shards, dtypes, status, findings (keys:
    ops/inspect.py)."""


@dataclass
class DiscoverReport(Report):
    """``ckpt inspect --discover --json``: the MTP tensors found from their names and the draft table (``yaml``)."""

    discovery: Discovery
    written: str | None = None  # the table file written (``write=``)
    allowed_invalid: list[dict[str, Any]] = field(default_factory=list)  # problems let through by allow_invalid

    @property
    def yaml(self) -> str:
        return self.discovery.yaml()

    def to_json(self) -> dict[str, Any]:
        return self.discovery.to_json() | ({"written": self.written} if self.written else {})


@dataclass
class ValidateReport(_validate.ValidationReport, Report):
    """``ckpt validate --json``: every problem with its rule, file and key (``ok`` is true when there is none)."""


@dataclass
class FixQuantConfigReport(_fix.FixReport, Report):
    """``ckpt validate --fix-quant-config --json``: the config changes, the files written, OUT's validation."""


@dataclass
class DiffReport(_diff.DiffReport, Report):
    """``ckpt diff --json``: per changed key its status and statistics; every key with ``all_keys``."""

    all_keys: bool = False  # list unchanged keys too (``all=True``, the CLI's --all)

    def to_json(self, all_keys: bool | None = None) -> dict[str, Any]:
        return super().to_json(all_keys=self.all_keys if all_keys is None else all_keys)


def _as(cls: type[_R], report: object, **extra: Any) -> _R:
    """The ops report ``report`` as the public subclass ``cls`` (the same field values)."""
    own = {f.name for f in fields(cls)} - set(extra)
    return cls(**{name: getattr(report, name) for name in own if hasattr(report, name)}, **extra)


# -- inspect ---------------------------------------------------------------------------------------------------


@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: Literal[False] = False, write: None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport: ...
@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: Literal[True], write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> DiscoverReport: ...
@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: bool = False, write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport | DiscoverReport: ...
def inspect(path: PathLike, *, arch: str | None = None, discover: bool = False, write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport | DiscoverReport:
    """Describe a checkpoint's MTP layers (headers only): roles, experts, shards, dtypes, parameters and bytes.

    ``path``: a directory, one .safetensors file or ``hf://org/repo@rev``; ``arch``: use this family's table
    instead of detecting it. ``discover=True``: find the MTP tensors from their names and draft a table
    (``DiscoverReport.yaml``), written to ``write`` (a .yaml file) when given. Never raises for a checkpoint it
    can read and classify: what the consistency gate refuses is in ``InspectReport.findings`` (``notes``: what
    validate notes); ``InputError`` only for unreadable input or an unknown family. ``allow_invalid``: checked
    (an unknown rule is a ``UsageError``), otherwise changes nothing for the description (``discover``: rules
    of the index gate to proceed despite). Headers only: ``progress`` shows nothing.
    """
    from ..model.consistency import parse_allow

    allow = parse_allow(allow_invalid)  # an unknown rule is a usage error before anything is opened
    if discover:
        return _discover(str(path), write, allow)
    if write is not None:
        raise UsageError("--write goes with --discover")
    return _as(InspectReport, _inspect.inspect_checkpoint(path, arch, allow))


def _discover(path: str, write: str | None, allow: frozenset[str]) -> DiscoverReport:
    from ..io.checkpoint import Checkpoint
    from ..model.gate import require_consistent
    from ..ops.discover import discover, write_draft
    from ..options import outside_inputs

    if write is not None and not write.endswith((".yaml", ".yml")):
        raise UsageError(f"--write {write}: a table file ends in .yaml")
    with Checkpoint.open(path) as ckpt:
        if write is not None:
            outside_inputs("--write", write, [ckpt.local_dir] if ckpt.local_dir else [])
        gate = require_consistent(ckpt, scope="files", allow=allow)
        found = discover(ckpt, family=Path(write).stem if write else None)
    if write:
        write_draft(found, write)
    return DiscoverReport(found, write, [p.to_json() for p in gate.allowed])


# -- validate --------------------------------------------------------------------------------------------------


@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: Literal[False] = False,
             out: None = None, link: str = "copy", dry_run: bool = False, overwrite: bool = False,
             progress: bool = False) -> ValidateReport: ...
@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: Literal[True],
             out: PathLike | None = None, link: str = "copy", dry_run: bool = False, overwrite: bool = False,
             progress: bool = False) -> FixQuantConfigReport: ...
@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: bool = False,
             out: PathLike | None = None, link: str = "copy", dry_run: bool = False, overwrite: bool = False,
             progress: bool = False) -> ValidateReport | FixQuantConfigReport: ...
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: bool = False,
             out: PathLike | None = None, link: str = "copy", dry_run: bool = False, overwrite: bool = False,
             progress: bool = False) -> ValidateReport | FixQuantConfigReport:
    """Check format, index and config-vs-tensor rules; every problem, with rule, file and key.

    Raises ``CheckFailed`` (its ``report`` a ``ValidateReport``) when there is a problem; ``InputError`` when
    ``path`` is not a checkpoint at all. ``fix_quant_config=True``: write ``path`` to ``out`` (a directory or
    ``s3://bucket/prefix``) with only its quantization config repaired (shards copied or linked by ``link``:
    copy | reflink | hardlink | remote) and OUT validated; ``dry_run`` computes the change and writes nothing;
    ``overwrite`` replaces OUT. Returns a ``FixQuantConfigReport`` (``status`` ``nothing-to-fix`` writes nothing).
    """
    from ..model.tables.loader import all_tables

    if arch is not None and arch not in all_tables():
        raise UsageError(f"--arch {arch!r}: unknown family; known: {', '.join(sorted(all_tables()))}")
    if fix_quant_config:
        return _fix_quant_config(path, arch, out, link, dry_run, overwrite, progress)
    for flag, given in (("-o", out is not None), ("--dry-run", dry_run), ("--overwrite", overwrite),
                        ("--link", link != "copy")):
        if given:
            raise UsageError(f"{flag} goes with --fix-quant-config")
    report = _as(ValidateReport, _validate.validate(path, arch))
    if not report.ok:
        raise CheckFailed(f"{len(report.problems)} problem(s): {', '.join(sorted(report.rules()))}",
                          report=report, path=report.root)
    return report


def _fix_quant_config(path: PathLike, arch: str | None, out_arg: PathLike | None, link: str, dry_run: bool,
                      overwrite: bool, progress: bool) -> FixQuantConfigReport:
    """Plan, write (unless ``dry_run``) and validate OUT."""
    from ..io.checkpoint import Checkpoint
    from ..options import outside_inputs
    from ..stream.execute import execute
    from ..stream.targets import output_location
    from ..stream.writer import PendingOutput

    if out_arg is None and not dry_run:
        raise UsageError("--fix-quant-config needs -o OUT (or --dry-run)")
    out = output_location(os.fspath(out_arg)) if out_arg is not None else None
    with Checkpoint.open(path) as ckpt:
        if isinstance(out, Path) and ckpt.local_dir is not None:  # a URL: the object-store writer checks
            outside_inputs("-o", out, [ckpt.local_dir])  # also when nothing is written: the same answer either way
        plan, report = _fix.plan_fix(ckpt, arch=arch, link=link, command=_fix_command(path, arch, out, link))
        if plan is not None and not dry_run:
            assert out is not None

            def check(where: Path, pending: PendingOutput) -> None:  # OUT must pass validate, mtp-quant-config too
                report.validation = _validate.validate_output(where, arch=arch, pending=pending)

            execute(plan, out, overwrite=overwrite, progress=progress_sink(progress), check=check)
            report.out, report.written = str(out), True
    return _as(FixQuantConfigReport, report)


def _fix_command(path: PathLike, arch: str | None, out: object, link: str) -> str:
    """The command the manifest records: the call as its command line (a library call has no argv of its own)."""
    words = ["ckpt", "validate", "--fix-quant-config", os.fspath(path)]
    words += ["-o", str(out)] if out is not None else ["--dry-run"]
    words += ["--arch", arch] if arch else []
    words += ["--link", link] if link != "copy" else []
    return shlex.join(words)


# -- diff ------------------------------------------------------------------------------------------------------


def diff(a: PathLike | StateDict, b: PathLike | StateDict, *, keys: str | None = None, stats: bool = False,
         dequant: bool = False, all: bool = False, allow_invalid: Sequence[str] = (),
         progress: bool = False) -> DiffReport:
    """Compare two checkpoints (directories, or state dicts in memory) key by key, streaming (memory stays bounded),
    and their config.json (a JSON diff) and side files (by digest). Never refuses a readable checkpoint: the index
    rules' findings on either side are reported (``problems``) and count as differences.

    ``keys``: only keys matching this regular expression; ``stats``: max |delta|, relative L2 and cosine per
    changed key; ``dequant``: compare FP8 block weights by dequantized value (implies ``stats``); ``all``: the
    report lists unchanged keys too. Raises ``CheckFailed`` (its ``report`` a ``DiffReport``) when they differ.
    """
    from ..io.checkpoint import Checkpoint
    from ..model.consistency import parse_allow
    from ..options import regex

    if keys is not None:
        regex("--keys", keys)  # before any checkpoint is opened
    allow = parse_allow(allow_invalid)
    with Checkpoint.open(a) as ca, Checkpoint.open(b) as cb:
        found = _diff.diff(ca, cb, keys=keys, stats=stats or dequant, dequant=dequant, allow=allow,
                           progress=progress_sink(progress))
    report = _as(DiffReport, found, all_keys=all)
    if not report.identical:
        raise CheckFailed(f"{report.a} and {report.b} differ: {report.summary()}", report=report)
    return report
