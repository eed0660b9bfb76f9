"""The table cache: a hit reads checked tables back as plain records (no YAML, no pydantic); edits of the tables
or of the code that checks them, damage and entries that do not hold what was stored miss (checked again)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ckpt_tools.errors import TableError
from ckpt_tools.model.tables import cache, loader


@pytest.fixture
def tables_dir(tmp_path, monkeypatch):
    d = tmp_path / "tables"
    d.mkdir()
    shutil.copy(loader.mappings_dir() / "architectures" / "deepseek_v3.yaml", d)
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    loader._load_dirs.cache_clear()
    yield d
    loader._load_dirs.cache_clear()


def _load(d):
    loader._load_dirs.cache_clear()
    return loader._load_dirs((d,))


def _entries(tmp_path):
    return sorted((tmp_path / "cache").glob("tables-*.json"))


def test_second_load_skips_yaml_and_equals_a_fresh_parse(tables_dir, tmp_path, monkeypatch):
    first = _load(tables_dir)
    assert len(_entries(tmp_path)) == 1
    parsed = []
    monkeypatch.setattr(loader, "_parse", lambda p: parsed.append(p))
    second = _load(tables_dir)
    assert parsed == [] and second == first and second is not first


def test_an_edited_table_misses_and_replaces_the_old_entry(tables_dir, tmp_path):
    _load(tables_dir)
    old = _entries(tmp_path)
    path = tables_dir / "deepseek_v3.yaml"
    path.write_text(path.read_text() + "\n# edited\n")
    assert "deepseek_v3" in _load(tables_dir)
    assert _entries(tmp_path) != old and len(_entries(tmp_path)) == 1


def test_an_entry_that_does_not_hold_what_was_stored_is_checked_again(tables_dir, tmp_path, monkeypatch):
    want = _load(tables_dir)
    (entry,) = _entries(tmp_path)
    data = json.loads(entry.read_text())
    assert data["tables"]["deepseek_v3"]["~"] == "ckpt_tools.model.tables.schema.Table"  # a checked record
    data["tables"]["deepseek_v3"]["family"] = "something_else"  # would be refused if it came from YAML
    entry.write_text(json.dumps(data))
    parsed = []
    real = loader._parse
    monkeypatch.setattr(loader, "_parse", lambda p: parsed.append(p) or real(p))
    assert _load(tables_dir) == want and parsed == [tables_dir / "deepseek_v3.yaml"]


def test_an_edit_of_the_checking_code_misses(tables_dir, tmp_path, monkeypatch):
    _load(tables_dir)
    code = tmp_path / "schema.py"
    code.write_text("# the schema as it was\n")
    monkeypatch.setattr(loader, "_CODE", (*loader._CODE, code))
    first = _load(tables_dir)
    code.write_text("# the schema, edited\n")
    parsed = []
    real = loader._parse
    monkeypatch.setattr(loader, "_parse", lambda p: parsed.append(p) or real(p))
    assert _load(tables_dir) == first and parsed == [tables_dir / "deepseek_v3.yaml"]


def test_a_hit_imports_neither_yaml_nor_pydantic(tables_dir, tmp_path):
    import subprocess
    import sys

    _load(tables_dir)
    probe = ("import sys; from pathlib import Path; from ckpt_tools.model.tables import loader; "
             f"t = loader._load_dirs((Path({str(tables_dir)!r}),))['deepseek_v3']; "
             "assert t.config['hidden'].kind == 'count' and t.mtp.glue['fusion'].kind == 'linear'; "
             "print(sorted(m for m in ('yaml', 'pydantic') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CKPT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_damaged_or_foreign_writable_entries_are_ignored(tables_dir, tmp_path):
    want = _load(tables_dir)
    (entry,) = _entries(tmp_path)
    entry.write_text("{not json")
    assert _load(tables_dir) == want  # parsed again
    (entry,) = _entries(tmp_path)
    files = sorted(tables_dir.glob("*.yaml"))
    assert cache.load(files, code=loader._CODE) == want  # the entry itself, read directly
    os.chmod(entry, 0o666)  # writable by others: not read
    assert cache.load(files, code=loader._CODE) is None


def test_a_bad_table_is_reported_and_nothing_is_cached(tables_dir, tmp_path):
    (tables_dir / "broken.yaml").write_text("family: broken\nkind: [\n")
    with pytest.raises(TableError, match="broken.yaml"):
        _load(tables_dir)
    assert _entries(tmp_path) == []


def test_cache_can_be_turned_off(tables_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", "off")
    _load(tables_dir)
    assert not (tmp_path / "cache").exists()
