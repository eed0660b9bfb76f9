"""GGUF tensor names for a family's tensors, from the ``gguf`` package's tensor map and the table's ``llama_cpp``
section: never typed here. Each tensor is first given the name llama.cpp's converter gives it before its map
(the MTP glue under the trunk's layer prefix at block ``trunk layers + depth``, as its converters remap every
family's MTP), then looked up in ``get_tensor_name_map(tensor_arch, block_count)``, widened by the kinds the
table says the package lacks, and by the names it gives for the kinds the package cannot name at all.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from ..errors import TableError

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # the sidecar's output types (extract --format gguf --gguf-type)
# ``ckpt probe --mtp-quant`` names a sidecar type gguf-TYPE; no scheme table may take the prefix (quant.tables)
GGUF_ROW = "gguf-"

# the converter's names for the MTP glue roles (llama.cpp conversion/qwen.py's remapper and glm.py / deepseek.py
# keys); llama.cpp's tensor map knows them under the layer prefix
GLUE_NAMES = {
    "embed_norm": "enorm.weight",
    "hidden_norm": "hnorm.weight",
    "fusion": "eh_proj.weight",
    "final_norm": "shared_head.norm.weight",
    "embed": "embed_tokens.weight",
    "head": "shared_head.head.weight",
}
# renames every llama.cpp converter applies before its map (conversion/base.py TextModel.filter_tensors)
CONVERTER_RENAMES = (("e_score_correction_bias", "e_score_correction.bias"), ("language_model.", ""))
SUFFIXES = (".weight", ".bias")  # the converter's map_tensor_name suffixes
# kinds llama.cpp's converter stores F32 whatever the output type (conversion/base.py prepare_tensors), besides
# every tensor of one dimension, every name ending in _norm.weight and every name not ending in .weight
F32_KINDS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D", "SHORTCONV_CONV",
             "INDEXER_PROJ", "SSM_CONV1D_Q", "SSM_CONV1D_K", "SSM_CONV1D_V")


class TensorNames:
    """HF-style name -> (MODEL_TENSOR kind name, GGUF name) for one family at ``block_count`` blocks."""

    def __init__(self, lc: Any, block_count: int, family: str) -> None:
        self.lc, self.block_count, self.family = lc, block_count, family

    @cached_property
    def _map(self) -> dict[str, tuple[Any, str]]:
        import gguf

        arch = getattr(gguf.MODEL_ARCH, self.lc.tensor_arch, None)
        if arch is None:
            raise TableError(f"{self.family}: llama_cpp.tensor_arch {self.lc.tensor_arch!r} is no gguf.MODEL_ARCH "
                             f"member (gguf {gguf.__version__ if hasattr(gguf, '__version__') else ''})",
                             rule="gguf-table")
        # a fresh copy of the block templates: TensorNameMap updates its class-level dict per architecture
        saved = dict(gguf.TensorNameMap.block_mappings_cfg)
        try:
            mapping = dict(gguf.get_tensor_name_map(arch, self.block_count).mapping)
        finally:
            gguf.TensorNameMap.block_mappings_cfg = saved
        for kind_name in self.lc.package_lacks:
            kind = getattr(gguf.MODEL_TENSOR, kind_name, None)
            if kind is None:
                raise TableError(f"{self.family}: llama_cpp.package_lacks {kind_name!r} is no gguf.MODEL_TENSOR member",
                                 rule="gguf-table")
            templates = saved.get(kind) or gguf.TensorNameMap.mappings_cfg.get(kind, ())
            for bid in range(self.block_count):
                name = gguf.TENSOR_NAMES[kind].format(bid=bid)
                for t in templates:
                    mapping.setdefault(t.format(bid=bid), (kind, name))
        for kind_name, (gguf_name, *templates) in self.lc.names.items():  # what the package cannot name at all
            for bid in range(self.block_count):
                for t in templates:
                    mapping[t.format(bid=bid)] = (kind_name, gguf_name.format(bid=bid))
        # a name in GGUF form is its own (a converter that formats a kind's name itself: format_tensor_name)
        for kind, name in list(mapping.values()):
            mapping.setdefault(name, (kind, name))
        mapping.update(self._converter_map(gguf))
        return mapping

    def _converter_map(self, gguf: Any) -> dict[str, tuple[str, str]]:
        """The table's ``tensor_map`` (a converter's own map of source names to kinds), whole names with their
        suffix: the source's, else ``.weight`` (the converter's format_tensor_name default)."""
        out = {}
        for template, kind_name in self.lc.tensor_map.items():
            kind = getattr(gguf.MODEL_TENSOR, kind_name, None)
            if (kind is None) == (kind_name not in self.lc.names):
                raise TableError(f"{self.family}: llama_cpp.tensor_map kind {kind_name!r} must be a gguf.MODEL_TENSOR "
                                 "member or in names (the package lacks it), not both or neither",
                                 rule="gguf-table")
            gname = gguf.TENSOR_NAMES[kind] if kind is not None else self.lc.names[kind_name][0]
            suffix = next((s for s in SUFFIXES if template.endswith(s)), ".weight")
            for bid in range(self.block_count) if "{bid}" in template else (0,):
                name = gname.format(bid=bid)
                out[template.format(bid=bid)] = (kind_name, name + suffix)
                out.setdefault(name, (kind_name, name))  # the GGUF name is its own, as the package's are
        return out

    def lookup(self, name: str) -> tuple[str, str] | None:
        """(kind name, GGUF name with suffix) for an HF-style name, or None."""
        for old, new in CONVERTER_RENAMES:
            name = name.replace(old, new)
        hit = self._map.get(name)
        if hit is not None:
            return getattr(hit[0], "name", hit[0]), hit[1]
        for suffix in SUFFIXES:
            if name.endswith(suffix):
                hit = self._map.get(name[: -len(suffix)])
                if hit is not None:
                    return getattr(hit[0], "name", hit[0]), hit[1] + suffix
        return None


def folded(fold: list[dict[str, str]], sub: str, base: str, bid: int) -> str:
    """The name llama.cpp's converter gives block-relative ``sub`` in MTP block ``bid`` (``base``: its prefix):
    renamed by a ``llama_cpp.fold`` entry (with ``{l}``: the whole name), else ``base + sub``."""
    from .expr import render

    name = next((f[sub] for f in fold if sub in f), sub)
    return render(name, {"l": bid}) if "{" in name else base + name


def glue_name(lc: Any, role: str, base: str, bid: int) -> str:
    """The name llama.cpp's converter gives an MTP glue tensor of block ``bid`` before its map: the table's
    ``llama_cpp.glue`` name for the role (with ``{l}``: the whole name), else GLUE_NAMES' under ``base``."""
    return folded([lc.glue], role, base, bid) if role in lc.glue else base + GLUE_NAMES[role]


def keeps_f32(kind: str, gguf_name: str, ndim: int, extra: list[str], dropped: list[str] = ()) -> bool:
    """Whether llama.cpp's converter stores this tensor F32 whatever the output type (``extra``: further kinds,
    ``dropped``: kinds of F32_KINDS it does not for the family's MTP block)."""
    return (ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")
            or (kind in F32_KINDS and kind not in dropped) or kind in extra)
