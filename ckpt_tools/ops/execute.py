"""Run a planned stitch or graft and write its report: the part of those verbs after planning.

The report (``StitchReport``, ``GraftReport``) is written into the output as ``stitch-report.json`` /
``graft-report.json`` after the output validated, and to ``--report`` when asked; ``--plan-json``
gets the plan. Printing is the caller's (the CLI renders the report this returns to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..stream.plan import Plan
    from ..stream.progress import Progress
    from ..stream.targets import Output


class Report(Protocol):
    """What a writing verb's report offers: its JSON, and the validation result this module fills in."""

    validation: dict | None

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


def execute_and_report(plan: Plan, report: Report, o: Outputs, allow: frozenset[str], name: str,
                       progress: Progress | None = None) -> None:
    """Write the plan JSON, execute the plan (unless dry run) with the report as ``name`` in the output, and
    write the report file. Inputs stay open meanwhile (the writer reads them)."""
    from ..jsonutil import write_json_file
    from ..options import outside_inputs

    if o.report_file is not None:
        outside_inputs("--report", o.report_file, plan.inputs)  # before anything is written
    if o.plan_json is not None:
        plan.write_json(o.plan_json)
    if not o.dry_run:
        _write(plan, report, o, allow, name, progress)
    if o.report_file is not None:
        write_json_file(o.report_file, report.to_json(), "--report", plan.inputs)


def _write(plan: Plan, report: Report, o: Outputs, allow: frozenset[str], name: str,
           progress: Progress | None) -> None:
    """Execute the plan; the output is validated before its index appears (a failure is exit 4), then the
    report is written as ``name``.

    What --allow-invalid let in from the verifier may be carried out: those rules do not fail it.
    """
    from ..jsonutil import dumps_strict
    from ..stream.execute import execute
    from ..stream.plan import OutputFile
    from ..stream.targets import write_output_file
    from .validate import validate_output

    def check(path: Path, pending) -> None:
        result = validate_output(path, allow=allow, pending=pending)
        report.validation = {"ok": True, "problems": [], **({"allowed": result["allowed"]} if "allowed" in result
                                                            else {})}

    plan.files.append(OutputFile(name, content=b"{}"))  # placeholder, rewritten below
    execute(plan, o.out, overwrite=o.overwrite, resume=o.resume, progress=progress, check=check)
    # tmp + rename: a run killed here leaves the placeholder, never a truncated report
    write_output_file(o.out, name, (dumps_strict(report.to_json(), indent=2) + "\n").encode())
