"""Every table's ``llama_cpp`` section holds: its names come from the gguf package (what the package lacks is
said, and is really absent), each family's tiny fixture gives a sidecar with every MTP tensor named and nothing
missing or unexpected, and, where llama.cpp b11434's own source tree is at hand (``LLAMA_CPP_SRC``, else
``.llama-cpp/src`` as ``make llama-cpp`` unpacks it), every tensor we write is one of the kinds llama.cpp b11434
lists for that architecture and the architecture is one it names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from ckpt_tools.api.inspecting import inspect_gguf
from ckpt_tools.api.writing import extract_gguf
from ckpt_tools.model.tables.loader import all_tables
from ckpt_tools.testing import make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

LLAMA = {n: t for n, t in sorted(all_tables().items()) if t.llama_cpp is not None}
_TREE = Path(os.environ.get("LLAMA_CPP_SRC") or Path(__file__).resolve().parent.parent / ".llama-cpp" / "src")
SRC = str(_TREE) if (_TREE / "gguf-py").is_dir() else None
# llama.cpp b11434 names no per-layer head copy for bailingmoe3 (its converter refuses one, and so do we)
OPTIONS = {"bailing_moe_v3": {"with_optional": False}, "deepseek_v4": {"with_optional": False}}


def test_the_two_families_issue_41_starts_with_are_covered():
    assert {"glm4_moe", "deepseek_v3"} <= set(LLAMA)


@pytest.mark.parametrize("family", sorted(LLAMA))
def test_names_come_from_the_package_and_its_gaps_are_real(family):
    lc = LLAMA[family].llama_cpp
    arch = getattr(gguf.MODEL_ARCH, lc.tensor_arch)  # an AttributeError names a member the package lacks
    kinds = set(gguf.MODEL_TENSORS[arch])
    for name in lc.package_lacks:
        kind = getattr(gguf.MODEL_TENSOR, name)
        assert kind not in kinds, f"{family}: the package lists {name} for {lc.tensor_arch} now; drop it"
    saved = dict(gguf.TensorNameMap.block_mappings_cfg)  # the map updates its class-level templates per architecture
    try:
        package = gguf.get_tensor_name_map(arch, 64)
    finally:
        gguf.TensorNameMap.block_mappings_cfg = saved
    for kind_name, (gguf_name, *templates) in lc.names.items():  # typed only where the package cannot name them
        kind = getattr(gguf.MODEL_TENSOR, kind_name, None)
        assert kind is None or not any(package.get_type(t.format(bid=3)) == kind for t in templates), \
            f"{family}: the package names {kind_name} for {lc.tensor_arch} now; drop it from llama_cpp.names"
        assert templates or kind is None, f"{family}: the package has {kind_name} now; drop it from llama_cpp.names"
    names = set(gguf.MODEL_ARCH_NAMES.values())
    if lc.arch in names:  # an architecture the package knows must be the one whose names we use
        assert gguf.MODEL_ARCH_NAMES[arch] == lc.arch
    else:
        assert lc.note and "package" in lc.note, f"{family}: say in the note that gguf lacks {lc.arch!r}"


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in LLAMA:
        d = tmp_path_factory.mktemp(family)
        src = make_checkpoint(family, d / "src", **OPTIONS.get(family, {}))
        trunk = write_trunk_gguf(src, d / "trunk.gguf")
        out[family] = Path(extract_gguf(src, d / "out", trunk).path)
    return out


@pytest.mark.parametrize("family", sorted(LLAMA))
def test_each_family_sidecar_is_complete_for_its_table(sidecars, family):
    assert family in inspect_gguf(sidecars[family]).summary.matching  # among the tables of its llama.cpp arch
    s = inspect_gguf(sidecars[family], arch=family).summary
    assert s.kind == "mtp-sidecar" and s.family == family
    assert s.problems == []
    for m in s.mtp.values():
        assert m["missing"] == [] and m["unexpected"] == []
        assert any(".nextn." in n for n in m["present"])


CHECK_AGAINST_B11434 = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
want = json.loads(sys.argv[2])
out = {}
for family, (arch, names) in want.items():
    members = [a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch]
    if not members:
        out[family] = f"llama.cpp b11434 names no architecture {arch!r}"
        continue
    allowed = set()
    for kind in gguf.MODEL_TENSORS[members[0]]:
        allowed.add(gguf.TENSOR_NAMES[kind])
    bad = []
    for name in names:
        parts = name.split(".")
        if parts[0] == "blk":
            parts[1] = "{bid}"
        full = ".".join(parts)
        stem = full.rsplit(".", 1)[0] if parts[-1] in ("weight", "bias") else full
        if stem not in allowed:
            bad.append(name)
    if bad:
        out[family] = f"not a tensor of {arch} in llama.cpp b11434: {bad}"
print(json.dumps(out))
"""


@pytest.mark.skipif(not SRC, reason="no llama.cpp b11434 source tree (LLAMA_CPP_SRC or .llama-cpp/src)")
def test_every_name_and_architecture_is_llama_cpp_b11434s(sidecars):
    want = {}
    for family, path in sidecars.items():
        r = gguf.GGUFReader(path)
        want[family] = (r.fields["general.architecture"].contents(), [t.name for t in r.tensors])
    r = subprocess.run([sys.executable, "-c", CHECK_AGAINST_B11434, SRC, json.dumps(want)], capture_output=True,
                       text=True, check=True)
    assert json.loads(r.stdout) == {}
