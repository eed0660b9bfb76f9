"""A table-driven MTP step around the family's own transformers decoder layer.

One MTP depth, as the family table describes it (``mtp`` section) and the serving engines run it::

    e = embed(token)                      the trunk's embedding, or the layer's own
    x = fusion(cat(enorm(e), hnorm(h)))   ``concat_order``: embed_first, or hidden_first
    x = block_1(x) ... block_n(x)         the family's decoder-layer class built from transformers' MTP
                                          config (else a copy of the trunk layer), loaded through the
                                          main model's own conversions
    x = final_norm(x)                     when the table names one
    logits = head(x)                      the trunk's head, or the layer's own

The norms are copies of the trunk's final norm (its ``norm`` convention checked). Nothing here names a
family: a block that cannot be built, or a glue role with no place here, is refused (``probe-family``).
The object offers what transformers' ``MtpModel`` offers ``probe.chain_logits``, so both are measured alike.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import InputError
from ...io.checkpoint import Checkpoint
from ...model.mtp import open_mtp
from ...model.tables.resolve import MtpLayer, Resolved, Spec, trunk_prefixes, trunk_specs
from ...stream.plan import OutputTensor
from .checks import load_problems, refuse, sequential_load, unquantized_config
from .state import RULE, Lazy, float_state, materialize

FAMILY_RULE = "probe-family"
GLUE_ROLES = ("embed_norm", "hidden_norm", "fusion", "final_norm", "embed", "head")  # what a step has a place for


@dataclass
class TrunkMatch:
    """The trunk decoder layer an MTP sub-block stands in for while it loads, and whose rotary inputs it takes: its
    index and checkpoint key prefix; ``layer_type``: the sub-block's own (its mask), when the MTP config gives one."""

    index: int
    prefix: str
    layer_type: str | None = None


def block_signature(specs: list[Spec], groups, prefix: str) -> tuple[frozenset[str], frozenset[str]]:
    """What a decoder layer is made of, by name relative to its prefix: its tensors and its expert groups."""
    return (frozenset(s.key[len(prefix):] for s in specs),
            frozenset(g.prefix[len(prefix):] for g in groups))


def trunk_layers(res: Resolved) -> list[tuple[TrunkMatch, tuple[frozenset[str], frozenset[str]]]]:
    """Every trunk decoder layer of the table: (index and prefix, signature)."""
    specs, groups = trunk_specs(res)
    parts: dict[str, tuple[list[Spec], list]] = {}
    for s in specs:
        parts.setdefault(s.key[: len(s.key) - len(s.sub or "")], ([], []))[0].append(s)
    for g in groups:
        parts.setdefault(g.prefix[: len(g.prefix) - len(g.sub_prefix)], ([], []))[1].append(g)
    out = []
    for index, prefix in enumerate(trunk_prefixes(res)):
        s, g = parts.get(prefix, ([], []))
        out.append((TrunkMatch(index, prefix), block_signature(s, g, prefix)))
    return out


def match_trunk_layers(res: Resolved, layer: MtpLayer) -> list[TrunkMatch]:
    """For each sub-block of an MTP layer, the first trunk layer with the same tensors (names relative to the
    layer, expert groups included); a sub-block no trunk layer matches is refused."""
    trunk = trunk_layers(res)
    out = []
    for b, bprefix in enumerate(layer.block_prefixes):
        mine = block_signature([s for s in layer.block if s.block == b], _groups_of(layer, bprefix), bprefix)
        found = next((m for m, sig in trunk if sig == mine), None)
        if found is None:
            raise InputError(f"MTP sub-block {bprefix!r} has no trunk decoder layer with the same tensors "
                             f"({len(mine[0])} tensors, {len(mine[1])} expert group(s)): the engine builds an MTP "
                             "block as a copy of the family's own decoder layer", rule=FAMILY_RULE)
        out.append(found)
    return out


def _groups_of(layer: MtpLayer, bprefix: str):
    """The expert groups of one sub-block: those under its prefix and under no longer sub-block prefix."""
    longer = [p for p in layer.block_prefixes if p != bprefix and p.startswith(bprefix)]
    return [g for g in layer.experts
            if g.prefix.startswith(bprefix) and not any(g.prefix.startswith(p) for p in longer)]


class TableMtpLayer(nn.Module):
    """One MTP depth: the norms, the fusion and the sub-blocks (decoder layers), the final norm."""

    def __init__(self, enorm: nn.Module, hnorm: nn.Module, fusion: nn.Linear, blocks: list[nn.Module],
                 post_norm: nn.Module | None, hidden_first: bool, layer_types: list[str | None]) -> None:
        super().__init__()
        self.enorm, self.hnorm, self.fusion = enorm, hnorm, fusion
        self.blocks = nn.ModuleList(blocks)
        self.post_norm = post_norm
        self.use_post_norm = post_norm is not None
        self.hidden_first = hidden_first
        self.layer_types = layer_types  # per sub-block: the trunk layer type it copies (its mask and rope)

    def forward(self, inputs_embeds: torch.Tensor, previous_hidden_state: torch.Tensor, *,
                block_inputs: list[dict]) -> torch.Tensor:
        e, h = self.enorm(inputs_embeds), self.hnorm(previous_hidden_state)
        x = self.fusion(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))
        for block, kwargs in zip(self.blocks, block_inputs, strict=True):
            x = _call_layer(block, x, kwargs)
        if self.use_post_norm and self.post_norm is not None:
            x = self.post_norm(x)
        return x


class _Seen(Exception):
    """Stops the main model's forward once the layer's inputs are seen."""


def _layer_inputs(main, trunk: int, n: int, device) -> tuple[torch.Tensor, ...] | None:
    """The ``position_embeddings`` trunk layer ``trunk`` receives for positions 0..n-1 (None: it takes none)."""
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)
        raise _Seen

    decoder = main.get_decoder()
    handle = decoder.layers[trunk].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            decoder(input_ids=torch.zeros(1, n, dtype=torch.long, device=device), use_cache=False)
    except _Seen:
        pass
    finally:
        handle.remove()
    pe = seen.get("position_embeddings")
    return tuple(pe) if isinstance(pe, (tuple, list)) else None


def _call_layer(block: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """A transformers decoder layer on ``x``, given the keyword inputs its forward takes."""
    params = inspect.signature(block.forward).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    out = block(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class TableMtp(nn.Module):
    """Every MTP depth of a verifier, built from its table around ``main``'s decoder layers."""

    def __init__(self, main, layers: list[TableMtpLayer], heads: list[nn.Module], trunk: list[list[int]]) -> None:
        super().__init__()
        self.config = main.config.get_text_config()
        self.layers = nn.ModuleList(layers)
        self._main = [main]  # not a submodule: its weights are not this module's
        self._heads = heads
        self._trunk = trunk  # per depth, per sub-block: the trunk layer it copies
        self._rope_seen: dict[tuple[int, int], object] = {}
        self.embed_tokens = main.get_input_embeddings()

    def create_masks_for_mtp_layer(self, layer_idx: int, inputs_embeds: torch.Tensor, mtp_cache, position_ids):
        """The causal mask of each sub-block's layer type (transformers' mask function for that type)."""
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING, create_causal_mask

        out = []
        for kind in self.layers[layer_idx].layer_types:
            fn = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(kind, create_causal_mask) if kind else create_causal_mask
            if isinstance(fn, dict):  # a hybrid type: its attention mask
                fn = fn.get("full_attention", create_causal_mask)
            out.append(fn(config=self.config, inputs_embeds=inputs_embeds, attention_mask=None, cache=mtp_cache,
                          position_ids=position_ids))
        return {"attention_mask": out}

    def forward_layer(self, layer_idx: int, last_hidden_states: torch.Tensor, position_ids: torch.Tensor,
                      mtp_cache=None, input_ids: torch.Tensor | None = None,
                      inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """One MTP step of depth ``layer_idx`` (``MtpModel.forward_layer``'s contract)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        layer = self.layers[layer_idx]
        masks = self.create_masks_for_mtp_layer(layer_idx, inputs_embeds, mtp_cache, position_ids)["attention_mask"]
        if not isinstance(masks, list):  # a mask given for the whole step (probe's chained depths)
            masks = [masks] * len(layer.blocks)
        inputs = [dict(attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False,
                       position_embeddings=self._position_embeddings(trunk, position_ids))
                  for mask, trunk in zip(masks, self._trunk[layer_idx], strict=True)]
        return layer(inputs_embeds, last_hidden_states, block_inputs=inputs)

    def _position_embeddings(self, trunk: int, position_ids: torch.Tensor):
        """What trunk layer ``trunk`` receives as ``position_embeddings`` in the main model's own forward, at
        ``position_ids``: read off that forward (stopped at the layer), so that every rope variant (per layer
        type, multimodal sections, none) is the family's own."""
        n = int(position_ids.max()) + 1
        seen = self._rope_seen.get((trunk, n))
        if seen is None:
            seen = self._rope_seen[(trunk, n)] = _layer_inputs(self._main[0], trunk, n, position_ids.device)
        if seen is None:
            return None
        return tuple(t[0][position_ids] for t in seen)  # [batch, positions, dim]

    def _project_to_logits(self, hidden_states: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """The head the depth drafts with, applied as the main model applies its own (muP scaling, vocab slice)."""
        multiplier = getattr(self.config, "logits_mup_width_multiplier", None)
        if multiplier is not None:
            hidden_states = hidden_states / multiplier
        logits = self._heads[layer_idx](hidden_states)
        unpadded = getattr(self.config, "unpadded_vocab_size", None)
        return logits[..., :unpadded] if unpadded is not None and unpadded < logits.shape[-1] else logits


# --- building ------------------------------------------------------------------------------------

def build(main, verifier: Checkpoint, tensors: Mapping[str, OutputTensor], scheme, dtype: str, device: str,
          where: str | None) -> tuple[TableMtp, list[str]]:
    """The MTP of ``verifier``'s table around ``main``, holding ``tensors`` (stored tensors under the verifier's
    MTP names: its own, or a draft mapped onto them), dequantized by our decoders where stored quantized.
    Returns the engine and the schemes whose decoders ran."""
    view = open_mtp(verifier)
    res = view.resolved
    unplaced = sorted(set(view.table.mtp.glue) - set(GLUE_ROLES))
    if unplaced:
        raise InputError(f"family {res.family!r}: glue role(s) {unplaced} have no place in the MTP step this engine "
                         "builds", rule=FAMILY_RULE, path=where)
    mtp_keys = set(view.keys())
    state, schemes = float_state({k: t for k, t in tensors.items() if k in mtp_keys}, scheme, dtype, where)
    torch_dtype = main.config.get_text_config().dtype or torch.float32
    if isinstance(torch_dtype, str):  # save_pretrained leaves the name on a live model's config
        torch_dtype = getattr(torch, torch_dtype)
    template = final_norm_module(main, res, where)
    check_norm_convention(template, res.table.norm, res.family, where)
    layers, heads, trunks = [], [], []
    layer_types = getattr(main.config.get_text_config(), "layer_types", None)
    used: set[str] = set()
    for layer in res.layers:
        glue = {role: s for role, s in layer.glue.items() if s.key in state}
        missing = [r for r in ("embed_norm", "hidden_norm", "fusion") if r not in glue]
        if missing:
            raise InputError(f"MTP depth {layer.depth}: no {missing[0]} tensor ({layer.glue.get(missing[0])})",
                             rule=RULE, path=where)
        blocks, matches = _blocks(main, res, layer, state, used, device, torch_dtype, where)
        norms = {r: _norm(template, state, glue[r].key, device, torch_dtype) for r in
                 ("embed_norm", "hidden_norm", "final_norm") if r in glue}
        fusion = _linear(state, glue["fusion"].key, device, torch_dtype)
        used.update(glue[r].key for r in ("embed_norm", "hidden_norm", "final_norm", "fusion") if r in glue)
        head = main.get_output_embeddings()
        if "head" in glue and glue["head"].copy_of is None:  # the layer's own head (no copy of the trunk's)
            head = _linear(state, glue["head"].key, device, torch_dtype)
        if "embed" in glue and glue["embed"].copy_of is None:
            raise InputError(f"MTP depth {layer.depth} has its own embedding ({glue['embed'].key}); the engine "
                             "drafts with the trunk's", rule=FAMILY_RULE, path=where)
        used.update(glue[r].key for r in ("embed", "head") if r in glue)  # copies: the engines take the trunk's
        kinds = [m.layer_type if m.layer_type is not None else layer_types[m.index]
                 if layer_types and m.index < len(layer_types) else None for m in matches]
        layers.append(TableMtpLayer(norms["embed_norm"], norms["hidden_norm"], fusion, blocks,
                                    norms.get("final_norm"), res.table.mtp.concat_order == "hidden_first", kinds))
        heads.append(head)
        trunks.append([m.index for m in matches])
    left = sorted(set(state) - used)
    if left:
        raise InputError(f"{len(left)} MTP tensor(s) the engine has no parameter for (first: {left[:3]})",
                         rule=RULE, path=where, key=left[0])
    engine = TableMtp(main, layers, heads, trunks).eval()
    return engine, schemes


def final_norm_module(main, res: Resolved, where: str | None) -> nn.Module:
    """The trunk's final norm module: the table's shared ``final_norm`` key as a module path of ``main``, or (a
    class that nests its decoder differently from the checkpoint's names) the decoder's child of that name."""
    spec = res.shared.get("final_norm")
    path = spec.key.rpartition(".")[0] if spec is not None else ""
    with contextlib.suppress(AttributeError):
        return main.get_submodule(path)
    norm = getattr(main.get_decoder(), path.rpartition(".")[2], None)
    if not isinstance(norm, nn.Module) or not hasattr(norm, "weight"):
        raise InputError(f"the table's trunk final norm {path!r} is no module of transformers' "
                         f"{type(main).__name__}", rule=FAMILY_RULE, path=where)
    return norm


def check_norm_convention(norm: nn.Module, convention: str, family: str, where: str | None) -> None:
    """The table's norm convention, checked against the class transformers uses: with a zero weight a
    zero-centred RMS norm normalises, a plain one gives zeros."""
    probe = copy.deepcopy(norm).float()
    with torch.no_grad():
        for p in probe.parameters():
            p.zero_()
        out = probe(torch.ones(1, 1, probe.weight.shape[-1]))
    computes = "plain" if float(out.abs().max()) == 0.0 else "zero_centred"
    if computes != convention:
        raise InputError(f"family {family!r}: the table says norm {convention!r}, but transformers' "
                         f"{type(norm).__name__} computes {computes!r}", rule=FAMILY_RULE, path=where)


def _value(state, key: str, device: str, dtype) -> torch.Tensor:
    return materialize(state[key]).to(device=device, dtype=dtype)


def _norm(template: nn.Module, state, key: str, device: str, dtype) -> nn.Module:
    norm = copy.deepcopy(template)
    with torch.no_grad():
        norm.weight.copy_(_value(state, key, device, dtype))
    return norm


def _linear(state, key: str, device: str, dtype) -> nn.Linear:
    w = _value(state, key, device, dtype)
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        out.weight.copy_(w)
    return out


def mtp_layer_config(main):
    """transformers' config for the MTP layers (``get_mtp_config``, as ``MtpModel`` builds them: index-specific
    fields such as ``layer_types`` and ``first_k_dense_replace`` replaced by the MTP's), without its quantization
    config; None when the family's config has none (no ``num_mtp_layers``)."""
    try:
        return unquantized_config(main.config).get_mtp_config()
    except (AttributeError, ValueError, TypeError, KeyError):
        return None


def _blocks(main, res: Resolved, layer: MtpLayer, state, used: set[str], device, dtype,
            where) -> tuple[list[nn.Module], list[TrunkMatch]]:
    """The sub-blocks of one MTP layer, loaded, and the trunk slot each stands in for.

    As the engines build them first: the decoder-layer class at MTP index ``depth`` from the MTP config
    (one sub-block). When that cannot be built, or its parameters are not the stored tensors, each
    sub-block is a copy of the trunk layer with the same tensors; when neither works, the first reason."""
    decoder_layers = main.get_decoder().layers
    config = mtp_layer_config(main) if len(layer.block_prefixes) == 1 else None
    first: InputError | None = None
    if config is not None:
        slot = _slot(main, res, config, layer.depth)
        try:
            block = type(decoder_layers[-1])(config, layer.depth).to(device=device, dtype=dtype)
        except Exception as e:  # a class that cannot be built at that index: the fallback decides
            first = InputError(f"transformers' {type(decoder_layers[-1]).__name__} cannot be built at MTP index "
                               f"{layer.depth}: {type(e).__name__}: {e}", rule=FAMILY_RULE, path=where)
        else:
            try:
                return [_load_block(main, decoder_layers, slot, block, layer, 0, state, used, device, dtype,
                                    where)], [slot]
            except InputError as e:
                first = e
    try:
        matches = match_trunk_layers(res, layer)
    except InputError as e:
        if first is not None:
            raise first from None
        why = (f"its MTP layer has {len(layer.block_prefixes)} sub-blocks" if len(layer.block_prefixes) > 1 else
               "its config has no MTP config (num_mtp_layers)")
        raise InputError(f"transformers cannot build this MTP block as MtpModel does ({why}), and {e.message}; "
                         "`ckpt probe --engine vllm` measures it where vLLM serves the family",
                         rule=FAMILY_RULE, path=where) from None
    blocks = [_load_block(main, decoder_layers, m,
                          _fresh_layer(main, decoder_layers[m.index], m.index, device, dtype, where),
                          layer, b, state, used, device, dtype, where) for b, m in enumerate(matches)]
    return blocks, matches


def _slot(main, res: Resolved, config, depth: int) -> TrunkMatch:
    """The trunk layer an MTP block built from the MTP config stands in for: the first of the MTP layer's own type
    (its rotary inputs are that type's), else the last (the class ``MtpModel`` takes)."""
    prefixes = trunk_prefixes(res)
    kinds = getattr(config, "layer_types", None)
    kind = kinds[depth] if kinds and depth < len(kinds) else None
    trunk_kinds = getattr(main.config.get_text_config(), "layer_types", None) or []
    index = next((i for i, k in enumerate(trunk_kinds) if kind is not None and k == kind), len(prefixes) - 1)
    return TrunkMatch(index, prefixes[index], kind)


def _load_block(main, decoder_layers, match: TrunkMatch, block: nn.Module, layer: MtpLayer, b: int, state,
                used: set[str], device, dtype, where) -> nn.Module:
    """``block`` (a fresh float decoder layer) holding sub-block ``b``'s tensors, loaded through ``main``'s own
    (float) weight conversions (fused experts and renames as for the trunk): it stands in for trunk layer
    ``match`` while the renamed tensors load, and every parameter of it must be filled, every tensor taken."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig


    bprefix = layer.block_prefixes[b]
    longer = [p for p in layer.block_prefixes if p != bprefix and p.startswith(bprefix)]
    glue = {s.key for s in layer.glue.values()}
    keys = [k for k in state if k.startswith(bprefix) and k not in glue and not any(k.startswith(p) for p in longer)]
    renamed = {match.prefix + k[len(bprefix):]: Lazy(lambda t=state[k]: materialize(t)) for k in keys}
    original = decoder_layers[match.index]
    path = next(name for name, module in main.named_modules() if module is original) + "."
    # the model's conversions without a quantizer's changes: the block is float (a quantized trunk linearizes
    # experts, and the conversions its quantizer adds expect packed tensors)
    conversions = get_model_conversion_mapping(main)
    with _standing_in(decoder_layers, match.index, block), sequential_load():
        info, _ = convert_and_load_state_dict_in_model(
            model=main, state_dict=renamed,
            load_config=LoadStateDictConfig(weight_mapping=conversions, device_map={"": torch.device(device)},
                                            dtype=dtype))
    d = info if isinstance(info, Mapping) else vars(info)
    missing = [k for k in d.get("missing_keys", ()) if k.startswith(path)]
    problems = load_problems({**d, "missing_keys": missing})
    if problems:
        raise refuse(where or "", f"MTP sub-block {bprefix!r} (as trunk layer {match.index})", problems)
    used.update(keys)
    _renumber(block, layer.depth)
    return block.eval()


def _fresh_layer(main, original: nn.Module, index: int, device, dtype, where) -> nn.Module:
    """A new float decoder layer of the trunk layer's class, built from the config without its quantization config:
    a trunk a quantizer loaded holds quantized modules, the MTP is loaded as float values (our decoders)."""
    config = unquantized_config(main.config).get_text_config()
    try:
        layer = type(original)(config, index)
    except TypeError as e:  # a decoder layer not built as (config, layer_idx)
        raise InputError(f"transformers' {type(original).__name__} is not built from (config, layer index): {e}",
                         rule=FAMILY_RULE, path=where) from None
    return layer.to(device=device, dtype=dtype)


@contextlib.contextmanager
def _standing_in(layers: nn.ModuleList, index: int, block: nn.Module) -> Iterator[None]:
    original = layers[index]
    layers[index] = block
    try:
        yield
    finally:
        layers[index] = original


def _renumber(block: nn.Module, depth: int) -> None:
    """The copy's modules index caches by the MTP depth, not by the trunk layer they were copied from."""
    for module in block.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx = depth
