"""``validate`` as a function (``ckpt validate``; its one writing mode, ``fix_quant_config=True``): see
``reading`` for the reading verbs' common contract."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from ..errors import CheckFailed, InputError, UsageError
from ..ops.check import validate as _validate
from .options import Validate, keywords
from .report import Report, as_public, progress_sink

if TYPE_CHECKING:
    from .fixing import FixQuantConfigReport

PathLike = str | os.PathLike[str]
ENGINES = (None, "vllm")  # validate --engine: a serving engine's own loader run over the checkpoint


@dataclass
class ValidateReport(_validate.ValidationReport, Report):
    """``ckpt validate --json``: every problem with its rule, file and key (``ok`` is true when there is none)."""


# -- validate --------------------------------------------------------------------------------------------------


@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: Literal[False] = False,
             out: None = None, link: str = Validate.link, dry_run: bool = False, overwrite: bool = False,
             progress: bool = False, engine: str | None = None) -> ValidateReport: ...
@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: Literal[True],
             out: PathLike | None = None, link: str = Validate.link, dry_run: bool = False, overwrite: bool = False,
             progress: bool = False, engine: str | None = None) -> FixQuantConfigReport: ...
@overload
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: bool = False,
             out: PathLike | None = None, link: str = Validate.link, dry_run: bool = False, overwrite: bool = False,
             progress: bool = False, engine: str | None = None) -> ValidateReport | FixQuantConfigReport: ...
@keywords(Validate)
def validate(path: PathLike, *, arch: str | None = None, fix_quant_config: bool = False,
             out: PathLike | None = None, link: str = Validate.link, dry_run: bool = False, overwrite: bool = False,
             progress: bool = False, engine: str | None = None) -> ValidateReport | FixQuantConfigReport:
    """Check format, index and config-vs-tensor rules; every problem, with rule, file and key.

    Raises ``CheckFailed`` (its ``report`` a ``ValidateReport``) when there is a problem; ``InputError`` when
    ``path`` is not a checkpoint at all. ``fix_quant_config=True`` returns a ``FixQuantConfigReport`` (``status``
    ``nothing-to-fix`` writes nothing). ``engine="vllm"``: ``UsageError`` where vLLM is not importable.
    """
    from ..model.tables.loader import all_tables

    if arch is not None and arch not in all_tables():
        raise UsageError(f"--arch {arch!r}: unknown family; known: {', '.join(sorted(all_tables()))}")
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: the engine validate can run is vllm")
    if fix_quant_config:
        if engine is not None:
            raise UsageError("--engine goes without --fix-quant-config")
        return _fix_quant_config(path, arch, out, link, dry_run, overwrite, progress)
    for flag, given in (("-o", out is not None), ("--dry-run", dry_run), ("--overwrite", overwrite),
                        ("--link", link != Validate.link)):
        if given:
            raise UsageError(f"{flag} goes with --fix-quant-config")
    if engine == "vllm":
        from ..ops.check import vllm_loader

        vllm_loader.vllm_version()  # before anything is read: exit 2 when vLLM is not importable here
        if "://" in os.fspath(path):
            raise UsageError("--engine vllm reads a local checkpoint directory (vLLM builds its config from it): "
                             "download it first")
    report = as_public(ValidateReport, _validate.validate(path, arch))
    if engine == "vllm":
        _engine_check(report, path, arch)
    if not report.ok:
        raise CheckFailed(f"{len(report.problems)} problem(s): {', '.join(sorted(report.rules()))}",
                          report=report, path=report.root)
    return report


def _engine_check(report: ValidateReport, path: PathLike, arch: str | None) -> None:
    """vLLM's loader findings added to ``report``: only where the checkpoint's own rules left a table to go by (a
    config or layout validate refuses is that problem first, not vLLM's)."""
    from ..ops.check import vllm_loader

    if report.family is None or report.draft_format is not None:
        report.notes.append(_validate.Problem("vllm", None, None, "vLLM's loader was not run: the checkpoint has "
                                              "no family table to go by (see the problems above)"))
        return
    try:
        problems, notes, _ = vllm_loader.check(path, arch or report.family)
    except InputError as e:  # cannot build (vllm-build) or open: exit 3, unless validate's problems say why first
        if not report.problems:
            raise
        report.notes.append(_validate.Problem(e.rule or "vllm-build", e.path, None, f"vLLM's loader was not run: "
                                              f"{_validate.bare_message(e)}"))
        return
    report.problems += problems
    report.notes += notes


def _fix_quant_config(path: PathLike, arch: str | None, out_arg: PathLike | None, link: str, dry_run: bool,
                      overwrite: bool, progress: bool) -> FixQuantConfigReport:
    """Plan, write (unless ``dry_run``) and validate OUT."""
    from ..io.checkpoint import Checkpoint
    from ..ops.convert import fix_quant_config as _fix
    from ..options import outside_inputs
    from ..stream.execute import execute
    from ..stream.targets import output_location
    from ..stream.writer import PendingOutput
    from .fixing import FixQuantConfigReport

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
    return as_public(FixQuantConfigReport, report)


def _fix_command(path: PathLike, arch: str | None, out: object, link: str) -> str:
    """The command the manifest records: the call as its command line (a library call has no argv of its own)."""
    words = ["ckpt", "validate", "--fix-quant-config", os.fspath(path)]
    words += ["-o", str(out)] if out is not None else ["--dry-run"]
    words += ["--arch", arch] if arch else []
    words += ["--link", link] if link != Validate.link else []
    return shlex.join(words)


# -- GGUF ------------------------------------------------------------------------------------------------------


@dataclass
class GgufValidateReport(Report):
    """``ckpt validate X.gguf [--gguf-trunk TRUNK.gguf] --json``: the file's summary and every problem."""

    summary: Any
    trunk: str | None
    problems: list[Any]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**self.summary.to_json(), "trunk": self.trunk, "problems": [p.to_json() for p in self.problems],
                "ok": self.ok}


def validate_gguf(path: PathLike, *, trunk: PathLike | None = None, arch: str | None = None) -> GgufValidateReport:
    """Check a GGUF file's MTP blocks against the family's table and, with ``trunk``, that the sidecar ``path``
    goes with that trunk GGUF (architecture, block count, every architecture and tokenizer key, shared tensor
    shapes). Raises ``CheckFailed`` (its ``report`` a ``GgufValidateReport``) when there is a problem."""
    from ..io.gguf_file import read_gguf
    from ..ops.check.gguf import check_pair, summarize

    g = read_gguf(path)
    extra: list[Any] = []
    if trunk is None:
        summary = summarize(g, arch)
    else:
        summary, extra = check_pair(g, read_gguf(trunk), arch)
    report = GgufValidateReport(summary, None if trunk is None else os.fspath(trunk), [*summary.problems, *extra])
    if not report.ok:
        rules = sorted({p.rule for p in report.problems})
        raise CheckFailed(f"{len(report.problems)} problem(s): {', '.join(rules)}", report=report,
                          path=os.fspath(path))
    return report
