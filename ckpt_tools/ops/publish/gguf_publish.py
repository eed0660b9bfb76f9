"""``ckpt push`` of a GGUF directory (``ckpt extract --format gguf``: ``mtp-*.gguf`` and ``ckpt_manifest.json``).

Validation is the GGUF one (ops/check/gguf.py): each file's MTP blocks against the family's table and, when the
manifest's trunk is on this machine, the sidecar against that trunk (``validate SIDECAR --gguf-trunk TRUNK``).
Without the trunk the pair is not checked, and the card says so.

A llama.cpp probe report names no tensor digest (``tensors`` is null: llama.cpp reads the file itself), so it is
matched to the pushed files by their bytes: an MTP of the report is a pushed sidecar's when its ``name`` is a
file whose sha256 is the pushed file's and which was not modified after the report was written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ...io.digest import file_sha256
from ...model.problem import Problem

SUFFIX = ".gguf"


def gguf_files(folder: Path) -> list[Path]:
    """The GGUF files a directory publishes, when it publishes no safetensors (else none: a checkpoint)."""
    if any(folder.glob("*.safetensors")):
        return []
    return sorted(p for p in folder.glob(f"*{SUFFIX}") if p.is_file() and not p.name.startswith("."))


@dataclass
class Note:
    key: str
    message: str


@dataclass
class GgufValidation:
    """What push needs of a validation (``ok``, ``problems`` with rules, ``notes``), for GGUF files."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    trunk: str | None = None  # the trunk each sidecar was checked against, None: not on this machine
    summaries: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def trunk_path(manifest: dict | None) -> Path | None:
    """The trunk GGUF the manifest names (``trunk.path``), or None."""
    trunk = (manifest or {}).get("trunk")
    path = trunk.get("path") if isinstance(trunk, dict) else None
    return Path(path) if isinstance(path, str) and path else None


def validate_folder(files: list[Path], manifest: dict | None) -> GgufValidation:
    from ...io.gguf_file import read_gguf
    from ..check.gguf import check_pair, summarize

    out = GgufValidation()
    trunk_file = trunk_path(manifest)
    trunk = read_gguf(trunk_file) if trunk_file is not None and trunk_file.is_file() else None
    if trunk is not None:
        out.trunk = str(trunk_file)
    family = (manifest or {}).get("family") if isinstance((manifest or {}).get("family"), str) else None
    for f in files:
        g = read_gguf(f)
        if trunk is not None and g.nextn:
            summary, extra = check_pair(g, trunk, family)
        else:
            summary, extra = summarize(g, family), []
        out.summaries.append(summary.to_json())
        out.problems += [Problem(p.rule, p.path, p.key, p.message) for p in [*summary.problems, *extra]]
        if trunk is None and g.nextn:
            where = f" ({trunk_file} is not on this machine)" if trunk_file is not None else ""
            out.notes.append(Note(f.name, "checked against its family's table only: not against a trunk" + where))
    return out


def match_report(files: list[Path], report: Path, drafts: list[dict]) -> tuple[list[int], str | None, list[str]]:
    """(indices of ``drafts`` that measured a pushed file, that file's sha256, why each other entry is not one)."""
    pushed = {file_sha256(f): f for f in files}
    made = report.stat().st_mtime
    matched: list[int] = []
    digest: str | None = None
    why: list[str] = []
    for i, d in enumerate(drafts):
        name = str(d.get("name"))
        recorded = (d.get("tensors") or {}).get("sha256")
        if recorded in pushed:  # a report that records the file's digest itself
            matched.append(i)
            digest = digest or recorded
            continue
        measured = _measured_file(name, report)
        if measured is None:
            why.append(f"{name}: no such file here")
            continue
        sha = file_sha256(measured)
        if sha not in pushed:
            why.append(f"{name}: sha256 {sha}")
        elif measured.stat().st_mtime > made:
            why.append(f"{name}: modified after the report was written")
        else:
            matched.append(i)
            digest = digest or sha
    return matched, digest, why


def _measured_file(name: str, report: Path) -> Path | None:
    """The file an MTP entry names: as given (absolute, or relative to the working directory), else relative to
    the report's directory."""
    for candidate in (Path(name), report.parent / name):
        if candidate.is_file() and os.fspath(candidate).endswith(SUFFIX):
            return candidate
    return None


def gguf_facts(folder: Path, manifest: dict | None, validation: object) -> dict | None:
    """What the card says of a GGUF directory (None for a checkpoint): its files, the trunk they go with (the
    manifest's, by file name), llama.cpp's architecture, the MTP layers and whether the pair was checked."""
    files = gguf_files(folder)
    if not files:
        return None
    m = manifest or {}
    trunk = trunk_path(m)
    checked = isinstance(validation, GgufValidation) and validation.trunk is not None

    def count(key: str) -> int | None:
        v = m.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return {"files": [f.name for f in files], "trunk": trunk.name if trunk is not None else None,
            "trunk_checked": checked, "llama_cpp_arch": m.get("llama_cpp_arch"), "gguf_type": m.get("gguf_type"),
            "nextn_predict_layers": count("nextn_predict_layers"), "block_count": count("block_count")}
