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

from ckpt_tools.model.tables.loader import mappings_dir

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


def _word(name: str, escaped: bool = False) -> re.Pattern:
    """``name`` (or an alternation of escaped names) as a whole word, any case."""
    body = name if escaped else re.escape(name)
    # "llama.cpp" and its programs (llama-server, llama-cli, llama-speculative-simple; llama-cpp: the option, the rule,
    # the make target) name the engine (GGUF sidecars, probe --engine llama.cpp), not the llama template family
    return re.compile(r"(?<![A-Za-z0-9_])(?:" + body + r")(?![A-Za-z0-9_])(?!\.cpp\b|-(?:cpp|server|cli|speculative))",
                      re.IGNORECASE)


def test_the_tables_name_families():
    names = _names_in_tables()
    # the scan is only meaningful if it knows the families: a sample of the shipped ones
    assert {"deepseek_v3", "DeepseekV3ForCausalLM", "qwen3_next", "nemotron_h", "inkling_mm_model"} <= names


def test_no_module_mentions_a_family_name():
    names = sorted(_names_in_tables(), key=len, reverse=True)  # longest first: report the most specific
    anyname = _word("|".join(re.escape(n) for n in names), escaped=True)
    hits = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, "no sources found"
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in anyname.finditer(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert hits == [], "family knowledge belongs in mappings/, not in code:\n" + "\n".join(hits)


def test_the_scan_would_catch_a_family_name(tmp_path):
    """The matcher finds names in code and comments, whatever the case, but not inside longer words."""
    pattern = _word("qwen3_next")
    assert pattern.search('if family == "qwen3_next":')
    assert pattern.search("# Qwen3_Next keeps its glue outside the layers")
    assert not pattern.search("qwen3_next_mtp_layer = 1")
    both = _word("|".join(re.escape(n) for n in ("qwen3", "qwen3_next")), escaped=True)
    assert [m.group(0) for m in both.finditer("qwen3_next and Qwen3.5 but not qwen3x")] == ["qwen3_next", "Qwen3"]
