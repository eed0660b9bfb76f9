"""Names and shapes of routed-expert tensors in every layout found in the wild.

A group of E experts, each with gate/up ``[I, H]`` and down ``[H, I]`` (``nn.Linear`` ``[out, in]``):

==================  ====================================================================  ==========
per-expert          ``P.{e}.gate_proj.weight`` ``[I,H]``, ``up_proj``, ``down_proj`` ``[H,I]``
fused               ``P.gate_up_proj`` ``[E,2I,H]``, ``P.down_proj`` ``[E,H,I]``           gate, up
stacked             ``P.gate_proj.weight`` ``[E,I,H]``, ``up``, ``down`` ``[E,H,I]``
stacked-transposed  ``P_gate_proj`` ``[E,H,I]``, ``P_up_proj``, ``P_down_proj`` ``[E,I,H]``
fused-transposed    ``P.gate_up_proj`` ``[E,H,2I]``, ``P.down_proj`` ``[E,I,H]``    blocked/interleaved
==================  ====================================================================  ==========

Non-gated groups (Nemotron-H) have no gate: fused layouts then hold ``P.up_proj``. Tables may override
the key templates of the layout a family ships.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from .expr import render

LAYOUT_NAMES = ("per-expert", "fused", "stacked", "stacked-transposed", "fused-transposed")
# one group holding the tensors of two layouts: engines and transformers load the names of one and ignore or
# refuse the other, fuse/unfuse cannot tell which is meant (validate, every gate and the converters: one rule)
MIXED_RULE = "expert-layouts-mixed"
MIXED_DESCRIPTION = "a routed-expert group holds the tensors of two layouts (per-expert and fused, ...)"

DEFAULT_KEYS: dict[str, dict[str, str]] = {
    "per-expert": {
        "gate": "{P}.{e}.gate_proj.weight",
        "up": "{P}.{e}.up_proj.weight",
        "down": "{P}.{e}.down_proj.weight",
    },
    "fused": {"gate_up": "{P}.gate_up_proj", "up": "{P}.up_proj", "down": "{P}.down_proj"},
    "stacked": {"gate": "{P}.gate_proj.weight", "up": "{P}.up_proj.weight", "down": "{P}.down_proj.weight"},
    "stacked-transposed": {"gate": "{P}_gate_proj", "up": "{P}_up_proj", "down": "{P}_down_proj"},
    "fused-transposed": {"gate_up": "{P}.gate_up_proj", "up": "{P}.up_proj", "down": "{P}.down_proj"},
}


@dataclass(frozen=True)
class ExpertLayout:
    name: str
    up_first: bool = False  # fused layouts: the up block comes first (some kernels)
    interleaved: bool = False  # fused-transposed: gate/up alternate along the last axis (gpt-oss)

    def __post_init__(self) -> None:
        if self.name not in LAYOUT_NAMES:
            raise ValueError(f"unknown expert layout {self.name!r}; known: {', '.join(LAYOUT_NAMES)}")
        if self.interleaved and self.name != "fused-transposed":
            raise ValueError("only fused-transposed supports interleaved gate/up")
        if self.up_first and self.name not in ("fused", "fused-transposed"):
            raise ValueError("up-first applies to fused layouts only")

    @property
    def transposed(self) -> bool:
        return self.name in ("stacked-transposed", "fused-transposed")

    @property
    def per_expert(self) -> bool:
        return self.name == "per-expert"

    @property
    def fused(self) -> bool:
        return self.name in ("fused", "fused-transposed")

    def label(self) -> str:
        opts = [o for o, on in (("up-first", self.up_first), ("interleaved", self.interleaved)) if on]
        return self.name + (f"({','.join(opts)})" if opts else "")

    @classmethod
    def parse(cls, text: str) -> ExpertLayout:
        """``fused``, ``fused-transposed:interleaved``, ``fused:up-first`` ..."""
        name, _, opts = text.partition(":")
        flags = {o.strip() for o in opts.split(",") if o.strip()}
        unknown = flags - {"up-first", "interleaved"}
        if unknown:
            raise ValueError(f"unknown layout option(s) {sorted(unknown)}")
        return cls(name.strip(), up_first="up-first" in flags, interleaved="interleaved" in flags)


@dataclass(frozen=True)
class ExpertGroup:
    """One MoE layer's routed experts, resolved against a config."""

    prefix: str  # full key prefix, e.g. ``model.layers.61.mlp.experts``
    count: int
    hidden: int
    inter: int
    gated: bool
    layout: ExpertLayout
    quant: bool = False
    names: tuple[tuple[str, str], ...] | None = None  # key templates overriding DEFAULT_KEYS[layout]
    depth: int | None = None
    sub_prefix: str = ""  # prefix relative to the block (for renaming into draft formats)

    def with_layout(self, layout: ExpertLayout, prefix: str | None = None) -> ExpertGroup:
        """The same experts in another layout (default key names) and optionally another prefix."""
        # a table's key templates hold for its own layout; same layout and same prefix = same keys
        keep_names = self.names if layout == self.layout and prefix in (None, self.prefix) else None
        return ExpertGroup(
            prefix if prefix is not None else self.prefix, self.count, self.hidden, self.inter, self.gated,
            layout, self.quant, keep_names, self.depth, self.sub_prefix,
        )

    def projections(self) -> tuple[str, ...]:
        return ("gate", "up", "down") if self.gated else ("up", "down")

    def _template(self, slot: str) -> str:
        templates = dict(self.names) if self.names else DEFAULT_KEYS[self.layout.name]
        return (templates.get(slot) or DEFAULT_KEYS[self.layout.name][slot]).replace("{P}", self.prefix)

    def key(self, slot: str, e: int | None = None) -> str:
        return render(self._template(slot), {"e": e if e is not None else 0})

    def tensors(self) -> list[ExpertTensor]:
        """Every tensor of this group in its layout, in a stable order."""
        return list(_group_tensors(self))

    def columns(self) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
        """The keys and the shapes of ``tensors()`` as two tuples (for C-level passes over a whole group)."""
        return _group_columns(self)

    def _slots(self) -> list[tuple[str, str, tuple[int, int], str | None, str]]:
        """Per projection of a per-expert layout: (slot, key template, shape, head, tail); head + str(e) + tail is
        the key when the template's only field is ``{e}`` (thousands of keys per layer: filled by concatenation)."""
        H, I = self.hidden, self.inter
        slots = []
        for p in self.projections():
            template = self._template(p)
            head, _, tail = template.partition("{e}")
            simple = template.count("{") == 1 and template != head
            slots.append((p, template, (H, I) if p == "down" else (I, H), head if simple else None, tail))
        return slots

    def _per_expert_keys(self) -> list[tuple[str, tuple[int, int], str, int]]:
        slots = self._slots()
        return [(head + str(e) + tail if head is not None else render(template, {"e": e}), shape, p, e)
                for e in range(self.count) for p, template, shape, head, tail in slots]

    def _tensors(self) -> list[ExpertTensor]:
        E, H, I = self.count, self.hidden, self.inter
        lay = self.layout
        out: list[ExpertTensor] = []
        if lay.per_expert:
            return [ExpertTensor(*row) for row in self._per_expert_keys()]
        t = lay.transposed
        if lay.fused:
            if self.gated:
                out.append(ExpertTensor(self.key("gate_up"), (E, H, 2 * I) if t else (E, 2 * I, H), "gate_up", None))
            else:
                out.append(ExpertTensor(self.key("up"), (E, H, I) if t else (E, I, H), "up", None))
        else:
            out += [ExpertTensor(self.key(p), (E, H, I) if t else (E, I, H), p, None) for p in self.projections()[:-1]]
        out.append(ExpertTensor(self.key("down"), (E, I, H) if t else (E, H, I), "down", None))
        return out


@lru_cache(maxsize=512)
def _group_tensors(group: ExpertGroup) -> tuple[ExpertTensor, ...]:
    """``group.tensors()``, made once per group (a release's trunk has 58 groups of 768, asked for several times
    while a checkpoint is classified and audited)."""
    return tuple(group._tensors())


@lru_cache(maxsize=512)
def _group_columns(group: ExpertGroup) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    rows = group._per_expert_keys() if group.layout.per_expert else _group_tensors(group)
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows)


def forget_group_tensors() -> None:
    """Drop the memoised tensors of every group (after a pass over a whole trunk: tens of thousands of keys)."""
    _group_tensors.cache_clear()
    _group_columns.cache_clear()


class ExpertTensor(NamedTuple):  # a tuple: built tens of thousands of times per checkpoint, cheaply
    key: str
    shape: tuple[int, ...]
    slot: str  # gate | up | down | gate_up
    expert: int | None  # per-expert tensors only


def scale_key(weight_key: str, suffix: str = "weight_scale_inv") -> str:
    """Companion scale name: ``x.weight`` -> ``x.weight_scale_inv``; bare names get ``_scale_inv``."""
    if weight_key.endswith(".weight"):
        return weight_key[: -len("weight")] + suffix
    return weight_key + "_" + suffix.removeprefix("weight_")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (128, 128)) -> tuple[int, ...]:
    """Block-scale grid for a weight: the last two dims divided by the block, rounded up."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


# (mapping, its size, its sorted keys) of the last mapping searched: planning visits one checkpoint at a time
_SORTED: list = [None, 0, []]


def keys_under(refs: Mapping[str, object], heads: tuple[str, ...]) -> list[str]:
    """Keys starting with any of ``heads``, by bisecting the mapping's sorted keys (sorted once per mapping)."""
    if _SORTED[0] is not refs or _SORTED[1] != len(refs):
        _SORTED[:] = [refs, len(refs), sorted(refs)]
    keys: list[str] = _SORTED[2]
    out: list[str] = []
    for head in heads:
        i = bisect.bisect_left(keys, head)
        while i < len(keys) and keys[i].startswith(head):
            out.append(keys[i])
            i += 1
    return out


def _layouts_of(group: ExpertGroup) -> tuple[dict[str, str], set[str]]:
    """(every tensor name of another layout of ``group`` -> that layout, the names of its own layout). A name both
    layouts use (fused and fused-transposed share theirs) is the group's own."""
    own = set(group.columns()[0])
    others: dict[str, str] = {}
    for name in LAYOUT_NAMES:
        if name != group.layout.name:
            for k in group.with_layout(ExpertLayout(name)).columns()[0]:
                if k not in own:
                    others.setdefault(k, name)
    return others, own


def other_layout_keys(group: ExpertGroup, keys: Iterable[str]) -> dict[str, str]:
    """Of ``keys``, those that are tensors of another layout of ``group`` than its own (a weight, or a companion
    named after it: ``..._scale_inv``, ``.weight_scale``), each with that layout's name (rule ``MIXED_RULE``)."""
    others, own = _layouts_of(group)
    out: dict[str, str] = {}
    for key in keys:
        base = key
        if base not in others and base not in own:  # a companion: the weight's name, "_", a suffix
            cuts = [i for i, ch in enumerate(key) if ch == "_"]
            base = next((key[:i] for i in reversed(cuts) if key[:i] in others or key[:i] in own), key)
        if base in others:
            out[key] = others[base]
    return out


def mixed_layout_keys(group: ExpertGroup, refs: Mapping[str, object]) -> dict[str, str]:
    """The tensors of ``refs`` that belong to another layout of ``group`` than its own (the layout on disk): key ->
    that layout's name. Each other layout's names are looked up (a few per group, or E x 3 per-expert ones), and
    the companions of those present: a release's 58 groups cost no pass over its 92,000 keys."""
    others, own = _layouts_of(group)
    out: dict[str, str] = {}
    for k, name in others.items():
        if k in refs:
            out[k] = name
            out.update((c, name) for c in keys_under(refs, (k + "_",)) if c not in own)
    return out


def mixed_layout_message(group: ExpertGroup, layout: str) -> str:
    return (f"a tensor of the {layout} layout of {group.prefix}, whose experts are stored {group.layout.label()}: "
            "a loader expects the names of one layout (the other's go unloaded, or are refused) and no conversion "
            "can tell which is meant; keep one layout's tensors")
