"""Links: each draft tensor (or expert group) with the verifier tensor(s) it corresponds to.

Extract runs the links forward (verifier -> draft); stitch runs the same links backward, so every
link is invertible: a rename (inverse: the reverse lookup), an expert re-layout (the layout back), a
swap of the fusion projection's two input halves (its own inverse), or a column-wise join of a family's
two ``[H, H]`` fusion halves (``fusion_embed`` / ``fusion_hidden``) into a format's single ``[H, 2H]``
fusion slot (inverse: split at the halves' widths, ``TensorLink.columns``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import InputError, UsageError
from ..expert_layouts import ExpertGroup, ExpertLayout
from ..expr import render, render_key
from ..mtp import MtpView
from ..tables.resolve import MtpLayer, Spec
from .supports import check_expressible

if TYPE_CHECKING:
    from .table import Format


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
        return [t.draft_key for t in self.tensors] + [t.key for e in self.experts for t in e.draft.tensors()]


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
        return render_key(template, "", {"i": 0})


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
        return render_key(template, self.prefix, self.env)

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
    spec = Spec(render_key(fmt.glue["fusion"], prefix, env), shape, "fusion", depth=first.depth, kind=first.kind,
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
