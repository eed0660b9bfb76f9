"""`ckpt extract --format gguf`: the MTP sidecar llama.cpp loads beside a trunk GGUF (``-m TRUNK -md SIDECAR``).

Its layout is the one llama.cpp's converter writes with ``--mtp``: the trunk's key-values (architecture and
vocabulary) with ``block_count`` = trunk layers + MTP layers and ``nextn_predict_layers``; then ``token_embd``,
``output_norm``, ``output`` and the MTP blocks' tensors, transformed as the family's table says (experts
stacked, MLA's ``kv_b_proj`` split). Everything is checked before a byte is written; values are decoded one
tensor (one expert, one band of rows) at a time and converted as the converter converts them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import __version__
from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, UsageError
from ...io.checkpoint import Checkpoint, revision_of, source_name
from ...io.gguf_file import GgufFile, GgufKV
from ...model.expert_layouts import ExpertLayout
from ...model.expr import evaluate, render
from ...model.formats import ExpertLink, correspond, get_format
from ...model.formats.reverse import as_verifier
from ...model.gate import require_consistent
from ...model.gguf_names import GGUF_TYPES, GLUE_NAMES, TensorNames, folded, glue_name, keeps_f32
from ...model.mtp import MtpView
from ...model.quant import gguf_repack
from ...stream.gguf_out import GgufTensorOut
from ...stream.plan import CopyBytes, OutputTensor, copy_of
from .build import draft_tensors, quantized_source

RULE_MISMATCH = "gguf-trunk-mismatch"
RULE_TRUNK = "gguf-trunk"
RULE_NAME = "gguf-name"
RULE_FAMILY = "gguf-family"
BAND_BYTES = 8 << 20  # float32 values of the rows converted at a time: memory stays a few bands


@dataclass
class GgufRequest:
    gguf_type: str = "f16"
    arch: str | None = None
    command: str = "ckpt extract --format gguf"
    allow_invalid: frozenset[str] = frozenset()


@dataclass
class SidecarPlan:
    name: str  # file name in the output directory
    arch: str
    kv: list[GgufKV]
    tensors: list[GgufTensorOut]
    manifest: dict = field(default_factory=dict)


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]  # the table's types name gguf's (a schema literal checks them)


def _file_type(name: str, forced: str | None = None) -> int:
    import gguf

    if forced is not None:  # the converter's, whatever its --outtype (llama_cpp.file_type)
        return int(gguf.LlamaFileType[forced])
    return int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[name])


def plan_sidecar(ckpt: Checkpoint, trunk: GgufFile, req: GgufRequest) -> SidecarPlan:
    if req.gguf_type not in GGUF_TYPES:
        raise UsageError(f"--gguf-type {req.gguf_type!r}: one of {', '.join(GGUF_TYPES)}")
    # a draft in another format is read as its verifier's MTP layers; the trunk says how many layers precede them
    draft = ckpt
    ckpt, arch = as_verifier(draft, int(trunk.block_count or 0) - trunk.nextn, req.arch)
    if ckpt is not draft:  # the draft's files judged as they are; its MTP layers below, in the verifier's names
        require_consistent(draft, scope="files", allow=req.allow_invalid, role="draft")
    gate = require_consistent(ckpt, arch=arch, allow=req.allow_invalid)
    view, table = gate.view, gate.table
    lc = table.llama_cpp
    if lc is None:
        raise InputError(f"{table.family}: its table names no llama.cpp architecture (no llama_cpp section): "
                         "llama.cpp b11434 has no MTP graph we know of for it", rule=RULE_FAMILY, path=str(ckpt.root))
    if view.count == 0:
        raise InputError(f"{ckpt.root}: the config declares no MTP layers for {table.family}; nothing to extract",
                         rule="no-mtp")
    view.require_complete()
    env = view.resolved.env
    for var in lc.requires:  # e.g. Qwen4-Exp's QSA: llama.cpp's graph has no path without it
        if not env.get(var):
            raise InputError(f"{table.family}: llama.cpp b11434's {lc.arch} graph requires {var}, which the config "
                             f"does not set ({' / '.join(table.config[var].keys)})", rule=RULE_FAMILY,
                             path=str(ckpt.root), key=table.config[var].keys[0])
    trunk_layers = check_trunk(trunk, table, env, lc)
    blocks = trunk_layers + view.count
    names = TensorNames(lc, blocks, table.family)
    tensors, from_trunk = _source_tensors(view, lc)
    tensors = _joined(tensors, lc)
    out: list[GgufTensorOut] = [_from_trunk(trunk, key, names, table.family) for key in from_trunk]
    for t, hf_name, spec_kind in tensors:
        out += _convert(t, hf_name, spec_kind, names, lc, env, req.gguf_type, table.family)
    envs = [_layer_env(table, env, i) for i in range(view.count)]
    kv = _kv(trunk, blocks, view.count, req.gguf_type, _extended(trunk, trunk_layers, lc, envs), lc.file_type)
    label = (trunk.kv["general.name"].value if "general.name" in trunk.kv else Path(str(ckpt.root)).name)
    fname = f"mtp-{_slug(label)}-{req.gguf_type.upper()}.gguf"
    manifest = {
        "kind": "mtp-gguf-sidecar",
        "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
        "trunk": {"path": str(trunk.path), "architecture": trunk.arch, "block_count": trunk.block_count},
        "family": table.family,
        "llama_cpp_arch": lc.arch,
        "block_count": blocks,
        "nextn_predict_layers": view.count,
        "gguf_type": req.gguf_type,
        # arrays of one value per trunk layer, copied as they are (as llama.cpp's converter writes its --mtp
        # sidecar: e.g. glm-dsa.attention.indexer.types)
        "per_layer_keys": sorted(k for k, v in trunk.kv.items() if k.startswith(f"{trunk.arch}.")
                                 and isinstance(v.value, list) and len(v.value) == trunk_layers),
        "per_layer_keys_extended": {f"{trunk.arch}.{k}": _one([_extend_value(v, e) for e in envs])
                                    for k, v in lc.extend.items()},
        "tensors": {t.name: {"type": t.qtype.name, "shape": list(t.shape), **t.meta} for t in out},
        "tool_version": __version__,
    }
    return SidecarPlan(fname, lc.arch, kv, out, manifest)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-") or "model"


# ---------------------------------------------------------------------------
# the trunk


def check_trunk(trunk: GgufFile, table: Any, env: dict, lc: Any) -> int:
    """The trunk's own layer count; its architecture and dimensions must be SRC's (exit 3 naming both)."""
    where = str(trunk.path)
    if trunk.arch is None:
        raise InputError("no general.architecture: not a model GGUF", rule=RULE_TRUNK, path=where)
    if trunk.arch != lc.arch:
        raise InputError(f"architecture: trunk {trunk.arch!r}, source {table.family} is {lc.arch!r} in llama.cpp",
                         rule=RULE_MISMATCH, path=where, key="general.architecture")
    if trunk.block_count is None:
        raise InputError(f"no {trunk.arch}.block_count", rule=RULE_TRUNK, path=where)
    if "tokenizer.ggml.model" not in trunk.kv:
        raise InputError("no tokenizer.* keys: a sidecar carries the trunk's vocabulary, and llama.cpp loads none "
                         "without it", rule=RULE_TRUNK, path=where, key="tokenizer.ggml.model")
    layers = int(trunk.block_count) - trunk.nextn
    pairs = [("num_layers", layers, f"{trunk.arch}.block_count - nextn_predict_layers"),
             ("vocab", trunk.vocab_size, "vocabulary (tokenizer.ggml.tokens)")]
    pairs += [(var, trunk.arch_value(key), f"{trunk.arch}.{key}") for var, key in lc.compare.items()
              if var in table.config]
    for var, theirs, what in pairs:
        ours = env.get(var)
        if ours is None or theirs is None:
            if theirs is None and ours not in (None, 0):
                raise InputError(f"{what}: absent from the trunk, source {var} = {ours}", rule=RULE_MISMATCH,
                                 path=where, key=what)
            continue
        if isinstance(theirs, list):  # per layer (Step-3.5's heads: sliding layers have their own): some layer's
            if int(ours) not in {int(v) for v in theirs}:
                raise InputError(f"{what}: no trunk layer has {var} = {ours} (trunk: {sorted(set(theirs))})",
                                 rule=RULE_MISMATCH, path=where, key=what)
        elif int(theirs) != int(ours):
            raise InputError(f"{what}: trunk {theirs}, source {var} = {ours}", rule=RULE_MISMATCH, path=where,
                             key=what)
    return layers


def _layer_env(table: Any, env: dict, i: int) -> dict:
    """The variables of MTP layer ``i``: the config's, ``i`` and the table's per-depth ``mtp.layer_vars``."""
    out = {**env, "i": i}
    for name, expr in table.mtp.layer_vars.items():
        out[name] = evaluate(expr, out)
    return out


def _extended(trunk: GgufFile, layers: int, lc: Any, envs: list[dict]) -> dict[str, list]:
    """The per-layer arrays the table says the converter extends for the MTP layers (``envs``: each one's), extended."""
    out = {}
    for suffix, value in lc.extend.items():
        key = f"{trunk.arch}.{suffix}"
        kv = trunk.kv.get(key)
        if kv is None or not isinstance(kv.value, list):  # one value for every layer holds for the MTP layers too
            continue
        if len(kv.value) == layers + len(envs):  # already lists the MTP layers, as a release config may
            continue
        if len(kv.value) != layers:
            raise InputError(f"{key}: not an array of one value per trunk layer ({layers})", rule=RULE_TRUNK,
                             path=str(trunk.path), key=key)
        out[key] = [*kv.value, *(_extend_value(value, e) for e in envs)]
    return out


def _extend_value(value: Any, env: dict) -> Any:
    """A table's value for one MTP layer (an expression over its variables: Step-3.5's layers alternate)."""
    if not isinstance(value, str):
        return value
    v = evaluate(value, env)
    return v if isinstance(v, (bool, float)) else int(v)


def _one(values: list) -> Any:
    """The manifest's record of what extended an array: one value when every MTP layer had the same."""
    return values[0] if len(set(values)) == 1 else values


def _kv(trunk: GgufFile, blocks: int, nextn: int, gguf_type: str, extended: dict[str, list],
        file_type: str | None = None) -> list[GgufKV]:
    """The trunk's key-values in its order (the unchanged ones as their bytes), the sidecar's own values set."""
    import gguf

    arch = trunk.arch
    set_keys = {f"{arch}.block_count": blocks, f"{arch}.nextn_predict_layers": nextn,
                "general.file_type": _file_type(gguf_type, file_type), **extended}
    kv = [v if v.key not in set_keys else GgufKV(v.key, set_keys.pop(v.key), v.vtype, v.sub_type)
          for v in trunk.kv.values()]
    return kv + [GgufKV(key, value, gguf.GGUFValueType.UINT32) for key, value in set_keys.items()]


# ---------------------------------------------------------------------------
# the source: every MTP tensor decoded to floats, plus the shared embedding, final norm and head


def _from_trunk(trunk: GgufFile, key: str, names: TensorNames, family: str) -> GgufTensorOut:
    """A shared tensor SRC does not hold (a draft): the trunk's own, its bytes as they are."""
    found = names.lookup(key)
    t = trunk.tensors.get(found[1]) if found is not None else None
    if t is None:
        raise InputError(f"{key}: SRC does not hold it and the trunk has no {found[1] if found else 'such'} tensor; "
                         "the sidecar carries it", rule="mtp-missing", path=str(trunk.path), key=key)
    import gguf

    return GgufTensorOut(t.name, t.shape, gguf.GGMLQuantizationType[t.type_name],
                         lambda: t.chunks(trunk.path), {"source": [f"trunk:{t.name}"], "from_trunk": True})


def _source_tensors(view: MtpView, lc: Any) -> tuple[list[tuple[OutputTensor, str, str]], list[str]]:
    """(tensor of float values, the name llama.cpp's converter maps, its table kind) in the converter's order,
    and the shared tensors SRC does not hold (a draft: the trunk's are carried)."""
    ckpt, res = view.ckpt, view.resolved
    quantized = quantized_source(view)
    corr = correspond(get_format("native"), view, None, with_embed=None, with_head=None)
    # llama.cpp stacks each projection's experts [experts, out, in]: a per-expert group is laid end to end (its
    # experts' bytes in order, decoded one expert at a time), another layout is restacked by our converters
    stacked = ExpertLayout("stacked")
    corr.experts = [e if e.verifier.layout.name in ("per-expert", "stacked")
                    else ExpertLink(e.verifier.with_layout(stacked), e.verifier) for e in corr.experts]
    produced = draft_tensors(view, corr, None, "F32" if quantized else None)
    specs = {s.key: s for s in res.mtp_specs()}
    groups: dict[str, tuple[Any, str]] = {}  # stacked key -> (group, projection)
    pieces: dict[str, tuple[str, int]] = {}  # per-expert key -> (stacked key, expert)
    for e in corr.experts:
        g = e.draft.with_layout(stacked)
        for slot in e.draft.projections():
            groups[g.key(slot)] = (e.draft, slot)
            if e.draft.layout.per_expert:
                for x in range(e.draft.count):
                    pieces[e.draft.key(slot, x)] = (g.key(slot), x)
    produced = _laid_end_to_end(produced, pieces)
    out: list[tuple[OutputTensor, str, str]] = []
    from_trunk: list[str] = []
    for role in ("embed", "final_norm", "head"):
        spec = res.shared.get(role)
        if spec is None:
            continue  # a tied head: llama.cpp takes token_embd, as its converter writes no output
        ref = ckpt.tensors.get(spec.key)
        if ref is None:  # a draft holds MTP layers only: the trunk's own embedding, norm and head go along
            from_trunk.append(spec.key)
            continue
        if ref.dtype not in FLOAT_DTYPES:
            raise InputError(f"the shared {role} {spec.key} is stored as {ref.dtype}; only float shared tensors "
                             "are read", rule=RULE_NAME, path=str(ckpt.root), key=spec.key)
        out.append((copy_of(ref, spec.key), spec.key, spec.kind))
    prefix = res.table.trunk.prefix
    for t in produced:
        if t.meta.get("role") == "scale":
            continue
        if t.key in groups:
            g, slot = groups[t.key]
            base = render(prefix, {**res.env, "l": _trunk_layers(res) + (g.depth or 0)})
            bid = _trunk_layers(res) + (g.depth or 0)
            out.append((t, f"{folded(lc.fold, g.sub_prefix, base, bid)}.{slot}_proj.weight", "linear"))
            t.meta["raw"] = ckpt.tensors  # a decoded expert's stored codes and scales (gguf_repack)
            continue
        spec = specs.get(t.key)  # the native names: the verifier's own (a decoded tensor's source is its packed key)
        glue = spec is not None and (spec.role in GLUE_NAMES or spec.role in lc.glue)
        if spec is None or spec.depth is None and not glue:
            raise InputError(f"{t.key}: not an MTP tensor of the table", rule=RULE_NAME, key=t.key)
        depth = spec.depth if spec.depth is not None else 0
        base = render(prefix, {**res.env, "l": _trunk_layers(res) + depth})
        bid = _trunk_layers(res) + depth
        if glue:
            out.append((t, glue_name(lc, spec.role, base, bid), spec.kind))
        elif spec.role == "block" and (spec.block == 0 or spec.block < len(lc.fold)):
            out.append((t, folded(lc.fold[spec.block:spec.block + 1], spec.sub, base, bid), spec.kind))
        else:
            raise InputError(f"{spec.key}: role {spec.role} (sub-block {spec.block}) has no place in llama.cpp's "
                             "MTP layout", rule=RULE_NAME, key=spec.key)
    return out, from_trunk


def _joined(tensors: list[tuple[OutputTensor, str, str]], lc: Any) -> list[tuple[OutputTensor, str, str]]:
    """The table's joins (``llama_cpp.join``): per block, its parts' rows end to end as one tensor, in the first
    part's place. Rows are whole in each part, so the whole is the parts' bytes one after the other."""
    from ...numeric.transforms import RecipeReader
    from ...stream.plan import Compute

    out: list[tuple[OutputTensor, str, str] | None] = list(tensors)
    for jn in lc.join:
        blocks: dict[str, dict[int, int]] = {}  # block name prefix -> part -> index in out
        for i, item in enumerate(out):
            for j, key in enumerate(jn.keys):
                if item is not None and item[1].endswith("." + key):
                    blocks.setdefault(item[1][: -len(key)], {})[j] = i
        for base, at in blocks.items():
            parts = [out[at[j]][0] for j in sorted(at)]  # type: ignore[index]
            same = (lambda p: p.shape[:1]) if jn.axis == "columns" else (lambda p: p.shape[1:])
            if len(at) != len(jn.keys) or len({(p.dtype, same(p)) for p in parts}) != 1:
                raise InputError(f"{base}: llama.cpp joins {', '.join(jn.keys)} into {jn.into}; the source holds "
                                 f"{', '.join(f'{p.key} {p.dtype} {list(p.shape)}' for p in parts)}",
                                 rule=RULE_NAME, key=parts[0].key)

            def produce(parts=parts):
                for p in parts:
                    yield RecipeReader(p.recipe).read(p.nbytes)

            first = parts[0]
            meta = {"source": [s for p in parts for s in p.meta.get("source", [p.key])],
                    "source_dtype": first.meta.get("source_dtype", first.dtype)}
            whole = (side_by_side(parts, meta) if jn.axis == "columns" else
                     OutputTensor(first.key, first.dtype, (sum(p.shape[0] for p in parts), *first.shape[1:]),
                                  Compute(produce, "join", inputs=[p.key for p in parts]), meta=meta))
            out[at[0]] = (whole, base + jn.into, out[at[0]][2])  # type: ignore[index]
            for j in range(1, len(jn.keys)):
                out[at[j]] = None
    return [item for item in out if item is not None]


def side_by_side(parts: list[OutputTensor], meta: dict) -> OutputTensor:
    """2-D tensors of one dtype and row count as one, each row the parts' rows side by side ([a | b], torch.cat
    dim 1). Read a band of rows of every part at a time: memory stays a few bands whatever the parts' size."""
    from ...numeric.transforms import RecipeReader
    from ...stream.plan import Compute

    rows = parts[0].shape[0]
    widths = [p.nbytes // rows for p in parts]  # bytes of one row of each part
    per = max(1, BAND_BYTES // sum(widths))

    def produce():
        readers = [RecipeReader(p.recipe) for p in parts]
        for done in range(0, rows, per):
            n = min(per, rows - done)
            bands = [r.read(n * w) for r, w in zip(readers, widths, strict=True)]
            yield b"".join(b[i * w:(i + 1) * w] for i in range(n) for b, w in zip(bands, widths, strict=True))

    first = parts[0]
    return OutputTensor(first.key, first.dtype, (rows, sum(p.shape[1] for p in parts)),
                        Compute(produce, "join-columns", inputs=[p.key for p in parts]), meta=meta)


def _laid_end_to_end(produced: list[OutputTensor], pieces: dict[str, tuple[str, int]]) -> list[OutputTensor]:
    """Per-expert tensors replaced by one stacked tensor per projection, produced expert after expert."""
    from ...numeric.transforms import RecipeReader
    from ...stream.plan import Compute

    parts: dict[str, dict[int, OutputTensor]] = {}
    out: list[OutputTensor] = []
    for t in produced:
        hit = pieces.get(t.key)
        if hit is None:
            out.append(t)
            continue
        if hit[0] not in parts:
            parts[hit[0]] = {}
            out.append(OutputTensor(hit[0], t.dtype, (), CopyBytes([])))  # placeholder, keeps the order
        parts[hit[0]][hit[1]] = t
    for i, t in enumerate(out):
        experts = parts.get(t.key)
        if experts is None:
            continue
        ordered = [experts[x] for x in range(len(experts))]
        first = ordered[0]

        def produce(ordered=ordered):
            for piece in ordered:
                yield RecipeReader(piece.recipe).read(piece.nbytes)

        out[i] = OutputTensor(t.key, first.dtype, (len(ordered), *first.shape),
                              Compute(produce, "stack", inputs=[p.key for p in ordered]),
                              meta={"source": [p.meta.get("source", [p.key])[0] for p in ordered],
                                    "source_dtype": first.meta.get("source_dtype", first.dtype), "role": "expert",
                                    "experts": ordered})  # _bands reads each expert's own bands
    return out


def _trunk_layers(res: Any) -> int:
    return int(evaluate(res.table.trunk.count, res.env))


# ---------------------------------------------------------------------------
# one source tensor -> its GGUF tensor(s)


def _convert(t: OutputTensor, hf_name: str, kind: str, names: TensorNames, lc: Any, env: dict, gguf_type: str,
             family: str) -> list[GgufTensorOut]:
    for sp in lc.split:
        if hf_name.endswith("." + sp.key):
            return _split(t, hf_name[: -len(sp.key)], sp, names, lc, env, gguf_type, family)
    found = names.lookup(hf_name)
    if found is None:
        raise InputError(f"{t.key} ({hf_name} in llama.cpp's converter) has no name in "
                         f"{'the table tensor_map' if lc.tensor_map else 'the gguf tensor map of ' + lc.tensor_arch}"
                         f"{' + ' + ', '.join(lc.package_lacks) if lc.package_lacks else ''}",
                         rule=RULE_NAME, path=f"mappings/architectures/{family}.yaml", key=t.key)
    tkind, gname = found
    offset = lc.norm_offset if kind == "norm" else 0.0
    qtype = _out_qtype(tkind, gname, t.shape, lc, gguf_type, _storage(t))
    meta = {"source": list(t.meta.get("source", [t.key])), "source_dtype": t.meta.get("source_dtype", t.dtype)}
    heads = next((int(evaluate(p.heads, env)) for p in lc.permute if hf_name.endswith("." + p.key)), None)
    if heads is not None:
        meta["permute"] = heads
        return [GgufTensorOut(gname, tuple(t.shape), qtype, lambda: _permuted(t, qtype, heads), meta)]
    return [GgufTensorOut(gname, tuple(t.shape), qtype, lambda: _bands(t, qtype, offset), meta)]


def _permuted(t: OutputTensor, qtype, heads: int) -> Iterator[bytes]:
    """Rows in llama.cpp's rotary order, as its LlamaModel.permute: each head's two halves interleaved row by row
    ([heads, 2, rows / heads / 2, cols] with the middle axes swapped). One attention projection, read whole."""
    import numpy as np

    from ...arrays import decode_floats
    from ...numeric.transforms import RecipeReader

    rows, cols = t.shape
    values = decode_floats(RecipeReader(t.recipe).read(t.nbytes), t.dtype).astype(np.float32, copy=False)
    values = values.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    yield _encode(np.ascontiguousarray(values), qtype)


def _storage(t: OutputTensor) -> str:
    """How the source stores ``t``: a scheme table's storage name where it was decoded, else its dtype."""
    first = t.meta.get("experts", [t])[0]
    return (first.meta.get("dequantized_from") or {}).get("format") or first.meta.get("source_dtype") or t.dtype


def _out_qtype(tkind: str, gname: str, shape: tuple[int, ...], lc: Any, gguf_type: str, storage: str | None = None):
    import gguf

    # the converter's own type for a matrix (llama_cpp.types) yields only to F32 for vectors and norms, as there
    forced = lc.types.get(tkind) or lc.types.get(storage or "")
    if forced and len(shape) > 1 and not gname.endswith("_norm.weight"):
        gguf_type = forced
    elif keeps_f32(tkind, gname, len(shape), list(lc.f32), list(lc.not_f32)):
        return gguf.GGMLQuantizationType.F32
    q = _qtype(gguf_type)
    block = gguf.GGML_QUANT_SIZES[q][0]
    if shape[-1] % block:  # the converter falls back to F16 where the rows do not split into blocks
        return gguf.GGMLQuantizationType.F16
    return q


def _encode(values, qtype) -> memoryview:
    import numpy as np
    from gguf import quants

    return _as_bytes(np.ascontiguousarray(quants.quantize(values, qtype)))


def _as_bytes(array) -> memoryview:
    """A contiguous array's bytes, not copied (the writer and the hash take any buffer)."""
    return memoryview(array.reshape(-1).view("u1"))


def _bands(t: OutputTensor, qtype, offset: float) -> Iterator[memoryview]:
    """The tensor's bytes in ``qtype``, a band of whole rows at a time (rows quantize independently). Bands are
    read in order on this thread, each into a buffer of its own (a stack's experts one after another), and
    converted on the decoding pool (numpy releases the GIL), at most a band per thread ahead of the one written."""
    import numpy as np

    from ...arrays import decode_floats
    from ...numeric.transforms import RecipeReader
    from ...parallel import ordered_map

    cols = t.shape[-1] if t.shape else 1
    row = _itemsize(t.dtype) * cols
    per = max(1, BAND_BYTES // (4 * cols))
    direct = t.dtype == "BF16" and not offset and _is_f16(qtype)
    repacked = gguf_repack.repacks(qtype)

    def read() -> Iterator[tuple[int, Any, Any]]:
        for part in t.meta.get("experts", [t]):
            stored = (gguf_repack.stored_codes(part.meta.get("source", []), t.meta.get("raw"), part.nbytes // 4, cols)
                      if repacked else None)  # then not decoded at all
            reader = RecipeReader(part.recipe) if stored is None else None
            rows = part.nbytes // row
            for done in range(0, rows, per):
                n = min(per, rows - done)
                yield n, reader and reader.read(n * row), stored and [a[done:done + n] for a in stored]

    def convert(band: tuple[int, Any, Any]) -> memoryview:
        n, buf, stored = band
        if stored:
            return _as_bytes(gguf_repack.blocks(*stored))
        if direct:
            return _as_bytes(_f16_of_bf16(buf))
        values = decode_floats(buf, t.dtype).astype(np.float32, copy=False).reshape(n, cols)
        if offset:
            values = values + np.float32(offset)
        return _encode(values, qtype)

    yield from ordered_map(convert, read())


def _is_f16(qtype) -> bool:
    import gguf

    return qtype == gguf.GGMLQuantizationType.F16


def _f16_of_bf16(buf: bytearray | bytes):
    """F16 bits of bf16 values, exactly the table's (``_bf16_to_f16``): a value whose exponent lies in F16's
    normal range converts without rounding (exponent rebased, mantissa moved up 3 bits), in integer operations;
    the others (F16 subnormals and zeros, overflow, Inf, NaN) are looked up. Integer arithmetic only: the same
    bytes on every CPU, at about half the CPU of a lookup of every value. Pieces of 128k values keep the
    intermediates in the core's cache."""
    import numpy as np

    x = np.frombuffer(buf, dtype="<u2")
    out = np.empty_like(x)
    table = _bf16_to_f16().view(np.uint16)
    step = 1 << 17
    for at in range(0, len(x), step):
        xs, o = x[at:at + step], out[at:at + step]
        np.left_shift(xs, 1, out=o)  # exponent and mantissa (the sign shifted out)
        o -= 0x7100  # bf16 exponent 113, F16's first: F16's 30 normal exponents are 0x1E00 after the shift
        odd = np.flatnonzero(o >= 0x1E00)
        looked_up = table[xs[odd]]
        np.subtract(xs, 0x3800, out=o)  # the exponent rebased by 127 - 15; a sign's borrow is shifted out next
        o <<= 3
        o |= xs & 0x8000
        o[odd] = looked_up
    return out


@functools.cache
def _bf16_to_f16():
    """F16 of every bf16 bit pattern, as llama.cpp's converter casts (bf16 -> f32 exactly, then numpy's astype:
    NaN payloads included), indexed by the bf16 bits. It is the reference ``_f16_of_bf16`` keeps to."""
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):
        return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32).astype(np.float16)


def _itemsize(dtype: str) -> int:
    from ...dtypes import DTYPES

    return DTYPES[dtype].nbytes(1)


def _split(t: OutputTensor, base: str, sp: Any, names: TensorNames, lc: Any, env: dict, gguf_type: str,
           family: str) -> list[GgufTensorOut]:
    """MLA's kv_b_proj [heads * (first + second), cols] as llama.cpp's converter splits it: the first part per
    head transposed ([heads, cols, first]), the second as it is ([heads, second, cols])."""
    heads, first, second = (int(evaluate(e, env)) for e in (sp.heads or "1", sp.first, sp.second))
    cols = t.shape[-1]
    if t.shape[0] != heads * (first + second):
        raise InputError(f"{t.key}: {t.shape[0]} rows, not heads {heads} x ({first} + {second})",
                         rule="shape-mismatch", key=t.key)
    outs = []
    held: dict[str, Any] = {}  # the decoded source, read once for both parts (written one after the other)
    for j, sub in enumerate(sp.into):
        found = names.lookup(base + sub)
        if found is None:
            raise InputError(f"{base + sub} (split of {t.key}) has no name in the gguf tensor map of {lc.tensor_arch}",
                             rule=RULE_NAME, path=f"mappings/architectures/{family}.yaml", key=t.key)
        tkind, gname = found
        shape = (heads, cols, first) if (j == 0 and sp.transpose_first) else (heads, first if j == 0 else second, cols)
        shape = shape if sp.heads else shape[1:]  # row ranges of a 2-D tensor (Qwen4-Exp's indexer q / k)
        qtype = _out_qtype(tkind, gname, shape, lc, gguf_type)
        meta = {"source": list(t.meta.get("source", [t.key])), "split": f"{sp.key}[{j}]"}
        outs.append(GgufTensorOut(gname, shape, qtype, lambda j=j, qtype=qtype: _split_values(
            t, j, heads, first, second, sp, qtype, held), meta))
    return outs


def _split_values(t: OutputTensor, part: int, heads: int, first: int, second: int, sp: Any, qtype,
                  held: dict[str, Any]) -> Iterator[bytes]:
    import numpy as np

    from ...arrays import decode_floats
    from ...numeric.transforms import RecipeReader

    cols = t.shape[-1]
    kv = held.pop("values", None)
    if kv is None:  # one attention projection: small beside the layer
        buf = RecipeReader(t.recipe).read(t.nbytes)
        kv = decode_floats(buf, t.dtype).astype(np.float32, copy=False).reshape(heads, first + second, cols)
    if part == 0:
        held["values"] = kv  # for the second part, written next
    if part == 0:
        values = kv[:, :first, :]
        if sp.transpose_first:
            values = values.transpose(0, 2, 1)
    else:
        values = kv[:, first:, :]
    for h in range(heads):
        yield _encode(np.ascontiguousarray(values[h]), qtype)


# ---------------------------------------------------------------------------
# the sidecar's MTP tensors decoded back (ckpt probe --mtp-quant gguf-TYPE)


def mtp_in_gguf(ckpt: Checkpoint, gguf_type: str) -> dict[str, tuple[list[OutputTensor], None]]:
    """``ckpt``'s own MTP tensors as the sidecar of ``gguf_type`` stores them (``_convert``'s bytes), decoded by
    gguf's ``dequantize`` and laid back under their checkpoint names and shapes (float32, in memory): per MTP
    tensor, ([its values], None), meta ``stored_bytes`` (its bytes in the sidecar) and ``encoded`` (stored in a
    type other than F32). The shared embedding, final norm and head the sidecar carries too are not MTP tensors."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from ...model.mtp import open_mtp
    from ...stream.plan import Compute

    if gguf_type not in GGUF_TYPES:
        raise UsageError(f"gguf type {gguf_type!r}: one of {', '.join(GGUF_TYPES)}")
    view = open_mtp(ckpt)
    table, res, lc = view.table, view.resolved, view.table.llama_cpp
    if lc is None:
        raise UsageError(f"{table.family}: its table names no llama.cpp architecture", rule=RULE_FAMILY)
    names = TensorNames(lc, _trunk_layers(res) + view.count, table.family)
    mtp_keys = {k for _, k in view.stored()}
    out: dict[str, tuple[list[OutputTensor], None]] = {}
    for t, hf_name, kind in _source_tensors(view, lc)[0]:
        sources = list(t.meta.get("source", [t.key]))
        if not set(sources) <= mtp_keys:
            continue
        parts, nbytes, encoded = [], 0, False
        for g in _convert(t, hf_name, kind, names, lc, res.env, gguf_type, table.family):
            with np.errstate(over="ignore"):  # a value beyond the type's range: refused below, by name
                raw = np.frombuffer(b"".join(bytes(c) for c in g.chunks()), dtype=np.uint8)
            v = quants.dequantize(raw, g.qtype).reshape(g.shape)
            if heads := g.meta.get("permute"):  # llama.cpp's rotary row order (_permuted), undone
                rows, cols = g.shape
                v = v.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
            parts.append(v)
            nbytes += g.nbytes
            encoded |= g.qtype != GGMLQuantizationType.F32
        values = _unsplit(parts, hf_name, lc) if len(parts) > 1 else parts[0]
        if kind == "norm" and lc.norm_offset:
            values = values - np.float32(lc.norm_offset)
        values = values.astype(np.float32).reshape(t.shape)
        bad = int(values.size - np.isfinite(values).sum())
        if bad:  # beyond the type's range (F16: 65504): the sidecar would hold inf, the row is no measurement
            raise UsageError(f"{t.key}: {bad} value(s) are not finite once stored as {gguf_type} (beyond its range)",
                             rule="nonfinite")
        if (len(sources) > 1 and len(sources) != t.shape[0]) or sources[0] in out:
            raise UsageError(f"{t.key}: the sidecar restacks it from another expert layout; not decoded back",
                             rule=RULE_NAME)
        pieces = list(values) if len(sources) > 1 else [values]
        for key, v in zip(sources, pieces, strict=True):
            blob = np.ascontiguousarray(v).tobytes()
            out[key] = ([OutputTensor(key, "F32", tuple(v.shape), Compute(lambda b=blob: [b], "gguf-decode"),
                                      meta={"stored_bytes": nbytes // len(pieces), "encoded": encoded})], None)
    return out


def _unsplit(parts: list, hf_name: str, lc: Any):
    """MLA's kv_b_proj back from its two sidecar tensors (``_split``'s inverse)."""
    import numpy as np

    sp = next(sp for sp in lc.split if hf_name.endswith("." + sp.key))
    if not sp.heads:
        return np.concatenate(parts, axis=0)
    first = parts[0].transpose(0, 2, 1) if sp.transpose_first else parts[0]
    joined = np.concatenate([first, parts[1]], axis=1)
    return joined.reshape(-1, joined.shape[-1])


# ---------------------------------------------------------------------------
# writing: the sidecar, then its manifest (last)


def write_sidecar(plan: SidecarPlan, out_dir: Path, inputs: list[str], overwrite: bool = False) -> tuple[Path, int]:
    """The sidecar at ``out_dir/plan.name`` and ``ckpt_manifest.json`` beside it: (its path, its size).

    The -o policy of every writer (stream/output_dir.py): never an input (``inputs``: the source and the trunk), not
    through a dangling link, an existing non-empty directory only with ``--overwrite``, under the directory's lock.
    ``--overwrite`` removes the manifest first (the output reads as incomplete), then what the earlier run listed
    as ``written`` (a sidecar of another type or name included); the new manifest, written last, lists its own."""
    import contextlib
    import json
    import os

    from ...errors import OutputError
    from ...io.artefacts import MANIFEST_NAME
    from ...stream.gguf_out import write_gguf
    from ...stream.output_dir import DirLock, check_not_an_input, check_output_dir, clear_previous_output

    check_not_an_input(out_dir, inputs)
    check_output_dir(out_dir, overwrite=overwrite, resume=False)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the output directory: {e.strerror or e}", path=str(out_dir)) from None
    target = out_dir / plan.name
    manifest_path = out_dir / MANIFEST_NAME
    lock: DirLock | None = DirLock(out_dir)
    try:
        check_output_dir(out_dir, overwrite=overwrite, resume=False)  # again under the lock
        if overwrite:
            clear_previous_output(out_dir, [MANIFEST_NAME])
        try:
            size, digests = write_gguf(target, plan.arch, plan.kv, plan.tensors)
        except BaseException:
            if created:  # a refusal while writing leaves nothing behind, not even the directory it made
                lock.release()
                lock = None
                with contextlib.suppress(OSError):
                    out_dir.rmdir()
            raise
        manifest = {**plan.manifest, "file": {"name": plan.name, "size": size},
                    "written": sorted([plan.name, MANIFEST_NAME]), "tensor_blake3": digests}
        tmp = manifest_path.with_name(f".{manifest_path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(tmp, manifest_path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write the manifest: {e.strerror or e}", path=str(manifest_path)) from None
    finally:
        if lock is not None:
            lock.release()
    return target, size
