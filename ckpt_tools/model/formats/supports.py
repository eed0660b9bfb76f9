"""Whether a format can express a family's MTP layers, and the environment its checks and templates read."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from ...errors import InputError, TableError
from ..expr import ExprError, evaluate, names_in
from ..mtp import MtpView

if TYPE_CHECKING:
    from .table import Format


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
    with contextlib.suppress(ExprError):
        if evaluate(expr, env) is not None:
            return []
    names = sorted(n for n in names_in(expr) if env.get(n) is None)
    return names or [expr]
