"""The one rule set: every check ``ckpt validate`` reports and the consistency gate refuses on.

``RULE_SET`` is a list of checks, each a function of a ``Context`` returning ``Problem``s, with
the rule names it may report, the stage it runs in and whether the gate refuses on it.
``validate`` runs every check and reports all it finds; the gate (``gate.check``) runs
the checks that refuse, from the same list, in the same order. So a rule cannot be known to one
and not the other: a new rule is one more entry here (tests/test_validate.py enumerates them).

Stages: ``files`` checks need only the opened files; ``model`` checks need the config, and those
with ``needs_view`` the family's table and MTP view (validate skips them when the family cannot
be told, and reports why). Rules refused while a checkpoint is opened (``Checkpoint.open``:
header rules, a missing shard, a key the index maps to a shard without it) are reported by
validate from its lenient open (``OPEN_RULES``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..io.artefacts import MANIFEST_NAME
from . import consistency as c
from .consistency import Problem
from .quant.agree import RULE as AGREE_RULE
from .quant.agree import agree_problems
from .quant.arg_rules import ARG_RULES
from .quant.audit import ORDER_RULE
from .quant.block_audit import BLOCK_SIZE_RULE, block_problems
from .quant.kv_scales import RULE as KV_SCALE_RULE
from .quant.kv_scales import kv_scale_problems
from .quant.patterns import RULE as PATTERN_RULE
from .quant.patterns import pattern_problems
from .quant.scale_values import RULE as SCALE_VALUE_RULE
from .quant.scale_values import scale_value_problems
from .stored_dtype import RULE as STORED_DTYPE_RULE
from .stored_dtype import stored_dtype_problems

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint
    from .mtp import MtpView
    from .tables.schema import Table

VALID_FORMATS = ("pt", "tf", "flax", "mlx")  # transformers load_state_dict's accepted __metadata__ formats
# Rules met while opening files (Checkpoint.open refuses them; validate's lenient open reports them).
OPEN_RULES = frozenset({
    "header-length", "header-too-large", "header-json", "header-not-object", "duplicate-key",
    "metadata-not-string", "tensor-entry", "unknown-dtype", "bad-shape", "bad-offsets", "misaligned",
    "size-mismatch", "overlap", "offsets-not-contiguous", "past-end", "trailing-bytes", "unreadable-shard",
    "index-json", "shard-path", "missing-shard", "index-key-missing", "config-json", "config-field",
})


@dataclass
class Context:
    """What a check may look at. ``unknown``: keys whose shard could not be read (presence unknown)."""

    ckpt: Checkpoint
    holders: c.Holders
    unknown: set[str] = field(default_factory=set)
    unreadable: list[str] = field(default_factory=list)
    view: MtpView | None = None
    table: Table | None = None
    whole_model: bool = False  # the trunk rules apply even to a checkpoint without a decoder layer
    config: str | None = None  # config.json's path when it is present and readable (the quant-config rule)
    checked: frozenset[tuple[str, str, Any]] = frozenset()  # scales an input's gate read already (PendingOutput)


def _codec(ctx: Context):
    """The checkpoint's block format: its view's, else the one it stores or declares (the table's hint)."""
    from .quant.codec import checkpoint_codec

    if ctx.view is not None:
        return ctx.view.codec
    return checkpoint_codec(ctx.ckpt, ctx.table.quantization if ctx.table else None)


@dataclass(frozen=True)
class Check:
    name: str
    rules: tuple[str, ...]  # every rule name ``run`` may report
    stage: str  # files | model
    refuses: bool  # the gate refuses on it (else validate reports it, no verb refuses)
    run: Callable[[Context], list[Problem]]
    needs_view: bool = False  # needs the family's table and MTP view


# -- report-only checks (outputs write their own index, metadata, headers and manifest) --------------------


def metadata_format(ctx: Context) -> list[Problem]:
    out = []
    for name, h in ctx.ckpt.headers.items():
        if h.metadata is not None and h.metadata.get("format") not in VALID_FORMATS:
            fmt = h.metadata.get("format")
            what = "has no 'format'" if fmt is None else f"has format {fmt!r}"
            out.append(Problem("metadata-format", c.shard_path(ctx.ckpt, name), None,
                               f"__metadata__ {what}; transformers' load_state_dict (v4) refuses a format that is not "
                               f"one of {', '.join(VALID_FORMATS)} (write {{\"format\": \"pt\"}})"))
    return out


def index_metadata(ctx: Context) -> list[Problem]:
    ckpt = ctx.ckpt
    if ckpt.index is None:
        return []
    where = c.index_path(ckpt)
    meta = ckpt.index.get("metadata")
    if not isinstance(meta, dict):
        return [Problem("index-metadata", where, None, "index has no 'metadata' object (transformers reads "
                                                       "index['metadata']); write {\"metadata\": {\"total_size\": N}}")]
    if "total_size" in meta and not ctx.unreadable:
        total = sum(h.data_bytes for h in ckpt.headers.values())
        ts = meta["total_size"]
        if not isinstance(ts, int) or isinstance(ts, bool) or ts != total:
            return [Problem("total-size", where, None,
                            f"metadata.total_size is {ts!r} but the shards hold {total} tensor bytes")]
    return []


def manifest_entries(ctx: Context) -> list[Problem]:
    """Every tensor our manifest lists is present with the dtype and shape it was written with."""
    ckpt = ctx.ckpt
    entries = (ckpt.manifest or {}).get("tensors")
    if not isinstance(entries, dict) or not ckpt.local_dir:
        return []
    where = str(ckpt.local_dir / MANIFEST_NAME)
    out = []
    for key, entry in entries.items():
        if key in ctx.unknown or not isinstance(entry, dict):
            continue
        ref = ckpt.tensors.get(key)
        if ref is None:
            out.append(Problem("manifest-missing", where, key,
                               "listed in ckpt_manifest.json but not in the checkpoint"))
        elif entry.get("dtype") != ref.dtype or list(entry.get("shape", [])) != list(ref.shape):
            out.append(Problem("manifest-mismatch", ref.file, key, f"is {ref.dtype} {list(ref.shape)}, the manifest "
                                                                   f"says {entry.get('dtype')} {entry.get('shape')}"))
    if (ckpt.manifest or {}).get("kind") == "mtp-draft":
        out += [Problem("manifest-extra", ckpt.tensors[key].file, key, "not listed in the draft's ckpt_manifest.json")
                for key in sorted(set(ckpt.tensors) - set(entries))]
    return out


# -- the rule set --------------------------------------------------------------------------------------------

RULE_SET: list[Check] = [
    Check("metadata", ("metadata-format",), "files", False, metadata_format),
    Check("index", ("index-empty", "index-key-missing", "unindexed-key", "duplicate-tensor"), "files", True,
          lambda ctx: c.index_problems(ctx.ckpt, ctx.holders)),
    Check("index-metadata", ("index-metadata", "total-size"), "files", False, index_metadata),
    Check("stray-files", ("unindexed-shard", "duplicate-tensor", "single-file-shadows-index"), "files", True,
          lambda ctx: c.stray_problems(ctx.ckpt, ctx.holders)),
    Check("manifest", ("manifest-missing", "manifest-mismatch", "manifest-extra"), "files", False, manifest_entries),
    Check("mtp", c.MTP_RULES, "model", True, lambda ctx: c.mtp_problems(ctx.view, ctx.unknown), needs_view=True),
    # exclusion / target entries compiled as their consumers compile them (model/quant/patterns.py)
    Check("quant-pattern", (PATTERN_RULE,), "model", True, lambda ctx: pattern_problems(ctx.ckpt)),
    # ModelOpt's two configuration files say the same (model/quant/agree.py): before the module checks, which
    # would blame the modules for what the files disagree on
    Check("quant-config-agree", (AGREE_RULE,), "model", True, lambda ctx: agree_problems(ctx.ckpt)),
    # each module as its config group declares it; the group's own arguments (ARG_RULES) and which group decides
    # (ORDER_RULE) are rules of their own
    Check("mtp-quant", ("mtp-quant-config", *ARG_RULES, ORDER_RULE), "model", True,
          lambda ctx: c.quant_config_problems(ctx.view, ctx.unknown), needs_view=True),
    Check("trunk-quant", (c.TRUNK_QUANT_RULE, *ARG_RULES, ORDER_RULE), "model", True,
          lambda ctx: c.trunk_quant_problems(ctx.view, ctx.unknown, whole_model=ctx.whole_model), needs_view=True),
    Check("tied-head", ("tied-head",), "model", True, lambda ctx: c.tied_head_problems(ctx.view), needs_view=True),
    Check("trunk", c.TRUNK_RULES, "model", True,
          lambda ctx: c.trunk_problems(ctx.view, ctx.unknown, whole_model=ctx.whole_model), needs_view=True),
    Check("expert-layouts", (c.MIXED_RULE,), "model", True, lambda ctx: c.mixed_layout_problems(ctx.view, ctx.unknown),
          needs_view=True),
    Check("stored-dtype", (STORED_DTYPE_RULE,), "model", True,
          lambda ctx: stored_dtype_problems(ctx.view, ctx.unknown), needs_view=True),
    Check("fp8", ("fp8-scale-missing", "fp8-scale-shape", BLOCK_SIZE_RULE, "quant-config"), "model", True,
          lambda ctx: block_problems(ctx.ckpt, _codec(ctx), ctx.unknown, ctx.config)),
    # every scale of every quantized module read as values (model/quant/scale_values.py)
    Check("scale-values", (SCALE_VALUE_RULE,), "model", True,
          lambda ctx: scale_value_problems(ctx.ckpt, ctx.unknown, ctx.checked)),
    # KV-cache scales are finite and positive (model/quant/kv_scales.py)
    Check("kv-scale-values", (KV_SCALE_RULE,), "model", True, lambda ctx: kv_scale_problems(ctx.ckpt, ctx.unknown)),
]


def run(ctx: Context, stage: str, *, refusing_only: bool,
        on_error: Callable[[Check, Exception], list[Problem]] | None = None) -> list[Problem]:
    """The problems of every check of ``stage`` (only those the gate refuses on, with ``refusing_only``).

    Checks needing the MTP view are skipped without one. ``on_error``: turns a check's CkptError (a
    config value its expressions cannot use) into problems, so the other checks still run;
    without it the error propagates (the gate refuses with it).
    """
    from ..errors import CkptError

    out: list[Problem] = []
    try:
        for check in RULE_SET:
            if check.stage != stage or (refusing_only and not check.refuses) or (check.needs_view and ctx.view is None):
                continue
            try:
                out += check.run(ctx)
            except CkptError as e:
                if on_error is None:
                    raise
                out += on_error(check, e)
    finally:  # the trunk checks memoise a release's 46,000 expert keys: not kept past them (a verb plans next)
        if stage == "model":
            from .quant.audit import forget_group_keys

            forget_group_keys()
    return out


def refusing_rules() -> set[str]:
    """Every rule name a refusing check may report."""
    return {r for check in RULE_SET if check.refuses for r in check.rules}


def known_rules() -> set[str]:
    """Every rule validate may report: the rule set's and those met while opening."""
    return {r for check in RULE_SET for r in check.rules} | OPEN_RULES
