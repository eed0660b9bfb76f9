"""MTP layers added to a verifier that stores none (stitch --mode add, graft): the view of the MTP it
will have (``virtual_view``), the plan that writes them into new shards beside its own
(``mtp_into``; dequant --only-mtp --link writes its decoded MTP layers the same way), and the refusal of a
verifier whose shards cannot be copied whole (``require_indexed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ...errors import InputError, PlanError, UsageError
from ...io.checkpoint import Checkpoint
from ...model.mtp import MtpView, detect_group_layout
from ...model.tables.resolve import resolve, trunk_specs
from ...stream.plan import OutputFile, OutputTensor, Plan, ShardLayout, copy_of
from .carry import carried_files, untouched_file


class ShardRecord(Protocol):
    """Where ``mtp_into`` records what it did with the shards: ``CarriedShards``, or a stitch / graft report."""

    copied_tensors: int
    rewritten_shards: list[str]
    new_shards: list[str]
    linked_files: list[str]


@dataclass
class CarriedShards:
    """What ``mtp_into`` did with the verifier's shards (a stitch or graft report records the same fields)."""

    copied_tensors: int = 0  # tensors outside the MTP layers, carried byte for byte
    rewritten_shards: list[str] = field(default_factory=list)  # shards written again without the dropped tensors
    new_shards: list[str] = field(default_factory=list)  # the model-mtp* shards
    linked_files: list[str] = field(default_factory=list)  # shards copied or linked whole (--link)


def virtual_view(declared: MtpView, count: int) -> MtpView:
    """What the verifier's MTP (``declared``: its gated view) would look like with ``count`` layers (add mode);
    its resolution is reused when the count stays."""
    verifier, res = declared.ckpt, declared.resolved
    if res.mtp_count != count:
        res = resolve(res.table, verifier.config, mtp_count=count)
    # Experts follow the trunk's layout on disk (a trunk with fused experts gets fused MTP experts).
    trunk_layouts = [detect_group_layout(g, verifier.tensors) for g in trunk_specs(res)[1]]
    layouts = {g.prefix: (trunk_layouts[0] if trunk_layouts else g.layout) for g in res.experts()}
    view = MtpView(verifier, res, layouts)
    view.present = res.mtp_specs(layouts)
    return view


def mtp_into(verifier: Checkpoint, mtp: list[OutputTensor], config_files: list[OutputFile], link: str,
             max_shard_size: int, command: str, inputs, manifest: dict, report: ShardRecord,
             drop: frozenset[str] = frozenset()) -> Plan:
    """The verifier with ``mtp`` written into new ``model-mtp*`` shards (stitch add mode, graft).

    Its shards are copied or linked as they are, except those holding ``drop`` keys (MTP tensors
    being replaced), which are rewritten without them; ``config_files`` replace the verifier's own
    files of those names (config.json, hf_quant_config.json); the other files are carried.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    files: list[OutputFile] = []
    tensors: list[OutputTensor] = []
    layouts: dict[str, ShardLayout] = {}
    wm = verifier.index["weight_map"] if verifier.index else None
    single = verifier.index is None
    for shard, keys in verifier.shard_keys.items():
        listed = [k for k in keys if wm is None or wm.get(k) == shard]
        # a lone model.safetensors would hide the index from loaders: give it a sharded name
        name = "model-00001-of-00002.safetensors" if single else shard
        kept = [k for k in listed if k not in drop]
        if len(kept) == len(listed):
            if single and link == "remote":
                raise UsageError("--link remote cannot rename the verifier's lone model.safetensors; use --link copy")
            files.append(untouched_file(verifier, shard, link, {k: verifier.tensors[k].nbytes for k in listed}, name))
            report.linked_files.append(name)
        elif kept:  # rewritten without the dropped tensors, the others byte for byte in their order
            tensors += [copy_of(verifier.tensors[k], k, {"copied_from": "verifier"}, name) for k in kept]
            layouts[name] = ShardLayout(order=kept)
            report.rewritten_shards.append(name)
        report.copied_tensors += len(kept)
    if single:
        names = {t.key: "model-00002-of-00002.safetensors" for t in mtp}
    else:
        split = split_state_dict_into_shards_factory({t.key: t for t in mtp}, get_storage_size=lambda t: t.nbytes,
                                                     filename_pattern="model-mtp{suffix}.safetensors",
                                                     max_shard_size=max_shard_size)
        names = {k: f for f, ks in split.filename_to_tensors.items() for k in ks}
    tensors += [OutputTensor(t.key, t.dtype, t.shape, t.recipe, shard=names[t.key], meta=t.meta) for t in mtp]
    taken = {f.name for f in files} | set(layouts)
    clash = taken & set(names.values())
    if clash:
        raise PlanError(f"new MTP shard name(s) {sorted(clash)} already exist in the verifier", rule="shard-name")
    report.new_shards = sorted(set(names.values()))
    replaced = {f.name for f in config_files}
    files = config_files + files + [f for f in carried_files(verifier) if f.name not in replaced]
    return Plan(command, tensors, files, inputs=inputs, max_shard_size=max_shard_size, manifest=manifest,
                shard_layouts=layouts)


def require_indexed(gate, verifier: Checkpoint, verb: str) -> None:
    """Shards copied whole would carry keys the index does not list (let in by --allow-invalid unindexed-key)."""
    if any(p.rule == "unindexed-key" for p in gate.allowed):
        raise InputError(f"{verb} copies the verifier's shards whole, so keys its index does not list would "
                         "stay in them; write a clean trunk first (`ckpt extract --drop-mtp --allow-invalid "
                         "unindexed-key`), then stitch into it", rule="unindexed-key", path=verifier.root)
