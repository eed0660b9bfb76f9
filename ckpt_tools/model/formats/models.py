"""The schema of a draft format table (mappings/formats/), checked when a table file is loaded.

Runs read the checked tables as plain records (``tables/plain.py``), so only a load that checks a file imports
this module (and pydantic).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
