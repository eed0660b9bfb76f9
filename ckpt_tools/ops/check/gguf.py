"""GGUF files judged against the tables: what a file is (a trunk, an MTP sidecar or both), its MTP tensors missing
or unexpected for the family, and whether a sidecar goes with a trunk (``validate SIDECAR --gguf-trunk TRUNK``).

A GGUF names its llama.cpp architecture, not our family: every table whose ``llama_cpp.arch`` it is is tried and
the one that explains the MTP blocks best is reported. Without a config, a tensor a table lists under a
condition (``when``) or as optional may be present or absent; one it lists unconditionally must be present.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...io.gguf_file import GgufFile
from ...model.gguf_names import GLUE_NAMES, TensorNames, folded, glue_name

RULE_MISSING = "gguf-mtp-missing"
RULE_UNEXPECTED = "gguf-mtp-unexpected"
RULE_FAMILY = "gguf-family"
RULE_PAIR = "gguf-pair"
SHARED = ("token_embd.weight", "output_norm.weight", "output.weight")
_BLK = "blk."


@dataclass
class GgufProblem:
    rule: str
    message: str
    key: str | None = None
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "message": self.message, "key": self.key, "path": self.path}


@dataclass
class GgufSummary:
    path: str
    arch: str | None
    kind: str  # trunk | mtp-sidecar | trunk+mtp | no-blocks
    block_count: int | None
    nextn_predict_layers: int
    trunk_layers: int | None
    family: str | None
    families: list[str]  # every table whose llama.cpp architecture this is
    tensors: int
    types: dict[str, int]
    shared: list[str]
    mtp: dict[int, dict[str, list[str]]] = field(default_factory=dict)  # block -> present / missing / unexpected
    problems: list[GgufProblem] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)  # the families that explain the MTP blocks equally well

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": "gguf", "architecture": self.arch, "kind": self.kind,
                "block_count": self.block_count, "nextn_predict_layers": self.nextn_predict_layers,
                "trunk_layers": self.trunk_layers, "family": self.family, "families": self.families,
                "tensors": self.tensors, "types": self.types, "shared": self.shared,
                "mtp": {str(b): v for b, v in self.mtp.items()},
                "matching": self.matching, "problems": [p.to_json() for p in self.problems], "ok": not self.problems}


def _block_of(name: str) -> int | None:
    if not name.startswith(_BLK):
        return None
    head = name[len(_BLK):].split(".", 1)[0]
    return int(head) if head.isdecimal() else None


def _expected(table: Any, names: TensorNames, bid: int) -> tuple[set[str], set[str]]:
    """(names an MTP block must hold, names it may hold) under the family's table, at block ``bid``."""
    from ...model.expr import render

    lc = table.llama_cpp
    env = {"l": bid}
    try:
        base = render(table.trunk.prefix, env)
    except Exception:  # a prefix that needs config variables: the usual layer prefix of the converters
        base = f"model.layers.{bid}."
    must: set[str] = set()
    may: set[str] = set()

    def add(hf: str, required: bool) -> None:
        for jn in lc.join:  # a part of a join has the whole's name
            hf = next((hf[: -len(k)] + jn.into for k in jn.keys if hf.endswith("." + k)), hf)
        for sp in lc.split:
            if hf.endswith(sp.key):
                for sub in sp.into:
                    add(hf[: -len(sp.key)] + sub, required)
                return
        hit = names.lookup(hf)
        if hit is None:
            return
        may.add(hit[1])
        if required:
            must.add(hit[1])

    for role, t in table.mtp.glue.items():
        if role in GLUE_NAMES or role in lc.glue:
            add(glue_name(lc, role, base, bid), not t.optional and t.when is None)
    for n, block in enumerate(table.mtp.blocks):
        # a repeated block's sub-blocks are not told apart here: a key may take any sub-block's name (none required)
        folds = [lc.fold[n:n + 1]] if block.repeat is None else [[], *([f] for f in lc.fold)]
        for ref in block.parts:
            for item in table.parts[ref.part]:
                required = ref.when is None and block.repeat is None
                if item.tensor is not None:
                    t = item.tensor
                    for fold in folds:
                        # a key from the root ('/mtp.fc_hidden.weight') is named as the sidecar names it, without '/'
                        add(folded(fold, t.key.lstrip("/"), base, bid), required and not t.optional and t.when is None)
                else:
                    ex = item.experts
                    projections = ("gate", "up", "down") if ex.gated else ("up", "down")
                    for p in projections:
                        add(f"{folded(lc.fold, ex.prefix, base, bid)}.{p}_proj.weight", required and ex.when is None)
    return must, may


def summarize(g: GgufFile, family: str | None = None) -> GgufSummary:
    """What ``g`` is and how its MTP blocks compare with the family's table."""
    from ...model.tables.loader import all_tables

    tables = {n: t for n, t in all_tables().items() if t.llama_cpp is not None and t.llama_cpp.arch == g.arch}
    types = dict(Counter(t.type_name for t in g.tensors.values()))
    blocks = int(g.block_count) if g.block_count is not None else None
    trunk_layers = blocks - g.nextn if blocks is not None else None
    present: dict[int, list[str]] = {}
    for name in g.tensors:
        b = _block_of(name)
        if b is not None:
            present.setdefault(b, []).append(name)
    has_trunk = any(trunk_layers is None or b < trunk_layers for b in present)
    has_mtp = trunk_layers is not None and any(b >= trunk_layers for b in present)
    kind = {(True, True): "trunk+mtp", (True, False): "trunk", (False, True): "mtp-sidecar"}.get(
        (has_trunk, has_mtp), "no-blocks")
    s = GgufSummary(str(g.path), g.arch, kind, blocks, g.nextn, trunk_layers, None, sorted(tables), len(g.tensors),
                    dict(sorted(types.items())), [n for n in SHARED if n in g.tensors])
    where = str(g.path)
    if g.nextn and not has_mtp:
        s.problems.append(GgufProblem(RULE_MISSING, f"nextn_predict_layers is {g.nextn} but no tensor of blocks "
                                                    f"{trunk_layers}..{blocks - 1}", path=where))
    if not tables:
        if g.nextn:
            s.problems.append(GgufProblem(RULE_FAMILY, f"no table names llama.cpp architecture {g.arch!r}: its MTP "
                                                       "tensors are not checked", path=where))
        return s
    if family is not None and family not in tables:
        s.problems.append(GgufProblem(RULE_FAMILY, f"--arch {family}: its llama.cpp architecture is not {g.arch!r}",
                                      path=where))
        return s
    if not g.nextn or blocks is None:
        s.family = family or (next(iter(tables)) if len(tables) == 1 else None)
        return s
    best: tuple[int, str, dict, list] | None = None
    scores: dict[str, int] = {}
    for name in ([family] if family else sorted(tables)):
        table = tables[name]
        names = TensorNames(table.llama_cpp, blocks, name)
        report: dict[int, dict[str, list[str]]] = {}
        problems: list[GgufProblem] = []
        for bid in range(trunk_layers, blocks):
            must, may = _expected(table, names, bid)
            # a tensor of the block the converter writes at the root (a table's names without {bid})
            have = set(present.get(bid, ())) | {n for n in may if _block_of(n) is None and n in g.tensors}
            missing, unexpected = sorted(must - have), sorted(have - may)
            report[bid] = {"present": sorted(have), "missing": missing, "unexpected": unexpected}
            problems += [GgufProblem(RULE_MISSING, f"{name}: block {bid} lacks it", key=k, path=where)
                         for k in missing]
            problems += [GgufProblem(RULE_UNEXPECTED, f"{name}: no tensor of the table maps to it", key=k, path=where)
                         for k in unexpected]
        scores[name] = len(problems)
        if best is None or len(problems) < best[0]:
            best = (len(problems), name, report, problems)
    assert best is not None
    _, s.family, s.mtp, problems = best
    s.matching = [n for n, score in scores.items() if score == best[0]]
    s.problems += problems
    return s


# ---------------------------------------------------------------------------
# a sidecar with its trunk


def check_pair(sidecar: GgufFile, trunk: GgufFile, family: str | None = None) -> tuple[GgufSummary, list[GgufProblem]]:
    """The sidecar's own summary and every reason it does not go with ``trunk``."""
    s = summarize(sidecar, family)
    out: list[GgufProblem] = []
    where = str(sidecar.path)

    def bad(message: str, key: str | None = None) -> None:
        out.append(GgufProblem(RULE_PAIR, message, key=key, path=where))

    if sidecar.arch != trunk.arch:
        bad(f"architecture: sidecar {sidecar.arch!r}, trunk {trunk.arch!r}", "general.architecture")
        return s, out
    if not sidecar.nextn:
        bad("the sidecar declares no nextn_predict_layers", f"{sidecar.arch}.nextn_predict_layers")
    trunk_layers = int(trunk.block_count or 0) - trunk.nextn
    if sidecar.block_count is not None and int(sidecar.block_count) != trunk_layers + sidecar.nextn:
        bad(f"block_count: sidecar {sidecar.block_count}, trunk layers {trunk_layers} + nextn {sidecar.nextn}",
            f"{sidecar.arch}.block_count")
    skip = {f"{trunk.arch}.block_count", f"{trunk.arch}.nextn_predict_layers", "general.file_type"}
    for key, kv in trunk.kv.items():
        if key in skip or not (key.startswith(f"{trunk.arch}.") or key.startswith("tokenizer.")):
            continue
        other = sidecar.kv.get(key)
        if other is None:
            bad(f"{key}: in the trunk, absent from the sidecar", key)
        elif isinstance(kv.value, list) and isinstance(other.value, list) and len(kv.value) == trunk_layers \
                and len(other.value) == trunk_layers + sidecar.nextn and other.value[:trunk_layers] == kv.value:
            continue  # one value per layer, the MTP layers' appended (the table's llama_cpp.extend)
        elif other.value != kv.value:
            bad(f"{key}: sidecar {_short(other.value)}, trunk {_short(kv.value)}", key)
    for key in sidecar.kv:
        if (key.startswith(f"{trunk.arch}.") or key.startswith("tokenizer.")) and key not in trunk.kv \
                and key not in skip:
            bad(f"{key}: in the sidecar, absent from the trunk", key)
    for name in SHARED:
        a, b = sidecar.tensors.get(name), trunk.tensors.get(name)
        if a is not None and b is not None and a.shape != b.shape:
            bad(f"{name}: shape {list(a.shape)} in the sidecar, {list(b.shape)} in the trunk", name)
    return s, out


def _short(v: Any) -> str:
    if isinstance(v, list):
        return f"[{len(v)} values]"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
