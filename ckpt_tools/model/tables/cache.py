"""A per-user cache of checked tables (YAML -> checked plain records, stored as JSON).

Parsing the YAML of every table costs 0.1-0.3 s and checking it with the schemas (pydantic) 0.1 s more,
paid by every command; reading the checked tables back from one JSON file takes milliseconds. An entry
holds the tables as they were after every check of their loader (schema, names, expressions) passed, as
plain records (``plain``); it is keyed by the path and content hash of every table file, the content of
the code that checks them and the tool version, so editing a table or its schema simply misses (and the
files are checked again); each set of table directories keeps one entry. Location: ``CKPT_CACHE_DIR``,
else ``$XDG_CACHE_HOME/ckpt-tools``, else ``~/.cache/ckpt-tools``; ``CKPT_CACHE_DIR=off`` disables it.
Files owned by another user, or writable by others, are not read: an entry is trusted as the installed
code is, so only its owner may have written it.
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


def _entry(files: list[Path], prefix: str = PREFIX, code: tuple[Path, ...] = (), extra: Any = None) -> Path | None:
    from ... import __version__

    root = cache_dir()
    if root is None:
        return None
    # contents, not modification times: those tick coarser than a quick edit
    key: list[Any] = [__version__, extra, *([str(f.resolve()), hashlib.sha256(f.read_bytes()).hexdigest()]
                                            for f in (*files, *code))]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return root / f"{_place_prefix(files, prefix)}{digest}.json"


def _place_prefix(files: list[Path], prefix: str) -> str:
    """The name prefix of the entries for these table directories: a new entry replaces older ones of the
    same directories only, so two installs (or runs with and without CKPT_TABLES) do not evict each other."""
    dirs = sorted({str(f.resolve().parent) for f in files})
    return f"{prefix}{hashlib.sha256(json.dumps(dirs).encode()).hexdigest()[:8]}-"


def load(files: list[Path], prefix: str = PREFIX, code: tuple[Path, ...] = (), extra: Any = None
         ) -> dict[str, Any] | None:
    """The checked tables of exactly these table files ({name: table}), or None. ``prefix``: one cache entry per
    kind of table (architectures, quantization schemes, formats); ``code``: the modules that check them;
    ``extra``: anything else their checks depend on (JSON)."""
    from .plain import loads

    try:
        path = _entry(files, prefix, code, extra)
        if path is None:
            return None
        with open(path, encoding="utf-8") as fh:
            st = os.fstat(fh.fileno())
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return None
            data = loads(fh.read())
        if not isinstance(data, dict) or data.get("files") != [str(f) for f in files] \
                or not isinstance(data.get("tables"), dict):
            return None
        return data["tables"]
    except Exception:  # a missing, stale or damaged entry means checking the YAML again
        return None


def store(files: list[Path], tables: dict[str, Any], prefix: str = PREFIX, code: tuple[Path, ...] = (),
          extra: Any = None) -> None:
    """Save the checked tables (atomically), replacing older entries. Tables that JSON would change
    (non-string keys, dates, ...) are not cached; failures cost speed, never correctness."""
    from .plain import dumps

    try:
        text = dumps({"files": [str(f) for f in files], "tables": tables})
        if text is None:
            return
        path = _entry(files, prefix, code, extra)
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
                name_of: Callable[[T], str], prefix: str = PREFIX, code: tuple[Path, ...] = (),
                extra: Any = None) -> dict[str, T]:
    """Every ``*.yaml`` of ``dirs`` built into a checked table, by name (later directories override earlier
    ones). ``build(path, data)`` checks one file's parsed YAML and returns its table as plain records
    (``plain.to_plain``); the tables are cached only when every file passed, and a hit neither parses nor checks
    (``code``, ``extra``: what the checks depend on besides the files, part of the entry's key)."""
    files = [p for d in dirs if d.is_dir() for p in sorted(d.glob("*.yaml"))]
    cached = load(files, prefix, code, extra)
    # every loader names a table after its file: an entry that disagrees is not what was stored (checked again)
    if cached is not None and list(cached) == list(dict.fromkeys(p.stem for p in files)) \
            and all(name_of(t) == name for name, t in cached.items()):
        return cached
    out: dict[str, T] = {}
    for p in files:
        t = build(p, parse(p))
        out[name_of(t)] = t
    store(files, out, prefix, code, extra)
    return out
