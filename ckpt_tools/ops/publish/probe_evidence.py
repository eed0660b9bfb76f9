"""``ckpt push``'s probe report: found, checked to describe the files being pushed, and its plot found beside it.

The report is ``--probe-report FILE`` or ``probe-report.json`` in the pushed directory. It must name the pushed
checkpoint's tensors: one of its MTPs (the verifier's own, or a draft) has the digest of the pushed files'
tensors (``tensors_digest``), else it is refused, naming both digests, so a number measured on other files is
never published (a GGUF directory's report, llama.cpp's, names no tensor digest: its MTPs are matched to the
pushed files by their bytes, see gguf_publish). The plot is ``--probe-plot FILE``, else the one the report names
(``plot``, relative to the report's directory), else ``probe-plot.png`` beside the report. A report or plot
outside the directory is uploaded under ``probe-report.json`` / ``probe-plot.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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
    from .gguf_publish import gguf_files

    ggufs = gguf_files(folder)
    if ggufs:
        return _gguf_evidence(folder, ggufs, report, plot, data, found)
    digest = tensors_digest(folder)
    matched = [i for i, d in enumerate(data["drafts"]) if (d.get("tensors") or {}).get("sha256") == digest.sha256]
    if not matched:
        measured = "; ".join(f"{d.get('name')}: {(d.get('tensors') or {}).get('sha256') or 'no digest'}"
                             for d in data["drafts"])
        raise InputError(f"the probe report measured other tensors ({measured}) than {folder} holds (sha256 "
                         f"{digest.sha256} over its {digest.tensors} tensors): probe these files again"
                         + (f" (or remove {REPORT_NAME} from the directory)" if found else ""),
                         rule="probe-report-stale", path=str(report))
    return _evidence(folder, report, plot, data, digest.sha256, matched)


def _evidence(folder: Path, report: Path, plot: Path | None, data: dict, digest: str, matched: list[int],
              basis: str = "tensors") -> tuple[ProbeEvidence, dict[str, Path]]:
    uploads: dict[str, Path] = {}
    report_path = _in_repo(folder, report, REPORT_NAME, uploads)
    plot = plot if plot is not None else _plot_beside(report, data)
    if plot is not None and not plot.is_file():
        raise InputError("no such plot", rule="probe-report", path=str(plot))
    plot_path = None if plot is None else _in_repo(folder, plot, PLOT_NAME, uploads)
    return ProbeEvidence(data, report_path, digest, matched, plot_path, basis), uploads


def _gguf_evidence(folder: Path, files: list[Path], report: Path, plot: Path | None, data: dict,
                   found: bool) -> tuple[ProbeEvidence, dict[str, Path]]:
    """A llama.cpp report (no tensor digest) matched to the pushed GGUF files by their bytes (gguf_publish)."""
    from .gguf_publish import match_report

    matched, digest, why = match_report(files, report, data["drafts"])
    if not matched or digest is None:
        raise InputError(f"the probe report measured no file with the bytes of {', '.join(f.name for f in files)} "
                         f"({'; '.join(why)}): probe these files again"
                         + (f" (or remove {REPORT_NAME} from the directory)" if found else ""),
                         rule="probe-report-stale", path=str(report))
    return _evidence(folder, report, plot, data, digest, matched, "gguf-file")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"cannot read the probe report: {e}", rule="probe-report", path=str(path)) from None
    drafts = data.get("drafts") if isinstance(data, dict) else None
    if not isinstance(drafts, list) or not drafts or not all(
            isinstance(d, dict) and isinstance(d.get("agreement"), list) and d["agreement"] for d in drafts):
        raise InputError("not a ckpt probe report (no 'drafts' with 'agreement' per depth)", rule="probe-report",
                         path=str(path))
    problem = report_problem(data)
    if problem is not None:
        raise InputError(f"{problem}: not what `ckpt probe --report` writes (it never reports a number that is "
                         "not one), so its numbers cannot go into a model card; probe these files again",
                         rule="probe-report", path=str(path))
    return data


# The report as `ckpt probe` writes it (ops.probe.probe.ProbeResult.to_json) and as the card reads it: each field
# the card reads, with what it must hold. Fields the card does not read are not judged.
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _optional(check):
    return lambda v: v is None or check(v)


_NUMBER = "a finite number"
DRAFT_FIELDS: dict[str, tuple[Any, str]] = {  # field -> (check, what it must be); absent = None
    "name": (_text, "a string"),
    "positions": (_count, "a count (an integer >= 0)"),
    "expected_accepted": (_finite, _NUMBER),
    "mean_acceptance_length": (_optional(_finite), f"{_NUMBER} or null"),
    "greedy_equal": (_optional(lambda v: isinstance(v, bool)), "true, false or null"),
    "tensors": (_optional(lambda v: isinstance(v, dict) and _optional(_text)(v.get("sha256"))),
                "null or an object whose sha256 is a string"),
}
REPORT_FIELDS: dict[str, tuple[Any, str]] = {
    "prompts": (_count, "a count (an integer >= 0)"),
    "max_new_tokens": (_optional(_count), "a count or null"),
    "prompts_sha256": (_optional(_text), "a string or null"),
    "dtype": (_optional(_text), "a string or null"),
    "device": (_optional(_text), "a string or null"),
    "chain": (_optional(_text), "a string or null"),
    "plot": (_optional(_text), "a string or null"),
    "engine": (_optional(lambda v: isinstance(v, dict) and all(_optional(_text)(v.get(k))
                                                              for k in ("name", "version"))),
               "null or an object whose name and version are strings"),
}


QUANT_STATUS = ("measured", "no-encoder", "unserved", "unencodable")  # ops.probe.mtp_quant.QuantRow.status
QUANT_FIELDS: dict[str, tuple[Any, str]] = {  # a row of --mtp-quant's table
    "scheme": (_text, "a string"),
    "status": (lambda v: v in QUANT_STATUS, f"one of {', '.join(QUANT_STATUS)}"),
    "bytes": (_optional(_count), "a count or null"),
    "reason": (_optional(_text), "a string or null"),
}
QUANT_MEASURED: dict[str, tuple[Any, str]] = {  # and of a measured one
    "bytes": (_count, "a count (an integer >= 0)"),
    "expected_accepted": (_finite, _NUMBER),
    "positions": (_count, "a count (an integer >= 0)"),
}


def report_problem(data: dict) -> str | None:
    """The first field of a probe report that is not what probe writes (``drafts[1].kl[0] is null, not a finite
    number``), or None."""
    for name, (check, what) in REPORT_FIELDS.items():
        if not check(data.get(name)):
            return f"{name} is {json.dumps(data.get(name))}, not {what}"
    problem = quant_problem(data)
    if problem is not None:
        return problem
    for i, d in enumerate(data["drafts"]):
        if "mean_acceptance_length" not in d and "expected_accepted" not in d:
            return f"drafts[{i}] has neither expected_accepted nor mean_acceptance_length"
        for name, (check, what) in DRAFT_FIELDS.items():
            if name == "expected_accepted" and name not in d and d.get("mean_acceptance_length") is not None:
                continue  # the card shows vLLM's own count then
            if not check(d.get(name)):
                return f"drafts[{i}].{name} is {json.dumps(d.get(name))}, not {what}"
        kl = d.get("kl") if d.get("kl") is not None else []
        if not isinstance(kl, list) or (kl and len(kl) != len(d["agreement"])):
            return (f"drafts[{i}].kl is {json.dumps(d.get('kl'))[:80]}, not a list of one number per depth "
                    f"({len(d['agreement'])}) or empty (vLLM measures no distribution)")
        for field, values in (("agreement", d["agreement"]), ("kl", kl)):
            for k, v in enumerate(values):
                if not _finite(v) or (field == "agreement" and not 0 <= v <= 1):
                    what = "a share in [0, 1]" if field == "agreement" else _NUMBER
                    return f"drafts[{i}].{field}[{k}] (depth {k + 1}) is {json.dumps(v)}, not {what}"
    return None


def quant_problem(data: dict) -> str | None:
    """The first field of the ``mtp_quant`` section (``ckpt probe --mtp-quant``) that is not what probe writes."""
    if "mtp_quant" not in data:
        return None
    rows = data["mtp_quant"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return f"mtp_quant is {json.dumps(rows)[:80]}, not a list of rows (objects)"
    for i, r in enumerate(rows):
        measured = r.get("status") == "measured"
        for name, (check, what) in [*QUANT_FIELDS.items(), *(QUANT_MEASURED.items() if measured else ())]:
            if not check(r.get(name)):
                return f"mtp_quant[{i}].{name} is {json.dumps(r.get(name))}, not {what}"
        if not measured:
            if any(k in r for k in ("agreement", "kl", "agreement_change")):
                return f"mtp_quant[{i}] ({r['status']}) holds numbers: only a measured row does"
            continue
        agreement = r.get("agreement")
        if not isinstance(agreement, list) or not agreement:
            return f"mtp_quant[{i}].agreement is {json.dumps(agreement)[:80]}, not a list of one share per depth"
        for field in ("agreement", "kl", "agreement_change"):
            values = r.get(field)
            if not isinstance(values, list) or len(values) != len(agreement):
                return (f"mtp_quant[{i}].{field} is {json.dumps(values)[:80]}, not a list of one number per depth "
                        f"({len(agreement)})")
            for k, v in enumerate(values):
                if not _finite(v) or (field == "agreement" and not 0 <= v <= 1):
                    what = "a share in [0, 1]" if field == "agreement" else _NUMBER
                    return f"mtp_quant[{i}].{field}[{k}] (depth {k + 1}) is {json.dumps(v)}, not {what}"
    return None


def _plot_beside(report: Path, data: dict) -> Path | None:
    named = data.get("plot")
    named_path = [report.parent / named] if isinstance(named, str) and named else []
    return next((c for c in [*named_path, report.parent / PLOT_NAME] if c.is_file()), None)


def _in_repo(folder: Path, local: Path, name: str, uploads: dict[str, Path]) -> str:
    """The file's path in the repository: its own inside ``folder``, else ``name`` (then uploaded from outside)."""
    try:
        return local.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        uploads[name] = local
        return name
