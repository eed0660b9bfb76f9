"""Plans for `ckpt dequant`: a whole checkpoint (or its MTP layers) from a quantization scheme to a float dtype.

Every module a scheme table (``mappings/quantization/*.yaml``) says is stored quantized becomes one
``{module}.weight`` of the requested dtype, decoded by ``model.quant.dequant`` (the decoder extract
--dequant runs); its companions (scales, global scales, zero points, activation scales, shapes) are
dropped. Every other tensor is a byte copy, in the source's order. When nothing stays quantized the
config loses ``quantization_config`` and the scheme's side files (``hf_quant_config.json``) are not
written; with ``--only-mtp`` the trunk stays quantized and the config is repaired to exclude the MTP
modules now stored in float (the repair stitch makes).

Refused before anything is written: a quantization the configuration declares that no table describes
(``quant-unknown``), quantized bytes no table decodes (``dequant-unknown``), a module missing its
scales (``dequant``), nothing quantized (``not-quantized``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from ... import __version__
from ...dtypes import FP8_DTYPES
from ...errors import InputError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, revision_of, source_name
from ...model.consistency import note_allowed
from ...model.gate import require_consistent
from ...model.quant import Storage, detect_scheme
from ...model.quant.config import SIDE_FILES
from ...model.quant.dequant import dequant_module
from ...model.quant.storage import storage_lookup
from ...model.quant.tables import all_schemes, loaded_schemes
from ...stream.fingerprint import record_inputs
from ...stream.plan import OutputFile, OutputTensor, Plan, copy_of
from ..writing.add_mtp import CarriedShards, mtp_into, require_indexed
from ..writing.carry import carried_files, check_link
from ..writing.out_dtype import DTYPE_NAMES, dtype_arg

OUT_DTYPES = ("BF16", "F16", "F32")  # what the decoders write (model.quant.decode_fp8.OUT_DTYPES)


@dataclass
class DequantRequest:
    dtype: str = "bf16"
    only_mtp: bool = False
    arch: str | None = None
    max_shard_size: int = 5 * 10**9
    command: str = "ckpt dequant"
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)
    # --link (with only_mtp): the shards holding no MTP tensor carried whole (copy | reflink | hardlink | remote),
    # the decoded MTP layers in new model-mtp* shards; None: every tensor written again into new shards
    link: str | None = None


@dataclass
class DequantPlan:
    plan: Plan
    family: str
    scheme: str | None  # what the configuration declares (None: nothing declared, tensors say it)
    dtype: str
    scope: str  # all | mtp
    modules: dict[str, str] = field(default_factory=dict)  # module -> storage label, of those dequantized
    dropped: list[str] = field(default_factory=list)  # companions not written (scales, shapes, ...)
    still_quantized: int = 0  # quantized modules left as stored (--only-mtp)
    carried: CarriedShards | None = None  # --link: the source's shards carried whole, rewritten, and the new ones
    link: str | None = None

    def summary(self) -> dict:
        labels = Counter(self.modules.values())
        return {
            "command": self.plan.command, "family": self.family, "scheme": self.scheme, "dtype": self.dtype,
            "scope": self.scope, "modules": len(self.modules), "storage": dict(sorted(labels.items())),
            "dropped_tensors": len(self.dropped), "still_quantized": self.still_quantized,
            "tensors": len(self.plan.tensors), "total_bytes": self.plan.total_bytes,
            "files": [f.name for f in self.plan.files if not (self.carried and f.name in self.carried.linked_files)],
            **({"link": self.link, "linked_shards": len(self.carried.linked_files),
                "rewritten_shards": self.carried.rewritten_shards, "new_shards": self.carried.new_shards}
               if self.carried is not None else {}),
        }


def quantized_modules(ckpt: Checkpoint, scheme, keys: list[str]) -> dict[str, Storage]:
    """Weight key -> storage of every module among ``keys`` that a scheme table says is stored quantized."""
    by_dtype: dict[str, set[str]] = {}  # weight dtype -> the suffixes a format stores such weights under
    for t in all_schemes().values():
        for f in t.storage:
            for dt in f.weight.dtypes:
                by_dtype.setdefault(dt, set()).add(f.weight.suffix)
    found: dict[str, Storage] = {}
    seen: set[str] = set()
    lookup = storage_lookup(scheme)
    for key in keys:
        for suffix in by_dtype.get(ckpt.tensors[key].dtype, ()):
            if not key.endswith("." + suffix):
                continue
            module = key[: -len(suffix) - 1]
            if module in seen:
                continue
            seen.add(module)
            st = lookup(ckpt, module)
            if st.quantized:
                found[st.tensors[next(iter(st.tensors))]] = st
    return found


def _visible_keys(ckpt: Checkpoint) -> list[str]:
    """Tensor keys in source order (shard, then offset), those the index lists for their shard only."""
    return [k for shard in sorted(ckpt.shard_keys) for k in ckpt.shard_keys[shard]
            if k in ckpt.tensors and (ckpt.index is None or ckpt.index["weight_map"].get(k) == shard)]


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_dequant(ckpt: Checkpoint, req: DequantRequest) -> DequantPlan:
    out_dtype = dtype_arg(req.dtype, "--dtype")
    if out_dtype not in OUT_DTYPES:
        raise UsageError(f"--dtype {req.dtype!r}: use bf16, fp16 or fp32")
    if req.link is not None:
        if not req.only_mtp:
            raise UsageError("--link goes with --only-mtp: without it every shard holding a quantized module is "
                             "written again")
        check_link(req.link, ckpt, "source")
    gate = require_consistent(ckpt, arch=req.arch, allow=req.allow_invalid)
    if req.link is not None:
        require_indexed(gate, ckpt, "dequant --link")
    view, table = gate.view, gate.table
    scheme = detect_scheme(ckpt)  # a declared quantization no table describes: InputError quant-unknown
    keys = _visible_keys(ckpt)
    everything = quantized_modules(ckpt, scheme, keys)
    scope_keys = keys
    if req.only_mtp:
        mtp = set(view.keys()) | set(view.beyond) | set(view.extra)
        scope_keys = [k for k in keys if k in mtp]
    in_scope = set(scope_keys)
    chosen = {w: st for w, st in everything.items() if w in in_scope}
    incomplete = [st for st in chosen.values() if not st.complete]
    if incomplete:
        st = incomplete[0]
        why = "; ".join([f"missing {k}" for k in st.missing] + list(st.problems))
        more = f" (and {len(incomplete) - 1} more module(s))" if len(incomplete) > 1 else ""
        raise InputError(f"{st.module} is stored {st.label} but cannot be decoded: {why}{more}", rule="dequant",
                         path=ckpt.root)
    misread = [st for st in chosen.values() if st.issues]
    if misread:  # its declared arguments make its consumers read it otherwise, or refuse it (storage.issues)
        st = misread[0]
        more = f" (and {len(misread) - 1} more module(s))" if len(misread) > 1 else ""
        raise InputError(f"{st.module} is stored {st.label} but cannot be decoded as its consumers read it: "
                         f"{st.issues[0][1]}{more}", rule=st.issues[0][0], path=ckpt.root)
    companions = {k for st in chosen.values() for k in st.all_keys()}
    _refuse_undecodable(ckpt, [k for k in scope_keys if k not in companions])
    if not chosen:
        where = "MTP layers" if req.only_mtp else "checkpoint"
        raise InputError(f"nothing to dequantize: no module of the {where} is stored quantized in a scheme of "
                         "mappings/quantization/", rule="not-quantized", path=ckpt.root)

    first_key = {st.all_keys()[0]: st for st in chosen.values()}
    tables = loaded_schemes()
    tensors: list[OutputTensor] = []
    dropped: list[str] = []
    for k in scope_keys if req.link is not None else keys:  # --link: the rest stays in the carried shards
        st = first_key.get(k)
        if st is not None:
            t = dequant_module(ckpt, st, f"{st.module}.weight", out_dtype, tables)
            t.shard = None  # sharded anew by size: the output is larger than the input
            tensors.append(t)
        elif k in companions:
            dropped.append(k)
        else:
            ref = ckpt.tensors[k]
            tensors.append(copy_of(ref, k))
    left = len(everything) - len(chosen)
    files = _config_files(ckpt, view, req, out_dtype, chosen, still_quantized=left > 0)
    names = {f.name for f in files}
    files += [f for f in carried_files(ckpt) if f.name not in names
              and not (left == 0 and f.name.lower() in {n.lower() for n in SIDE_FILES})]
    q = ckpt.config.get("quantization_config")
    manifest = {
        "kind": "dequantized",
        "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
        "family": table.family,
        "scope": "mtp" if req.only_mtp else "all",
        "dequantized_to": out_dtype,
        "source_quantization": {"scheme": scheme.name if scheme is not None else None,
                                "config": q if isinstance(q, dict) else None,
                                "storage": sorted({st.label for st in chosen.values()})},
        "modules": len(chosen),
        "dropped_tensors": len(dropped),
        "still_quantized": left,
        "tool_version": __version__,
    }
    carried = None
    if req.link is None:
        plan = Plan(req.command, tensors, files, max_shard_size=req.max_shard_size,
                    manifest=note_allowed(manifest, gate))
    else:  # the shards without MTP tensors whole, those with some rewritten without them, the MTP in new shards
        carried = CarriedShards()
        plan = mtp_into(ckpt, tensors, files[:len(names)], req.link, req.max_shard_size, req.command, [],
                        note_allowed(manifest, gate), carried, drop=frozenset(scope_keys))
        side = {n.lower() for n in SIDE_FILES}
        plan.files = [f for f in plan.files if not (left == 0 and f.name.lower() in side and f.name not in names)]
    record_inputs(plan, source=ckpt)
    return DequantPlan(plan, table.family, scheme.name if scheme is not None else None, out_dtype,
                       "mtp" if req.only_mtp else "all", {st.module: st.label for st in chosen.values()},
                       dropped, left, carried, req.link)


def _refuse_undecodable(ckpt: Checkpoint, keys: list[str]) -> None:
    """FP8 bytes in scope that no module claims: no table says how to decode them (rule dequant-unknown)."""
    odd = [k for k in keys if ckpt.tensors[k].dtype in FP8_DTYPES]
    if odd:
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        raise InputError(f"{odd[0]} is {ckpt.tensors[odd[0]].dtype}{more}, stored in no format of the scheme tables in "
                         "mappings/quantization/ (weight and scale names); nothing was written. Fused FP8 experts: "
                         "`ckpt unfuse-experts --dequant`", rule="dequant-unknown", path=ckpt.root)


def _config_files(ckpt: Checkpoint, view, req: DequantRequest, out_dtype: str, chosen: dict[str, Storage],
                  still_quantized: bool) -> list[OutputFile]:
    """config.json: without quantization_config when nothing stays quantized, else with the dequantized
    MTP modules excluded (and the scheme's side files repaired likewise)."""
    if not ckpt.config_present:
        return []
    if still_quantized:
        from ..writing.output_config import config_files, repair_config  # the repair stitch makes for float MTP modules

        rep = repair_config(ckpt, view, ckpt.config.raw, dict.fromkeys(chosen, out_dtype), changed_only=True)
        return config_files(ckpt, ckpt.config.raw, rep)
    raw = dict(ckpt.config.raw)
    raw.pop("quantization_config", None)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k != "quantization_config"}
    for key in ("torch_dtype", "dtype"):  # what loaders build the model in: the weights' dtype now
        if key in raw:
            raw[key] = DTYPE_NAMES[out_dtype]
    return [OutputFile("config.json", content=(json.dumps(raw, indent=2, ensure_ascii=False) + "\n").encode())]
