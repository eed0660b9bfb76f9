"""The schema of a quantization-scheme table (``mappings/quantization/*.yaml``), checked on load.

A table is data about one way of storing quantized linear layers and declaring them:

- ``declared_in``: how a checkpoint's configuration declares the scheme (which file, which section,
  which field values; per-group schemes such as compressed-tensors ``config_groups``; per-module
  schemes such as ModelOpt ``quantized_layers``), the numeric parameters read from it, and how it
  says which modules are quantized and which are not (targets, exclusion lists and the consumer's
  matcher for each, which is also the form an exclusion is written in);
- ``storage``: how one quantized linear is stored (tensor suffixes relative to the module,
  dtypes, packing, scale granularity, global scales, optional tensors) and which numeric
  decoder turns it back into values.

Expressions (``granularity``, ``when``) use ckpt_tools.model.expr over ``rows`` / ``cols`` (the
logical weight matrix [rows, cols], i.e. [out, in]) and the params of ``declared_in``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..tables.plain import SchemeParams

Scalar = str | int | float | bool | None
MATCHERS = ("compressed-tensors", "quark", "modelopt", "transformers", "exact")
CODES = ("fp8", "e4m3", "e5m2", "e2m1", "int")
ROLES = ("scale", "global_scale", "zero_point", "input_scale", "shape", "g_idx", "other")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamDef(_Strict):
    """A parameter read from the configuration: the first of ``keys`` found in the module entry, the
    group, then the section (dotted keys reach into nested objects), else ``default``."""

    keys: list[str] = Field(default_factory=list)
    default: Scalar | list[Scalar] = None
    # an explicit ``null`` under a key is the value (None), not an absent key: transformers reads
    # ``weight_block_size: null`` as per-tensor FP8, not as the default block
    null_is_value: bool = False


class ExcludeDef(_Strict):
    """A list field of the section naming modules that stay unquantized, read with ``matcher``."""

    field: str
    # compressed-tensors: exact name or ``re:`` regex (re.match), fused names decided by their shards (vLLM
    # requires every shard to agree); quark: the same rules (vLLM quark/utils.py); modelopt: fnmatch
    # globs; transformers: ``should_convert_module`` (a regex from the start up to a module boundary,
    # or a suffix); exact: the name itself (vLLM fp8 ``ignored_layers``)
    matcher: Literal["compressed-tensors", "quark", "modelopt", "transformers", "exact"]
    create: bool = False  # exclusion_entries adds this field when no exclude field exists yet
    # how one entry excludes a whole subtree (an MTP layer prefix), in this matcher's pattern language:
    # {name} the prefix as it is, {re} regex-escaped; None: the matcher has none (exact names only)
    subtree: str | None = None


class RefuseDef(_Strict):
    """Declared arguments the scheme's consumers refuse to load (e.g. compressed-tensors' removed activation
    orders): every module the group declares is refused under ``rule``, with ``reason``."""

    when: str  # expression over params
    rule: Literal["quant-zero-point", "quant-group-size", "quant-actorder"]
    reason: str  # what the consumers do, and what repairs it


class ConfigDef(_Strict):
    """One place where a configuration declares the scheme (a scheme may be declared in two files:
    ModelOpt writes config.json ``quantization_config`` and ``hf_quant_config.json``); every place
    present is read, and the consumers of each must agree."""

    file: Literal["config.json", "hf_quant_config.json"] = "config.json"
    section: str = "quantization_config"  # dotted key of the quantization section in that file
    match: dict[str, list[Scalar]]  # section field -> accepted values (strings compare case-insensitively)
    groups: str | None = None  # section field holding named per-group schemes (compressed-tensors config_groups)
    # group field -> accepted values; a field a group lacks is read from the section (CT `format`)
    group_match: dict[str, list[Scalar]] = Field(default_factory=dict)
    targets: str | None = None  # group field listing targets (CT `targets`); None: every linear module
    # section field mapping module name -> its own scheme (ModelOpt MIXED_PRECISION quantized_layers): a
    # module is quantized only when it has an entry
    per_module: str | None = None
    module_match: dict[str, list[Scalar]] = Field(default_factory=dict)  # fields of such an entry
    exclude: list[ExcludeDef] = Field(default_factory=list)
    params: dict[str, ParamDef] = Field(default_factory=dict)
    refuse: list[RefuseDef] = Field(default_factory=list)
    # the section field declaring KV-cache quantization (ModelOpt ``kv_cache_quant_algo`` / ``kv_cache_scheme``,
    # compressed-tensors ``kv_cache_scheme``): where a scheme is declared in two places, both must say the same
    # (rule quant-config-agree, quant/agree.py)
    kv_cache: str | None = None

    @model_validator(mode="after")
    def _levels(self):
        if (self.group_match or self.targets) and not self.groups:
            raise ValueError("group_match and targets need groups")
        if self.module_match and not self.per_module:
            raise ValueError("module_match needs per_module")
        if self.groups and self.per_module:
            raise ValueError("a scheme declares either groups or per_module entries, not both")
        if self.exclude and sum(e.create for e in self.exclude) != 1:
            raise ValueError("exactly one exclude field must be marked create: true")
        return self


class EvidenceDef(_Strict):
    """A tensor whose presence tells this scheme from another one its configuration looks like."""

    suffix: str
    dtypes: list[str]


class TensorDef(_Strict):
    suffix: str  # relative to the module: ``weight_packed`` is ``<module>.weight_packed``
    dtypes: list[str]
    role: Literal["scale", "global_scale", "zero_point", "input_scale", "shape", "g_idx", "other"] = "other"
    optional: bool = False
    # expression over params: whether the declared arguments give the module this tensor (None: always). False and
    # present: a tensor its consumers never read (a zero point under a symmetric scheme); true and absent: missing
    # (unless optional)
    when: str | None = None


class WeightDef(_Strict):
    suffix: str = "weight"
    dtypes: list[str]
    pack: int = 1  # codes per stored element along the last axis (2: two e2m1 per byte; 8: eight int4 per int32)

    @field_validator("pack")
    @classmethod
    def _pack(cls, v: int) -> int:
        if v not in (1, 2, 4, 8):
            raise ValueError("pack must be 1, 2, 4 or 8")
        return v


class ScaleDef(_Strict):
    """The scale of a quantized weight: one value per ``granularity`` tile of [out, in]."""

    tensor: str  # suffix of the scale tensor
    granularity: str  # expression giving [rows, cols] of one tile, e.g. "[1, group_size]", "block", "[rows, cols]"
    # float: the stored value (F32 / BF16 / F16 / F8_E4M3); e8m0: 2**(byte - 127), with byte 255 read as
    # NaN (OCP MX, DeepSeek) or as 2**128 = inf (compressed-tensors' mxfp4 decompression)
    encoding: Literal["float", "e8m0"] = "float"
    e8m0_top: Literal["nan", "inf"] = "nan"
    # a per-row scale (grid [rows, 1]) may also be stored as [rows] (ModelOpt per-channel); otherwise the shape
    # is exactly the grid (storage.scale_shapes)
    row_vector: bool = False
    # expression over params: when true, the tile's columns must divide the weight's columns (compressed-tensors'
    # group strategies refuse a partial last group); None: a partial edge tile is read as it is (block FP8)
    divides: str | None = None


class GlobalScaleDef(_Strict):
    tensor: str
    op: Literal["divide", "multiply"]  # effective scale = fl32(scale / g) (compressed-tensors) or fl32(scale * g)


class ZeroPointDef(_Strict):
    tensor: str
    packed: Literal["none", "rows"] = "none"  # rows: int32 words along the row axis (compressed-tensors pack)


class DecoderDef(_Strict):
    """How values come back: ``(code_value - zero_point) * effective_scale``, one float32 product,
    then one rounding to the output dtype."""

    # fp8: the weight dtype says (F8_E4M3 or F8_E5M2); another name: a code kind registered with
    # decode.register_codes (checked when the table loads, tables._check)
    codes: str
    bits: int = 8  # int codes: bits per code (4 or 8)
    offset: int = 0  # int codes: stored unsigned with this offset (compressed-tensors pack: 2**(bits-1))
    scale: ScaleDef
    global_scale: GlobalScaleDef | None = None
    zero_point: ZeroPointDef | None = None

    @model_validator(mode="after")
    def _bits(self):
        if self.codes == "int" and self.bits not in (4, 8):
            raise ValueError("int codes of 4 or 8 bits are supported")
        return self


class FormatDef(_Strict):
    """One way the scheme stores a quantized linear (a scheme may have several: FP8 and FP4 experts)."""

    name: str
    label: str  # how inspect / validate name it; may use {params}
    when: str | None = None  # expression over params: this format applies when true
    weight: WeightDef
    tensors: list[TensorDef] = Field(default_factory=list)
    decoder: DecoderDef
    encoder: str | None = None  # quant.codec.CODECS name: how float values are written in this format
    # which shards of an engine-fused layer (the family table's fused_modules) the producer gives one
    # per-tensor scale: all of them, routed experts' only, or none
    shared_scale: Literal["fused", "experts", "none"] = "none"

    @model_validator(mode="after")
    def _decoder_tensors(self):
        known = {t.suffix for t in self.tensors}
        d = self.decoder
        for what, suffix in (("scale", d.scale.tensor), ("global_scale", d.global_scale and d.global_scale.tensor),
                             ("zero_point", d.zero_point and d.zero_point.tensor)):
            if suffix and suffix not in known:
                raise ValueError(f"decoder.{what}.tensor {suffix!r} is not one of the format's tensors {sorted(known)}")
        return self


class UnservedDef(_Strict):
    """A serving engine that does not serve MTP layers stored in this scheme for some families: ``ckpt probe
    --mtp-quant`` lists the scheme with ``reason`` and never recommends it there."""

    engine: str  # the engine and version (and build) the limit was read or measured in
    families: list[str] | None = None  # the families it refuses; None: every family not in ``only``
    only: list[str] | None = None  # it serves the scheme for these families only
    experts: bool = False  # the limit holds only where the MTP layer holds routed experts
    reason: str


class SchemeTable(_Strict, SchemeParams):
    scheme: str
    title: str
    notes: str | None = None
    consumers: list[str] = Field(default_factory=list)  # the code whose behaviour the table describes
    declared_in: list[ConfigDef]
    evidence: list[EvidenceDef] = Field(default_factory=list)
    storage: list[FormatDef]
    # last name components of the KV-cache (and attention) scales its consumers load beside the linear layers
    # (vLLM maybe_remap_kv_scale_name: ``self_attn.k_proj.k_scale``, ``self_attn.k_scale``, ...): each value
    # must be finite and positive (rule kv-scale-value, quant/kv_scales.py)
    kv_cache_scales: list[str] = Field(default_factory=list)
    # serving engines that do not load MTP layers in this scheme for some families (UnservedDef)
    unserved: list[UnservedDef] = Field(default_factory=list)

    # ``params`` (SchemeParams): every parameter name its declarations read

    @field_validator("storage")
    @classmethod
    def _names(cls, v: list[FormatDef]) -> list[FormatDef]:
        names = [f.name for f in v]
        if not v or len(set(names)) != len(names):
            raise ValueError(f"storage needs at least one format, with distinct names (got {names})")
        return v
