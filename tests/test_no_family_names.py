"""No module under ckpt_tools/ names a model family: family knowledge lives in the YAML tables.

Every family name, model type and architecture (including the engines' draft architectures and the
model types draft formats support) that appears in mappings/ is searched for, case-insensitively
and as a whole word, in every Python source file of the package - code, strings and comments alike.
Tests and docs outside ckpt_tools/ may name families freely.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ckpt_tools.tables.loader import mappings_dir

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_tools"


def _names_in_tables() -> set[str]:
    names: set[str] = set()
    for path in sorted(mappings_dir().glob("*/*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if "family" in data:  # architecture and template tables
            names.add(data["family"])
            detect = data.get("detect") or {}
            names |= set(detect.get("architectures") or []) | set(detect.get("model_types") or [])
            names |= set((data.get("engines") or {}).values())
            fixture = data.get("fixture") or {}
            for scope in (fixture, fixture.get("text_config") or {}):
                if isinstance(scope.get("model_type"), str):
                    names.add(scope["model_type"])
                names |= {a for a in scope.get("architectures") or [] if isinstance(a, str)}
        else:  # draft formats
            names |= set((data.get("supports") or {}).get("model_types") or [])
    return {n for n in names if isinstance(n, str) and n}


def _word(name: str) -> re.Pattern:
    return re.compile(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", re.IGNORECASE)


def test_the_tables_name_families():
    names = _names_in_tables()
    # the scan is only meaningful if it knows the families: a sample of the shipped ones
    assert {"deepseek_v3", "DeepseekV3ForCausalLM", "qwen3_next", "nemotron_h", "inkling_mm_model"} <= names


def test_no_module_mentions_a_family_name():
    patterns = {n: _word(n) for n in _names_in_tables()}
    hits = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, "no sources found"
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name, pattern in patterns.items():
                if pattern.search(line):
                    hits.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {name!r} in {line.strip()[:100]!r}")
    assert hits == [], "family knowledge belongs in mappings/, not in code:\n" + "\n".join(hits)


def test_the_scan_would_catch_a_family_name(tmp_path):
    """The matcher finds names in code and comments, whatever the case, but not inside longer words."""
    pattern = _word("qwen3_next")
    assert pattern.search('if family == "qwen3_next":')
    assert pattern.search("# Qwen3_Next keeps its glue outside the layers")
    assert not pattern.search("qwen3_next_mtp_layer = 1")
