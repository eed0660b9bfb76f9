"""``ckpt push``'s probe report: found, checked to describe the files being pushed, and its plot found beside it.

The report is ``--probe-report FILE`` or ``probe-report.json`` in the pushed directory. It must name the pushed
checkpoint's tensors: one of its MTPs (the verifier's own, or a draft) has the digest of the pushed files'
tensors (``tensors_digest``), else it is refused, naming both digests, so a number measured on other files is
never published. The plot is ``--probe-plot FILE``, else the one the report names (``plot``, relative to the
report's directory), else ``probe-plot.png`` beside the report. A report or plot outside the directory is
uploaded under ``probe-report.json`` / ``probe-plot.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import InputError
from ...model.card_probe import ProbeEvidence
from ..shared.tensors_digest import tensors_digest

REPORT_NAME = "probe-report.json"
PLOT_NAME = "probe-plot.png"


def find(folder: Path, report: Path | None, plot: Path | None) -> tuple[ProbeEvidence | None, dict[str, Path]]:
    """The evidence for the card (None without a report) and the files outside ``folder`` to upload with it
    (path in the repository -> local file)."""
    found = report is None
    if report is None:
        report = folder / REPORT_NAME
        if not report.is_file():
            if plot is not None:
                raise InputError("--probe-plot needs a probe report (--probe-report, or probe-report.json in the "
                                 "directory)", rule="probe-report", path=str(plot))
            return None, {}
    data = _read(report)
    digest = tensors_digest(folder)
    matched = [i for i, d in enumerate(data["drafts"]) if (d.get("tensors") or {}).get("sha256") == digest.sha256]
    if not matched:
        measured = "; ".join(f"{d.get('name')}: {(d.get('tensors') or {}).get('sha256') or 'no digest'}"
                             for d in data["drafts"])
        raise InputError(f"the probe report measured other tensors ({measured}) than {folder} holds (sha256 "
                         f"{digest.sha256} over its {digest.tensors} tensors): probe these files again"
                         + (f" (or remove {REPORT_NAME} from the directory)" if found else ""),
                         rule="probe-report-stale", path=str(report))
    uploads: dict[str, Path] = {}
    report_path = _in_repo(folder, report, REPORT_NAME, uploads)
    plot = plot if plot is not None else _plot_beside(report, data)
    if plot is not None and not plot.is_file():
        raise InputError("no such plot", rule="probe-report", path=str(plot))
    plot_path = None if plot is None else _in_repo(folder, plot, PLOT_NAME, uploads)
    return ProbeEvidence(data, report_path, digest.sha256, matched, plot_path), uploads


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"cannot read the probe report: {e}", rule="probe-report", path=str(path)) from None
    drafts = data.get("drafts") if isinstance(data, dict) else None
    if not isinstance(drafts, list) or not drafts or not all(
            isinstance(d, dict) and isinstance(d.get("agreement"), list) and d["agreement"] for d in drafts):
        raise InputError("not a ckpt probe report (no 'drafts' with 'agreement' per depth)", rule="probe-report",
                         path=str(path))
    return data


def _plot_beside(report: Path, data: dict) -> Path | None:
    named = data.get("plot")
    named_path = [report.parent / named] if isinstance(named, str) and named else []
    for candidate in [*named_path, report.parent / PLOT_NAME]:
        if candidate.is_file():
            return candidate
    return None


def _in_repo(folder: Path, local: Path, name: str, uploads: dict[str, Path]) -> str:
    """The file's path in the repository: its own inside ``folder``, else ``name`` (then uploaded from outside)."""
    try:
        return local.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        uploads[name] = local
        return name
