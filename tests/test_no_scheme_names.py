"""No verb names a quantization scheme: scheme knowledge lives in mappings/quantization/ and model/quant's codecs.

Every scheme, storage-format and codec name of the scheme tables (``ct-nvfp4``, ``nvfp4``, ``fp8-block``,
``modelopt-fp8`` ...) and the producers they are named after is searched for, case-insensitively and as a whole
word, in every Python source file under ckpt_tools/ops/ - code, strings and comments alike. ``fp8`` alone is a
number format every FP8 scheme shares (the F8_E4M3 dtype), not a scheme, and is left out. As a value, though,
a ``quant_method`` the tables match (``"fp8"``) or a companion suffix they name (``"weight_scale_inv"``) is a
scheme fact: no string literal in ops/ is one (a dict key such as inspect's ``"fp8":`` field is allowed).
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpt_tools.model.quant.codec import CODECS
from ckpt_tools.model.quant.tables import all_schemes

OPS = Path(__file__).resolve().parent.parent / "ckpt_tools" / "ops"
PRODUCERS = {"compressed-tensors", "modelopt", "quark"}  # what the tables' names abbreviate (ct-, modelopt-, quark-)


def _names() -> set[str]:
    tables = all_schemes()
    names = set(tables) | set(CODECS) | PRODUCERS
    names |= {f.name for t in tables.values() for f in t.storage} | {
        f.encoder for t in tables.values() for f in t.storage if f.encoder}
    return names - {"fp8"}


def _word(names: list[str]) -> re.Pattern:
    body = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(r"(?<![A-Za-z0-9_-])(?:" + body + r")(?![A-Za-z0-9_-])", re.IGNORECASE)


def test_the_tables_name_schemes():
    assert {"fp8-block", "ct-nvfp4", "nvfp4", "mxfp4", "int8", "modelopt-fp8", "quark-mxfp4"} <= _names()


def test_no_verb_names_a_scheme():
    pattern = _word(sorted(_names()))
    files = sorted(OPS.rglob("*.py"))
    assert files, "no sources found"
    hits = [f"{p.relative_to(OPS.parent)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}"
            for p in files for n, line in enumerate(p.read_text().splitlines(), 1) for m in pattern.finditer(line)]
    assert hits == [], "scheme knowledge belongs in mappings/quantization/ and model/quant, not in ops/:\n" + \
        "\n".join(hits)


def test_the_scan_would_catch_a_scheme_name():
    pattern = _word(sorted(_names()))
    assert pattern.search('if scheme == "ct-nvfp4":')
    assert pattern.search("# NVFP4 experts keep their global scale")
    assert pattern.search("for ModelOpt, hf_quant_config.json")
    assert not pattern.search("rule fp8-block-size")  # a rule's name, not the scheme's
    assert not pattern.search("an FP8 weight")


def _values() -> re.Pattern:
    tables = all_schemes().values()
    values = {str(v) for t in tables for d in t.declared_in for v in d.match.get("quant_method", ())}
    values |= {x.suffix for t in tables for f in t.storage for x in f.tensors if "_" in x.suffix}
    values -= {x.role for t in tables for f in t.storage for x in f.tensors}  # a role ("input_scale") is generic
    body = "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))
    return re.compile(r"""(["'])(?:""" + body + r""")\1(?!\s*:)""")  # "FP8" in a message is a number format


def test_no_verb_holds_a_scheme_value():
    pattern = _values()
    hits = [f"{p.relative_to(OPS.parent)}:{n}: {line.strip()[:100]!r}" for p in sorted(OPS.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == [], "a quant_method or companion suffix belongs to the scheme tables (ask the codec):\n" + \
        "\n".join(hits)


def test_the_scan_would_catch_a_scheme_value():
    pattern = _values()
    assert pattern.search('q.get("quant_method", "fp8")')
    assert pattern.search("SCALE_SUFFIXES = ('weight_scale_inv', 'weight_scale')")
    assert not pattern.search('{"fp8": self.fp8}')
    assert not pattern.search('"an fp8 weight"')
