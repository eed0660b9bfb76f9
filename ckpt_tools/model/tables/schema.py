"""The schema every architecture table must satisfy (validated on load).

A table is data: where a family keeps its MTP layers, what each tensor is, how
experts are laid out, which norm convention and quantization apply. Key and shape
fields are expressions over the table's declared config variables (see expr.py).
"""

# No `from __future__ import annotations` here: with it pydantic compiles and evaluates every field's
# annotation from its text when the module loads, a tenth of this module's start-up cost.
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .plain import VarKind
from .roles import GLUE_ROLES

TENSOR_KINDS = ("linear", "norm", "bias", "embedding", "router", "other")
EXPERT_LAYOUTS = ("per-expert", "fused", "stacked", "stacked-transposed", "fused-transposed")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


VAR_TYPES = ("count", "int", "number", "bool", "str", "list", "seq", "any")


class VarDef(_Strict, VarKind):
    """Where a config variable comes from: the first of ``keys`` present wins.

    Dotted keys reach into nested objects (``mtp_config.num_nextn_predict_layers``);
    every key is looked up in ``text_config`` first, then at the top level.

    ``type`` is what the config value must be before any expression sees it: ``count`` (a
    non-negative integer: every dimension and count), ``int``, ``number`` (finite), ``bool``, ``str``,
    ``list`` (of scalars), ``seq`` (a string or such a list) or ``any``. When a table leaves it
    out, the default's type decides (``false`` -> bool, ``0`` -> count, ``[]`` -> list, ...), and
    a variable without a default is a count.
    """

    keys: list[str]
    default: int | float | bool | str | list | None = None
    required: bool = True
    type: Literal["count", "int", "number", "bool", "str", "list", "seq", "any"] | None = None
    # ``kind`` (VarKind): ``type``, else the default's type


class TensorDef(_Strict):
    key: str
    shape: list[int | str]
    kind: Literal["linear", "norm", "bias", "embedding", "router", "other"] = "linear"
    dtype: str | None = None  # stored dtype when it differs from the model's (e.g. F32 router bias)
    quant: bool = False  # block-quantized (FP8) in quantized releases
    optional: bool = False  # some releases ship it, some do not
    when: str | None = None  # condition over config variables
    tag: str | None = None  # canonical sub-role used by draft formats (router, shared_up_proj, ...)
    copy_of: str | None = None  # per-layer copy of a shared tensor (embed / head)
    init: Literal["normal", "zeros", "ones", "copy"] | None = None
    # the release stores this tensor in ``dtype`` whatever the model dtype, and checkpoints must too:
    # ``validate`` and the gate check it (rule ``stored-dtype``, model/stored_dtype.py) and ``extract
    # --dtype`` does not cast it. Only where a public release listing fixes it (say which in a comment).
    dtype_fixed: bool = False

    @model_validator(mode="after")
    def _fixed_needs_dtype(self):
        if self.dtype_fixed and self.dtype is None:
            raise ValueError(f"tensor {self.key}: dtype_fixed needs a dtype")
        return self


class ExpertsDef(_Strict):
    prefix: str  # key prefix of the expert group, e.g. ``mlp.experts``
    count: str | int
    hidden: str | int
    inter: str | int
    layout: Literal["per-expert", "fused", "stacked", "stacked-transposed", "fused-transposed"] = "per-expert"
    gated: bool = True
    interleaved: bool = False  # fused-transposed only: gate/up columns alternate (gpt-oss)
    up_first: bool = False  # fused layouts: up block before gate block
    names: dict[str, str] | None = None  # layout-specific key templates overriding the defaults
    quant: bool = False
    when: str | None = None


class PartItem(_Strict):
    """One entry of a block part: a tensor, or a group of routed experts."""

    tensor: TensorDef | None = None
    experts: ExpertsDef | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.tensor is None) == (self.experts is None):
            raise ValueError("a part item is either a tensor or an experts group")
        return self


class PartRef(_Strict):
    part: str
    when: str | None = None


class BlockDef(_Strict):
    """A decoder block (or one sub-block of an MTP step) built from named parts.

    ``repeat`` (an expression giving a string or a list, e.g. a hybrid pattern such as
    ``"*E"``) instantiates the block once per element, in order: the prefix, the parts'
    ``when`` conditions and the tensors may then use ``j`` (the element's position) and
    ``item`` (the element itself), e.g. ``when: "item == 'E'"``.
    """

    prefix: str = ""  # relative to the MTP layer prefix; a leading '/' makes it absolute
    parts: list[PartRef]
    repeat: str | None = None

    @field_validator("parts", mode="before")
    @classmethod
    def _strings(cls, v):
        return [{"part": p} if isinstance(p, str) else p for p in v]


class TrunkDef(_Strict):
    prefix: str  # template with {l}
    count: str
    parts: list[PartRef]

    @field_validator("parts", mode="before")
    @classmethod
    def _strings(cls, v):
        return [{"part": p} if isinstance(p, str) else p for p in v]


class MtpDef(_Strict):
    count: str  # expression giving the number of MTP layers (depths)
    prefix: str  # template with {i}: where MTP layer i lives
    concat_order: Literal["embed_first", "hidden_first"] = "embed_first"
    glue: dict[str, TensorDef]  # role -> tensor; keys relative to prefix, '/' = from the root
    blocks: list[BlockDef]
    layer_vars: dict[str, str] = Field(default_factory=dict)  # extra per-depth variables (exprs over i)
    count_field: str | None = None  # config variable to patch when MTP is dropped or added

    @field_validator("glue")
    @classmethod
    def _roles(cls, v):
        bad = sorted(set(v) - set(GLUE_ROLES))
        if bad:
            raise ValueError(f"unknown glue role(s) {bad}; known: {list(GLUE_ROLES)}")
        return v


VLLM_CHECKS = ("served", "loaded", "names")


class VllmVariant(_Strict):
    """Another draft class vLLM picks for the family's MTP layers, and when (e.g. a multimodal variant of the
    same checkpoint layout): ``validate --engine vllm`` accepts it where the config says so."""

    architecture: str  # registry key, as vllm.architecture
    cls: str = Field(alias="class")  # registry module and class
    when: str  # what in config.json makes vLLM pick it

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class VllmDef(_Strict):
    """How vLLM serves the family's MTP layers, and how far a test checked it (tests/test_vllm_tables.py).

    ``check``: ``served`` (a tiny checkpoint serves with speculative decoding on vLLM's CPU build),
    ``loaded`` (its MTP class's ``load_weights`` takes every MTP tensor and leaves no parameter unloaded),
    ``names`` (only the key names were read from vLLM's loader: say why in ``note``).
    """

    architecture: str  # the draft architecture vLLM's speculative config picks (registry key)
    cls: str = Field(alias="class")  # registry module and class, e.g. glm4_moe_mtp.Glm4MoeMTP
    check: Literal["served", "loaded", "names"]
    depths: int | None = None  # MTP depths vLLM builds when fewer than the checkpoint has
    device: Literal["cpu", "meta"] = "cpu"  # where the load check builds the class
    dtype: Literal["float32", "bfloat16"] = "float32"  # the dtype the CPU layers accept
    # CPU stand-ins the load check installs (named in ckpt_tools/ops/check/vllm_cpu.py), for layers whose
    # construction needs a GPU kernel although loading does not
    stubs: list[Literal["cuda_stream", "sparse_attention", "moe_kernel", "cuda_imports", "flash_varlen"]] = Field(
        default_factory=list)
    fixture: dict = Field(default_factory=dict)  # config overrides for sizes / fields vLLM's classes need
    # what vLLM's loader skips on purpose (say why in the note and the header): glue roles, or block tensor keys
    # relative to the block (e.g. attention.g_proj.weight)
    unread: list[str] = Field(default_factory=list)
    note: str | None = None  # why the check stops where it does; disagreements with vLLM
    variants: list[VllmVariant] = Field(default_factory=list)  # other draft classes vLLM picks for the layout

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _names_say_why(self):
        if self.check == "names" and not self.note:
            raise ValueError("vllm.check: names needs a note saying why the loader does not run")
        bad = sorted(u for u in self.unread if u not in GLUE_ROLES and "." not in u)
        if bad:
            raise ValueError(f"vllm.unread: {bad} is neither a glue role ({list(GLUE_ROLES)}) nor a tensor key")
        return self


LLAMA_CPP_CHECKS = ("served", "converter", "names")
LLAMA_CPP_COMPARE = {"hidden": "embedding_length", "heads": "attention.head_count", "experts": "expert_count"}


class LlamaCppSplitDef(_Strict):
    """One tensor llama.cpp's graph wants split in two along its rows, per head (MLA's ``kv_b_proj`` into
    ``k_b_proj`` / ``v_b_proj``): rows ``[heads, first + second, cols]``; the first part is transposed per head
    when ``transpose_first`` (``attn_k_b`` is ``[heads, cols, first]``), as llama.cpp's converter does."""

    key: str  # block-relative key of the source tensor, e.g. self_attn.kv_b_proj.weight
    heads: str | None = None  # expressions over the table's config variables; no heads: two 2-D row ranges
    first: str
    second: str
    into: list[str]  # the two block-relative names the tensor map knows, e.g. [self_attn.k_b_proj.weight, ...]
    transpose_first: bool = True

    @field_validator("into")
    @classmethod
    def _two(cls, v):
        if len(v) != 2 or v[0] == v[1]:
            raise ValueError("llama_cpp.split.into needs two distinct names")
        return v

    @model_validator(mode="after")
    def _rows_are_not_transposed(self):
        if self.heads is None and self.transpose_first:
            raise ValueError("llama_cpp.split without heads (two row ranges) takes transpose_first: false")
        return self


class LlamaCppJoinDef(_Strict):
    """Tensors of one MTP block that llama.cpp's graph wants as one, their rows end to end in the order of ``keys``
    (q / k / v where the family's MTP graph takes only a fused attn_qkv). A block holding none of them (already
    fused) is left alone."""

    keys: list[str] = Field(min_length=2)  # block-relative keys, e.g. self_attn.q_proj.weight
    into: str  # the block-relative name the tensor map knows for the whole, e.g. self_attn.qkv_proj.weight
    # columns: each row the parts' rows side by side (Qwen4-Exp's eh_proj = [fc_embedding | fc_hidden])
    axis: Literal["rows", "columns"] = "rows"


class LlamaCppPermuteDef(_Strict):
    """A q / k projection whose rows llama.cpp's converter reorders for its rotary layout (LlamaModel.permute)."""

    key: str  # block-relative key of the tensor, e.g. mixer.q_proj.weight
    heads: str  # the heads its rows are grouped in (an expression over the table's config variables)


class LlamaCppDef(_Strict):
    """How llama.cpp (build b11434) drafts with the family's MTP layers, and what its GGUF holds.

    Routed experts are always stacked (one ``[experts, out, in]`` tensor per projection), as every llama.cpp
    converter with MTP stacks them. Tensor names are never typed here: they come from the ``gguf`` package's
    tensor map of ``tensor_arch`` (``get_tensor_name_map``). What the package (0.19.0, older than b11434) lacks
    is said as data: an ``arch`` string it has no ``MODEL_ARCH`` for, and ``package_lacks``, the
    ``MODEL_TENSOR`` kinds llama.cpp b11434 has for the architecture that the package's list for
    ``tensor_arch`` does not (the NextN kinds), and ``names``, the kinds it cannot name at all (typed as
    llama.cpp b11434's gguf-py has them, held by its converter's output). ``check``: ``served`` (llama.cpp
    drafted with our sidecar in a test), ``converter`` (every tensor and key equal llama.cpp's converter --mtp
    output, tests/test_gguf_converter.py), ``names`` (names and kinds checked against llama.cpp b11434's
    gguf-py, tests/test_gguf_tables.py: say why no more in ``note``).
    """

    arch: str  # general.architecture llama.cpp b11434 reads, e.g. glm4moe, deepseek2
    tensor_arch: str  # the gguf package's MODEL_ARCH member whose tensor map names our tensors
    package_lacks: list[str] = Field(default_factory=list)  # MODEL_TENSOR member names
    # kinds the package cannot name for tensor_arch at all (no member, or not the converter's names): MODEL_TENSOR
    # name -> [its GGUF name, the converter's names before its map], with {bid}, as llama.cpp b11434's gguf-py has them
    # (just [its GGUF name] where tensor_map gives the source names)
    names: dict[str, list[str]] = Field(default_factory=dict)
    requires: list[str] = Field(default_factory=list)  # config variables llama.cpp's graph cannot do without
    check: Literal["served", "converter", "names"]
    split: list[LlamaCppSplitDef] = Field(default_factory=list)
    join: list[LlamaCppJoinDef] = Field(default_factory=list)
    permute: list[LlamaCppPermuteDef] = Field(default_factory=list)
    # the converter adds this to every norm weight of the MTP layer (zero-centred norms stored as w - 1)
    norm_offset: float = 0.0
    f32: list[str] = Field(default_factory=list)  # further MODEL_TENSOR kinds the family's converter keeps F32
    # kinds it keeps F32 elsewhere but not in the family's MTP block (Nemotron-H: its F32 check matches the source's
    # layer number, mtp.layers.1, against the block's name, and misses)
    not_f32: list[str] = Field(default_factory=list)
    # ``{arch}.<key>`` arrays of one value per trunk layer that the converter extends with this value (a string:
    # an expression over the config variables) for each MTP layer (e.g. attention.recurrent_layers: false, an MTP
    # block attends); others are copied as they are
    extend: dict[str, bool | int | float | str] = Field(default_factory=dict)
    # an MTP step of several sub-blocks folded into the one llama.cpp block the converter writes: per sub-block,
    # block-relative key -> the name the converter gives it there, block-relative or, with ``{l}`` (the block), whole
    # (Nemotron-H: the MoE sub-layer's norm.weight is model.layers.{l}.post_attention_layernorm.weight); without it
    # a step of more than one sub-block is refused
    fold: list[dict[str, str]] = Field(default_factory=list)
    # glue role -> the name the converter gives it before its map, where not the usual one (gguf_names.GLUE_NAMES
    # under the trunk's layer prefix): block-relative, or with ``{l}`` (the block) whole
    glue: dict[str, str] = Field(default_factory=dict)
    # SRC config variable -> the trunk's ``{arch}.<key>`` it must equal (checked before anything is written)
    # (the defaults apply where the table declares the variable: a dense family has no ``experts``)
    compare: dict[str, str] = Field(default_factory=lambda: dict(LLAMA_CPP_COMPARE))
    # a converter that names tensors with its own map, not the package's TensorNameMap (DeepSeek-V4's): its source
    # name templates ({bid}: the block) -> MODEL_TENSOR kind; the GGUF name is the kind's, with the source's suffix
    tensor_map: dict[str, str] = Field(default_factory=dict)
    # a converter that types tensors itself, whatever --outtype says (DeepSeek-V4's tensor_force_quant): a matrix's
    # GGUF type by its kind, else by its source's storage (a dtype, or a scheme table's storage name: fp8-block);
    # and the general.file_type it writes
    types: dict[str, Literal["f32", "f16", "bf16", "q8_0", "mxfp4"]] = Field(default_factory=dict)
    file_type: str | None = None  # a gguf.LlamaFileType member name
    note: str | None = None

    @model_validator(mode="after")
    def _names_say_why(self):
        if self.check == "names" and not self.note:
            raise ValueError("llama_cpp.check: names needs a note saying why nothing ran")
        return self


class DetectDef(_Strict):
    architectures: list[str] = Field(default_factory=list)
    model_types: list[str] = Field(default_factory=list)


class Table(_Strict):
    family: str
    title: str
    kind: Literal["mtp", "template"] = "mtp"  # template: a family without native MTP (init-draft only)
    notes: str | None = None
    detect: DetectDef
    config: dict[str, VarDef]
    norm: Literal["plain", "zero_centred"] = "plain"
    dtype: str = "BF16"  # default stored dtype when the config names none
    # a quantization scheme name (mappings/quantization/<name>.yaml) whose block format fixtures and the
    # demo write where there is no checkpoint to ask; a checkpoint's own companions come from the scheme
    # it declares or stores (ckpt_tools.model.quant.codec)
    quantization: str | None = None
    # Draft architectures the serving engines use for this family, e.g.
    # {sglang_nextn: <Arch>ForCausalLMNextN, vllm_mtp: <Arch>MTPModel}
    engines: dict[str, str] = Field(default_factory=dict)
    # Layers the serving engines build from several checkpoint modules (vLLM packed_modules_mapping /
    # SGLang stacked_params_mapping): fused name -> the module names it packs, e.g. {qkv_proj: [q_proj,
    # k_proj, v_proj]}. Quantization exclusions must name both spellings (ckpt_tools.model.quant.audit).
    fused_modules: dict[str, list[str]] = Field(default_factory=dict)
    vllm: VllmDef | None = None  # vLLM's MTP class for the family and the level it was checked at
    llama_cpp: LlamaCppDef | None = None  # llama.cpp's architecture for the family (GGUF sidecars)
    demo: bool = False  # the family `ckpt demo` builds when --family is not given
    shared: dict[str, TensorDef] = Field(default_factory=dict)  # embed, final norm, head, ...
    parts: dict[str, list[PartItem]]
    trunk: TrunkDef
    mtp: MtpDef
    # A tiny but structurally faithful config.json for this family, used by the fixture
    # generator (ckpt_tools.testing) and the demo. Real key names, tiny dimensions.
    fixture: dict = Field(default_factory=dict)

    @field_validator("config", mode="before")
    @classmethod
    def _vars(cls, v):
        out = {}
        for name, d in (v or {}).items():
            if isinstance(d, str):
                d = {"keys": [d]}
            elif isinstance(d, list):
                d = {"keys": d}
            out[name] = d
        return out

    @model_validator(mode="after")
    def _vllm_engine(self):
        named = self.engines.get("vllm_mtp")
        if self.vllm is not None and named is not None and named != self.vllm.architecture:
            raise ValueError(f"engines.vllm_mtp {named!r} and vllm.architecture {self.vllm.architecture!r} differ")
        return self

    @field_validator("fused_modules")
    @classmethod
    def _fused(cls, v):
        for name, shards in v.items():
            if len(shards) < 2 or len(set(shards)) != len(shards) or name in shards:
                raise ValueError(f"fused module {name!r} needs two or more distinct shard names, not itself")
        return v

    @field_validator("parts", mode="before")
    @classmethod
    def _items(cls, v):
        out = {}
        for name, items in (v or {}).items():
            conv = []
            for it in items:
                if isinstance(it, dict) and "experts" in it:
                    conv.append({"experts": it["experts"]})
                elif isinstance(it, dict) and "tensor" not in it:
                    conv.append({"tensor": it})
                else:
                    conv.append(it)
            out[name] = conv
        return out
