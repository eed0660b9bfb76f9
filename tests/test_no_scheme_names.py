"""No verb names a quantization scheme: scheme knowledge lives in mappings/quantization/ and model/quant's codecs.

Every scheme, storage-format and codec name of the scheme tables (``ct-nvfp4``, ``nvfp4``, ``fp8-block``,
``modelopt-fp8`` ...) and the producers they are named after is searched for, case-insensitively and as a whole
word, in every Python source file under ckpt_tools/ops/ - code, strings and comments alike. ``fp8`` alone is a
number format every FP8 scheme shares (the F8_E4M3 dtype), not a scheme, and is left out.
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
