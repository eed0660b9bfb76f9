"""The parsed-table cache: hits skip YAML parsing but never the checks; edits and damage miss."""

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


def test_a_tampered_entry_is_still_checked(tables_dir, tmp_path):
    _load(tables_dir)
    (entry,) = _entries(tmp_path)
    data = json.loads(entry.read_text())
    (key,) = data
    data[key]["family"] = "something_else"  # would be refused if it came from YAML
    entry.write_text(json.dumps(data))
    with pytest.raises(TableError, match="must match the file name"):
        _load(tables_dir)


def test_damaged_or_foreign_writable_entries_are_ignored(tables_dir, tmp_path):
    want = _load(tables_dir)
    (entry,) = _entries(tmp_path)
    entry.write_text("{not json")
    assert _load(tables_dir) == want  # parsed again
    (entry,) = _entries(tmp_path)
    os.chmod(entry, 0o666)  # writable by others: not read
    assert cache.load(sorted(tables_dir.glob("*.yaml"))) is None


def test_a_bad_table_is_reported_and_nothing_is_cached(tables_dir, tmp_path):
    (tables_dir / "broken.yaml").write_text("family: broken\nkind: [\n")
    with pytest.raises(TableError, match="broken.yaml"):
        _load(tables_dir)
    assert _entries(tmp_path) == []


def test_cache_can_be_turned_off(tables_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", "off")
    _load(tables_dir)
    assert not (tmp_path / "cache").exists()
