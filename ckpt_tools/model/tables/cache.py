"""A per-user cache of parsed table files (YAML -> plain data, stored as JSON).

Parsing the YAML of every table costs 0.1-0.3 s, paid by every command; reading the same
data back from one JSON file takes milliseconds. Only the parsing is cached: every table
is still checked (schema and names) on every run, so a damaged or edited cache cannot
smuggle in a table that would be refused. An entry is keyed by the path and content hash
of every table file and the tool version, so editing a table simply misses; each set of table
directories keeps one entry. Location:
``CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpt-tools``, else ``~/.cache/ckpt-tools``;
``CKPT_CACHE_DIR=off`` disables it. Files owned by another user, or writable by others,
are not read.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

PREFIX = "tables-"
T = TypeVar("T")


def cache_dir() -> Path | None:
    configured = os.environ.get("CKPT_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "no") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckpt-tools"


def _entry(files: list[Path], prefix: str = PREFIX) -> Path | None:
    from ... import __version__

    root = cache_dir()
    if root is None:
        return None
    key: list[Any] = [__version__]
    for f in files:  # contents, not modification times: those tick coarser than a quick edit
        key.append([str(f.resolve()), hashlib.sha256(f.read_bytes()).hexdigest()])
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return root / f"{_place_prefix(files, prefix)}{digest}.json"


def _place_prefix(files: list[Path], prefix: str) -> str:
    """The name prefix of the entries for these table directories: a new entry replaces older ones of the
    same directories only, so two installs (or runs with and without CKPT_TABLES) do not evict each other."""
    dirs = sorted({str(f.resolve().parent) for f in files})
    return f"{prefix}{hashlib.sha256(json.dumps(dirs).encode()).hexdigest()[:8]}-"


def load(files: list[Path], prefix: str = PREFIX) -> dict[str, Any] | None:
    """The parsed data of exactly these table files ({str(path): data}), or None. ``prefix``: one
    cache entry per kind of table (architectures, quantization schemes)."""
    try:
        path = _entry(files, prefix)
        if path is None:
            return None
        with open(path, encoding="utf-8") as fh:
            st = os.fstat(fh.fileno())
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return None
            data = json.load(fh)
        if not isinstance(data, dict) or sorted(data) != sorted(str(f) for f in files):
            return None
        return data
    except Exception:  # a missing, stale or damaged entry means parsing the YAML again
        return None


def store(files: list[Path], parsed: dict[str, Any], prefix: str = PREFIX) -> None:
    """Save the parsed data (atomically), replacing older entries. Data that JSON would change
    (non-string keys, dates, ...) is not cached; failures cost speed, never correctness."""
    try:
        text = json.dumps(parsed)
        if json.loads(text) != parsed:
            return
        path = _entry(files, prefix)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in path.parent.glob(f"{_place_prefix(files, prefix)}*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except Exception:
        return


def load_tables(dirs: tuple[Path, ...], parse: Callable[[Path], Any], build: Callable[[Path, Any], T],
                name_of: Callable[[T], str], prefix: str = PREFIX) -> dict[str, T]:
    """Every ``*.yaml`` of ``dirs`` built into a table, by name (later directories override earlier
    ones). YAML parsing is most of the cost, so the parsed data is cached; ``build`` checks run on every
    load, and only data whose tables all passed them is stored."""
    files = [p for d in dirs if d.is_dir() for p in sorted(d.glob("*.yaml"))]
    parsed = load(files, prefix)
    fresh = parsed is None
    if fresh:
        parsed = {str(p): parse(p) for p in files}
    out: dict[str, T] = {}
    for p in files:
        t = build(p, parsed[str(p)])
        out[name_of(t)] = t
    if fresh:
        store(files, parsed, prefix)
    return out
