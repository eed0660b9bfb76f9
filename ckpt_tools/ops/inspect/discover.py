"""`ckpt inspect --discover`: a draft architecture table for a checkpoint no table describes.

From the config and the safetensors headers (plus one small norm tensor): the MTP tensors are the keys
with an ``mtp`` / ``nextn`` name part and the decoder-layer keys at or beyond the config's layer count;
they are grouped into depths by the index after the MTP prefix (an index-less key is shared by every
depth; a depth spanning several physical sub-layers becomes several sub-blocks); glue roles come from
common names (``GLUE_NAMES``), everything else goes into block parts, routed experts recognised in
every layout of ``model.expert_layouts``. The result is a YAML table (``mappings/architectures/``
schema) with the facts names cannot tell marked ``VERIFY``.

Only generic naming conventions are used, no family knowledge; the trunk, the fixture and the fusion
input order are filled in by hand.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...errors import InputError, OutputError, UsageError
from ...io.checkpoint import Checkpoint
from ...io.config import ConfigView
from ...model.expert_layouts import DEFAULT_KEYS, LAYOUT_NAMES, ExpertLayout
from ...model.quant.codec import Codec, checkpoint_codec, scale_suffixes

LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers")
MTP_COUNT_KEYS = (
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules", "num_mtp_layers",
    "mtp_config.num_nextn_predict_layers", "mtp_config.num_mtp_layers", "mtp_config.num_layers",
)
MTP_TOKENS = frozenset({"mtp", "nextn"})

# Glue tensor names (the key after the layer prefix, without ``.weight``) -> canonical role.
GLUE_NAMES: dict[str, str] = {
    "enorm": "embed_norm", "embed_norm": "embed_norm", "emb_norm": "embed_norm",
    "pre_fc_norm_embedding": "embed_norm", "token_layernorm": "embed_norm",
    "hnorm": "hidden_norm", "hidden_norm": "hidden_norm", "pre_fc_norm_hidden": "hidden_norm",
    "hidden_layernorm": "hidden_norm",
    "eh_proj": "fusion", "fc": "fusion", "input_proj": "fusion", "linear_proj": "fusion",
    "e_proj": "fusion_embed", "h_proj": "fusion_hidden",
    "shared_head.norm": "final_norm", "final_layernorm": "final_norm", "final_norm": "final_norm",
    "chain_norm": "final_norm",
    "embed_tokens": "embed", "emb.tok_emb": "embed", "tok_emb": "embed", "word_embeddings": "embed",
    "shared_head.head": "head", "shared_head": "head", "head": "head", "lm_head": "head",
}
# ``norm`` right under the layer prefix is the final norm only when nothing above claims that role.
FALLBACK_FINAL_NORM = "norm"
SHARED_NAMES = {"embed": ("embed_tokens", "embed", "embeddings", "word_embeddings", "tok_embeddings"),
                "final_norm": ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f"),
                "head": ("lm_head", "head", "unembed", "output")}
HIDDEN_FIRST_FLAGS = ("mtp_hidden_states_first",)

_INDEX = re.compile(r"^\d+$")


@dataclass
class Found:
    key: str
    shape: tuple[int, ...]
    dtype: str
    index: int | None  # the layer index after the MTP prefix (None: shared by every depth)
    prefix: str  # the key up to and including the index part ("" when index is None)
    container: str  # the key up to (excluding) the index part
    rest: str  # the key after the prefix


@dataclass
class Discovery:
    """What discovery found, and the draft table built from it."""

    family: str
    num_layers: int | None
    num_layers_key: str | None
    count: int | None
    count_key: str | None
    keys: list[str]  # every MTP tensor found (scales included)
    depth_of: dict[str, int | None]  # key -> depth (None: shared by every depth); scales excluded
    sub_blocks: int
    table: dict
    notes: list[str] = field(default_factory=list)

    def yaml(self) -> str:
        head = [
            f"# Draft table written by `ckpt inspect --discover` for {self.family}: {len(self.keys)} MTP tensor(s),",
            f"# {len({d for d in self.depth_of.values() if d is not None})} depth(s)"
            + (f" of {self.sub_blocks} sub-layers each" if self.sub_blocks > 1 else "") + ".",
            "# Save it as mappings/architectures/<family>.yaml (the file name must equal `family`), then refine:",
            "# - VERIFY concat_order (the fusion input order cannot be read from names; check the serving",
            "#   engine's MTP code) and norm (guessed from a norm tensor's values);",
            "# - describe the decoder layers under `trunk.parts` (needed by fixtures and init-draft --from-layer);",
            "# - replace literal dimensions by config variables, add a tiny `fixture:` config and a golden list.",
        ]
        head += [f"# note: {n}" for n in self.notes]
        body = yaml.safe_dump(self.table, sort_keys=False, default_flow_style=None, width=120)
        return "\n".join(head) + "\n" + body

    def to_json(self) -> dict:
        return {"family": self.family, "num_layers": self.num_layers, "num_layers_key": self.num_layers_key,
                "mtp_count": self.count, "mtp_count_key": self.count_key, "mtp_tensors": len(self.keys),
                "depths": sorted({d for d in self.depth_of.values() if d is not None}),
                "sub_blocks": self.sub_blocks, "notes": self.notes, "yaml": self.yaml()}


def discover(ckpt: Checkpoint, family: str | None = None) -> Discovery:
    """Find the MTP tensors of ``ckpt`` and draft an architecture table for them."""
    config = ckpt.config
    n, n_key = _first(config, LAYER_COUNT_KEYS)
    count, count_key = _first(config, MTP_COUNT_KEYS)
    containers = _trunk_containers(ckpt.tensors, n)
    found, scales = _find(ckpt, containers, n)
    notes: list[str] = []
    geo = _depths(found, n, count, count_key, notes)
    depth_of = {f.key: geo.depth(f) for f in found}
    dims = _Dims(_int_or_none(config.get("hidden_size")), _int_or_none(config.get("vocab_size")))
    fmt = checkpoint_codec(ckpt)  # the block format its weights are stored in (model.quant.codec)
    entries = _Entries(dims, _main_dtype(ckpt), fmt)
    glue, glue_src = _glue(found, depth_of, geo, entries)
    parts, blocks = _body(found, depth_of, geo, glue_src, entries, notes)
    norm, why = _guess_norm(ckpt, found)
    notes.append(f"norm guessed {norm}: {why}")
    name = family or _sanitize((config.model_types() or ["checkpoint"])[0]) + "_discovered"
    order = "hidden_first" if any(config.get(f) is True for f in HIDDEN_FIRST_FLAGS) else "embed_first"
    table: dict = {
        "family": name,
        "title": f"{name} (discovered; VERIFY)",
        "detect": {"architectures": config.architectures()[:1], "model_types": config.model_types()[:1]},
        "config": _config_vars(n_key, count_key, dims),
        "norm": norm,
        "dtype": entries.dtype,
    }
    if any(fmt.stores(f.dtype) for f in found):
        table["quantization"] = fmt.scheme  # the scheme table whose block format the scales are in
    table["shared"] = _shared(ckpt, found, containers, dims)
    table["parts"] = parts
    trunk_container = sorted(containers)[0] if containers else "model.layers"
    table["trunk"] = {"prefix": trunk_container + ".{l}.", "count": "num_layers", "parts": []}
    table["mtp"] = _mtp_section(geo, count_key, order, glue, blocks, notes)
    return Discovery(name, n, n_key, count, count_key, sorted([f.key for f in found] + scales),
                     depth_of, geo.k, table, notes)


def _int_or_none(v: object) -> int | None:
    return v if isinstance(v, int) else None


# ---------------------------------------------------------------------------
# 1. candidates


def _first(config: ConfigView, keys) -> tuple[int | None, str | None]:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v, k
    return None, None


def _has_mtp_token(part: str) -> bool:
    return bool(MTP_TOKENS & set(part.lower().split("_")))


def _trunk_containers(keys, n: int | None) -> set[str]:
    """Containers ``X.layers`` whose indices 0..n-1 are (mostly) present: the decoder stack."""
    seen: dict[str, set[int]] = defaultdict(set)
    for key in keys:
        parts = key.split(".")
        for j in range(1, len(parts) - 1):
            if _INDEX.match(parts[j]) and not any(_has_mtp_token(p) for p in parts[:j]):
                seen[".".join(parts[:j])].add(int(parts[j]))
                break
    if n is None:
        return set()
    return {c for c, idx in seen.items() if n - 1 in idx and len([i for i in idx if i < n]) >= max(1, n // 2)}


def _locate(key: str, containers: set[str], n: int | None) -> tuple[int | None, str, str] | None:
    """(index, prefix, container) when ``key`` is an MTP tensor, else None."""
    parts = key.split(".")
    token = next((j for j, p in enumerate(parts[:-1]) if _has_mtp_token(p)), None)
    if token is not None:
        for j in range(token, len(parts) - 1):
            if _INDEX.match(parts[j]):
                return int(parts[j]), ".".join(parts[: j + 1]) + ".", ".".join(parts[:j])
        return None, "", ".".join(parts[: token + 1])
    if n is None:
        return None
    for j in range(1, len(parts) - 1):
        if _INDEX.match(parts[j]):
            container = ".".join(parts[:j])
            if container in containers and int(parts[j]) >= n:
                return int(parts[j]), ".".join(parts[: j + 1]) + ".", container
            return None
    return None


def _is_scale(key: str, keys, suffixes: frozenset[str]) -> bool:
    for suffix in suffixes:
        if key.endswith("." + suffix) and key[: -len(suffix)] + "weight" in keys:
            return True
        if key.endswith("_" + suffix.removeprefix("weight_")) and key[: -len(suffix) + len("weight_") - 1] in keys:
            return True
    return False


def _find(ckpt: Checkpoint, containers: set[str], n: int | None) -> tuple[list[Found], list[str]]:
    """Step 1: the MTP tensors, and apart from them their FP8 scales; InputError (no-mtp) when there are none."""
    keys = ckpt.tensors
    found: list[Found] = []
    scales: list[str] = []
    suffixes = scale_suffixes()
    for key, ref in keys.items():
        loc = _locate(key, containers, n)
        if loc is None:
            continue
        if _is_scale(key, keys, suffixes):
            scales.append(key)
            continue
        index, prefix, container = loc
        rest = key[len(prefix):] if prefix else key[len(container) + 1:]
        found.append(Found(key, tuple(ref.shape), ref.dtype, index, prefix, container, rest))
    if not found:
        raise InputError(f"{ckpt.root}: no MTP-looking tensors (no 'mtp' / 'nextn' name part, no decoder layer at "
                         f"index >= {n if n is not None else '?'}); nothing to discover", rule="no-mtp")
    return found, scales


# ---------------------------------------------------------------------------
# 2. grouping


def _index_template(offset: int, n: int | None, k: int, j: int) -> str:
    """``{...}`` expression for the physical index of sub-layer j of depth i."""
    terms = []
    if n is not None and offset == n:
        terms.append("num_layers")
    elif offset:
        terms.append(str(offset))
    terms.append("i" if k == 1 else f"i * {k}")
    if j:
        terms.append(str(j))
    return "{" + " + ".join(terms) + "}"


@dataclass
class _Depths:
    """How MTP layer indices map onto depths: ``k`` physical sub-layers per depth, counted from ``offset``."""

    offset: int
    k: int
    count: int  # depths found
    n: int | None  # the config's layer count: an index template starts at num_layers when offset equals it
    container: str  # the layer prefix: the most common container among indexed keys

    def depth(self, f: Found) -> int | None:
        return None if f.index is None else (f.index - self.offset) // self.k

    def sub(self, f: Found) -> int:
        """Which sub-layer of its depth an indexed tensor is in."""
        return (f.index - self.offset) % self.k

    def prefix_template(self, j: int, cont: str | None = None) -> str:
        """The key prefix of sub-layer ``j`` of depth ``i`` under ``cont`` (the layer prefix by default)."""
        cont = self.container if cont is None else cont
        return f"{cont}.{_index_template(self.offset, self.n, self.k, j)}." if cont else ""


def _depths(found: list[Found], n: int | None, count: int | None, count_key: str | None,
            notes: list[str]) -> _Depths:
    """Step 2: depths and sub-layers, from the indices found and the config's MTP count."""
    indices = sorted({f.index for f in found if f.index is not None})
    offset = indices[0] if indices else 0
    k = 1
    if count and indices and len(indices) % count == 0 and len(indices) > count:
        k = len(indices) // count
        notes.append(f"{len(indices)} MTP layer indices for {count_key} = {count}: {k} sub-layers per depth")
    depths = max(1, (len(indices) + k - 1) // k) if indices else 1
    if count is not None and depths != count:
        notes.append(f"found {depths} depth(s) but {count_key} says {count}")
    main_container = Counter(f.container for f in found if f.index is not None).most_common(1)
    return _Depths(offset, k, depths, n, main_container[0][0] if main_container else "")


def _strip_weight(rest: str) -> str:
    return rest[: -len(".weight")] if rest.endswith(".weight") else rest


def _glue_role(f: Found) -> str | None:
    name = _strip_weight(f.rest)
    if name in GLUE_NAMES:
        return GLUE_NAMES[name]
    if f.rest == "weight":  # one tensor per container, e.g. model.mtp_emb_norm.{i}.weight
        last = f.container.rsplit(".", 1)[-1]
        stem = "_".join(p for p in last.split("_") if p.lower() not in MTP_TOKENS)
        return GLUE_NAMES.get(stem)
    return None


def _glue(found: list[Found], depth_of: dict[str, int | None], geo: _Depths,
          entries: _Entries) -> tuple[dict[str, dict], dict[str, Found]]:
    """Step 3a: glue roles found at depth 0 (their key templates generalise over i): entries and tensors."""
    hidden = entries.dims.hidden
    glue: dict[str, dict] = {}
    glue_src: dict[str, Found] = {}
    depth0 = [f for f in found if depth_of[f.key] in (0, None)]
    candidates: list[tuple[str, Found]] = [(r, f) for f in depth0 if (r := _glue_role(f)) is not None]
    if not any(r == "final_norm" for r, _ in candidates):  # a bare `norm` right under the prefix
        bare = [f for f in depth0 if _strip_weight(f.rest) == FALLBACK_FINAL_NORM]
        candidates += [("final_norm", f) for f in sorted(bare, key=lambda f: f.index is not None)]
    for role, f in candidates:
        if role in glue or (role == "fusion" and hidden and f.shape != (hidden, 2 * hidden)):
            continue
        if role in ("fusion_embed", "fusion_hidden") and hidden and f.shape != (hidden, hidden):
            continue
        if f.index is None:
            template = "/" + f.key
        else:
            j = geo.sub(f)
            template = (f.rest if f.container == geo.container and j == 0
                        else "/" + geo.prefix_template(j, f.container) + f.rest)
        t = entries.tensor(template, f, role)
        if role in ("embed", "head"):
            t["copy_of"] = role
        glue[role] = t
        glue_src[role] = f
    return glue, glue_src


def _is_glue(f: Found, glue_src: dict[str, Found], geo: _Depths) -> bool:
    """``f`` is a glue tensor, or the same glue tensor at another depth."""
    for g in glue_src.values():
        if f.key == g.key:
            return True
        if g.index is not None and f.index is not None and (g.container, g.rest) == (f.container, f.rest) \
                and geo.sub(g) == geo.sub(f):
            return True
    return False


# ---------------------------------------------------------------------------
# 3. experts and tensor entries


# Routed experts are recognised by the key templates of every layout (expert_layouts.DEFAULT_KEYS), under a
# prefix ending in ``experts``; per-expert groups also by Mixtral's w1 / w3 / w2 names.
_PER_EXPERT = re.compile(r"^(?P<p>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
_PER_EXPERT_ALIASES = {"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"}
_SLOT_NAMES = {slot: (template.removeprefix("{P}.{e}."), _PER_EXPERT_ALIASES[slot])
               for slot, template in DEFAULT_KEYS["per-expert"].items()}
_STACKED_LAYOUTS = [name for name in LAYOUT_NAMES if name != "per-expert"]
_TAILS = {template.removeprefix("{P}") for name in _STACKED_LAYOUTS for template in DEFAULT_KEYS[name].values()}
_STACKED = re.compile(r"^(?P<p>(?:.*\.)?experts)(?P<tail>" + "|".join(map(re.escape, sorted(_TAILS))) + ")$")


def _slots(layout: str, gated: bool) -> tuple[str, ...]:
    """The tensors of a stacked group: a fused one joins gate and up, a non-gated one has neither gate slot."""
    if not gated:
        return ("up", "down")
    return ("gate_up", "down") if "gate_up" in DEFAULT_KEYS[layout] else ("gate", "up", "down")


def _stacked_layout(tails: dict[str, tuple[int, ...]], hidden: int | None) -> tuple[str, bool, int, int] | None:
    """(layout, gated, hidden, inter) of the stacked group whose key tails (-> shapes) are ``tails``, or None.

    fused and fused-transposed share their names: the hidden size tells them apart ([E, H, I] down is fused)."""
    for layout in _STACKED_LAYOUTS:
        for gated in (True, False):
            keys = {DEFAULT_KEYS[layout][slot].removeprefix("{P}"): slot for slot in _slots(layout, gated)}
            if set(keys) != set(tails):
                continue
            shape = {slot: tails[tail] for tail, slot in keys.items()}
            _, d1, d2 = shape["down"]
            first = shape["gate_up" if "gate_up" in shape else "up"]
            transposed = ExpertLayout(layout).transposed
            if layout in ("fused", "fused-transposed"):
                transposed = hidden is not None and first[1] == hidden and d2 == hidden
                layout = "fused-transposed" if transposed else "fused"
            return (layout, gated, d2, d1) if transposed else (layout, gated, d1, d2)
    return None


def _experts(rel: dict[str, tuple[tuple[int, ...], str]], hidden: int | None) -> tuple[list[dict], set[str]]:
    """Routed-expert groups among block tensors (relative key -> (shape, dtype)); the keys they cover."""
    groups: list[dict] = []
    used: set[str] = set()
    per: dict[str, dict[int, dict[str, tuple[int, ...]]]] = defaultdict(lambda: defaultdict(dict))
    for key, (shape, _) in rel.items():
        m = _PER_EXPERT.match(key)
        if m:
            per[m["p"]][int(m["e"])][m["rest"]] = shape
    for p, experts in per.items():
        count = len(experts)
        if sorted(experts) != list(range(count)):
            continue
        rests = set(experts[0])
        if any(set(v) != rests for v in experts.values()):
            continue
        names: dict[str, str] = {}
        for slot, options in _SLOT_NAMES.items():
            hit = [o for o in options if o in rests]
            if hit:
                names[slot] = hit[0]
        gated = "gate" in names
        if set(names.values()) != rests or "down" not in names or "up" not in names:
            continue
        inter, hid = experts[0][names["up"]]
        entry = {"prefix": p, "count": count, "hidden": hid, "inter": inter, "layout": "per-expert", "gated": gated}
        if names != {s: o[0] for s, o in _SLOT_NAMES.items() if s in names}:
            entry["names"] = {s: "{P}.{e}." + n for s, n in names.items()}
        groups.append(entry)
        used |= {f"{p}.{e}.{r}" for e in experts for r in rests}
    stacked: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = defaultdict(dict)
    for key, (shape, _) in rel.items():
        m = _STACKED.match(key)
        if m and len(shape) == 3 and key not in used:
            stacked[m["p"]][m["tail"]] = (key, shape)
    for p, bytail in stacked.items():
        found = _stacked_layout({t: shape for t, (_, shape) in bytail.items()}, hidden)
        if found is None:
            continue
        layout, gated, hid, inter = found
        count = next(iter(bytail.values()))[1][0]
        groups.append({"prefix": p, "count": count, "hidden": hid, "inter": inter, "layout": layout, "gated": gated})
        used |= {k for k, _ in bytail.values()}
    return groups, used


def _kind(rel: str, shape: tuple[int, ...]) -> str:
    name = _strip_weight(rel).rsplit(".", 1)[-1]
    if rel.endswith(".bias") or name.endswith("_bias"):
        return "bias"
    if len(shape) == 1 and "norm" in rel:
        return "norm"
    if rel.endswith("gate.weight") or name in ("router", "gate"):
        return "router"
    return "linear" if len(shape) == 2 else "other"


class _Dims:
    """Literal dimensions, written as config variables where the match is unambiguous."""

    def __init__(self, hidden: int | None, vocab: int | None) -> None:
        self.hidden, self.vocab = hidden, vocab

    def dim(self, d: int):
        if self.hidden and d == self.hidden:
            return "hidden"
        if self.hidden and d == 2 * self.hidden:
            return "2 * hidden"
        if self.vocab and d == self.vocab:
            return "vocab"
        return d

    def shape(self, shape) -> list:
        return [self.dim(d) for d in shape]


@dataclass
class _Entries:
    """Table entries for found tensors: shape in config variables, kind, dtype unless the table's, quant."""

    dims: _Dims
    dtype: str  # the table's dtype
    fmt: Codec  # the checkpoint's block format: its weights are quantized linears

    def tensor(self, key_template: str, f: Found, role: str | None = None) -> dict:
        t: dict = {"key": key_template, "shape": self.dims.shape(f.shape)}
        kind = "embedding" if role == "embed" else "norm" if role in ("embed_norm", "hidden_norm", "final_norm") \
            else _kind(f.rest, f.shape)
        if kind != "linear":
            t["kind"] = kind
        if f.dtype != self.dtype and not self.fmt.stores(f.dtype):
            t["dtype"] = f.dtype
        if self.fmt.stores(f.dtype):
            t["quant"] = True
        return t


def _body(found: list[Found], depth_of: dict[str, int | None], geo: _Depths, glue_src: dict[str, Found],
          entries: _Entries, notes: list[str]) -> tuple[dict[str, list], list[dict]]:
    """Step 3b: everything but the glue, as parts and the blocks that place them."""
    body = [f for f in found if f.index is not None and not _is_glue(f, glue_src, geo)]
    parts, blocks = _blocks(body, depth_of, geo, entries)
    # tensors shared by every depth that are not glue: one extra block, instantiated at depth 0 only
    extras = [f for f in found if f.index is None and not _is_glue(f, glue_src, geo)]
    if extras:
        common = _common_prefix([f.key for f in extras])
        if common:
            parts["shared_extras"] = [entries.tensor(f.key[len(common):], f) for f in extras]
            blocks.append({"prefix": "/" + common, "parts": [{"part": "shared_extras", "when": "i == 0"}]})
            notes.append(f"{len(extras)} tensor(s) shared by every depth are not glue; they sit in one extra "
                         "block of depth 0 (`shared_extras`)")
        else:
            notes.append(f"left out {len(extras)} tensor(s) shared by every depth with no common prefix: "
                         + ", ".join(f.key for f in extras[:5]))
    if not blocks:
        parts["block"] = []
        blocks.append({"parts": ["block"]})
    return parts, blocks


def _blocks(body: list[Found], depth_of: dict[str, int | None], geo: _Depths,
            entries: _Entries) -> tuple[dict[str, list], list[dict]]:
    """One block per (indexed container, sub-layer), the main container first; one part per distinct content."""
    parts: dict[str, list] = {}
    blocks: list[dict] = []
    sig_to_part: dict[tuple, str] = {}
    conts = sorted({f.container for f in body}, key=lambda c: (c != geo.container, c))
    for cont in conts:
        for j in range(geo.k):
            per_depth: dict[int, dict[str, tuple[tuple[int, ...], str]]] = defaultdict(dict)
            refs: dict[tuple[int, str], Found] = {}
            for f in body:
                if f.container == cont and geo.sub(f) == j:
                    d = depth_of[f.key]
                    per_depth[d][f.rest] = (f.shape, f.dtype)
                    refs[(d, f.rest)] = f
            if not per_depth:
                continue
            refs_list = []
            for d in sorted(per_depth):
                rel = per_depth[d]
                sig = (cont, j, tuple(sorted((r, s, t) for r, (s, t) in rel.items())))
                if sig not in sig_to_part:
                    name = "block" if not sig_to_part and geo.k == 1 else f"block_{len(sig_to_part)}"
                    sig_to_part[sig] = name
                    parts[name] = _part_items(rel, refs, d, entries)
                refs_list.append((d, sig_to_part[sig]))
            blocks.append(_block_entry(cont, j, geo, refs_list))
    return parts, blocks


def _block_entry(cont: str, j: int, geo: _Depths, refs_list: list[tuple[int, str]]) -> dict:
    """A block: its prefix unless it is the layer's own, and its part (per depth when they differ)."""
    block: dict = {}
    if cont != geo.container or j or geo.k > 1:
        block["prefix"] = "/" + geo.prefix_template(j, cont)
    names_used = {p for _, p in refs_list}
    if len(names_used) == 1:
        block["parts"] = [next(iter(names_used))]
    else:
        block["parts"] = [{"part": p, "when": f"i == {d}"} for d, p in refs_list]
    return block


def _part_items(rel, refs, depth, entries: _Entries) -> list:
    groups, used = _experts(rel, entries.dims.hidden)
    items: list = [entries.tensor(r, refs[(depth, r)]) for r in sorted(
        rel, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)]) if r not in used]
    for g in groups:
        e = dict(g)
        e["hidden"] = entries.dims.dim(e["hidden"])
        items.append({"experts": e})
    return items


# ---------------------------------------------------------------------------
# 4. the table


def _sanitize(name: str) -> str:
    s = re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()
    return s or "discovered"


def _main_dtype(ckpt: Checkpoint) -> str:
    counts = Counter(r.dtype for r in ckpt.tensors.values() if r.dtype in ("BF16", "F16", "F32"))
    return counts.most_common(1)[0][0] if counts else "BF16"


def _guess_norm(ckpt: Checkpoint, found: list[Found]) -> tuple[str, str]:
    """zero_centred when a 1-D norm weight averages near 0 (its weights are (1 + w)), else plain."""
    for f in found:
        if len(f.shape) == 1 and "norm" in f.key and f.dtype in ("BF16", "F16", "F32") and f.shape[0] <= 1 << 16:
            mean = float(abs(ckpt.tensors[f.key].torch().float()).mean())
            return ("zero_centred" if mean < 0.5 else "plain"), f"mean |w| of {f.key} is {mean:.3f}"
    return "plain", "no norm tensor to look at"


def _config_vars(n_key: str | None, count_key: str | None, dims: _Dims) -> dict:
    """Step 4a: the table's config variables."""
    cfg_vars: dict = {"num_layers": n_key or "num_hidden_layers",
                      "num_mtp": {"keys": [count_key] if count_key else list(MTP_COUNT_KEYS[:1]), "default": 0}}
    if dims.hidden is not None:
        cfg_vars["hidden"] = "hidden_size"
    if dims.vocab is not None:
        cfg_vars["vocab"] = "vocab_size"
    cfg_vars["tied"] = {"keys": ["tie_word_embeddings"], "default": False}
    return cfg_vars


def _mtp_section(geo: _Depths, count_key: str | None, order: str, glue: dict, blocks: list[dict],
                 notes: list[str]) -> dict:
    """Step 4b: the table's ``mtp`` section."""
    mtp_prefix = geo.prefix_template(0)
    if not mtp_prefix:
        notes.append("no indexed MTP layer prefix: every MTP tensor is shared by the depths")
    mtp: dict = {"count": "num_mtp" if count_key else str(geo.count)}
    if count_key:
        mtp["count_field"] = "num_mtp"
    mtp.update(prefix=mtp_prefix or "mtp.{i}.", concat_order=order, glue=glue, blocks=blocks)
    return mtp


def _common_prefix(keys: list[str]) -> str:
    parts = [k.split(".") for k in keys]
    out = []
    for group in zip(*parts, strict=False):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    if len(out) >= min(len(p) for p in parts):
        out = out[:-1]
    return ".".join(out) + "." if out else ""


def _shared(ckpt: Checkpoint, found: list[Found], containers: set[str], dims: _Dims) -> dict:
    """Top-level embedding, final norm and head (outside the decoder stack and the MTP tensors)."""
    mtp = {f.key for f in found}
    out: dict = {}
    for key, ref in sorted(ckpt.tensors.items(), key=lambda kv: (kv[0].count("."), kv[0])):
        if key in mtp or any(key.startswith(c + ".") for c in containers):
            continue
        stem = _strip_weight(key).rsplit(".", 1)[-1]
        for role, names in SHARED_NAMES.items():
            if role in out or stem not in names:
                continue
            if role == "final_norm" and len(ref.shape) != 1:
                continue
            if role != "final_norm" and len(ref.shape) != 2:
                continue
            t: dict = {"key": key, "shape": dims.shape(tuple(ref.shape))}
            if role == "embed":
                t["kind"] = "embedding"
            elif role == "final_norm":
                t["kind"] = "norm"
            else:
                t["when"] = "not tied"
            out[role] = t
    return out


def write_draft(discovery: Discovery, path: str | Path) -> Path:
    """Write the draft YAML; the table's family becomes the file's stem (the loader requires it)."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise UsageError(f"--write {path}: a table file ends in .yaml")
    family = path.stem
    if not re.fullmatch(r"[A-Za-z0-9_]+", family):
        raise UsageError(f"--write {path}: the file name is the family name; use letters, digits and _")
    discovery.table["family"] = family
    discovery.table["title"] = f"{family} (discovered; VERIFY)"
    discovery.family = family
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(discovery.yaml())
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}", path=str(path)) from None
    return path
