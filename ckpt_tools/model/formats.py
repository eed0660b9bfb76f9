"""Draft formats (tables in mappings/formats/) and the correspondence they define.

A format maps canonical MTP roles to names. Resolved against a verifier's MTP view it
yields ``Link``s: each draft tensor (or expert group) with the verifier tensor(s) it
corresponds to. Extract runs the links forward (verifier -> draft); stitch runs the
same links backward. Every link is invertible: a rename, an expert re-layout, a swap
of the fusion projection's two input halves, or a column-wise join of a family's two
``[H, H]`` fusion halves (``fusion_embed`` / ``fusion_hidden``) into a format's single
``[H, 2H]`` fusion slot (split again by stitch).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InputError, TableError, UsageError
from .expert_layouts import ExpertGroup, ExpertLayout
from .expr import ExprError, evaluate, names_in, render
from .mtp import MtpView
from .prefixes import WRAPPERS, peel
from .tables import cache as table_cache
from .tables.loader import _parse, mappings_dir
from .tables.resolve import MtpLayer, Spec


class FieldRequirement(BaseModel):
    """Config fields (dotted paths in ``config.set``) whose source value must be known when ``when`` holds.

    The consumer builds its model from them and has a default of its own for each; writing no
    value would let that default (another model's) decide silently, so the family is refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    fields: list[str]
    when: str | None = None  # condition over the format environment (format_env)
    reason: str = ""


class ConfigCheck(BaseModel):
    """A condition over the format environment the consumer's model needs (refused with ``reason``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    expr: str
    reason: str
    when: str | None = None


class Supports(BaseModel):
    """What a format's consumer can load. An unmet condition refuses the family, with ``reason``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_types: list[str] = Field(default_factory=list)
    # block tensor names (after tag renames) the consumer's layer must find, and the only ones it takes
    block_requires: list[str] = Field(default_factory=list)
    block_allows: list[str] = Field(default_factory=list)  # regular expressions
    reason: str = ""
    # glue roles the consumer's layer always has: a family without one cannot round-trip
    glue_requires: list[str] = Field(default_factory=list)
    glue_reason: str = ""
    config_requires: list[FieldRequirement] = Field(default_factory=list)
    config_checks: list[ConfigCheck] = Field(default_factory=list)


class DetectRule(BaseModel):
    """How stitch recognises a draft of this format from its config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    config_equals: dict = Field(default_factory=dict)  # every key must have this value
    architecture_suffix: str | None = None
    # draft keys (after wrapper prefixes) that mark this format when no config or manifest says
    # (a trainer's DCP step folder has neither): every one must be present
    keys: list[str] = Field(default_factory=list)


class ConfigRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    base: Literal["source", "none"] = "source"
    set: dict = Field(default_factory=dict)


class Format(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    title: str
    rename: Literal["native", "reprefix", "roles"]
    max_layers: int | None = None
    layer_prefix: str = ""
    glue: dict[str, str] = Field(default_factory=dict)
    embed: str | None = None  # where --with-embed puts the embedding (roles formats)
    head: str | None = None
    block_prefix: str = ""
    tag_renames: dict[str, str] = Field(default_factory=dict)
    expert_layout: str | None = None  # None: keep the verifier's layout
    expert_prefix: str | None = None  # relative to the block prefix; None: the family's own
    concat_order: Literal["embed_first", "hidden_first"] | None = None  # None: keep the family's
    norm: Literal["plain", "zero_centred", "family"] = "family"
    drop_roles: list[str] = Field(default_factory=list)
    requires_engine: str | None = None
    carry_files: bool = False  # copy tokenizer / generation config / other non-weight files
    detect: DetectRule | None = None
    # config.json fields (dotted paths) naming the model a draft of this format came from:
    # stitch's proof that the draft belongs to the verifier (see provenance.py)
    evidence: list[str] = Field(default_factory=list)
    ignore_keys: list[str] = Field(default_factory=list)  # draft keys stitch skips on purpose (with reason)
    # wrapper prefixes this format's trainer puts on keys, beyond the generic ones (prefixes.WRAPPERS)
    strip_prefixes: list[str] = Field(default_factory=list)
    supports: Supports = Field(default_factory=Supports)
    config: ConfigRecipe = Field(default_factory=ConfigRecipe)
    # named constant tables the config template reads (e.g. a consumer's per-model-type defaults);
    # their "{expr}" leaves are filled over the same environment first
    tables: dict[str, dict] = Field(default_factory=dict)


CACHE_PREFIX = "formats-"


def formats_dir() -> Path:
    return mappings_dir() / "formats"


def _build(path: Path, data: object) -> Format:
    try:
        fmt = Format.model_validate(data)
    except ValidationError as e:
        msgs = "; ".join(f"field {'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:6])
        raise TableError(msgs, path=str(path)) from None
    if fmt.name != path.stem:
        raise TableError(f"field name: {fmt.name!r} must match the file name {path.stem!r}", path=str(path))
    return fmt


@lru_cache(maxsize=1)
def all_formats() -> dict[str, Format]:
    # parsed once into the tables' cache (checked on every load, like the architecture tables): most runs
    # then never import yaml
    return table_cache.load_tables((formats_dir(),), _parse, _build, lambda f: f.name, CACHE_PREFIX)


def get_format(name: str) -> Format:
    formats = all_formats()
    if name not in formats:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(sorted(formats))}")
    return formats[name]


def detect_format(config: dict, manifest: dict | None, keys: Collection[str] = (),
                  strip_prefix: str | None = None) -> Format:
    """The format of a draft: its manifest says so, else the format tables' detect rules (its config,
    then its keys, with wrapper prefixes or ``strip_prefix`` stripped), else native."""
    if manifest and manifest.get("format") in all_formats():
        return all_formats()[manifest["format"]]
    return _by_config(config) or _by_keys(keys, strip_prefix) or all_formats()["native"]


def wrappers_of(fmt: Format) -> tuple[list[str], dict[str, str]]:
    """The wrapper prefixes a draft of ``fmt`` may carry, and how each is known (for reports)."""
    own = [p for p in fmt.strip_prefixes if p not in WRAPPERS]
    return [*own, *WRAPPERS], {p: f"format {fmt.name}" for p in own}


def all_wrappers() -> list[str]:
    """Every wrapper prefix known: the generic ones and those any format declares."""
    return list(dict.fromkeys(p for fmt in all_formats().values() for p in wrappers_of(fmt)[0]))


def _by_keys(keys: Collection[str], strip_prefix: str | None) -> Format | None:
    listed = list(keys)
    have = set(listed)
    for fmt in all_formats().values():
        marks = fmt.detect.keys if fmt.detect else []
        prefixes = [strip_prefix] if strip_prefix is not None else ["", *peel(listed, wrappers_of(fmt)[0])]
        if marks and any(all(p + m in have for m in marks) for p in prefixes):
            return fmt
    return None


def _by_config(config: dict) -> Format | None:
    for fmt in all_formats().values():
        rule = fmt.detect
        if rule is None:
            continue
        if rule.config_equals and all(config.get(k) == v for k, v in rule.config_equals.items()):
            return fmt
        archs = config.get("architectures") or []
        if rule.architecture_suffix and any(isinstance(a, str) and a.endswith(rule.architecture_suffix)
                                            for a in archs):
            return fmt
    return None


# ---------------------------------------------------------------------------
# Links


@dataclass
class TensorLink:
    draft_key: str
    verifier_key: str
    spec: Spec  # the verifier-side spec (role, depth, kind, shape)
    swap_halves: bool = False  # fusion weight whose two input halves trade places
    shape: tuple[int, ...] = ()  # the draft tensor's shape
    # Non-empty: the draft tensor is these verifier tensors joined along the last axis, in
    # this order (extract concatenates them, stitch splits the draft tensor back).
    columns: tuple[Spec, ...] = ()

    def verifier_keys(self) -> list[str]:
        return [s.key for s in self.columns] if self.columns else [self.verifier_key]


FUSION_HALVES = {"embed_first": ("fusion_embed", "fusion_hidden"), "hidden_first": ("fusion_hidden", "fusion_embed")}


@dataclass
class ExpertLink:
    draft: ExpertGroup  # layout and prefix in the draft
    verifier: ExpertGroup  # layout and prefix on the verifier's disk


@dataclass
class Correspondence:
    fmt: Format
    view: MtpView
    layers: list[int]
    tensors: list[TensorLink] = field(default_factory=list)
    experts: list[ExpertLink] = field(default_factory=list)

    def draft_keys(self) -> list[str]:
        out = [t.draft_key for t in self.tensors]
        for e in self.experts:
            out += [t.key for t in e.draft.tensors()]
        return out


def _key(template: str, prefix: str, env: dict) -> str:
    if template.startswith("/"):
        return render(template[1:], env)
    return prefix + render(template, env)


def check_expressible(fmt: Format, view: MtpView, layers: list[int]) -> None:
    """Refuse, with the reason, a format that cannot hold this family's MTP layers."""
    table = view.table
    why = None
    if fmt.max_layers is not None and len(layers) > fmt.max_layers:
        why = (f"it holds at most {fmt.max_layers} MTP layer(s) and {len(layers)} were requested; "
               "pick one with --layers")
    elif fmt.supports.model_types and not set(fmt.supports.model_types) & set(view.ckpt.config.model_types()):
        why = fmt.supports.reason or f"it supports model types {fmt.supports.model_types} only"
    elif fmt.rename != "native" and _sub_block_count(view) != 1:
        why = f"{table.family} spreads one MTP step over {_sub_block_count(view)} sub-blocks"
    elif fmt.norm not in ("family", table.norm):
        why = (f"its norms are {fmt.norm} while {table.family} uses {table.norm} norms; converting "
               "(1 + w) to w in bf16 is lossy")
    elif _block_unfit(fmt, view):
        why = _block_unfit(fmt, view)
    elif fmt.rename == "reprefix" and [s for s in view.resolved.glue_specs() if s.depth is None]:
        outside = [s.key for s in view.resolved.glue_specs() if s.depth is None]
        why = (f"{table.family} keeps glue tensors outside the layer prefix ({outside[0]}); "
               "it is not an appended-layer family")
    elif fmt.requires_engine and fmt.requires_engine not in table.engines:
        why = f"table {table.family} names no {fmt.requires_engine} architecture (the engine has no draft class for it)"
    elif _glue_unfit(fmt, view, layers):
        why = _glue_unfit(fmt, view, layers)
    elif _config_unfit(fmt, view, layers):
        why = _config_unfit(fmt, view, layers)
    if why:
        raise InputError(f"format {fmt.name} cannot express {table.family}: {why}", rule="format-unsupported")


def _sub_block_count(view: MtpView) -> int:
    """Sub-blocks of one MTP step (repeated blocks expanded), as the config resolves them."""
    return max((len(layer.block_prefixes) for layer in view.resolved.layers), default=len(view.table.mtp.blocks))


def _block_unfit(fmt: Format, view: MtpView) -> str | None:
    """Why the family's MTP block cannot be the format consumer's layer (None when it can)."""
    sup = fmt.supports
    if not (sup.block_requires or sup.block_allows):
        return None
    subs = {fmt.tag_renames.get(s.tag or "", s.sub or "") for layer in view.resolved.layers for s in layer.block}
    missing = [r for r in sup.block_requires if r not in subs]
    foreign = sorted(x for x in subs if sup.block_allows and not any(re.fullmatch(p, x) for p in sup.block_allows))
    if not missing and not foreign:
        return None
    detail = (f"its block lacks {missing[:3]}" if missing else f"its block has {foreign[:3]}")
    return f"{sup.reason or 'the consumer cannot load this block'} ({detail})"


def _glue_unfit(fmt: Format, view: MtpView, layers: list[int]) -> str | None:
    """Why the family lacks a glue role the consumer's layer always has (None when it has them all)."""
    need = fmt.supports.glue_requires
    have = {role for i in layers for role in view.resolved.layers[i].glue}
    missing = [r for r in need if r not in have]
    if not missing:
        return None
    return f"its MTP layer has no {missing[0]} tensor: {fmt.supports.glue_reason or 'the consumer always builds one'}"


def format_env(fmt: Format, view: MtpView, layers: list[int]) -> dict:
    """The variables a format's config template and checks read: the family table's config
    variables, plus facts about the MTP layers as this format names them."""
    res = view.resolved
    present = {s.key for s in view.present}
    chosen = [res.layers[i] for i in layers]
    block = [s for layer in chosen for s in layer.block if s.key in present]
    env = dict(res.env)
    env.update(
        has_experts=any(layer.experts for layer in chosen),
        # block tensor names in the format (after its tag renames), relative to its block prefix
        block_keys=sorted({fmt.tag_renames.get(s.tag or "", s.sub or "") for s in block}),
        verifier_prefix=chosen[0].prefix if chosen else None,
        # the format keeps the verifier's names below the layer prefix (glue and block alike)
        names_kept=_names_kept(fmt, chosen, present),
        verifier_expert_layouts=sorted({view.layouts[g.prefix].label() for layer in chosen for g in layer.experts}),
    )
    return env


def _names_kept(fmt: Format, chosen, present: set[str]) -> bool:
    for layer in chosen:
        for role, spec in layer.glue.items():
            if spec.key not in present or role in ("embed", "head"):
                continue
            if fmt.glue.get(role) != spec.key.removeprefix(layer.prefix) or not spec.key.startswith(layer.prefix):
                return False
        if any(fmt.tag_renames.get(s.tag or "", s.sub) != s.sub for s in layer.block if s.key in present):
            return False
        if any(fmt.expert_prefix not in (None, g.sub_prefix) for g in layer.experts):
            return False
    return True


def _config_unfit(fmt: Format, view: MtpView, layers: list[int]) -> str | None:
    """Why the consumer cannot be configured for this family (None when it can)."""
    sup = fmt.supports
    if not (sup.config_requires or sup.config_checks):
        return None
    env = format_env(fmt, view, layers)
    for req in sup.config_requires:
        if req.when and not _holds(req.when, env):
            continue
        for path in req.fields:
            missing = _unknown_field(fmt, path, env)
            if missing:
                table = view.table
                keys = [k for n in missing if n in table.config for k in table.config[n].keys]
                where = (f"config.json has none of {keys}" if keys
                         else f"table {table.family} declares no {', '.join(missing)}")
                return f"it needs {path} ({where}){': ' + req.reason if req.reason else ''}"
    for check in sup.config_checks:
        if check.when and not _holds(check.when, env):
            continue
        try:
            ok = bool(evaluate(check.expr, env))
        except ExprError as e:
            return f"{check.reason} (cannot tell: {e})"
        if not ok:
            return check.reason
    return None


def _holds(expr: str, env: dict) -> bool:
    try:
        return bool(evaluate(expr, env))
    except ExprError:
        return False


def _unknown_field(fmt: Format, path: str, env: dict) -> list[str]:
    """The variables ``path``'s template needs but cannot get ([] when its value is known)."""
    node: object = fmt.config.set
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise TableError(f"config_requires names {path!r}, which config.set does not have",
                             path=f"format {fmt.name}")
        node = node[part]
    if not (isinstance(node, str) and node.startswith("{") and node.endswith("}")):
        return []
    expr = node[1:-1]
    try:
        if evaluate(expr, env) is not None:
            return []
    except ExprError:
        pass
    names = sorted(n for n in names_in(expr) if env.get(n) is None)
    return names or [expr]


def correspond(
    fmt: Format,
    view: MtpView,
    layers: list[int] | None = None,
    *,
    with_embed: bool | None = None,
    with_head: bool | None = None,
) -> Correspondence:
    """Which draft tensor corresponds to which verifier tensor, for ``layers`` of ``view``."""
    res = view.resolved
    layers = list(range(res.mtp_count)) if layers is None else layers
    bad = [i for i in layers if not 0 <= i < res.mtp_count]
    if bad:
        raise UsageError(f"--layers {bad} out of range: {res.family} declares {res.mtp_count} MTP layer(s)")
    check_expressible(fmt, view, layers)
    present = {s.key for s in view.present}
    corr = Correspondence(fmt, view, layers)
    seen: set[str] = set()  # glue tensors shared by several layers are linked once
    for out_i, i in enumerate(layers):
        names = _NAMINGS[fmt.rename](fmt, res.layers[i], out_i, i)
        corr.tensors += _glue_links(names, present, seen, with_embed, with_head, res.table.mtp.concat_order)
        corr.tensors += [TensorLink(names.block(spec), spec.key, spec, False, spec.shape)
                         for spec in names.layer.block if spec.key in present]
        corr.experts += [_expert_link(names, view, g) for g in names.layer.experts]
    _shared_links(corr, with_embed, with_head)
    dupes = _duplicates(corr.draft_keys())
    if dupes:
        raise InputError(f"format {fmt.name} maps several tensors of {view.table.family} to {dupes[:5]}",
                         rule="format-collision")
    return corr


class _Naming:
    """How a format names one MTP layer of the draft; ``Format.rename`` picks the kind (``_NAMINGS``).

    Unless a kind says otherwise, the layer is renumbered from 0 under the format's ``layer_prefix``
    and its experts take the format's layout.
    """

    native = False  # keeps the family's own names: per-layer embed / head copies are kept by default

    def __init__(self, fmt: Format, layer: MtpLayer, out_i: int, i: int) -> None:
        self.fmt, self.layer = fmt, layer
        self.env = {"i": out_i}
        self.prefix = render(fmt.layer_prefix, self.env)

    def glue(self, role: str, spec: Spec) -> str | None:
        """The draft key of a glue tensor; None when the format's single fusion slot takes it (a half)."""
        raise NotImplementedError

    def block(self, spec: Spec) -> str:
        raise NotImplementedError

    def expert_prefix(self, g: ExpertGroup) -> str:
        raise NotImplementedError

    def experts(self, on_disk: ExpertGroup, g: ExpertGroup) -> ExpertGroup:
        """The draft's expert group for ``g``, stored on the verifier's disk as ``on_disk``."""
        layout = ExpertLayout.parse(self.fmt.expert_layout) if self.fmt.expert_layout else on_disk.layout
        return on_disk.with_layout(layout, prefix=self.expert_prefix(g))

    @staticmethod
    def shared_key(fmt: Format, role: str, spec: Spec, template: str | None, taken: list[str]) -> str | None:
        """Where --with-embed / --with-head put the shared tensor (None: already carried)."""
        if template is None or role in fmt.drop_roles:
            raise UsageError(f"format {fmt.name} cannot carry the {role}; drop --with-{role}")
        return _key(template, "", {"i": 0})


class _Reprefix(_Naming):
    """The family's names below its layer prefix, under the format's."""

    def _moved(self, key: str) -> str:
        return self.prefix + key[len(self.layer.prefix):]

    def glue(self, role: str, spec: Spec) -> str | None:
        return self._moved(spec.key)

    def block(self, spec: Spec) -> str:
        return self._moved(spec.key)

    def expert_prefix(self, g: ExpertGroup) -> str:
        return self._moved(g.prefix)


class _Native(_Naming):
    """The family's own names and layer indices (lossless)."""

    native = True

    def __init__(self, fmt: Format, layer: MtpLayer, out_i: int, i: int) -> None:
        self.fmt, self.layer = fmt, layer
        self.env = {"i": i}
        self.prefix = layer.prefix

    def glue(self, role: str, spec: Spec) -> str | None:
        return spec.key

    def block(self, spec: Spec) -> str:
        return spec.key

    def experts(self, on_disk: ExpertGroup, g: ExpertGroup) -> ExpertGroup:
        return on_disk

    @staticmethod
    def shared_key(fmt: Format, role: str, spec: Spec, template: str | None, taken: list[str]) -> str | None:
        return None if spec.key in taken else spec.key  # a tied head is the embedding, carried under its name


class _Roles(_Naming):
    """Names by canonical role: the format's glue templates, its block prefix and tag renames."""

    def __init__(self, fmt: Format, layer: MtpLayer, out_i: int, i: int) -> None:
        super().__init__(fmt, layer, out_i, i)
        self.block_out = self.prefix + fmt.block_prefix

    def glue(self, role: str, spec: Spec) -> str | None:
        fmt = self.fmt
        template = fmt.glue.get(role) or (fmt.embed if role == "embed" else fmt.head if role == "head" else None)
        if template is None and role in FUSION_HALVES["embed_first"] and "fusion" in fmt.glue:
            return None  # joined into the format's single fusion slot
        if template is None:
            raise InputError(f"format {fmt.name} has no place for the {role} tensor {spec.key}",
                             rule="format-unsupported")
        return _key(template, self.prefix, self.env)

    def block(self, spec: Spec) -> str:
        return self.block_out + self.fmt.tag_renames.get(spec.tag or "", spec.sub or "")

    def expert_prefix(self, g: ExpertGroup) -> str:
        return self.block_out + (self.fmt.expert_prefix or g.sub_prefix)


_NAMINGS: dict[str, type[_Naming]] = {"native": _Native, "reprefix": _Reprefix, "roles": _Roles}


def _glue_links(names: _Naming, present: set[str], seen: set[str], with_embed: bool | None,
                with_head: bool | None, family_order: str) -> list[TensorLink]:
    """The glue tensors of one layer, each once; two fusion halves joined when the format has one slot."""
    fmt = names.fmt
    links: list[TensorLink] = []
    halves: dict[str, Spec] = {}
    for role, spec in names.layer.glue.items():
        if spec.key in seen or spec.key not in present:
            continue
        seen.add(spec.key)
        if not _keep_copy(role, names.native, with_embed, with_head, set(fmt.drop_roles)):
            continue
        dkey = names.glue(role, spec)
        if dkey is None:
            halves[role] = spec
            continue
        swap = (role == "fusion" and fmt.concat_order is not None and fmt.concat_order != family_order)
        links.append(TensorLink(dkey, spec.key, spec, swap, spec.shape))
    if halves:
        links.append(_joined_fusion(fmt, halves, fmt.concat_order or family_order, names.prefix, names.env))
    return links


def _shared_links(corr: Correspondence, with_embed: bool | None, with_head: bool | None) -> None:
    """With --with-embed / --with-head and no per-layer copy, carry the shared tensor."""
    fmt, view = corr.fmt, corr.view
    naming = _NAMINGS[fmt.rename]
    for role, wanted, template in [("embed", with_embed, fmt.embed), ("head", with_head, fmt.head)]:
        if not wanted or any(t.spec.role == role for t in corr.tensors):
            continue
        spec = _shared_for(role, view)
        dkey = naming.shared_key(fmt, role, spec, template, [t.draft_key for t in corr.tensors])
        if dkey is not None:
            corr.tensors.append(TensorLink(dkey, spec.key, spec, False, spec.shape))


def _expert_link(names: _Naming, view: MtpView, g: ExpertGroup) -> ExpertLink:
    """An expert group of the layer: as stored on the verifier's disk, and as the draft holds it."""
    on_disk = g.with_layout(view.layouts[g.prefix]) if view.layouts[g.prefix] != g.layout else g
    return ExpertLink(names.experts(on_disk, g), on_disk)


def _joined_fusion(fmt: Format, halves: dict[str, Spec], order: str, prefix: str, env: dict) -> TensorLink:
    """One ``[H, 2H]`` fusion tensor from the family's two ``[H, H]`` halves, in ``order``."""
    roles = FUSION_HALVES[order]
    absent = [r for r in roles if r not in halves]
    if absent:
        have = ", ".join(s.key for s in halves.values())
        raise InputError(f"format {fmt.name} joins both fusion halves into one tensor, but {absent[0]} is "
                         f"missing (have {have})", rule="missing-tensor")
    parts = tuple(halves[r] for r in roles)
    rows = {s.shape[:-1] for s in parts}
    if len(rows) != 1:
        raise InputError(f"fusion halves {[s.key for s in parts]} differ in shape {[list(s.shape) for s in parts]}",
                         rule="shape-mismatch")
    shape = (*parts[0].shape[:-1], sum(s.shape[-1] for s in parts))
    first = parts[0]
    spec = Spec(_key(fmt.glue["fusion"], prefix, env), shape, "fusion", depth=first.depth, kind=first.kind,
                dtype=first.dtype, quant=first.quant)
    return TensorLink(spec.key, first.key, spec, False, shape, columns=parts)


def _keep_copy(role: str, native: bool, with_embed, with_head, drop: set[str]) -> bool:
    """Per-layer embed/head copies: kept by the native format (lossless), else only when asked."""
    if role in drop:
        return False
    if role == "embed":
        return with_embed if with_embed is not None else native
    if role == "head":
        return with_head if with_head is not None else native
    return True


def _shared_for(role: str, view: MtpView) -> Spec:
    spec = view.resolved.shared_source(role)
    if spec is None or spec.key not in view.ckpt.tensors:
        raise InputError(f"--with-{role}: the checkpoint has no shared {role} tensor to carry", rule="missing-tensor")
    return Spec(spec.key, spec.shape, role, kind=spec.kind, dtype=spec.dtype)


def _duplicates(keys: list[str]) -> list[str]:
    seen, dup = set(), []
    for k in keys:
        if k in seen:
            dup.append(k)
        seen.add(k)
    return dup


# ---------------------------------------------------------------------------
# Draft configs

_HUB_CACHE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def verifier_name_of(source: str) -> str:
    """How a draft config names its verifier: the Hub id for ``hf://org/name[@rev]`` and for a Hub
    cache snapshot (``.../models--org--name/snapshots/<sha>``), else the path exactly as given
    (never made absolute: the config may be pushed, and a user's directory is no one else's)."""
    text = str(source)
    if text.startswith("hf://"):
        return text[len("hf://"):].split("@", 1)[0].rstrip("/")
    m = _HUB_CACHE.search(text.replace("\\", "/"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return text


def _fill(value, env: dict, omitted: list[str], path: str):
    """Evaluate ``"{expr}"`` leaves of a config template; drop leaves whose inputs are unknown.

    A dict may start from ``$merge`` (a list of dicts or "{expr}"s giving dicts, later ones
    winning; an item whose inputs are unknown contributes nothing) and remove ``$drop`` keys
    (names, or "{expr}"s giving lists of names); its other keys are set on top.
    """
    if isinstance(value, dict) and ("$merge" in value or "$drop" in value):
        return _merged(value, env, omitted, path)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            filled = _fill(v, env, omitted, f"{path}.{k}" if path else k)
            if filled is not _OMIT:
                out[k] = filled
        return out
    if isinstance(value, list):
        return [x for x in (_fill(v, env, omitted, path) for v in value) if x is not _OMIT]
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value.count("{") == 1:
        try:
            result = evaluate(value[1:-1], env)
        except ExprError:
            omitted.append(path)
            return _OMIT
        if result is None:
            omitted.append(path)
            return _OMIT
        return copy.deepcopy(result)
    return value


_OMIT = object()


def _merged(value: dict, env: dict, omitted: list[str], path: str) -> dict:
    out: dict = {}
    for item in value.get("$merge") or []:
        part = _fill(item, env, [], path)  # optional contributions: nothing to report when absent
        if isinstance(part, dict):
            out.update(part)
        elif part is not _OMIT:
            raise TableError(f"{path}: $merge item {item!r} is not a mapping", path="format config")
    for item in value.get("$drop") or []:
        keys = _fill(item, env, [], path)  # a key, or "{expr}" giving a list of keys
        for k in (keys if isinstance(keys, list) else [] if keys is _OMIT else [keys]):
            out.pop(k, None)
    rest = {k: v for k, v in value.items() if k not in ("$merge", "$drop")}
    out.update(_fill(rest, env, omitted, path))
    return out


def template_env(fmt: Format, env: dict) -> dict:
    """``env`` plus the format's named tables, their "{expr}" leaves filled over ``env``."""
    return {**env, **{name: _fill(t, env, [], name) for name, t in fmt.tables.items()}}


def draft_config(fmt: Format, source: dict, env: dict) -> tuple[dict, list[str]]:
    """The draft's config.json and the template fields left out for lack of a value."""
    omitted: list[str] = []
    base = copy.deepcopy(source) if fmt.config.base == "source" else {}
    filled = _fill(fmt.config.set, template_env(fmt, env), omitted, "")
    _merge(base, filled)
    return base, omitted


def _merge(base: dict, updates: dict) -> None:
    """Set each key where it lives (text_config first for nested configs), else at the top."""
    tc = base.get("text_config") if isinstance(base.get("text_config"), dict) else None
    for k, v in updates.items():
        if tc is not None and k in tc and k not in base:
            tc[k] = v
        else:
            base[k] = v
