"""The resume journal: what each finished file of an interrupted run held, so ``--resume`` reuses only that.

A shard or whole file that is in place with the right size and header may still not hold the bytes the run
wrote (edited, truncated and re-extended, replaced after the kill). As each file completes and the hashes of
what landed are in, one JSON line is appended to ``.ckpt-resume-journal.jsonl``: its name, size and digests
(per tensor for a written shard, the whole file for one copied whole). ``--resume`` reuses a file only when
the journal has its line and the file's bytes, hashed again, give the same digests; any other file is
written again. A line torn by the kill is ignored (that file is written again).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

JOURNAL_NAME = ".ckpt-resume-journal.jsonl"


class Journal:
    """Appends entries (thread-safe: hasher threads complete them); ``read`` gives the previous run's."""

    def __init__(self, out: Path) -> None:
        self.path = out / JOURNAL_NAME
        self._lock = threading.Lock()
        self._closed = False

    def start(self, keep: bool, manifest: dict | None = None) -> dict[str, dict]:
        """The previous run's entries (``keep``: resuming; ``manifest``: the one it wrote, if any, read first), and a
        journal that starts from them."""
        entries = {**from_manifest(manifest), **read(self.path)} if keep else {}
        with self._lock:
            tmp = self.path.with_name(f".{JOURNAL_NAME}.partial")
            with open(tmp, "w") as fh:  # rewritten whole: a torn line of the previous run is not carried
                fh.writelines(json.dumps({"file": name, **entry}) + "\n" for name, entry in entries.items())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        return entries

    def add(self, name: str, entry: dict) -> None:
        line = json.dumps({"file": name, **entry}) + "\n"
        with self._lock:
            if self._closed:
                return  # the run finished: its journal is gone, and a late line must not bring it back
            with open(self.path, "a") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())

    def close(self) -> None:
        with self._lock:
            self._closed = True


def from_manifest(manifest: dict | None) -> dict[str, dict]:
    """Entries from a manifest the run wrote (a run killed after it, before its index): per shard the tensor
    digests it lists, per whole file its digest and size (only digests of this run's algorithm)."""
    from ..io import digest

    algo = digest.manifest_algo()
    out: dict[str, dict] = {}
    if not isinstance(manifest, dict):
        return out
    for key, t in (manifest.get("tensors") or {}).items():
        if isinstance(t, dict) and isinstance(t.get("file"), str) and isinstance(t.get(algo), str):
            out.setdefault(t["file"], {"tensors": {}})["tensors"][key] = t[algo]
    for name, f in (manifest.get("files") or {}).items():
        if isinstance(f, dict) and isinstance(f.get(algo), str) and isinstance(f.get("size"), int):
            out[name] = {"size": f["size"], "whole": f[algo]}
    return out


def read(path: Path) -> dict[str, dict]:
    """file name -> its last complete entry; unreadable lines are skipped."""
    out: dict[str, dict] = {}
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return out
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            name = entry.pop("file")
            out[name] = entry
    return out
