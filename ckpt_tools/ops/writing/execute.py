"""Run a writing verb's plan: the part of every writing verb after planning.

``write_plan`` (extract, init-draft, fuse/unfuse-experts): ``--plan-json`` gets the plan, the output
is written and validated unless it is a dry run, and ``Written`` says what landed.
``execute_and_report`` (stitch, graft): the same, with the verb's report (``StitchReport``,
``GraftReport``) written into the output as ``stitch-report.json`` / ``graft-report.json`` after the
output validated, and to ``--report`` when asked. Printing is the caller's (the CLI renders the
report the public function returns).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ...stream.plan import Plan
    from ...stream.progress import Progress
    from ...stream.targets import Output
    from ...stream.writer import WriteResult


class Report(Protocol):
    """What a writing verb's report offers: its JSON, and the validation result this module fills in."""

    validation: dict | None
    link_digests: dict | None

    def to_json(self) -> dict: ...


@dataclass(frozen=True)
class Outputs:
    """Where a writing verb's results go (its -o, --dry-run, --plan-json, --report, ... options)."""

    out: Output
    dry_run: bool = False
    plan_json: Path | None = None
    report_file: Path | None = None
    overwrite: bool = False
    resume: bool = False


@dataclass(frozen=True)
class Written:
    """What a write put into its output (the start of extract's, init-draft's and experts' ``--json``)."""

    output: str
    tensors: int
    tensor_bytes: int
    bytes_written: int
    bytes_read: int  # from the inputs (the output's validation is not counted)
    files: list[str]
    seconds: float

    @classmethod
    def of(cls, plan: Plan, result: WriteResult, read_before: int = 0) -> Written:
        return cls(str(result.out_dir), len(plan.tensors), plan.total_bytes, result.bytes_written,
                   result.bytes_read - read_before, list(result.files), round(result.seconds, 3))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def bytes_read_so_far() -> int:
    """The process's input byte count. The writer reports the running total; a verb subtracts what was read
    before it started, so that each of several verbs in one process (a training script, tests) counts its own."""
    from ...io.safetensors_io import IO_STATS

    return IO_STATS.total


def write_plan(plan: Plan, o: Outputs, allow: frozenset[str], progress: Progress | None = None, *,
               arch: str | None = None, read_before: int = 0) -> tuple[Written, dict[str, Any]] | None:
    """Write the plan JSON, then (unless dry run, which returns None) execute the plan. The output is
    validated (as ``arch`` when given) before its index appears: an invalid one is an OutputError
    (exit 4) and is never marked complete. Returns what was written (``read_before``: the
    ``bytes_read_so_far()`` when the verb started) and the validation result."""
    if o.plan_json is not None:
        plan.write_json(o.plan_json)
    if o.dry_run:
        return None
    from ...stream.execute import execute  # the writer's modules: not imported for a dry run
    from ..check.validate import validate_output

    validation: dict[str, Any] = {}
    result = execute(plan, o.out, overwrite=o.overwrite, resume=o.resume, progress=progress,
                     check=lambda path, pending: validation.update(validate_output(path, arch=arch, allow=allow,
                                                                                   pending=pending)))
    return Written.of(plan, result, read_before), validation


def execute_and_report(plan: Plan, report: Report, o: Outputs, allow: frozenset[str], name: str,
                       progress: Progress | None = None) -> None:
    """Write the plan JSON, execute the plan (unless dry run) with the report as ``name`` in the output, and
    write the report file. Inputs stay open meanwhile (the writer reads them)."""
    from ...jsonutil import write_json_file
    from ...options import outside_inputs

    if o.report_file is not None:
        outside_inputs("--report", o.report_file, plan.inputs)  # before anything is written
    if o.plan_json is not None:
        plan.write_json(o.plan_json)
    if not o.dry_run:
        _write(plan, report, o, allow, name, progress)
    if o.report_file is not None:
        write_json_file(o.report_file, report.to_json(), "--report", plan.inputs)


def link_digests(plan: Plan, result: WriteResult) -> dict | None:
    """How the digest of each shard linked whole (--link hardlink / reflink) was had, None when none is: the
    output's manifest lists every linked shard's whole-file digest (verify-manifest, --resume), and a link moves
    no bytes to hash on the way, so each is taken over from its input's manifest where that manifest describes
    the file as it is, else read once from the file that landed (``hashed``, each with why)."""
    from ...stream.writer import source_size

    linked = [f for f in plan.files if f.tensors and f.link in ("hardlink", "reflink")]
    if not linked:
        return None
    taken = {f.name: result.reused[f.name] for f in linked if f.name in result.reused}
    hashed = {f.name: f"no ckpt_manifest.json beside {f.source} lists its digest" if f.known is None else
              f"{f.known.manifest} describes another file (size, mtime, inode or device differ)"
              for f in linked if f.name not in taken}
    return {"from_manifest": taken, "hashed": hashed,
            "hashed_bytes": sum(source_size(f.source) for f in linked if f.name in hashed and f.source)}


def _write(plan: Plan, report: Report, o: Outputs, allow: frozenset[str], name: str,
           progress: Progress | None) -> None:
    """Execute the plan; the output is validated before its index appears (a failure is exit 4), then the
    report is written as ``name``.

    What --allow-invalid let in from the verifier may be carried out: those rules do not fail it.
    """
    from ...jsonutil import dumps_indented
    from ...stream.execute import execute
    from ...stream.plan import OutputFile
    from ...stream.targets import write_output_file
    from ..check.validate import validate_output

    def check(path: Path, pending) -> None:
        result = validate_output(path, allow=allow, pending=pending)
        report.validation = {"ok": True, "problems": [], **({"allowed": result["allowed"]} if "allowed" in result
                                                            else {})}

    plan.files.append(OutputFile(name, content=b"{}"))  # placeholder, rewritten below
    result = execute(plan, o.out, overwrite=o.overwrite, resume=o.resume, progress=progress, check=check)
    report.link_digests = link_digests(plan, result)
    # tmp + rename: a run killed here leaves the placeholder, never a truncated report
    write_output_file(o.out, name, (dumps_indented(report.to_json(), 2) + "\n").encode())
