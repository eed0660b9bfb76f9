"""Rendering shared by the writing commands: plans for --dry-run, reports after a write."""

from __future__ import annotations

from ..stream.plan import Plan
from ..stream.writer import WriteResult
from .common import emit_json, human_bytes, out_console


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


def report_write(plan: Plan, result: WriteResult, json_output: bool, *, bytes_read: int, extra: dict | None = None,
                 validation=None) -> None:
    report = {
        "output": str(result.out_dir),
        "tensors": len(plan.tensors),
        "tensor_bytes": plan.total_bytes,
        "bytes_written": result.bytes_written,
        "bytes_read": bytes_read,
        "files": result.files,
        "seconds": round(result.seconds, 3),
        **(extra or {}),
    }
    if validation is not None:
        report["validation"] = validation
    if json_output:
        emit_json(report)
        return
    c = out_console()
    c.print(f"wrote {report['tensors']} tensors ({human_bytes(plan.total_bytes)}) to {result.out_dir} "
            f"in {report['seconds']} s; read {human_bytes(bytes_read)} from the source")
