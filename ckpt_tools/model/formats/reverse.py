"""A draft of any format read as its verifier's MTP layers, without the verifier (extract --format gguf from a
finetuned draft): the verifier's config given back by the format's own config template, run backwards, and the
draft's tensors renamed along the correspondence links (references only: no byte is read or copied), a trainer's
wrapper prefix stripped as stitch strips it.

The template runs backwards three ways: a format built on the source config (SGLang NextN) keeps it, but for the
fields it sets itself; one that embeds the source's text config (speculators' ``transformer_layer_config``)
gives that back; one that copies single config variables (AngelSpec's MTPConfig) gives those back, under the
family table's keys. What a draft does not record (its verifier's trunk layer count) comes from the caller (the
trunk GGUF's). A link that changes bytes (a half swap, a column join) has no rename: refused, naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import TYPE_CHECKING

from ...errors import InputError
from ...io.config import ConfigView
from ..expr import render_key
from ..mtp import MtpView
from ..prefixes import unwrap
from ..provenance import config_claims
from ..tables.loader import all_tables, detect_table, get_table
from ..tables.resolve import resolve
from .links import correspond
from .table import detect_format, wrappers_of

if TYPE_CHECKING:
    from ...io.checkpoint import Checkpoint
    from ..tables.schema import Table
    from .table import Format

RULE = "draft-transformed"
_VAR = re.compile(r"^\{(\w+)\}$")


def as_verifier(draft: Checkpoint, trunk_layers: int, arch: str | None = None) -> tuple[Checkpoint, str | None]:
    """``draft`` with its verifier's config and MTP tensor names, and its family (None: the config says it); a
    native draft (already so) as it is."""
    fmt = detect_format(draft.config.raw, draft.manifest, draft.tensors)
    if fmt.rename == "native":
        return draft, arch
    table, config = _verifier_config(fmt, draft, trunk_layers, arch or _family(fmt, draft))
    cv = ConfigView(config, f"{draft.root} ({fmt.name} config, read back)")
    count = fmt.max_layers or 1
    res = resolve(table, cv, mtp_count=count)
    layouts = {g.prefix: g.layout for g in res.experts()}
    view = MtpView(dataclasses.replace(draft, config=cv, tensors={}), res, layouts, present=res.mtp_specs(layouts))
    corr = correspond(fmt, view, list(range(count)))
    names: dict[str, str] = {}  # draft module prefix -> verifier module prefix (weights and their companions)
    for link in corr.tensors:
        if link.swap_halves or link.columns:
            raise InputError(f"{link.draft_key}: format {fmt.name} holds {link.verifier_key} transformed (halves "
                             "swapped or joined), which reading it back would have to undo", rule=RULE,
                             path=str(draft.root), key=link.draft_key)
        names[_module(link.draft_key)] = _module(link.verifier_key)
    for role, template in (("embed", fmt.embed), ("head", fmt.head)):  # a roles format's shared tensors
        spec = res.shared.get(role)
        if template and spec is not None and role not in fmt.drop_roles:
            names.setdefault(_module(render_key(template, "", {"i": 0})), _module(spec.key))
    for e in corr.experts:  # the draft's layout, under the verifier's prefix (read as the view finds it)
        back = e.verifier.with_layout(e.draft.layout)
        names.update(zip((_module(t.key) for t in e.draft.tensors()), (_module(t.key) for t in back.tensors()),
                         strict=True))
    known = {*corr.draft_keys(), *fmt.ignore_keys, *(t[1:] for t in (fmt.embed, fmt.head) if t and t[0] == "/")}
    draft = unwrap(draft, known, wrappers=wrappers_of(fmt)[0]).ckpt  # a trainer's wrapper prefix (module., ...)
    moved = {key: new for key in draft.tensors if (new := _moved(key, names)) is not None}  # others: never read
    tensors = {new: draft.tensors[key]._replace(key=new) for key, new in moved.items()}
    shard_keys = {shard: [moved[k] for k in keys if k in moved] for shard, keys in draft.shard_keys.items()}
    return dataclasses.replace(draft, config=cv, tensors=tensors, shard_keys=shard_keys, index=None), table.family


def _module(key: str) -> str:
    return key[: -len("weight")] if key.endswith("weight") else key


def _moved(key: str, names: dict[str, str]) -> str | None:
    return next((new + key[len(old):] for old, new in names.items()
                 if key == old or key.startswith(old) and old.endswith(".")), None)


def _family(fmt: Format, draft: Checkpoint) -> str | None:
    """The family the draft's manifest names, else the one table its config's evidence fields name."""
    family = (draft.manifest or {}).get("family")
    if isinstance(family, str) and family:
        return family
    names = {v for _, v in config_claims(draft.config.raw, fmt.evidence)}
    found = {t.family for t in all_tables().values() if t.kind == "mtp" and names & (
        set(t.detect.architectures) | set(t.detect.model_types) | set(t.engines.values()))}
    return found.pop() if len(found) == 1 else None


def _verifier_config(fmt: Format, draft: Checkpoint, trunk_layers: int, family: str | None) -> tuple[Table, dict]:
    if not draft.config_present:
        raise InputError(f"no config.json: a {fmt.name} draft's dimensions are in it (a trainer's step folder has "
                         "none; its exported model directory does)", rule="no-config", path=str(draft.root))
    raw = draft.config.raw
    set_ = fmt.config.set
    if fmt.config.base == "source":  # the source's config, but for the fields the format sets
        config = {k: copy.deepcopy(v) for k, v in raw.items() if k not in set_}
    else:
        embedded = [k for k, v in set_.items() if isinstance(v, dict) and "{text_config}" in (v.get("$merge") or [])]
        config = copy.deepcopy(raw[embedded[0]]) if embedded and isinstance(raw.get(embedded[0]), dict) else {}
    table = get_table(family) if family else detect_table(ConfigView(config)) if config else None
    if table is None:
        raise InputError(f"a {fmt.name} draft that does not name its verifier's family (no ckpt_manifest.json, no "
                         f"evidence field {fmt.evidence} naming one table): pass --arch NAME", rule="unknown-family",
                         path=str(draft.root))
    if not config:  # single variables copied by the template: each back under the family's first key
        for field, template in set_.items():
            m = _VAR.match(template) if isinstance(template, str) else None
            if m and m.group(1) in table.config and field in raw and raw[field] is not None:
                _put(config, table.config[m.group(1)].keys[0], raw[field])
    view = ConfigView(config)
    for var, value in ((table.trunk.count, trunk_layers), (table.mtp.count_field, fmt.max_layers or 1)):
        keys = table.config[var].keys if var in table.config else []
        if keys and not any(view.has(k) for k in keys):
            _put(config, keys[0], value)
    return table, config


def _put(config: dict, dotted: str, value) -> None:
    *outer, last = dotted.split(".")
    for part in outer:
        config = config.setdefault(part, {})
    config[last] = value
