"""Draft format tables (mappings/formats/): the model, loading, and recognising a draft's format.

A format maps canonical MTP roles to names; ``links`` resolves it against a verifier's MTP view,
``supports`` says whether it can express a family at all, ``templates`` fills its config.json.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import TableError, UsageError
from ..prefixes import WRAPPERS, peel
from ..tables import cache as table_cache
from ..tables.loader import _parse, mappings_dir


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
