"""What every writing verb shares (its options are declared in api/options.py): ``--layers`` parsing, the
invocation the manifest records, the plan a --dry-run shows, and the lines said after a write."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .common import command_line, human_bytes, out_console, say_allowed

if TYPE_CHECKING:
    from ..stream.plan import Plan


def layers(text: str | None) -> list[int] | None:
    """--layers: MTP depths, each below the MTP bound, none twice (extract and stitch)."""
    if text is None:
        return None
    from ..model.tables.resolve import MAX_MTP_LAYERS
    from ..options import index_list

    return index_list("--layers", text, MAX_MTP_LAYERS - 1)


@contextlib.contextmanager
def invoked() -> Iterator[None]:
    """Around a writing verb's call: the manifest records the command line, and what --allow-invalid let
    in is said once the plan is made (before anything is written)."""
    from ..api.writing import invocation

    with invocation(command_line(), on_plan=lambda plan: say_allowed(plan.manifest.get("allowed_invalid"))):
        yield


def say_written(report: Any) -> None:
    """The line after a write: tensors, bytes, where, how long, how much was read."""
    w = report.written
    out_console().print(f"wrote {w.tensors} tensors ({human_bytes(w.tensor_bytes)}) to {w.output} "
                        f"in {w.seconds} s; read {human_bytes(w.bytes_read)} from the source")


def say_shards_written(out: str, report: Any) -> None:
    """The line after a stitch or graft: which of the verifier's shards were rewritten, which are new."""
    out_console().print(f"wrote {out}; rewritten shards: {', '.join(report.rewritten_shards) or '-'}; "
                        f"new shards: {', '.join(report.new_shards) or '-'}")
    links = getattr(report, "link_digests", None)
    if links and links["hashed"]:  # a link moves no bytes: its digest for the manifest is one read of what landed
        first = next(iter(links["hashed"].items()))
        out_console().print(f"linked shards hashed for the manifest: {len(links['hashed'])} "
                            f"({human_bytes(links['hashed_bytes'])}), e.g. {first[0]}: {first[1]}; "
                            f"taken from the input's manifest: {len(links['from_manifest'])}", soft_wrap=True)


def say_config_changes(repair: dict | None, shown: int = 4) -> None:
    """``repair``: ``quant.repair.Repair.to_json()``; nothing is printed when the config is unchanged."""
    if not repair:
        return
    for ch in repair.get("changes", []):
        where = f"{ch['file']}:{'.'.join(p for p in (ch.get('section'), ch.get('field')) if p)}"
        for verb, entries in (("added", ch.get("add") or []), ("removed", ch.get("remove") or [])):
            if entries:
                more = f", ... (+{len(entries) - shown})" if len(entries) > shown else ""
                out_console().print(f"quantization config: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                                    f"{verb} in {where}: {', '.join(entries[:shown])}{more}",
                                    markup=False, soft_wrap=True)


def render_plan(plan: Plan, console) -> None:
    """One row per planned tensor; the shard column only when the plan writes more than one."""
    from .layout import Col, print_table

    shards = plan.shards()
    where = {t.key: name for name, ts in shards.items() for t in ts}
    cols = [Col("tensor", "id"), Col("dtype", "id"), Col("shape", "id"), Col("bytes", "id", "right"),
            Col("recipe")] + ([Col("shard", "id")] if len(shards) > 1 else [])
    rows = []
    for t in plan.tensors:
        d = t.recipe.describe()
        recipe = d["op"] + (f" ({len(d['ranges'])} ranges)" if "ranges" in d and len(d["ranges"]) > 1 else "")
        rows.append([t.key, t.dtype, str(list(t.shape)), human_bytes(t.nbytes), recipe, where[t.key]][:len(cols)])
    print_table(console, cols, rows, title=f"plan: {plan.command}")
    console.print(f"{len(plan.tensors)} tensors, {human_bytes(plan.total_bytes)} in {len(shards)} shard(s)"
                  + (f" ({next(iter(shards))})" if len(shards) == 1 else "")
                  + f"; files: {', '.join(f.name for f in plan.files) or '-'}", markup=False)
